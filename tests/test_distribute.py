"""ROLL under tf.distribute.MirroredStrategy with two logical CPU devices.

The logical devices must be configured before TensorFlow initialises, so the
work runs in a fresh interpreter (`tests/_roll_distribute.py`) and this test
checks the numbers it reports.

* Fast (about 10 s of CPU): every replica gets the same examples, and the
  sampled axis each example drew is read back from a probe model whose loss
  with `samples=1` is `D * (axis + 1)^2`. No replica may repeat another's axes
  for `roll_loss` with `seed=None` or an int seed, for the regularizer's
  per-step seeds (int seed or None) and for its fixed evaluation seed.
* Slow (about 45 s on 2 cores; `make test-all`): the per-replica loss and
  gradient, and one `fit` step, against the single-device run of the same
  global batch. `tests/test_multiworker.py` does the same across two processes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.scripts import run_script

PROBE_D = 16  # tests/_roll_distribute.py: the probe neuron has weight a + 1 on axis a


def _run(out, *flags):
    run_script("_roll_distribute.py", out, *flags, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def draws(tmp_path_factory):
    report = _run(tmp_path_factory.mktemp("replicas") / "draws.json", "--replicas-only")
    assert report["replicas"] == 2
    return report["draws"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("distribute") / "report.json")


def _axes(losses):
    """Axis drawn per example from the probe's loss `D * (axis + 1)^2` (checked integral)."""
    root = np.sqrt(np.asarray(losses, np.float64) / PROBE_D) - 1
    axes = np.rint(root).astype(int)
    np.testing.assert_allclose(root, axes, atol=1e-3)
    assert np.all((axes >= 0) & (axes < PROBE_D))
    return axes  # [replicas, steps, examples]


def test_the_probe_decodes_the_sampled_axis(draws):
    # exact: ||g||^2 = sum_a (a + 1)^2; with samples=1 the estimate is D * (a + 1)^2
    assert draws["exact_probe"] == [pytest.approx(sum((a + 1) ** 2 for a in range(PROBE_D)))]


@pytest.mark.parametrize("case", ["roll_loss_seed_none", "roll_loss_seed5", "layer_seed3",
                                  "layer_seed_none", "eval_seed"])
def test_replicas_draw_independent_axes_for_the_same_examples(draws, case):
    axes = _axes(draws[case])
    assert axes.shape == (2, 4, 8)
    first, second = axes
    for step in range(axes.shape[1]):
        assert not np.array_equal(first[step], second[step]), (case, step)
    # independent uniform draws agree on 1 / 16 of the examples on average
    assert np.mean(first == second) < 0.3, (case, axes.tolist())
    # the examples of one replica do not share one draw either
    assert all(len(set(row.tolist())) > 1 for row in first)


@pytest.mark.parametrize("case,fresh", [("roll_loss_seed_none", True), ("layer_seed3", True),
                                        ("layer_seed_none", True), ("roll_loss_seed5", False),
                                        ("eval_seed", False)])
def test_training_steps_draw_afresh_and_fixed_seeds_repeat(draws, case, fresh):
    axes = _axes(draws[case])
    for replica in axes:
        for step in range(1, len(replica)):
            assert np.array_equal(replica[step], replica[0]) != fresh, (case, axes.tolist())


@pytest.mark.slow
def test_two_replicas(report):
    assert report["replicas"] == 2


@pytest.mark.slow
def test_per_replica_loss_and_gradient_equal_single_device(report):
    assert report["direct_loss_scale"] > 0.1
    assert report["direct_loss_diff"] <= 1e-5 * report["direct_loss_scale"] + 1e-6
    assert report["direct_grad_scale"] > 1e-3
    assert report["direct_grad_diff"] <= 1e-5 * report["direct_grad_scale"] + 1e-7


@pytest.mark.slow
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
