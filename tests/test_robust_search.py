"""The relaxation's radius search: fewer bound passes, the same lower bounds, and sound.

A bound pass at radius `eps` also gives the root of its final linear bound, a radius it
certifies without another pass (`keras_roll.robust.bounds.RelaxedMargins.root`), and the
search steers by those roots (`keras_roll.robust.search`). Checked here:

* passes are counted by a counter on the pass function itself, not by the search's own
  tally (which `RobustRadius.bound_passes` must match): fewer with roots than with the
  bracketing search alone (the roots withheld), on an MLP and a tiny CNN, with lower
  bounds no looser than the bracketing search's beyond its tolerance;
* soundness: random points in the l_inf and l2 balls of the returned lower radius and a
  PGD attack (tf.GradientTape) inside them never change the float32 model's prediction;
  on a 6-32-32-4 MLP the lower bound never exceeds the exact minimal l_inf perturbation
  of a MILP (scipy HiGHS, `tests/test_robust_exact.py`);
* the root itself: every radius below a failed pass's root is certified (sampling and
  PGD at the root), and on hand-built linear forms the search finds the fixed point;
* the default rigor's relaxation bounds the margins' rounding by the probabilistic bound
  beside the worst case: never below "strict", above it on a wide float32 network, and
  still sound in the model's own float32 evaluation.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
import keras_roll.robust.api as robust_api
from keras_roll.robust.bounds import RelaxedMargins, relaxed_margins
from keras_roll.robust.search import MAX_STEPS, search_certified
from keras_roll.robust.upper_search import shrink_upper
from tests.test_robust_exact import _mlp, affine_stack, exact_milp, near_boundary

TOL = 1e-3  # robust_radius's default bisect_tol
# Compiled: the MLP tests share one model (`_shared_mlp`), whose passes trace once.
pytestmark = pytest.mark.graph
_MODELS = {}


def _shared_mlp():
    """The 6-32-32-4 ReLU MLP (seed 7) of the MLP tests, built once: its compiled passes
    (cached per model) serve every test of the file."""
    if not _MODELS:
        _MODELS["mlp"] = _mlp((32, 32), 0.0, 6, 4, 7)
    return _MODELS["mlp"]


def _cnn(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(4, 3, strides=2, activation="relu")(inp)
    h = keras.layers.Conv2D(6, 2, activation="relu")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(12, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(4)(h))


@contextlib.contextmanager
def counted(roots: bool = True):
    """Counts the examples each bound pass of `robust_radius` runs on; with
    `roots=False` the passes' roots are withheld (and the affine map's), so the search
    brackets alone, as it did before it used them."""
    original, search = robust_api.relaxed_margins, robust_api.search_certified
    calls = []

    def passes(twin, x, pred, eps, *args, **kwargs):
        calls.append(len(x))
        out = original(twin, x, pred, eps, *args, **kwargs)
        if not roots:
            nan = np.full_like(out.offset, np.nan)
            out = RelaxedMargins(out.lower, nan, nan)
        return out

    def bracketing(*args, root_at_zero=None, value_at_zero=None, **kwargs):
        return search(*args, **kwargs)

    robust_api.relaxed_margins = passes
    if not roots:
        robust_api.search_certified = bracketing
    try:
        yield calls
    finally:
        robust_api.relaxed_margins, robust_api.search_certified = original, search


def _inputs(model, n, seed):
    shape = tuple(model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=(n, *shape)).astype(np.float32)


@pytest.mark.parametrize("kind", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
def test_fewer_passes_and_bounds_no_looser(kind):
    model = _shared_mlp() if kind == "mlp" else _cnn(1)
    x = _inputs(model, 6, 2)
    out = {}
    for roots in (True, False):
        with counted(roots) as calls:
            rr = keras_roll.robust_radius(model, x, norms=(np.inf, 2), method="relaxation",
                                          rigor="float32", verbose=False)
        out[roots] = (rr, sum(calls))
    (new, n_new), (old, n_old) = out[True], out[False]
    for rr, n in out.values():  # the result's tally is the counter's
        assert sum(int(rr.bound_passes[p].sum()) for p in (np.inf, 2)) == n
    assert n_new <= 0.75 * n_old, (n_new, n_old)
    for p in (np.inf, 2):
        searched = old.bound_passes[p] > 0
        assert searched.sum() >= 4
        assert np.all(new.lower[p] >= old.lower[p] / (1 + TOL) ** 2), (new.lower[p],
                                                                         old.lower[p])


def _pgd(model, x, pred, radius, p, steps=40):
    """Projected gradient descent on the margin to the runner-up inside each ball
    (float32 model): the points found, `[B, *shape]`."""
    x0 = tf.constant(x, tf.float32)
    r = tf.constant(radius.reshape(-1, *[1] * (x.ndim - 1)), tf.float32)
    delta = tf.zeros_like(x0)
    axes = list(range(1, x.ndim))
    onehot = tf.one_hot(pred, int(model.outputs[0].shape[-1]))
    for _ in range(steps):
        with tf.GradientTape() as tape:
            tape.watch(delta)
            z = model(x0 + delta)
            other = tf.reduce_max(z - 1e9 * onehot, -1)
            loss = tf.reduce_sum(other - tf.reduce_sum(z * onehot, -1))
        g = tape.gradient(loss, delta)
        if p == np.inf:
            delta = tf.clip_by_value(delta + 0.1 * r * tf.sign(g), -r, r)
        else:
            n = tf.sqrt(tf.reduce_sum(g * g, axes, keepdims=True)) + 1e-30
            delta = delta + 0.1 * r * g / n
            dn = tf.sqrt(tf.reduce_sum(delta * delta, axes, keepdims=True))
            delta = delta * tf.minimum(1.0, r / tf.maximum(dn, 1e-30))
    return (x0 + delta).numpy()


def _ball_samples(x, radius, p, k, rng):
    """`[B * k, *shape]` points in the closed lp balls (corners and surface included)."""
    b, d = x.shape[0], int(np.prod(x.shape[1:]))
    if p == np.inf:
        u = rng.uniform(-1, 1, (b, k, d))
        u[:, : k // 2] = np.sign(u[:, : k // 2])  # vertices
    else:
        u = rng.normal(size=(b, k, d))
        u /= np.linalg.norm(u, axis=-1, keepdims=True)
        u[:, k // 2:] *= rng.uniform(0, 1, (b, k - k // 2, 1)) ** (1 / d)
    pts = x.reshape(b, 1, d).astype(np.float64) + radius[:, None, None] * u
    return pts.reshape(b * k, *x.shape[1:]).astype(np.float32)


def _assert_no_flip(model, x, radius, p, seed=0):
    """Sampled points and PGD inside the balls of `radius` keep the prediction."""
    pred = np.argmax(np.asarray(model(x)), -1)
    radius = np.asarray(radius, np.float64) * (1 - 1e-6)  # float32 points stay inside
    k = 200
    pts = _ball_samples(x, radius, p, k, np.random.default_rng(seed))
    got = np.argmax(np.asarray(model(pts)), -1).reshape(len(x), k)
    assert np.all(got == pred[:, None]), np.flatnonzero(np.any(got != pred[:, None], 1))
    adv = _pgd(model, x, pred, radius, p)
    assert np.all(np.argmax(np.asarray(model(adv)), -1) == pred)


@pytest.mark.parametrize("kind,rigor", [
    pytest.param("mlp", "float64", marks=pytest.mark.slow),
    pytest.param("mlp", "float32", marks=pytest.mark.slow),
    pytest.param("cnn", "float64", marks=pytest.mark.slow),
    pytest.param("cnn", "float32", marks=pytest.mark.slow)])
def test_certified_balls_keep_the_prediction(kind, rigor):
    model = _mlp((32, 32), 0.0, 6, 4, 3) if kind == "mlp" else _cnn(3)
    x = _inputs(model, 6, 4)
    rr = keras_roll.robust_radius(model, x, norms=(np.inf, 2), method="relaxation",
                                  rigor=rigor, verbose=False)
    for p in (np.inf, 2):
        assert np.all(rr.lower[p] > 0)
        assert np.all(rr.bound_passes[p] > 0)
        _assert_no_flip(model, x, rr.lower[p], p)


def test_root_of_a_failed_pass_is_certified():
    """A pass at a radius it does not certify still certifies every radius up to its
    root: the points of those balls keep the prediction."""
    model = _shared_mlp()
    x = _inputs(model, 8, 7)  # inputs whose failed passes all have a positive root
    twin = keras_roll.linearize(model).at_dtype("float64")
    pred = np.argmax(np.asarray(model(x)), -1)
    rr = keras_roll.robust_radius(model, x, norms=(np.inf,), method="relaxation",
                                  rigor="float32", verbose=False)
    eps = 1.3 * rr.lower[np.inf]  # beyond what the passes certify
    out = relaxed_margins(twin, x.astype(np.float64), pred, eps, np.inf, guard=False)
    assert np.all(np.min(out.lower, 1) <= 0)
    root = out.root()
    assert np.all((root > 0) & (root < eps))
    # The linear form is a lower bound of the pass's own value at eps.
    assert np.all(out.offset - eps[:, None] * out.slope <= out.lower + 1e-12)
    _assert_no_flip(model, x, root, np.inf, seed=1)


@pytest.mark.parametrize("rigor", [pytest.param("float64", marks=pytest.mark.slow),
                                   "float32"])
def test_lower_bound_never_exceeds_the_milp(rigor):
    model = _shared_mlp()
    stages = affine_stack(model)
    x = near_boundary(stages, (6,), 3, seed=8)
    rr = keras_roll.robust_radius(model, x, norms=(np.inf,), method="relaxation",
                                  rigor=rigor, verbose=False)
    lower = rr.lower[np.inf]
    assert np.all(lower > 0)
    flat = x.astype(np.float64)
    # The MILP over a ball 1.5x the lower bound: infeasible (inf) means the exact radius
    # lies beyond it, and so beyond the lower bound.
    exact = np.array([exact_milp(stages, flat[i], rr.predicted[i], np.inf, 1.5 * lower[i], 4)[1]
                      for i in range(len(x))])
    assert np.isfinite(exact).sum() >= 2
    assert np.all(lower <= exact * (1 + 2e-5) + 1e-7), (lower, exact)


def test_search_on_hand_built_linear_forms():
    """`offset(eps) = c - k eps^2` with slope 1: a pass at `eps` certifies it where
    `c - k eps^2 - eps > 0`, and its root is `c - k eps^2` (valid up to eps). The
    search reaches the fixed point in a few passes; with roots that say nothing
    (NaN) it brackets alone, and answers within the tolerance either way."""
    c = np.array([0.04, 1.0, 9.0, 0.25, 2.0])
    k = np.array([0.0, 1.0, 10.0, 50.0, 0.3])
    fixed = (-1 + np.sqrt(1 + 4 * k * c)) / np.where(k > 0, 2 * k, 1)
    fixed = np.where(k > 0, fixed, c)
    counts = {}

    def values(with_roots):
        def fn(i, eps):
            counts[with_roots] = counts.get(with_roots, 0) + len(i)
            offset = c[i] - k[i] * eps**2
            v = offset - eps
            return (v, offset) if with_roots else v
        return fn

    upper = np.array([np.inf, 5.0, np.nan, 1.0, 10.0])
    for with_roots in (True, False):
        res = search_certified(values(with_roots), np.zeros(5), upper, np.ones(5), TOL)
        assert np.all(res.lower <= fixed) and np.all(res.lower >= fixed / (1 + TOL) ** 2)
        assert np.all(res.passes < MAX_STEPS)
    assert counts[True] <= 0.6 * counts[False], counts


def test_search_survives_useless_roots():
    """Roots far below the answer (sound, but no help) or beyond the bracket: the
    safeguards fall back to bracketing, which ends within the tolerance."""
    r = np.array([0.3, 2.0, 0.05])

    def values(i, eps):
        return r[i] - eps, np.where(eps > r[i], 1e-9, 1e3)

    res = search_certified(values, np.zeros(3), np.array([1.0, 4.0, np.inf]), np.ones(3),
                           TOL)
    assert np.all(res.lower <= r) and np.all(res.lower >= r / (1 + TOL) ** 2)
    assert np.all(res.passes < MAX_STEPS)


@pytest.mark.slow
def test_default_relaxation_guard_on_a_wide_float32_mlp():
    """784-100-100-10 at initialisation, points 1 % of the way back from an adversarial
    point: the default rigor's relaxation certifies more than "strict"'s (never less),
    and its balls keep the float32 prediction."""
    keras.utils.set_random_seed(0)
    model = _mlp((100, 100), 0.0, 784, 10, 0)
    x = np.random.default_rng(1).uniform(0, 1, (6, 784)).astype(np.float32)
    rr = keras_roll.robust_radius(model, x, norms=(np.inf,), verbose=False)
    adv = rr.adversarial[np.inf]
    near = (adv + 0.01 * (x - adv)).astype(np.float32)
    twin = keras_roll.linearize(model).at_dtype("float64")
    pred = np.argmax(np.asarray(model(near)), -1)
    eps = np.full(len(near), 1e-6)
    default = relaxed_margins(twin, near.astype(np.float64), pred, eps, np.inf,
                              guard="float64")
    strict = relaxed_margins(twin, near.astype(np.float64), pred, eps, np.inf,
                             guard="strict")
    assert np.all(default.lower >= strict.lower)
    assert np.all(default.offset >= strict.offset)
    assert np.mean(np.min(default.lower, 1) > np.min(strict.lower, 1)) >= 0.5
    got = {}
    for rigor in ("float64", "strict"):
        got[rigor] = keras_roll.robust_radius(model, near, norms=(np.inf, 2),
                                              method="relaxation", rigor=rigor,
                                              verbose=False)
    for p in (np.inf, 2):
        assert np.all(got["float64"].lower[p] >= got["strict"].lower[p])
        assert np.mean(got["float64"].lower[p] > got["strict"].lower[p]) >= 0.5
        _assert_no_flip(model, near, got["float64"].lower[p], p)


def test_shrink_upper_on_a_known_threshold():
    """A probe that finds a point at `r` exactly when its radius is at least `r` and its
    budget at least `need`: the search ends within `tol` of `r`, never below it, with
    budgets that grow as the bracket narrows and within `max_steps`."""
    r = np.array([1.0, 2.0, 5.0, 3.0])
    need = np.array([0, 0, 0, 10**6])  # the last probe never succeeds
    seen = []

    def probe(idx, eps, steps):
        seen.append((idx.copy(), steps.copy()))
        return np.where((eps >= r[idx]) & (steps >= need[idx]), r[idx], np.nan)

    upper = np.array([1.05, 2.5, 5.0 * 1.01, 3.3])
    res = shrink_upper(probe, np.array([0.0, 1.9, 0.0, 0.0]), upper, steps=10,
                       max_steps=400, tol=1e-3)
    assert np.all(res.upper >= r)
    np.testing.assert_allclose(res.upper[:3], r[:3], rtol=1e-12)  # a hit returns r itself
    assert res.upper[3] == upper[3]  # nothing found: the upper given
    assert np.all(res.steps <= 400) and np.all(res.probes >= 1)
    last = [s[list(i).index(3)] for i, s in seen if 3 in i]
    assert last == sorted(last) and last[-1] > last[0]  # the failing row's budgets grow
    assert sum(last) == res.steps[3]


def test_upper_never_below_the_milp_and_records_the_methods():
    """On a 6-32-32-4 MLP: every upper bound of `robust_radius` is at least the exact
    minimal l_inf perturbation (MILP, scipy HiGHS), every point changes the float32
    prediction, and the records of the methods and budgets are right and survive
    `concat`."""
    from keras_roll.robust import BoundSource, RobustRadius

    model = _shared_mlp()
    stages = affine_stack(model)
    x = near_boundary(stages, (6,), 4, seed=9).astype(np.float32)
    rr = keras_roll.robust_radius(model, x, norms=(np.inf,), rigor="float32",
                                  attack=keras_roll.robust.AttackOptions(steps=50),
                                  verbose=False)
    upper, lower = rr.upper[np.inf], rr.lower[np.inf]
    assert np.all(np.isfinite(upper))
    pts = rr.adversarial[np.inf].astype(np.float32)
    assert np.all(np.argmax(np.asarray(model(pts, training=False)), axis=1) != rr.predicted)
    flat = x.astype(np.float64)
    exact = np.array([exact_milp(stages, flat[i], rr.predicted[i], np.inf,
                                 upper[i] * (1 + 1e-6), 4)[1] for i in range(len(x))])
    assert np.all(np.isfinite(exact))
    assert np.all(upper >= exact * (1 - 2e-5) - 1e-7), (upper, exact)
    assert np.all(lower <= exact * (1 + 2e-5) + 1e-7), (lower, exact)
    for field in (rr.lower_method[np.inf], rr.upper_method[np.inf]):
        assert all(isinstance(m, BoundSource) for m in field)
    searched = np.isin(rr.upper_method[np.inf], [BoundSource.ATTACK, BoundSource.SEARCH])
    assert np.all(rr.attack_steps[np.inf] > 0)  # the attack ran on every input
    assert np.all(rr.seconds[np.inf] > 0)
    relaxed = rr.lower_method[np.inf] == BoundSource.RELAXATION
    assert np.all(rr.bound_passes[np.inf][relaxed] > 0)
    assert searched.any() or np.all(rr.exact[np.inf])
    both = RobustRadius.concat([rr, rr])
    for name in ("lower_method", "upper_method", "attack_steps", "seconds", "bound_passes"):
        np.testing.assert_array_equal(getattr(both, name)[np.inf],
                                      np.tile(getattr(rr, name)[np.inf], 2))
    assert all(isinstance(m, BoundSource) for m in both.upper_method[np.inf])
    text = str(rr.summary())
    assert "attack steps" in text and "bound passes" in text
