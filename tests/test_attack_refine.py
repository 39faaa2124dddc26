"""The attack's first-order refinement along the decision boundary (`attack_refine`).

* `linear_target` against scipy's LP (HiGHS) for l1 and l_inf and Hoelder's equality
  `|c| / ||g||_q` for every norm: the point of least norm on a hyperplane.
* On an affine two-class model the minimal clear flip is known in closed form: from a
  far adversarial point, one round reaches it (never below it).
* On a small ReLU net, from a weak attack's points: never farther, every point changes
  the float32 prediction by the flip gap and stays inside the domain.
"""

import keras
import numpy as np
import pytest
from scipy.optimize import linprog

from keras_roll.robust import AttackOptions, minimal_norm_attack
from keras_roll.robust.adversarial import FLIP_GAP, clearly_other, lp_norm, model_outputs
from keras_roll.robust.attack_refine import linear_target, refine_points

NORMS = (1, 2, np.inf)
DUAL = {1: np.inf, 2: 2, np.inf: 1}


def _lp_min(g, c, p):
    """min ||d||_p s.t. g . d = c, for p = 1 or inf, by an LP (d = u - v, u, v >= 0)."""
    n = g.size
    if p == 1:
        res = linprog(np.ones(2 * n), A_eq=np.concatenate([g, -g])[None], b_eq=[c],
                      bounds=[(0, None)] * (2 * n), method="highs")
        return res.fun
    # l_inf: min t s.t. -t <= d_i <= t
    cost = np.zeros(n + 1)
    cost[-1] = 1.0
    eye = np.eye(n)
    a_ub = np.block([[eye, -np.ones((n, 1))], [-eye, -np.ones((n, 1))]])
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(2 * n), A_eq=np.append(g, 0.0)[None],
                  b_eq=[c], bounds=[(None, None)] * n + [(0, None)], method="highs")
    return res.fun


@pytest.mark.parametrize("p", NORMS)
def test_linear_target_is_the_least_norm_point_on_the_hyperplane(p):
    rng = np.random.default_rng(3)
    g = rng.normal(size=(5, 7))
    level = rng.normal(size=5)
    aim = linear_target(g, level, p)
    np.testing.assert_allclose(np.sum(g * aim, axis=1), level, rtol=1e-10, atol=1e-12)
    holder = np.abs(level) / lp_norm(g, DUAL[p])
    np.testing.assert_allclose(lp_norm(aim, p), holder, rtol=1e-10)
    if p != 2:
        lp = [_lp_min(g[i], level[i], p) for i in range(5)]
        np.testing.assert_allclose(lp_norm(aim, p), lp, rtol=1e-7)


def _affine(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)])
    w, b = model.get_weights()
    return model, w.astype(np.float64), b.astype(np.float64)


@pytest.mark.parametrize("p", NORMS)
def test_one_round_reaches_the_closed_form_minimum_on_an_affine_model(p):
    model, w, b = _affine(5)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 6))
    out = x @ w + b
    pred = np.argmax(out, axis=1)
    g = (w[:, pred] - w[:, 1 - pred]).T  # gradients of f_pred - f_other
    m = out[np.arange(4), pred] - out[np.arange(4), 1 - pred]
    # a far adversarial point: a random direction that lowers the margin, to -m
    d = rng.normal(size=x.shape)
    d *= np.where(np.sum(g * d, axis=1) > 0, -1.0, 1.0)[:, None]
    d *= (2.0 * m / -np.sum(g * d, axis=1))[:, None]
    start = (x + d).astype(np.float32).astype(np.float64)
    assert clearly_other(model_outputs(model, start.astype(np.float32)), pred).all()
    lo, hi = np.full(6, -np.inf), np.full(6, np.inf)
    pts, dist = refine_points(model, x, start, pred, p, lo, hi, rounds=1)
    exact = m / lp_norm(g, DUAL[p])  # the boundary itself, no gap: a floor
    assert np.all(dist >= exact * (1 - 1e-6))
    assert np.all(dist <= exact * (1 + 1e-3))  # the gap: 2^-16 of the outputs
    assert np.all(dist < lp_norm(start - x, p))
    assert clearly_other(model_outputs(model, pts.astype(np.float32)), pred).all()


@pytest.fixture(scope="module")
def relu_net():
    keras.utils.set_random_seed(2)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(24, activation="relu"),
                             keras.layers.Dense(24, activation="relu"), keras.layers.Dense(3)])


@pytest.mark.parametrize("p", NORMS)
def test_refinement_never_moves_away_and_every_point_flips(relu_net, p):
    model = relu_net
    x = np.random.default_rng(4).uniform(0.2, 0.8, size=(6, 8))
    pred = np.argmax(model_outputs(model, x.astype(np.float32)), axis=1)
    weak = AttackOptions(steps=8, restarts=1, polish=0, probe_steps=0, refine=0)
    nb = minimal_norm_attack(model, x, p, pred=pred, domain=(0.0, 1.0), options=weak)
    ok = np.isfinite(nb.upper)
    assert ok.sum() >= 3
    lo, hi = np.zeros(8), np.ones(8)
    pts, dist = refine_points(model, x[ok], nb.adversarial[ok], pred[ok], p, lo, hi, rounds=4)
    assert np.all(dist <= nb.upper[ok])
    np.testing.assert_allclose(dist, lp_norm(pts - x[ok], p))
    out = model_outputs(model, pts.astype(np.float32))
    assert np.all(np.argmax(out, axis=1) != pred[ok])
    wins = np.max(out, axis=1) - out[np.arange(ok.sum()), pred[ok]]
    assert np.all(wins > FLIP_GAP * np.max(np.abs(out), axis=1))
    assert np.all((pts >= 0.0) & (pts <= 1.0))


def test_refine_option_is_checked():
    with pytest.raises(ValueError, match="refine"):
        AttackOptions(refine=-1).checked()


def test_chunks_of_one_row_give_each_rows_own_refinement(relu_net, monkeypatch):
    """The rows run in chunks that fit `CHUNK_BYTES`: with one row per chunk, each row
    gets exactly what a call on that row alone gives (the same batch sizes, so the same
    rounding; across batch sizes the model's rounding can pick another share), and
    every point still flips."""
    from keras_roll.robust import attack_refine

    model = relu_net
    x = np.random.default_rng(9).uniform(0.2, 0.8, size=(5, 8))
    pred = np.argmax(model_outputs(model, x.astype(np.float32)), axis=1)
    weak = AttackOptions(steps=8, restarts=1, polish=0, probe_steps=0, refine=0)
    nb = minimal_norm_attack(model, x, 2, pred=pred, domain=(0.0, 1.0), options=weak)
    ok = np.flatnonzero(np.isfinite(nb.upper))
    box = (np.zeros(8), np.ones(8))
    alone = [refine_points(model, x[i:i + 1], nb.adversarial[i:i + 1], pred[i:i + 1], 2, *box,
                           rounds=3) for i in ok]
    calls = []
    inner = attack_refine._refine_rows
    monkeypatch.setattr(attack_refine, "_refine_rows",
                        lambda *a: calls.append(len(a[1])) or inner(*a))
    monkeypatch.setattr(attack_refine, "CHUNK_BYTES", 1)  # one row per chunk
    pts, dist = refine_points(model, x[ok], nb.adversarial[ok], pred[ok], 2, *box, rounds=3)
    assert calls == [1] * ok.size
    np.testing.assert_array_equal(dist, [d[0] for _, d in alone])
    np.testing.assert_array_equal(pts, np.concatenate([q for q, _ in alone]))
    assert np.all(dist <= nb.upper[ok])
    assert clearly_other(model_outputs(model, pts.astype(np.float32)), pred[ok]).all()
