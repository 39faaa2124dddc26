"""The branch and bound's budget: its clock, its share among the probes, and leaves
that leave the batch once verified.

* `BranchOptions.clock="cpu"` counts the process's CPU time (`time.process_time`),
  "wall" the elapsed time; anything else is a clear error.
* The probe just below the upper bound gets `FIRST_SHARE` of the time; once it is
  undecided, the next probe gets all that is left (against an oracle ball with a
  known radius, as `test_branch_schedule`).
* A batch of leaves bounded together gives every leaf the bound it gets alone, with
  verified leaves leaving the batch between multiplier steps; each bound is at most
  the smallest margin over a dense grid of the ball's points in the leaf (2-D net,
  numpy layer by layer).
"""

import time

import numpy as np
import pytest

import keras_roll.robust.branch as branch
from keras_roll.compile.twin import linearize
from keras_roll.robust import BranchOptions
from keras_roll.robust.subdomains import LeafPasses, _Ball
from tests.test_branch_schedule import _Oracle
from tests.test_robust_exact import _mlp, affine_stack, forward, grid_margins


class _P:
    p = np.inf


def _bracket(monkeypatch, oracle, lo, hi, options, clock="monotonic"):
    monkeypatch.setattr(branch, "verify_ball", oracle.verify)
    monkeypatch.setattr(branch, "_shrink", oracle.shrink)
    monkeypatch.setattr(time, clock, oracle.monotonic)
    return branch._bracket(_P(), None, np.zeros(2), 0, lo, hi, 0.0, 1e-3, options)


def test_the_clock_is_checked():
    assert BranchOptions(clock="cpu").checked().clock == "cpu"
    with pytest.raises(ValueError, match="'wall' or 'cpu'.*'gpu'"):
        BranchOptions(clock="gpu").checked()


def test_a_cpu_clock_budgets_the_process_time(monkeypatch):
    oracle = _Oracle(r=1.0, hard=0.05, decide_seconds=1e9)  # never decided near 1
    monkeypatch.setattr(time, "monotonic", lambda: 1e6)  # the wall clock stands
    _bracket(monkeypatch, oracle, 0.9, 1.0, BranchOptions(max_seconds=8.0, clock="cpu"),
             clock="process_time")
    assert oracle.budgets[0] == pytest.approx(branch.FIRST_SHARE * 8.0)
    assert oracle.clock == pytest.approx(8.0)


def test_after_an_undecided_first_probe_the_next_gets_the_rest(monkeypatch):
    # certified below 1 / 1.05, undecided in [1 / 1.05, 1] unless given 100 s
    oracle = _Oracle(r=1.0, hard=0.05, decide_seconds=100.0)
    lo, hi, _, spent = _bracket(monkeypatch, oracle, 0.9, 1.0, BranchOptions(max_seconds=20.0))
    b = np.array(oracle.budgets)
    assert oracle.probes[0] == pytest.approx(1.0 - 5e-4)
    assert b[0] == pytest.approx(branch.FIRST_SHARE * 20.0)
    assert b[1] == pytest.approx(20.0 - b[0])  # all that is left
    # the geometric middle of [0.9, 0.9995] is below 1 / 1.05: certified
    assert lo == pytest.approx(np.sqrt(0.9 * 0.9995)) and hi == 1.0
    assert oracle.clock <= 20.0 + 1e-9 and spent.probes == len(oracle.probes)


@pytest.mark.slow
def test_leaves_bounded_together_or_alone_agree_and_stay_sound():
    model = _mlp((8, 8), 0.0, 2, 3, 1)
    stages = affine_stack(model)
    twin = linearize(model).at_dtype("float64")
    passes = LeafPasses(twin, np.inf, False, twin.memory_budget, 8, layer_steps=0)
    rng = np.random.default_rng(1)
    x, eps = rng.normal(size=2), 0.5
    pred = int(np.argmax(forward(stages, x[None])))
    pre, margins = grid_margins(stages, x, eps, 161, pred)
    n = passes.layout.size
    splits = np.zeros((6, n), np.int8)  # each leaf holds a point of the grid
    for k in range(1, 6):
        units = rng.choice(n, size=rng.integers(1, 6), replace=False)
        side = np.sign(pre[rng.integers(len(pre)), units])
        splits[k, units] = np.where(side == 0, 1, side)
    params = np.concatenate([np.zeros((6, 2, n)), np.full((6, 2, n), np.nan)], -1)
    options = BranchOptions(beta_steps=6)
    probe = _Ball(passes, model, x, pred, eps, 0.0, options).evaluate(splits, params)[0]
    gap = float(np.median(probe.min(axis=1)))  # some leaves verified, some not
    together = _Ball(passes, model, x, pred, eps, gap, options).evaluate(splits, params)[0]
    alone = np.concatenate([_Ball(passes, model, x, pred, eps, gap, options).evaluate(
        splits[k:k + 1], params[k:k + 1])[0] for k in range(6)])
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-9)
    assert (together.min(axis=1) > gap).any() and (together.min(axis=1) <= gap).any()
    for k in range(6):
        inside = np.all((splits[k] == 0) | (splits[k] * pre >= 0), axis=1)
        assert inside.any()
        assert np.all(together[k] <= margins[inside].min(axis=0) + 1e-9), k
