"""The minimal-norm attack (keras_roll.robust.attacks) against independent references.

* A linear model: the minimal lp distance to another class is in closed form,
  `min_j (f_y - f_j) / ||w_y - w_j||_q`; with a box domain (l_inf) it is found by
  bisection on the radius of the best box-clipped sign step.
* A 2-D ReLU net: the minimal distance by brute force on a fine grid.
* Every point is checked with the Keras model itself (`model(x)`: another batch,
  another call), its distance recomputed, its place in the domain checked.
"""

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.robust import AttackOptions, minimal_norm_attack
from keras_roll.robust.adversarial import FLIP_GAP

NORMS = (1, 2, np.inf)

pytestmark = pytest.mark.graph  # the attack's loop of steps: much faster compiled
DUAL = {1: np.inf, 2: 2, np.inf: 1}


def _norm(v, p):
    v = v.reshape(v.shape[0], -1)
    return np.linalg.norm(v, ord=p, axis=1)


def _linear(d=20, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    model = keras.Sequential([keras.Input((d,)), keras.layers.Dense(classes)])
    w = rng.normal(size=(d, classes)).astype(np.float32)
    b = rng.normal(size=classes).astype(np.float32)
    model.layers[0].set_weights([w, b])
    return model, w.astype(np.float64), b.astype(np.float64)


def _check_points(model, x, nb, p, pred):
    """Every point flips the Keras model's prediction; `upper` is its distance from `x`."""
    found = np.isfinite(nb.upper)
    pts = nb.adversarial[found].astype(np.float32)
    assert np.all(np.argmax(np.asarray(model(pts, training=False)), axis=1) != pred[found])
    np.testing.assert_allclose(_norm(pts.astype(np.float64) - x[found], p), nb.upper[found],
                               rtol=1e-12)


@pytest.fixture(scope="module")
def linear():
    """`_linear()`, shared by the tests on a linear model (its attack loop traced once:
    one graph serves every norm)."""
    return _linear()


@pytest.mark.parametrize("p", NORMS)
def test_linear_model_meets_the_closed_form(linear, p):
    model, w, b = linear
    x = np.random.default_rng(1).normal(size=(12, w.shape[0])).astype(np.float32)
    x64 = x.astype(np.float64)
    f = x64 @ w + b
    pred = np.argmax(f, axis=1)
    others = [[j for j in range(w.shape[1]) if j != y] for y in pred]
    exact = np.array([min((f[i, y] - f[i, j]) / np.linalg.norm(w[:, y] - w[:, j], DUAL[p])
                          for j in others[i]) for i, y in enumerate(pred)])
    nb = minimal_norm_attack(model, x, p)
    assert np.all(np.isfinite(nb.upper))
    _check_points(model, x64, nb, p, pred)
    assert np.all(nb.upper >= exact * (1 - 1e-6))  # never below the true minimum
    # The point must win by FLIP_GAP of the largest output: the closed form with that gap.
    out = nb.adversarial @ w + b
    gap = FLIP_GAP * np.max(np.abs(out), axis=1)
    with_gap = np.array([min((f[i, y] - f[i, j] + gap[i]) / np.linalg.norm(
        w[:, y] - w[:, j], DUAL[p]) for j in others[i]) for i, y in enumerate(pred)])
    assert np.all(nb.upper <= with_gap * (1 + 1e-3))


def test_box_domain_linf_meets_the_bisected_minimum():
    """Two classes, inputs in [0, 1]: the l_inf minimum is the smallest eps whose best
    clipped step `x - eps sign(w)` (clipped to the box) reaches the hyperplane."""
    model, w, b = _linear(d=10, classes=2, seed=2)
    rng = np.random.default_rng(3)
    x = rng.uniform(0.3, 0.7, size=(8, 10)).astype(np.float32)
    x64 = x.astype(np.float64)
    pred = np.argmax(x64 @ w + b, axis=1)
    v = np.where(pred[:, None] == 0, w[:, 0] - w[:, 1], w[:, 1] - w[:, 0])  # margin gradient
    c = np.where(pred == 0, b[0] - b[1], b[1] - b[0])

    def margin_at(eps):
        step = np.clip(x64 - eps[:, None] * np.sign(v), 0.0, 1.0)
        return np.sum(step * v, axis=1) + c

    reach = margin_at(np.ones(8)) < 0
    lo, hi = np.zeros(8), np.ones(8)
    for _ in range(60):
        mid = (lo + hi) / 2
        below = margin_at(mid) <= 0
        hi, lo = np.where(below, mid, hi), np.where(below, lo, mid)
    nb = minimal_norm_attack(model, x, np.inf, domain=(0.0, 1.0))
    assert np.all(np.isfinite(nb.upper[reach]))
    assert np.all(np.isnan(nb.upper[~reach]))  # no point inside the box: none returned
    _check_points(model, x64, nb, np.inf, pred)
    found = np.isfinite(nb.upper)
    assert np.all((nb.adversarial[found] >= 0) & (nb.adversarial[found] <= 1))
    assert np.all(nb.upper[found] >= hi[found] * (1 - 1e-6))
    assert np.all(nb.upper[found] <= hi[found] * (1 + 2e-3))


@pytest.fixture(scope="module")
def net2d():
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    h = 0.004
    g = np.arange(-2.0, 2.0 + h / 2, h)
    grid = np.stack(np.meshgrid(g, g, indexing="ij"), -1).reshape(-1, 2)
    labels = np.argmax(np.asarray(model(grid.astype(np.float32), training=False)),
                       axis=1)
    return model, grid, labels, h


# l2 slow: the attack's l2 steps meet the closed form by default
# (test_linear_model_meets_the_closed_form[2]); l1 and l_inf keep their projections.
@pytest.mark.parametrize("p", [1, pytest.param(2, marks=pytest.mark.slow), np.inf])
def test_2d_net_never_below_the_brute_force_minimum(net2d, p):
    model, grid, labels, h = net2d
    x = np.random.default_rng(5).uniform(-0.8, 0.8, size=(10, 2)).astype(np.float32)
    x64 = x.astype(np.float64)
    pred = np.argmax(np.asarray(model(x, training=False)), axis=1)
    nb = minimal_norm_attack(model, x, p)
    _check_points(model, x64, nb, p, pred)
    cell = _norm(np.array([[h, h]]), p)[0]  # a boundary point is within a cell of the grid's
    brute = np.array([np.min(_norm(grid[labels != y] - x64[i], p)) for i, y in enumerate(pred)])
    ok = brute < 1.0  # the boundary lies well inside the grid
    assert ok.sum() >= 5 and np.all(np.isfinite(nb.upper[ok]))
    assert np.all(nb.upper[ok] >= brute[ok] - cell)
    ratio = nb.upper[ok] / brute[ok]
    assert np.median(ratio) <= 1.01, ratio


def test_starts_from_a_known_point_and_only_shrinks_it(linear):
    model, w, b = linear
    x = np.random.default_rng(7).normal(size=(6, 20)).astype(np.float32)
    pred = np.argmax(np.asarray(model(x, training=False)), axis=1)
    far = minimal_norm_attack(model, x, 2, options=AttackOptions(steps=5, restarts=1))
    start = x + 3.0 * (far.adversarial - x)  # further out along the same line
    still = np.argmax(np.asarray(model(start.astype(np.float32), training=False)), axis=1) != pred
    nb = minimal_norm_attack(model, x, 2, start=start,
                             options=AttackOptions(steps=20, restarts=1))
    assert np.all(nb.upper[still] <= _norm(start - x, 2)[still])
    _check_points(model, x.astype(np.float64), nb, 2, pred)


def test_deterministic_with_a_seed(linear):
    model, _, _ = linear
    x = np.random.default_rng(9).normal(size=(5, 20)).astype(np.float32)
    opts = AttackOptions(steps=10, restarts=5, seed=3)
    a = minimal_norm_attack(model, x, np.inf, options=opts)
    b = minimal_norm_attack(model, x, np.inf, options=opts)
    np.testing.assert_array_equal(a.upper, b.upper)
    np.testing.assert_array_equal(a.adversarial, b.adversarial)


@pytest.mark.parametrize("kw, match", [
    ({"p": 3}, "p=3"),
    ({"options": AttackOptions(steps=0)}, "steps.*0"),
    ({"options": AttackOptions(max_seconds=-1.0)}, "max_seconds.*-1.0"),
    ({"options": AttackOptions(gamma=2.0)}, "gamma.*2.0"),
    ({"domain": (0.0, 0.5)}, "outside domain"),
    ({"domain": (1.0, 0.0)}, "low <= high"),
])
def test_bad_arguments_name_the_problem(linear, kw, match):
    model, _, _ = linear
    x = np.random.default_rng(0).uniform(0, 1, size=(3, 20)).astype(np.float32)
    with pytest.raises(ValueError, match=match):
        minimal_norm_attack(model, x, **{"p": 2, **kw})


@pytest.fixture(scope="module")
def cnn():
    keras.utils.set_random_seed(11)
    model = keras.Sequential([
        keras.Input((10, 10, 1)), keras.layers.Rescaling(1 / 255, name="rescaling"),
        keras.layers.Conv2D(4, 3, strides=2, activation="relu"),
        keras.layers.Conv2D(8, 3, strides=1, activation="relu"), keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
    x = np.random.default_rng(12).uniform(0, 255, size=(8, 10, 10, 1)).astype(np.float32)
    return model, x


def _check_result(model, x, rr, p):
    found = np.isfinite(rr.upper[p])
    assert found.all()
    pts = rr.adversarial[p].astype(np.float32)
    assert np.all(np.argmax(np.asarray(model(pts, training=False)), axis=1) != rr.predicted)
    np.testing.assert_allclose(_norm(pts.astype(np.float64) - x, p), rr.upper[p], rtol=1e-12)
    assert np.all(rr.lower[p] <= rr.upper[p])


def test_robust_radius_attack_method_on_a_cnn(cnn):
    """`method="attack"`: points flip, the upper bound is their distance, and it is at
    most the walk's on most inputs."""
    model, x = cnn
    x = x[:4]  # four inputs of eight: the walk on this CNN costs more than the attack
    norms = (2, np.inf)
    walk = keras_roll.robust_radius(model, x, norms=norms, method="walk", verbose=False)
    # a third of the default budget (on this CNN it still beats the walk on every input)
    opts = AttackOptions(steps=50, restarts=3, polish=1, probe_budget=100)
    att = keras_roll.robust_radius(model, x, norms=norms, method="attack", attack=opts,
                                   verbose=False)
    for p in norms:
        _check_result(model, x.astype(np.float64), att, p)
        assert set(att.upper_method[p]) == {"attack"}
        ratio = att.upper[p] / walk.upper[p]
        assert np.mean(ratio <= 1 + 1e-6) >= 0.75, ratio


@pytest.mark.slow
def test_best_runs_the_attack_from_the_walks_point(cnn):
    model, x = cnn
    norms = (2, np.inf)
    walk = keras_roll.robust_radius(model, x, norms=norms, method="walk", verbose=False)
    att = keras_roll.robust_radius(model, x, norms=norms, method="attack", verbose=False)
    best = keras_roll.robust_radius(model, x, norms=norms, verbose=False)
    for p in norms:
        _check_result(model, x.astype(np.float64), best, p)
        assert np.all(best.upper[p] <= walk.upper[p] * (1 + 1e-12))  # started from its point
        assert np.all(best.upper[p] <= att.upper[p] * (1 + 1e-3))
        assert {"attack", "search"} & set(best.upper_method[p])


def test_robust_radius_attack_in_layer_units(cnn):
    """With wrt= the attack's upper bound is stated in the Rescaling's output units."""
    model, x = cnn
    opts = AttackOptions(steps=20, restarts=1)
    raw = keras_roll.robust_radius(model, x[:3], norms=(2,), method="attack", attack=opts,
                                   verbose=False)
    scaled = keras_roll.robust_radius(model, x[:3], norms=(2,), method="attack", attack=opts,
                                      wrt="rescaling", verbose=False)
    np.testing.assert_allclose(scaled.upper[2], raw.upper[2] / 255, rtol=1e-6)
    with pytest.raises(ValueError, match="AttackOptions"):
        keras_roll.robust_radius(model, x[:1], method="attack", attack={"steps": 5},
                                 verbose=False)


@pytest.mark.parametrize("p", NORMS)
def test_probes_only_shrink_and_every_point_flips(cnn, p):
    """`probe_attack` from the attack's points: never farther, every point changes the
    float32 prediction (`model(x)`), its distance is `upper`; the steps counted
    are within the budget."""
    from keras_roll.robust.attacks import probe_attack, run_attack

    model, x = cnn
    x64 = x.astype(np.float64)
    pred = np.argmax(np.asarray(model(x, training=False)), axis=1)
    opts = AttackOptions(steps=30, restarts=2, probe_steps=10, probe_budget=60, polish=1)
    nb, steps = run_attack(model, x, p, options=opts, probes=False)
    assert np.all(steps == 60 + 30 * np.isfinite(nb.upper))  # the polish: rows with a point
    _check_points(model, x64, nb, p, pred)
    probed, spent = probe_attack(model, x, p, pred, nb.adversarial, np.zeros(len(x)), opts)
    _check_points(model, x64, probed, p, pred)
    found = np.isfinite(nb.upper)
    assert np.all(probed.upper[found] <= nb.upper[found])
    assert np.all((spent >= 10 * found) & (spent <= 60))
