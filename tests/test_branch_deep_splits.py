"""Splitting a leaf on several units at once (a small frontier fills one batch).

* The children of a leaf split on `d` units are the `2^d` sign patterns of those
  units (checked against `itertools.product`), each agreeing with its parent elsewhere:
  together they cover the parent's subdomain.
* Verdicts on 2-D networks stay sound with deep splits: a ball inside the exact radius
  (brute force on a dense grid, l_inf) is certified, one beyond it holds a point the
  float32 Keras model classifies as another class; both at a batch that splits the
  root on 5 or more units at once.
"""

import itertools

import numpy as np
import pytest

from keras_roll.compile.twin import linearize
from keras_roll.robust import BranchOptions
from keras_roll.robust.adversarial import lp_norm, predict_classes
from keras_roll.robust.subdomains import LeafPasses, _children, verify_ball
from tests.test_robust_exact import _mlp, affine_stack, forward

pytestmark = pytest.mark.graph


def test_children_are_every_sign_pattern_of_the_split_units():
    rng = np.random.default_rng(0)
    splits = rng.choice([-1, 0, 1], size=(3, 12)).astype(np.int8)
    units = np.array([[0, 4, 7], [1, 2, 3], [11, 5, 9]])
    params = rng.normal(size=(3, 2, 24))
    kids, kid_params = _children(splits, params, units)
    assert kids.shape == (24, 12) and kid_params.shape == (24, 2, 24)
    for i in range(3):
        mine = kids[i::3]  # pattern-major: child k m + i belongs to leaf i
        np.testing.assert_array_equal(kid_params[i::3], np.repeat(params[i:i + 1], 8, 0))
        others = np.setdiff1d(np.arange(12), units[i])
        np.testing.assert_array_equal(mine[:, others], np.repeat(splits[i:i + 1, others], 8, 0))
        patterns = {tuple(row) for row in mine[:, units[i]]}
        assert patterns == set(itertools.product([-1, 1], repeat=3))


def _linf_radius(stages, x, pred, top=3.0, n=801):
    """The exact l_inf distance to another class, to the grid's resolution: the
    smallest `max |x' - x|` over grid points classified otherwise (an upper bound)
    and that minus one grid step (a lower bound); a second grid over the square of
    the first one's distance."""
    for _ in range(2):
        t = np.linspace(-top, top, n)
        pts = np.stack(np.meshgrid(t, t), -1).reshape(-1, 2)
        other = np.argmax(forward(stages, x + pts), 1) != pred
        d = np.abs(pts[other]).max(axis=1).min()
        below, top = d - 2 * top / (n - 1), d
    return below, d


@pytest.mark.slow
def test_deep_splits_certify_inside_and_refute_beyond_the_radius():
    model = _mlp((16, 16), 0.0, 2, 3, 3)
    stages = affine_stack(model)
    twin = linearize(model).at_dtype("float64")
    # CROWN's layer bounds (layer_steps=0): with optimized ones the root has too few
    # unstable units left for a split of 5+ units at once
    passes = LeafPasses(twin, np.inf, True, twin.memory_budget, 64, layer_steps=0)
    x = np.random.default_rng(3).normal(size=(4, 2)).astype(np.float32).astype(np.float64)
    options = BranchOptions(batch=64, layer_steps=0)
    for i in (2, 3):  # inputs whose relaxation alone certifies no ball this close

        pred = int(predict_classes(model, x[i:i + 1])[0])
        below, above = _linf_radius(stages, x[i], pred)
        near = verify_ball(passes, model, x[i], pred, 0.998 * below, 0.0, options,
                           deadline=np.inf)
        assert near.status == "certified"
        assert near.leaves >= 1 + 32  # the root's children came in one split of 5+ units
        far = verify_ball(passes, model, x[i], pred, 1.1 * above, 0.0, options,
                          deadline=np.inf)
        assert far.status == "adversarial"
        assert predict_classes(model, far.point[None].astype(np.float32))[0] != pred
        assert lp_norm(far.point[None] - x[i:i + 1], np.inf)[0] <= 1.1 * above * (1 + 1e-6)
