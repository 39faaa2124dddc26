"""robust_radius traces its passes once, whatever the norm and the guard.

The references are the per-norm passes as they were traced before (the same pass body
with the norm a Python value, run eagerly) and `dual_norm` with a Python norm.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.geometry import NORM_ORDER, dual_norm, norm_code
from keras_roll.robust import bounds as robust_bounds

pytestmark = pytest.mark.graph  # the subject is the traced graphs


def test_dual_norm_of_a_norm_code_is_the_norm():
    g = np.random.default_rng(0).normal(size=(2, 3, 5))
    for p in NORM_ORDER:
        want = dual_norm(g, p, axis=2).numpy()
        got = tf.function(lambda g, c: dual_norm(g, c, axis=2))(
            tf.constant(g), tf.constant(norm_code(p))).numpy()
        np.testing.assert_array_equal(got, want)
    assert [norm_code(p) for p in ("l1", 2.0, "linf")] == [0, 1, 2]


@pytest.fixture(scope="module")
def tiny():
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu")(inp)
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    x = np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)
    return model, x


def _counted(monkeypatch, module, name: str) -> tuple:
    """`(traced, body)`: `module.name` (a compiled pass's Python body) records its last
    argument in `traced` each time it runs, i.e. each time it is traced."""
    traced, body = [], getattr(module, name)

    def counting(*args):
        traced.append(args[-1])
        return body(*args)

    monkeypatch.setattr(module, name, counting)
    return traced, body


def test_one_relaxation_trace_serves_every_norm(tiny, monkeypatch):
    model, x = tiny
    traced, body = _counted(monkeypatch, robust_bounds, "_bounds_fn")
    for p in NORM_ORDER:
        rr = keras_roll.robust_radius(model, x, norms=(p,), method="relaxation",
                                      intermediate="crown", verbose=False)
        assert np.all(rr.lower[p] > 0)
    assert len(traced) == 1 and tf.is_tensor(traced[0])

    # the shared graph's bounds are the per-norm pass's (the norm a Python value)
    twin = keras_roll.linearize(model).at_dtype("float64")
    x64 = x.astype(np.float64)
    pred = np.argmax(model(x).numpy(), axis=1)
    eps = np.array([0.05, 0.2, 0.1])
    chunk = robust_bounds.example_chunk(twin, x.shape[1:])
    for p in NORM_ORDER:
        got = robust_bounds.relaxed_margins(twin, x64, pred, eps, p, guard="float64")
        want = body(twin, robust_bounds.BoundMethod.RELAXATION, "float64",
                    twin.memory_budget, chunk, robust_bounds.SlopeOptions(),
                    tf.constant(x64), tf.constant(pred), tf.constant(eps), p)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-12, atol=1e-15)
    assert len(traced) == 1


def test_one_decision_terms_trace_serves_every_guard(tiny, monkeypatch):
    from keras_roll.robust import region

    model, x = tiny
    model = keras.models.clone_model(model)  # a twin of its own: no pass traced yet
    model.set_weights(tiny[0].get_weights())
    traced, _ = _counted(monkeypatch, region, "_terms_fn")
    twin = keras_roll.linearize(model).at_dtype("float64")
    x64 = x.astype(np.float64)
    pred = np.argmax(model(x).numpy(), axis=1)
    terms = {g: region.decision_terms(twin, x64, pred, g) for g in (False, "strict", "float64")}
    assert len(traced) == 1
    # the margins' gradients are the model's (tf.GradientTape), whatever the guard
    xt = tf.constant(x64)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        logits = tf.cast(model(tf.cast(xt, tf.float32)), tf.float64)
    jac = tape.batch_jacobian(logits, xt).numpy()  # [B, L, D]
    rows = np.arange(len(x))[:, None]
    want = jac[rows, pred[:, None]] - jac[rows, terms[False].classes]
    for t in terms.values():
        np.testing.assert_allclose(t.gradients, want, rtol=1e-5, atol=1e-6)
    assert not terms[False].err_at_x.any() and terms[False].strict_at_x is None
    strict, default = terms["strict"], terms["float64"]
    assert np.all(strict.err_at_x > 0) and strict.strict_at_x is None
    # under "float64" the worst case rides beside the probabilistic bound, which is smaller
    np.testing.assert_allclose(default.strict_at_x, strict.err_at_x, rtol=1e-12)
    assert np.all(default.err_at_x < strict.err_at_x)
