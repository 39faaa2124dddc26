"""ROLL under tf.distribute.MirroredStrategy with two logical CPU devices.

The logical devices must be configured before TensorFlow initialises, so the
work runs in a fresh interpreter (`tests/_roll_distribute.py`) and this test
checks the numbers it reports against the single-device run of the same global
batch. The fresh interpreter and two-replica tracing take about 45 s on 2 cores,
so the module is marked `slow` (`make test-all` runs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_roll_distribute.py")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("distribute") / "report.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, SCRIPT, str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_two_replicas(report):
    assert report["replicas"] == 2


def test_per_replica_loss_and_gradient_equal_single_device(report):
    assert report["direct_loss_scale"] > 0.1
    assert report["direct_loss_diff"] <= 1e-5 * report["direct_loss_scale"] + 1e-6
    assert report["direct_grad_scale"] > 1e-3
    assert report["direct_grad_diff"] <= 1e-5 * report["direct_grad_scale"] + 1e-7


@pytest.mark.parametrize("variant", ["chunked", "sampled"])
def test_fit_step_matches_single_device(report, variant):
    # The regularizer moves the weights by much more than the tolerance, so an
    # add_loss that Keras did not scale by 1 / num_replicas would fail here.
    assert report["roll_update"] > 1e-2
    assert report[f"{variant}_weight_diff"] <= 1e-6 + 1e-4 * report["roll_update"]
    single, mirrored = report[f"{variant}_loss"]
    assert mirrored == pytest.approx(single, rel=1e-5)
    single, mirrored = report[f"{variant}_roll"]
    assert mirrored == pytest.approx(single, rel=1e-5)
