"""robust_radius's rounding guard near a decision boundary, and when `exact` is claimed.

The inputs lie 1 % of the way from robust_radius's own adversarial point back to
`x`: logit margins of about 1e-3, where a worst-case guard of the logits leaves
nothing. The default rigor has `certify`'s probabilistic semantics; "strict" stays
worst case. References, independent of keras_roll: the affine map of the network
at each input written out in numpy (float64), its nearest decision hyperplane,
and bisection of the float32 Keras model along the segment to the adversarial
point.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_roll

pytestmark = pytest.mark.graph  # many compiled passes: faster as graphs

NORMS = (2, np.inf)


def _mlp(d, widths, seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((d,))
    h = inp
    for w in widths:
        h = keras.layers.Dense(w, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


def _affine_map(model, x):
    """`(margins [L-1], gradients [L-1, D])` of `f_y - f_j` at `x`, numpy float64."""
    dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
    h, jac = x.astype(np.float64), np.eye(x.size)
    for i, layer in enumerate(dense):
        w, b = (np.asarray(v, np.float64) for v in layer.get_weights())
        h, jac = h @ w + b, jac @ w
        if i < len(dense) - 1:
            on = h > 0
            h, jac = h * on, jac * on
    y = int(np.argmax(h))
    others = [j for j in range(h.size) if j != y]
    return h[y] - h[others], (jac[:, [y]] - jac[:, others]).T


def _nearest_hyperplane(model, x, p):
    m, g = _affine_map(model, x)
    q = {2: 2, np.inf: 1}[p]
    return float(np.min(m / np.linalg.norm(g, ord=q, axis=1)))


def _first_flip(model, x, adv, steps=40):
    """`[n]`: the distance fraction along each `x -> adv` where the float32 model first
    changes its prediction (bisection of all rows at once; `adv` flips)."""
    pred = np.argmax(np.asarray(model(x.astype(np.float32))), -1)
    lo, hi = np.zeros(len(x)), np.ones(len(x))
    for _ in range(steps):
        mid = (lo + hi) / 2
        pts = (x + mid[:, None] * (adv - x)).astype(np.float32)
        same = np.argmax(np.asarray(model(pts)), -1) == pred
        lo, hi = np.where(same, mid, lo), np.where(same, hi, mid)
    return hi


# The attack's budget: its upper bounds are not the subject here (the guard's lower
# bounds and the region's exact claims are); tests/test_attacks.py tests the attack.
CHEAP = keras_roll.robust.AttackOptions(steps=10, restarts=1, polish=0, probe_steps=0)


@pytest.fixture(scope="module")
def near():
    """The model and `points(p)`: the inputs 1 % back from the walk's points in norm `p`
    (walked once per norm asked for: by default l_inf alone)."""
    model = _mlp(64, (32, 32))
    x = np.random.default_rng(1).uniform(0, 1, (6, 64)).astype(np.float32)
    points = {}

    def points_of(p):
        if p not in points:
            rr = keras_roll.robust_radius(model, x, norms=(p,), method="walk", verbose=False)
            assert np.all(np.isfinite(rr.upper[p]))
            adv = rr.adversarial[p]
            points[p] = (adv + 0.01 * (x - adv)).astype(np.float32)
        return points[p]

    return model, points_of


# l2 slow: the guard near the boundary is the same code for both norms (only the dual
# norm of the decision hyperplane differs); l_inf runs by default.
@pytest.mark.parametrize("p", [pytest.param(2, marks=pytest.mark.slow), np.inf],
                         ids=["l2", "linf"])
def test_default_is_positive_and_exact_near_the_boundary(near, p):
    model, points = near
    x = points(p)
    rr = keras_roll.robust_radius(model, x, norms=(p,), attack=CHEAP, verbose=False)
    strict = keras_roll.robust_radius(model, x, norms=(p,), rigor="strict", attack=CHEAP,
                                      verbose=False)
    lower, upper = rr.lower[p], rr.upper[p]
    assert np.all(lower > 0), lower
    assert np.mean(rr.exact[p]) >= 0.5, rr.exact[p]
    # Never below the worst case (the relaxation's searches stop within bisect_tol).
    assert np.all(lower >= strict.lower[p] * (1 - 2e-3))
    for i in range(len(x)):
        t = _nearest_hyperplane(model, x[i], p)
        if rr.exact[p][i] and rr.lower_method[p][i] == "decision":
            # the minimum of exact arithmetic, bracketed by the model's rounding
            np.testing.assert_allclose(rr.exact_value[p][i], t, rtol=1e-7)
            assert lower[i] <= t <= upper[i]
    # Soundness: no bound exceeds the distance where the float32 model flips.
    x64 = x.astype(np.float64)
    for res in (rr, strict):
        adv = res.adversarial[p]
        dist = _first_flip(model, x64, adv) * np.linalg.norm(adv - x64, ord=p, axis=1)
        assert np.all(res.lower[p] <= dist * (1 + 1e-9)), (res.rigor, res.lower[p], dist)
    # Probes at 0.999 x the default lower bound keep the float32 model's prediction.
    rng = np.random.default_rng(0)
    pred = np.argmax(np.asarray(model(x)), -1)
    dirs = np.concatenate([rng.normal(size=(len(x), 32, x.shape[1])),
                           (rr.adversarial[p] - x64)[:, None]], axis=1)
    dirs /= np.linalg.norm(dirs, ord=p, axis=2, keepdims=True)
    probes = (x64[:, None] + 0.999 * lower[:, None, None] * dirs).astype(np.float32)
    got = np.argmax(np.asarray(model(probes.reshape(-1, x.shape[1]))), -1)
    assert np.all(got.reshape(len(x), -1) == pred[:, None])


def test_bisect_tol_is_no_wider_than_exact_rtol():
    import inspect

    params = inspect.signature(keras_roll.robust_radius).parameters
    assert params["bisect_tol"].default <= params["exact_rtol"].default


@pytest.mark.slow
def test_wide_float32_mlp_default_certifies_where_strict_gives_zero():
    """784-100-100-10, the case where every worst-case lower bound is 0."""
    model = _mlp(784, (100, 100))
    x = np.random.default_rng(1).uniform(0, 1, (4, 784)).astype(np.float32)
    rr = keras_roll.robust_radius(model, x, norms=(np.inf,), verbose=False)
    adv = rr.adversarial[np.inf]
    near = (adv + 0.01 * (x - adv)).astype(np.float32)
    default = keras_roll.robust_radius(model, near, norms=(np.inf,), verbose=False)
    strict = keras_roll.robust_radius(model, near, norms=(np.inf,), rigor="strict",
                                      verbose=False)
    assert np.all(default.lower[np.inf] >= strict.lower[np.inf])
    assert np.mean(default.lower[np.inf] > 0) >= 0.5
    assert np.mean(default.exact[np.inf]) >= 0.5


def test_default_intermediate_bounds_contain_the_float32_evaluation_and_beat_strict():
    """The relaxation's layer bounds under the default rigor (CROWN rows with the
    probabilistic rounding bound, intervals widened by it) contain every hidden
    pre-activation the float32 Keras model computes at 300 points of the l_inf ball,
    at a radius (2^-20) where the rounding bound decides (the first layer's extreme
    corners among them); and they are never
    wider than the worst case's, narrower somewhere."""
    import tensorflow as tf

    from keras_roll.compile.bounds import bound_rule, logit_margins
    from keras_roll.compile.bounds.crown import RelaxedOps, relaxation_refiner
    from keras_roll.compile.bounds.ibp import interval_pass
    from keras_roll.robust import bounds as robust_bounds

    keras.utils.set_random_seed(0)
    inp = keras.Input((784,))
    pre1 = keras.layers.Dense(100)(inp)
    pre2 = keras.layers.Dense(100)(keras.layers.ReLU()(pre1))
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.ReLU()(pre2)))
    hidden = keras.Model(inp, [pre1, pre2])
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1024, (3, 784)) / 1024.0  # x +- eps is exact in float32
    eps = 2.0**-20
    twin = keras_roll.linearize(model).at_dtype("float64")
    lm = logit_margins(twin.interpreter, tf.constant(x), tf.zeros([3], tf.int64))
    boxes = {}
    for mode in ("float64", "strict"):
        arithmetic = robust_bounds.guard_arithmetic(twin, mode)
        lines = RelaxedOps(lm.values)
        refine = relaxation_refiner(lm.structure, lm.values, lines, tf.fill([3], eps), np.inf,
                                    2**26, 3, robust_bounds._loss_of(arithmetic))
        res = interval_pass(lm.structure, lm.values, tf.fill([3], eps), arithmetic, refine)
        boxes[mode] = [(lm.values.inputs[i][0].numpy(), res.boxes[node.inputs[0]])
                       for i, node in enumerate(lm.structure.nodes)
                       if not bound_rule(node.op).linear]
    assert len(boxes["float64"]) == 2
    # the corners where the first layer's units reach their extremes, and random ones
    w1 = np.sign(model.layers[1].get_weights()[0].T[:50])
    steps = np.concatenate([16 * w1, -16 * w1, rng.choice([-16, 16], (100, 784)),
                            rng.integers(-16, 17, (100, 784))])[:, None]
    pts = (x[None] + steps * eps / 16).reshape(-1, 784)  # multiples of 2^-24: exact
    got = [np.asarray(h, np.float64).reshape(300, 3, -1) for h in hidden(pts.astype(np.float32))]
    narrower = 0
    for (z0, box), (_, strict), h in zip(boxes["float64"], boxes["strict"], got):
        lo, hi = z0 + box.lo.numpy(), z0 + box.hi.numpy()
        assert np.all((h >= lo[None]) & (h <= hi[None]))
        width, strict_width = (hi - lo), (strict.hi - strict.lo).numpy()
        assert np.all(width <= strict_width * (1 + 1e-12))
        narrower += int(np.sum(width < 0.9 * strict_width))
    assert narrower > 0
