"""ROLL across two worker processes (MultiWorkerMirroredStrategy over 127.0.0.1).

Two subprocesses run `tests/_roll_multiworker.py` with `TF_CONFIG` naming both
on free local ports; Keras auto-shards the global batch between them and the
gradients are all-reduced over gRPC. After one `fit` step of SGD both workers
must hold the weights that one process computes on the whole global batch (the
exact ROLL loss in several chunks, so the custom gradient runs too), and their
replicas must draw different axes for the same examples with `seed=None`.

Two fresh interpreters and the collective set-up take 30-60 s on 2 cores, so
the module is marked `slow` (`make test-all`); `tests/test_distribute.py`
keeps fast per-replica checks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import _roll_multiworker as worker

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_roll_multiworker.py")
TIMEOUT_S = 300


def _free_ports(n):
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("multiworker")
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs, logs = [], []
    try:
        for index in range(2):
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       TF_CONFIG=json.dumps({"cluster": cluster,
                                             "task": {"type": "worker", "index": index}}))
            log = open(out_dir / f"worker{index}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, SCRIPT, str(out_dir / f"worker{index}.json")],
                env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the workers did not finish within {TIMEOUT_S} s; logs in {out_dir}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    for index, proc in enumerate(procs):
        text = (out_dir / f"worker{index}.log").read_text()
        assert proc.returncode == 0, f"worker {index} failed:\n{text[-4000:]}"
    return [json.loads((out_dir / f"worker{i}.json").read_text()) for i in range(2)]


@pytest.fixture(scope="module")
def single():
    """One process, no strategy, the whole global batch."""
    weights, logs = worker.fit_step(None)
    before = [v.numpy() for v in worker.build().trainable_variables]
    return [np.asarray(w) for w in weights], logs, before


def test_two_workers_one_replica_each(reports):
    assert [r["task"] for r in reports] == [0, 1]
    assert all(r["replicas"] == 2 for r in reports)


def test_one_fit_step_equals_one_process_on_the_global_batch(reports, single):
    weights, logs, before = single
    # The step moves the weights by much more than the tolerance.
    assert max(np.max(np.abs(w - b)) for w, b in zip(weights, before)) > 1e-2
    for report in reports:
        got = [np.asarray(w) for w in report["weights"]]
        for g, w in zip(got, weights):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
        assert report["logs"]["loss"] == pytest.approx(logs["loss"], rel=1e-5)
        assert report["logs"]["roll_loss"] == pytest.approx(logs["roll_loss"], rel=1e-5)
        # each worker computed on its half of the global batch (Keras auto-shards it)
        assert report["logs"]["local_examples"] == [worker.GLOBAL_BATCH / 2]
    assert logs["local_examples"] == [worker.GLOBAL_BATCH]


def test_workers_draw_different_axes_with_seed_none(reports):
    axes = []
    for report in reports:
        (local,) = report["probe"]  # one replica per worker
        root = np.sqrt(np.asarray(local, np.float64) / worker.PROBE_D) - 1
        np.testing.assert_allclose(root, np.rint(root), atol=1e-3)
        axes.append(np.rint(root).astype(int))
    assert axes[0].shape == (8,)
    assert np.mean(axes[0] == axes[1]) < 0.5, [a.tolist() for a in axes]
