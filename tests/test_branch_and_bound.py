"""Branch and bound on activation splits against independent references.

* Soundness of every subdomain's bound: random splits (stable units too, so some
  subdomains are empty), random multipliers `beta >= 0` and random lower slopes
  `alpha` (some outside the slope range) on 2-D networks, against
  the smallest margin over a dense grid of the ball's points that satisfy the splits
  (the network read layer by layer into numpy, `test_robust_exact.affine_stack`).
* The radius: `robust_radius(branch=...)` against the MILP of `test_robust_exact`
  (scipy HiGHS): every lower bound at most the MILP's radius, and the bracket closed
  (`exact`, with `exact_value` equal to the MILP's within `exact_rtol`).
* Adversarial points: a ball larger than the exact radius yields a point that the
  float32 Keras model classifies as another class; a smaller one is never refuted.
"""

import numpy as np
import pytest

import keras_roll
from keras_roll.compile.twin import linearize
from keras_roll.robust import BranchOptions
from keras_roll.robust.adversarial import lp_norm, predict_classes
from keras_roll.robust.branch import branch_radius
from keras_roll.robust.subdomains import LeafPasses, _Ball, verify_ball
from tests.test_robust_exact import (
    EXACT_RTOL,
    RTOL,
    _mlp,
    affine_stack,
    brute_force_l2,
    exact_milp,
    forward,
    near_boundary,
    pre_activations,
)

pytestmark = pytest.mark.graph  # many small calls of the same passes: faster compiled


def _pre_activations(stages, pts):
    """`[n, units]` pre-activations of every activation stage, concatenated."""
    out, h = pre_activations(stages, pts)
    return np.concatenate(out, axis=1), h


def _grid(x, eps, p, n=241):
    t = np.linspace(-eps, eps, n)
    pts = np.stack(np.meshgrid(t, t), -1).reshape(-1, 2)
    if p == 2:
        pts = pts[np.sum(pts * pts, axis=1) <= eps * eps]
    return x + pts


_PASSES = {}


def _net_2d(p):
    """`(model, stages, passes)`: a 2-10-10-3 ReLU net and its unguarded leaf passes in
    norm `p` (CROWN's layer bounds), built once per norm for the tests of this file."""
    if p not in _PASSES:
        model = _mlp((10, 10), 0.0, 2, 3, 5)
        twin = linearize(model).at_dtype("float64")
        _PASSES[p] = (model, affine_stack(model),
                      LeafPasses(twin, p, False, twin.memory_budget, 8, layer_steps=0))
    return _PASSES[p]


# (l_inf, no refinement) slow: its two halves run by default, l_inf in (inf, True)
# and the unrefined boxes in (2, False).
@pytest.mark.parametrize("p,refine", [(np.inf, True), (2, False),
                                      pytest.param(np.inf, False, marks=pytest.mark.slow)])
def test_random_splits_and_multipliers_stay_sound(p, refine):
    model, stages, passes = _net_2d(p)  # final pass
    rng = np.random.default_rng(0)
    x = rng.normal(size=2)
    pred = int(np.argmax(forward(stages, x[None])))
    eps = 0.6
    pre, logits = _pre_activations(stages, _grid(x, eps, p))
    others = [(pred + 1 + k) % 3 for k in range(2)]  # the order of the bound's rows
    margins = logits[:, [pred]] - logits[:, others]
    n = passes.layout.size
    assert n == 20
    ball = _Ball(passes, model, x, pred, eps, 0.0, BranchOptions(refine=refine))
    # Leaves 1-5 split up to 8 units the way a random point of the ball has them
    # (a subdomain that holds that point), leaves 6-7 at random (often empty).
    splits = np.zeros((8, n), np.int8)
    for k in range(1, 8):
        units = rng.choice(n, size=rng.integers(1, 9), replace=False)
        side = np.sign(pre[rng.integers(len(pre)), units]) if k < 6 else \
            rng.choice([-1, 1], size=units.size)
        splits[k, units] = np.where(side == 0, 1, side)
    betas = rng.exponential(0.5, size=(8, 2, n)) * (splits != 0)[:, None]
    los, his, deltas, empty = ball.layer_boxes(splits.astype(np.float64))
    # CROWN's lower slopes (None), then random ones per margin, some outside [0, 1]
    for alphas in (None, rng.uniform(-0.5, 1.5, size=betas.shape)):
        lower, *_ = passes.bounds(ball.xt, ball.pt, ball.et, los, his, deltas,
                                  splits.astype(np.float64), betas, alphas)
        lower = np.where(empty[:, None], np.inf, lower.numpy())
        checked = 0
        for k in range(8):
            ok = np.all((splits[k] == 0) | (splits[k] * pre >= 0), axis=1)
            if ok.any():
                true = margins[ok].min(axis=0)
                assert np.all(lower[k] <= true + 1e-9), (k, lower[k], true)
                checked += 1
        assert checked >= 6
        assert np.all(np.isfinite(lower[0]))  # the whole ball is never empty


def _small(seed=0):
    model = _mlp((12, 12), 0.0, 4, 3, seed)
    stages = affine_stack(model)
    x = near_boundary(stages, (4,), 4, seed=7, back=0.3)
    return model, stages, x


def test_balls_just_inside_the_milp_radius_are_certified():
    """One input (the slow test_branch_closes_the_bracket_at_the_milp_radius runs four,
    through robust_radius); CROWN's layer bounds on every leaf (`layer_steps=0`: the
    optimized ones are tests/test_branch_layer_bounds.py's subject)."""
    model, stages, x = _small()
    p = np.inf
    twin = linearize(model).at_dtype("float64")
    passes = LeafPasses(twin, p, True, twin.memory_budget, 32, layer_steps=0)
    flat = x.reshape(len(x), -1).astype(np.float64)
    for i in range(1):
        pred = int(predict_classes(model, x[i:i + 1])[0])
        raw, exact = exact_milp(stages, flat[i], pred, p, 0.5, 3)
        radius = min(raw, exact)
        inside = verify_ball(passes, model, flat[i], pred, radius * (1 - EXACT_RTOL / 4), 0.0,
                             BranchOptions(), deadline=np.inf)
        assert inside.status == "certified"
        outside = verify_ball(passes, model, flat[i], pred, radius * 1.01, 0.0,
                              BranchOptions(), deadline=np.inf)
        assert outside.status == "adversarial"
        assert predict_classes(model, outside.point[None].astype(np.float32))[0] != pred


def _closes_at_the_milp_radius(model, stages, x, classes, seconds):
    """`robust_radius(branch=...)` in l_inf against the MILP: sound, and exact everywhere."""
    p = np.inf
    rr = keras_roll.robust_radius(model, x, norms=(p,), verbose=False,
                                  branch=BranchOptions(max_seconds=seconds))
    flat = x.reshape(len(x), -1).astype(np.float64)
    raw, exact = np.array([exact_milp(stages, flat[i], rr.predicted[i], p,
                                      1.5 * rr.upper[p][i], classes)
                           for i in range(len(x))]).T
    assert np.all(rr.lower[p] <= np.minimum(raw, exact) * (1 + RTOL) + 1e-9)
    assert np.all(rr.exact[p]), (rr.lower[p], rr.upper[p])
    np.testing.assert_allclose(rr.exact_value[p], exact, rtol=EXACT_RTOL)
    adv = rr.adversarial[p].astype(np.float32)
    assert np.all(predict_classes(model, adv) != rr.predicted)
    return rr


@pytest.mark.slow
def test_branch_closes_the_bracket_at_the_milp_radius():
    model, stages, x = _small()
    rr = _closes_at_the_milp_radius(model, stages, x, 3, 60)
    assert np.any(rr.lower_method[np.inf] == "branch"), rr.lower_method[np.inf]


@pytest.mark.slow
def test_branch_closes_on_a_wider_mlp():
    model = _mlp((32, 32), 0.0, 6, 4, 0)
    stages = affine_stack(model)
    x = near_boundary(stages, (6,), 4, seed=7, back=0.3)
    _closes_at_the_milp_radius(model, stages, x, 4, 120)


def test_balls_beyond_the_radius_hold_real_adversarial_points():
    model, stages, passes = _net_2d(2)  # the passes of test_random_splits_...[2-False]
    x = np.random.default_rng(3).normal(size=(2, 2)).astype(np.float32).astype(np.float64)
    for i in range(len(x)):
        pred = int(predict_classes(model, x[i:i + 1])[0])
        radius = brute_force_l2(stages, x[i], pred, 10.0)
        far = verify_ball(passes, model, x[i], pred, 1.2 * radius, 0.0, BranchOptions(),
                          deadline=np.inf)
        assert far.status == "adversarial"
        assert predict_classes(model, far.point[None].astype(np.float32))[0] != pred
        assert lp_norm(far.point[None] - x[i:i + 1], 2)[0] <= 1.2 * radius * (1 + 1e-5)
        near = verify_ball(passes, model, x[i], pred, 0.97 * radius, 0.0, BranchOptions(),
                           deadline=np.inf)
        assert near.status == "certified"


@pytest.mark.slow
def test_probes_climb_past_the_radius_without_an_upper_bound():
    model = _mlp((16, 16), 0.0, 2, 3, 3)
    stages = affine_stack(model)
    twin = linearize(model).at_dtype("float64")
    x = np.random.default_rng(3).normal(size=(2, 2)).astype(np.float32).astype(np.float64)
    pred = predict_classes(model, x)
    radii = np.array([brute_force_l2(stages, x[i], pred[i], 10.0) for i in range(len(x))])
    res = branch_radius(model, twin, x, pred, 2, 0.7 * radii, np.full(2, np.nan),
                        np.full(x.shape, np.nan), options=BranchOptions(max_seconds=60))
    assert np.all(res.lower <= radii * (1 + 1e-9)) and np.all(res.lower > 0.7 * radii)
    assert np.all(res.improved_upper) and np.all(res.upper >= radii * (1 - 2e-3))
    classes = predict_classes(model, res.adversarial.astype(np.float32))
    assert np.all(classes != pred) and np.all(classes == res.runner_up)
    np.testing.assert_allclose(lp_norm(res.adversarial - x, 2), res.upper, rtol=1e-12)


@pytest.mark.parametrize("field,value", [("max_seconds", 0), ("batch", 1), ("beta_steps", -1),
                                         ("max_leaves", 2.5), ("beta_rate", -0.1),
                                         ("alpha", 1), ("candidates", 0)])
def test_bad_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"BranchOptions.{field}"):
        BranchOptions(**{field: value}).checked()


def test_robust_radius_refuses_other_branch_values():
    model, _, x = _small()
    with pytest.raises(ValueError, match="BranchOptions"):
        keras_roll.robust_radius(model, x, branch={"max_seconds": 5}, verbose=False)
