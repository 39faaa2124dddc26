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


@pytest.fixture(scope="module")
def near():
    model = _mlp(64, (32, 32))
    x = np.random.default_rng(1).uniform(0, 1, (6, 64)).astype(np.float32)
    rr = keras_roll.robust_radius(model, x, norms=NORMS, method="walk", verbose=False)
    points = {}
    for p in NORMS:
        assert np.all(np.isfinite(rr.upper[p]))
        adv = rr.adversarial[p]
        points[p] = (adv + 0.01 * (x - adv)).astype(np.float32)
    return model, points


@pytest.mark.parametrize("p", NORMS, ids=["l2", "linf"])
def test_default_is_positive_and_exact_near_the_boundary(near, p):
    model, points = near
    x = points[p]
    rr = keras_roll.robust_radius(model, x, norms=(p,), verbose=False)
    strict = keras_roll.robust_radius(model, x, norms=(p,), rigor="strict", verbose=False)
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
