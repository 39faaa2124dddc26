"""The rounding guard of the branch and bound's leaves follows the call's rigor.

* Under rigor "float64" the leaves' passes sum the rounding terms as the relaxation
  does (the probabilistic bound, with the worst case as a second guard), under
  "strict" the worst case, under "float32" none (`LeafPasses.mode`).
* Under "float64", random splits and multipliers keep every leaf's bound below the
  smallest margin over a dense grid of the ball's points in the leaf (2-D network,
  numpy layer by layer), and never below the worst-case guard's bound by more than
  the worst-case rounding terms allow (the probabilistic terms are the smaller).
"""

import numpy as np
import pytest

from keras_roll.compile.bounds.ibp import RoundingLoss
from keras_roll.compile.twin import linearize
from keras_roll.options import Rigor
from keras_roll.robust import BranchOptions
from keras_roll.robust.bounds import guard_loss
from keras_roll.robust.subdomains import LeafPasses, _Ball
from tests.test_robust_exact import _mlp, affine_stack, forward, grid_margins

pytestmark = pytest.mark.graph


def test_the_mode_follows_the_rigor():
    model = _mlp((4,), 0.0, 2, 3, 0)
    twin = linearize(model).at_dtype("float64")
    modes = {r: LeafPasses(twin, np.inf, r, twin.memory_budget, 4).mode
             for r in (Rigor.FLOAT64, Rigor.STRICT, Rigor.FLOAT32, True, False)}
    assert modes == {Rigor.FLOAT64: "float64", Rigor.STRICT: "strict",
                     Rigor.FLOAT32: "none", True: "strict", False: "none"}
    strict = LeafPasses(twin, np.inf, True, twin.memory_budget, 4)
    assert guard_loss(strict.arithmetic, {}) is RoundingLoss
    probable = LeafPasses(twin, np.inf, Rigor.FLOAT64, twin.memory_budget, 4)
    assert guard_loss(probable.arithmetic, {0: (1.0, 1.0)}) is not RoundingLoss


@pytest.mark.slow
def test_probabilistic_leaves_stay_sound_on_the_grid():
    model = _mlp((10, 10), 0.0, 2, 3, 5)
    stages = affine_stack(model)
    twin = linearize(model).at_dtype("float64")
    rng = np.random.default_rng(0)
    x = rng.normal(size=2)
    pred = int(np.argmax(forward(stages, x[None])))
    eps = 0.6
    pre, margins = grid_margins(stages, x, eps, 241, pred)
    n = pre.shape[1]
    splits = np.zeros((8, n), np.int8)
    for k in range(1, 8):
        units = rng.choice(n, size=rng.integers(1, 9), replace=False)
        splits[k, units] = np.where(pre[rng.integers(len(pre)), units] >= 0, 1, -1)
    betas = rng.exponential(0.5, size=(8, 2, n)) * (splits != 0)[:, None]
    bounds = {}
    for mode in ("float64", "strict"):
        passes = LeafPasses(twin, np.inf, mode, twin.memory_budget, 8)
        ball = _Ball(passes, model, x, pred, eps, 0.0, BranchOptions())
        los, his, deltas, empty = ball.layer_boxes(splits.astype(np.float64))
        lower, *_ = passes.bounds(ball.xt, ball.pt, ball.et, los, his, deltas,
                                  splits.astype(np.float64), betas)
        bounds[mode] = np.where(empty[:, None], np.inf, lower.numpy())
    for k in range(8):
        inside = np.all((splits[k] == 0) | (splits[k] * pre >= 0), axis=1)
        assert inside.any()
        assert np.all(bounds["float64"][k] <= margins[inside].min(axis=0) + 1e-9)
    # float32 rounding on this net is ~1e-6 of the margins: the two guards differ by
    # little, and the probabilistic one is not the looser beyond that
    assert np.all(bounds["float64"] >= bounds["strict"] - 1e-6)
