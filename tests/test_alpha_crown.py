"""Optimized relaxations (alpha-CROWN) against independent references.

The optimized intermediate bounds (`SlopeOptions(intermediate=True)`) contain every
activation's input on a dense grid of the ball and lie inside CROWN's.

* Soundness whatever the slopes: on 2-D ReLU / LeakyReLU networks, the bound of every
  logit difference with random per-row lower slopes (inside the pieces' slope range
  and outside it) lies below its minimum over a dense grid of the ball, computed in
  numpy from the Keras layers alone (`tests.test_robust_exact.affine_stack`).
* At the exact minimal l_inf perturbation (the MILP of `tests.test_robust_exact`,
  scipy HiGHS), no slopes certify the ball: some margin's lower bound is <= 0.
* The optimized bound is at least CROWN's and below the grid's minimum; the radius of
  `robust_radius(method="alpha_crown")` is at least CROWN's and at most the MILP's.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile.bounds import BoundMethod, SlopeOptions, logit_margins, lower_bounds
from keras_roll.compile.bounds.alpha import optimized_refiner
from keras_roll.compile.bounds.crown import (
    RelaxedOps,
    relaxation_refiner,
    relaxed_lower_bounds,
)
from keras_roll.compile.bounds.ibp import interval_pass
from keras_roll.robust.bounds import arithmetic_of
from tests.test_robust_exact import (
    _mlp,
    affine_stack,
    exact_milp,
    forward,
    near_boundary,
    pre_activations,
)

NETS = {"relu": lambda: _mlp((16, 16), 0.0, 2, 3, 3),
        "leaky": lambda: _mlp((16, 16), 0.2, 2, 3, 4)}


class _Bounds:
    """CROWN's intermediate bounds on the balls of radii `eps` around `x`, and the final
    bound of the margins `f_y - f_j` (`y` the prediction) with any lower slopes."""

    def __init__(self, model, x, eps, p, slopes=None):
        twin = keras_roll.linearize(model).at_dtype("float64")
        x64 = tf.constant(x, tf.float64)
        self.pred = np.argmax(twin.primal(x64).logits.numpy(), -1)
        self.lm = logit_margins(twin.interpreter, x64, tf.constant(self.pred))
        s, v = self.lm.structure, self.lm.values
        self.eps, self.p = tf.constant(eps, tf.float64), p
        self.lines = RelaxedOps(v)
        refine = relaxation_refiner(s, v, self.lines, self.eps, p, 2**26, len(x))
        if slopes is not None:
            refine = optimized_refiner(refine, s, v, self.lines, self.eps, p, 2**26, len(x),
                                       slopes)
        self.boxes = interval_pass(s, v, self.eps, arithmetic_of(twin, False), refine=refine)

    def lower(self, slopes=None) -> np.ndarray:
        """`[B, C]` margins' lower bounds over the balls with the slopes `{index: alpha}`."""
        for i in self.lines.optimizable():
            self.lines.set_lower_slopes(i, None if slopes is None else slopes[i])
        s = self.lm.structure
        low = relaxed_lower_bounds(s, self.lm.values, s.output_key, self.lm.rows, self.lines,
                                   self.boxes.deltas, self.eps, self.p)
        return (self.lm.margins + low).numpy()

    def random_slopes(self, rng, widen=0.0) -> dict:
        """Per row, uniform in the slope range widened by `widen` on both sides."""
        out = {}
        rows = int(self.lm.rows.shape[1])
        for i in self.lines.optimizable():
            lo, hi = (r.numpy()[:, None] for r in self.lines.slope_range(i))
            u = rng.uniform(-widen, 1 + widen, (lo.shape[0], rows, *lo.shape[2:]))
            out[i] = tf.constant(lo + (hi - lo) * u)
        return out


def _grid_minimum(stages, x, pred, eps, p, n=241) -> np.ndarray:
    """`[B, C]` minima of `f_y - f_j` over a dense grid of each ball (its boundary
    included), `j` in the order of `margin_rows`."""
    t = np.linspace(-1.0, 1.0, n)
    grid = np.stack(np.meshgrid(t, t), -1).reshape(-1, 2)
    if p == 2:
        grid = grid[np.linalg.norm(grid, axis=1) <= 1.0]
        theta = np.linspace(0, 2 * np.pi, 4 * n, endpoint=False)
        grid = np.concatenate([grid, np.stack([np.cos(theta), np.sin(theta)], 1)])
    out = []
    for xi, yi, ei in zip(x, pred, eps):
        f = forward(stages, xi[None] + ei * grid)
        classes = f.shape[1]
        others = (yi + 1 + np.arange(classes - 1)) % classes
        out.append(np.min(f[:, [yi]] - f[:, others], axis=0))
    return np.array(out)


@pytest.fixture(scope="module", params=sorted(NETS))
def net(request):
    model = NETS[request.param]()
    x = np.random.default_rng(1).normal(size=(3, 2)) * 0.5
    return model, affine_stack(model), x


@pytest.mark.parametrize("p", [np.inf, 2])
def test_any_slopes_give_bounds_below_the_grid_minimum(net, p):
    """Random per-row slopes in the range, and outside it, bound every margin from below
    on the whole ball; CROWN's own slopes given explicitly give CROWN's bound."""
    model, stages, x = net
    eps = np.array([0.3, 0.6, 1.0])
    b = _Bounds(model, x, eps, p)
    truth = _grid_minimum(stages, x, b.pred, eps, p)
    crown = b.lower()
    assert np.all(crown <= truth + 1e-9)
    assert any(np.any(b.lines.unstable(i).numpy()) for i in b.lines.optimizable())
    rng = np.random.default_rng(0)
    for widen in (0.0, 0.0, 0.0, 1.0):
        low = b.lower(b.random_slopes(rng, widen))
        assert np.all(low <= truth + 1e-9), (low, truth)
    same = {i: b.lines.lower_slopes(i) for i in b.lines.optimizable()}
    np.testing.assert_array_equal(b.lower(same), crown)


def test_optimized_bound_lies_between_crown_and_the_grid_minimum(net):
    """`BoundMethod.ALPHA_CROWN` >= CROWN on every margin (strictly on some), and below
    the grid's minimum."""
    model, stages, x = net
    eps = np.array([0.3, 0.6, 1.0])
    b = _Bounds(model, x, eps, np.inf)
    truth = _grid_minimum(stages, x, b.pred, eps, np.inf)
    s, v, arithmetic = b.lm.structure, b.lm.values, arithmetic_of(
        keras_roll.linearize(model).at_dtype("float64"), False)
    crown = lower_bounds(s, v, b.lm.rows, b.eps, np.inf, BoundMethod.RELAXATION,
                         arithmetic).numpy()
    alpha = lower_bounds(s, v, b.lm.rows, b.eps, np.inf, BoundMethod.ALPHA_CROWN, arithmetic,
                         slopes=SlopeOptions(steps=8, lr=0.3)).numpy()
    margins = b.lm.margins.numpy()
    assert np.all(alpha >= crown)
    assert np.any(alpha > crown + 1e-6)
    assert np.all(margins + alpha <= truth + 1e-9)
    unchanged = lower_bounds(s, v, b.lm.rows, b.eps, np.inf, BoundMethod.ALPHA_CROWN,
                             arithmetic, slopes=SlopeOptions(steps=0)).numpy()
    np.testing.assert_array_equal(unchanged, crown)


def _grid_pre_activations(stages, x, eps, n=121) -> list:
    """Per activation, `[B, G, units]` its inputs on a dense grid of each l_inf ball."""
    t = np.linspace(-1.0, 1.0, n)
    grid = np.stack(np.meshgrid(t, t), -1).reshape(-1, 2)
    return pre_activations(stages, x[:, None] + eps[:, None, None] * grid[None])[0]


def test_optimized_intermediate_bounds_hold_and_are_tighter(net):
    """`optimized_refiner` (`SlopeOptions(intermediate=True)`): every activation's input
    interval contains its values on a dense grid of the ball, lies inside CROWN's, and is
    strictly narrower somewhere; the final bound stays below the grid's minimum."""
    model, stages, x = net
    eps = np.array([0.3, 0.6, 1.0])
    crown = _Bounds(model, x, eps, np.inf)
    opt = _Bounds(model, x, eps, np.inf, SlopeOptions(steps=8, lr=0.3, intermediate=True))
    narrower = False
    for i, z in zip(opt.lines.optimizable(), _grid_pre_activations(stages, x, eps)):
        _, lo, hi = (np.asarray(t) for t in opt.lines.intervals[i])
        _, c_lo, c_hi = (np.asarray(t) for t in crown.lines.intervals[i])
        assert np.all(lo[:, None] <= z.min(axis=1, keepdims=True) + 1e-9)
        assert np.all(hi[:, None] >= z.max(axis=1, keepdims=True) - 1e-9)
        assert np.all(lo >= c_lo) and np.all(hi <= c_hi)
        narrower |= bool(np.any(hi - lo < (c_hi - c_lo) * (1 - 1e-6)))
    assert narrower
    assert np.all(opt.lower() <= _grid_minimum(stages, x, opt.pred, eps, np.inf) + 1e-9)


def test_no_slopes_certify_the_ball_of_the_exact_radius():
    """At the MILP's minimal l_inf perturbation `d` (a point at distance `d` changes the
    class), every choice of slopes leaves some margin's lower bound <= 0 on the ball of
    radius `d`, and so does the optimized bound."""
    model = _mlp((12, 12), 0.0, 4, 3, 0)
    stages = affine_stack(model)
    x = near_boundary(stages, (4,), 2, seed=7).astype(np.float64)
    pred = np.argmax(forward(stages, x), 1)
    exact = np.array([exact_milp(stages, xi, yi, np.inf, 1.0, 3)[1]
                      for xi, yi in zip(x, pred)])
    assert np.all(np.isfinite(exact))
    b = _Bounds(model, x, exact, np.inf)
    rng = np.random.default_rng(2)
    for _ in range(5):
        assert np.all(np.min(b.lower(b.random_slopes(rng)), axis=1) <= 1e-9)
    opt = keras_roll.robust.bounds.relaxed_margins(
        keras_roll.linearize(model).at_dtype("float64"), x, pred, exact, np.inf,
        method="alpha_crown", guard=False, slopes=SlopeOptions(steps=10, lr=0.2))
    assert np.all(np.min(opt.lower, axis=1) <= 1e-9)


@pytest.mark.slow
def test_alpha_radius_lies_between_crowns_and_the_milps():
    """`robust_radius(method="alpha_crown")`: lower >= CROWN's lower (to the search's
    tolerance), strictly larger on some input, and <= the MILP's exact l_inf radius
    (about 60 s)."""
    model = _mlp((16, 16), 0.0, 4, 3, 0)
    stages = affine_stack(model)
    x = near_boundary(stages, (4,), 4, seed=7, back=0.5)
    pred = np.argmax(forward(stages, x.astype(np.float64)), 1)
    kw = dict(norms=(np.inf,), rigor="float32", verbose=False, bisect_tol=1e-4)
    # the MILP's ball: just above the walk's adversarial point (tight big-M bounds)
    walk = keras_roll.robust_radius(model, x, method="walk", **kw).upper[np.inf]
    exact = np.array([exact_milp(stages, xi.astype(np.float64), yi, np.inf, 1.01 * r, 3)[1]
                      for xi, yi, r in zip(x, pred, walk)])
    crown = keras_roll.robust_radius(model, x, method="relaxation", **kw).lower[np.inf]
    rr = keras_roll.robust_radius(model, x, method="alpha_crown",
                                  slopes=SlopeOptions(steps=30, lr=0.2), **kw)
    alpha = rr.lower[np.inf]
    assert np.all(alpha >= crown * (1 - 2e-4))
    assert np.any(alpha > crown * 1.01)
    assert np.all(alpha <= exact * (1 + 1e-6))
    assert set(rr.lower_method[np.inf]) <= {"alpha_crown", "region"}


def test_slopes_api_refuses_bad_values():
    """Clear errors: options out of range, a wrong `slopes=` type, an op without slopes."""
    with pytest.raises(ValueError, match="steps"):
        SlopeOptions(steps=-1).checked()
    with pytest.raises(ValueError, match="lr"):
        SlopeOptions(lr=0.0).checked()
    with pytest.raises(ValueError, match="max_seconds"):
        SlopeOptions(max_seconds=-2).checked()
    model = NETS["relu"]()
    with pytest.raises(ValueError, match="SlopeOptions"):
        keras_roll.robust_radius(model, np.zeros((1, 2)), method="alpha_crown",
                                 slopes={"steps": 3})
    b = _Bounds(model, np.zeros((1, 2)), np.array([0.5]), np.inf)
    with pytest.raises(ValueError, match="optimizable"):
        b.lines.set_lower_slopes(0, tf.zeros([1, 16], tf.float64))
