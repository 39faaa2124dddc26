"""The attack's one graph for every norm, and its budget following what it can gain.

* The loop with the norm as a graph argument gives exactly the results of the loop
  built for that norm alone (fixed seeds, fixed and adaptive rows, both step kinds).
* One trace serves every norm and batch size (the compiled loop is built once).
* Rows at a fixed radius stop at their first point, and the steps counted are the
  steps run; rows whose bracket is closed get no further run; every point flips the
  float32 prediction of the Keras model (`model(x)`, another call).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll.robust.attack_points as attack_points
from keras_roll.compile.caches import cached
from keras_roll.geometry import NORM_ORDER, norm_code
from keras_roll.robust.attack_loop import compiled_loop
from keras_roll.robust.attacks import AttackOptions, run_attack

pytestmark = pytest.mark.graph


@pytest.fixture(scope="module")
def net():
    """One model for the tests that share its compiled loop (one trace)."""
    return _net()


def _net(seed=0, d=6, classes=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((d,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(classes)])


def _args(model, rows, steps, fixed, smooth, p, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype(np.float32)
    pred = np.argmax(np.asarray(model(x)), axis=1)
    d0 = (0.1 * rng.normal(size=x.shape)).astype(np.float32)
    eps0 = np.where(fixed, 0.5, 0.0).astype(np.float32)
    return (tf.constant(x), tf.constant(d0), tf.constant(eps0), tf.constant(pred),
            tf.constant(np.full(rows, -1, np.int64)), tf.constant(np.full(6, -3.0, np.float32)),
            tf.constant(np.full(6, 3.0, np.float32)), tf.constant(np.full(rows, steps, np.int32)),
            tf.constant(1.0), tf.constant(0.05), tf.constant(fixed), tf.constant(smooth),
            tf.constant(norm_code(p)))


@pytest.mark.parametrize("p", [pytest.param(p, marks=() if p == np.inf else pytest.mark.slow)
                               for p in NORM_ORDER])
def test_the_norm_argument_gives_the_one_norm_graphs_results(net, p):
    model = net
    shared = cached(model, ("minimal_norm_attack",), lambda: compiled_loop(model))
    alone = compiled_loop(model, p)
    fixed = np.array([False, True, False, True, False])
    for smooth in (False, True):
        args = _args(model, 5, 30, fixed, smooth, p)
        for a, b in zip(shared(*args), alone(*args)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_trace_serves_every_norm_and_batch_size(monkeypatch):
    model = _net(1)
    built = []
    real = attack_points.compiled_loop
    monkeypatch.setattr(attack_points, "compiled_loop",
                        lambda m, p=None: built.append(p) or real(m, p))
    x = np.random.default_rng(2).normal(size=(5, 6))
    opts = AttackOptions(steps=5, restarts=1, polish=0, probe_steps=0)
    for p in (1, 2, np.inf):
        for rows in (5, 3):
            nb, _ = run_attack(model, x[:rows], p, options=opts)
            assert np.isfinite(nb.upper).all()
    assert built == [None]


def test_fixed_rows_stop_at_their_first_point_and_steps_are_counted_as_run(net):
    model = net
    fn = cached(model, ("minimal_norm_attack",), lambda: compiled_loop(model))
    fixed = np.array([True, True, False])
    args = list(_args(model, 3, 40, fixed, False, np.inf, seed=3))
    args[2] = tf.constant(np.array([50.0, 1e-4, 0.0], np.float32))  # any move flips / none can
    _, norm, _, taken = (np.asarray(v) for v in fn(*args))
    assert np.isfinite(norm[0]) and taken[0] < 5   # a point at once: the row stops
    assert not np.isfinite(norm[1]) and taken[1] == 40  # no point within 1e-4: every step
    assert taken[2] == 40                            # adaptive rows run their steps


def test_closed_brackets_get_no_run_and_every_point_flips(net):
    model = net
    x = np.random.default_rng(4).normal(size=(4, 6))
    opts = AttackOptions(steps=20, restarts=2, polish=2, probe_steps=0)
    first, spent = run_attack(model, x, 2, options=opts)
    assert np.isfinite(first.upper).all() and (spent == 2 * 20 + 2 * 20).all()
    lower = first.upper.copy()
    lower[1:] = 0.0  # row 0's bracket is closed: lower = upper
    again, spent = run_attack(model, x, 2, options=opts, lower=lower, start=first.adversarial)
    assert spent[0] == 0 and (spent[1:] > 0).all()
    assert again.upper[0] == first.upper[0]
    assert np.all(again.upper <= first.upper)
    pts = again.adversarial.astype(np.float32)
    pred = np.argmax(np.asarray(model(x.astype(np.float32))), axis=1)
    assert np.all(np.argmax(np.asarray(model(pts)), axis=1) != pred)
    np.testing.assert_allclose(np.linalg.norm(pts.astype(np.float64) - x, axis=1), again.upper,
                               rtol=1e-12)


@pytest.mark.slow
def test_skipping_closed_brackets_never_loosens_the_lower_bound(monkeypatch):
    """robust_radius with a wide exact_rtol (brackets close after the walk): the
    lower bounds with the attack's skipping are no looser (to rounding) than those of
    an attack that runs every input, at fewer steps; every upper bound is a point that
    flips the float32 prediction."""
    import keras_roll

    model = _net(5, d=6, classes=4)
    x = np.random.default_rng(6).normal(size=(12, 6)).astype(np.float32)
    kw = dict(norms=(2, np.inf), exact_rtol=0.9, verbose=False,
              attack=AttackOptions(steps=30, restarts=2, polish=1, probe_budget=60))
    skipping = keras_roll.robust_radius(model, x, **kw)
    monkeypatch.setattr(attack_points.Runner, "open_rows",
                        lambda self, best_norm: np.arange(best_norm.shape[0]))
    every = keras_roll.robust_radius(model, x, **kw)
    pred = np.argmax(np.asarray(model(x)), axis=1)
    assert any(np.any(skipping.attack_steps[p] < every.attack_steps[p]) for p in (2, np.inf))
    for p in (2, np.inf):
        # the relaxation's search starts from the other upper bound: it ends at the same
        # certified radius up to rounding (1.7e-10 seen), far inside bisect_tol (1e-3)
        assert np.all(skipping.lower[p] >= every.lower[p] * (1 - 1e-8))
        assert np.all(skipping.attack_steps[p] <= every.attack_steps[p])
        pts = skipping.adversarial[p].astype(np.float32)
        assert np.all(np.argmax(np.asarray(model(pts)), axis=1) != pred)
