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


# --------------------------------------------------------------------------- shared graphs


@pytest.fixture(scope="module")
def small_cnn():
    """A CNN of 8x8x2 = 128 input axes: certify's default rigor takes its float32 path
    (the noise pass before and after the gradients)."""
    keras.utils.set_random_seed(2)
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(3, 3, strides=2, activation="relu")(inp)
    h = keras.layers.Dense(6, activation="relu")(keras.layers.Flatten()(h))
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    x = np.random.default_rng(4).normal(size=(3, 8, 8, 2)).astype(np.float32)
    return model, x


def test_one_noise_graph_serves_both_tracks(small_cnn):
    from keras_roll.rounding import noise

    model, x = small_cnn
    twin = keras_roll.linearize(keras.models.clone_model(model)).at_dtype("float64")
    twin.model.set_weights(model.get_weights())
    fwd = twin.forward(x.astype(np.float64))
    l1 = np.random.default_rng(5).uniform(0.5, 2.0, (3, twin.num_neurons(x.shape[1:])))
    at_x = noise.noise_bound(twin, fwd, tracks=(0,))
    growth = noise.noise_bound(twin, fwd, l1=l1, tracks=(1,), reverse=True)
    assert noise._compiled(twin).python_function.experimental_get_tracing_count() == 1
    assert at_x.sigma_per_radius is None and growth.sigma_at_x is None
    assert growth.overflow is None and not at_x.overflow.any()
    # the terms of the pass that carries both tracks (a graph of its own)
    both = noise.noise_bound(twin, fwd, l1=l1)
    np.testing.assert_allclose(at_x.sigma_at_x, both.sigma_at_x, rtol=1e-5)
    np.testing.assert_allclose(growth.sigma_per_radius, both.sigma_per_radius, rtol=1e-5)
    np.testing.assert_allclose(at_x.exact_at_x, both.exact_at_x, rtol=1e-12)
    assert np.all(at_x.sigma_at_x > 0) and np.all(growth.sigma_per_radius > 0)
    # reverse mode also counts each tensor's readers: never smaller
    assert np.all(growth.exact_per_radius >= both.exact_per_radius)
    assert np.any(growth.exact_per_radius > both.exact_per_radius)


def test_the_walk_traces_one_line_graph(tiny):
    from benchmarks.traces import traces

    model, x = tiny
    model = keras.models.clone_model(model)
    model.set_weights(tiny[0].get_weights())
    with traces() as seen:
        rr = keras_roll.robust_radius(model, x, norms=(2,), method="walk", verbose=False)
    names = [t.name for t in seen]
    assert names.count("_line_fn") == 1 and "_probe" not in names
    # every upper bound is a point the Keras model assigns another class, at that distance
    found = np.isfinite(rr.upper[2])
    assert found.all()
    adv = rr.adversarial[2].astype(np.float32)
    assert np.all(np.argmax(model(adv).numpy(), 1) != np.argmax(model(x).numpy(), 1))
    np.testing.assert_allclose(np.linalg.norm(rr.adversarial[2] - x, axis=1), rr.upper[2],
                               rtol=1e-12)


def test_the_twin_and_model_calls_trace_once_for_every_batch_size(small_cnn):
    from keras_roll.compile.caches import compiled_call

    model, x = small_cnn
    model = keras.models.clone_model(model)
    model.set_weights(small_cnn[0].get_weights())
    lin = keras_roll.linearize(model)
    call = compiled_call(model)
    for b in (1, 3, 2):
        j = lin.jacobian(x[:b])  # the axes tangent, streamed
        np.testing.assert_allclose(call(tf.constant(x[:b])).numpy(), model(x[:b]).numpy(),
                                   rtol=1e-6, atol=1e-6)
        xt = tf.constant(x[:b])
        with tf.GradientTape() as tape:  # the Jacobian of the logits, independently
            tape.watch(xt)
            logits = model(xt)
        want = tape.batch_jacobian(logits, xt).numpy().reshape(b, 3, -1)
        np.testing.assert_allclose(lin.output_jacobian(x[:b]), want, rtol=1e-5, atol=1e-6)
        assert j.shape == (b, lin.num_neurons(x.shape[1:]), 128)
    assert lin.compiled.axes_tangent.experimental_get_tracing_count() == 1
    assert call.experimental_get_tracing_count() == 1


def test_batched_relaxes_only_the_leading_arguments():
    """`batch_polymorphic(fn, batched=1)`: the first argument's batch axis is free, a
    later tensor (an input shape, a chunk's start) keeps its shape."""
    from keras_roll.compile.caches import batch_polymorphic

    specs = []

    class Recorder:
        def get_concrete_function(self, *args):
            specs.append(args)

        def __call__(self, x, shape, k):
            return np.asarray(x).reshape(-1, *np.asarray(shape)) * k

    was = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(False)  # traces ahead only for graphs
    try:
        wrapped = batch_polymorphic(Recorder(), batched=1)
        for b in (2, 5):
            x = np.ones((b, 6))
            out = wrapped(x, tf.constant([2, 3]), 2.0)
            np.testing.assert_array_equal(out, np.full((b, 2, 3), 2.0))
    finally:
        tf.config.run_functions_eagerly(was)
    assert specs == [(tf.TensorSpec([None, 6], tf.float64), tf.TensorSpec([2], tf.int32), 2.0)]


@pytest.mark.slow  # robust_radius's first call compiled: about 5 CPU s
def test_robust_radius_traces_each_graph_once(small_cnn):
    from benchmarks.traces import traces

    model, x = small_cnn
    model = keras.models.clone_model(model)
    model.set_weights(small_cnn[0].get_weights())
    with traces() as seen:
        first = keras_roll.robust_radius(model, x[:2], norms=(2, np.inf), verbose=False)
    names = [t.name for t in seen]
    assert len(names) == len(set(names)), sorted(names)
    assert {"_noise_pass", "_line_fn", "_terms_fn", "_bounds_fn"} <= set(names)
    with traces() as again:  # another batch size, the same graphs
        rr = keras_roll.robust_radius(model, x, norms=(2, np.inf), verbose=False)
    assert not again, [t.name for t in again]
    for p in (2, np.inf):
        # batching: the attack's float32 upper bound, where the relaxation's search
        # starts, rounds with the batch (1e-6 here); the search then lands within its
        # `bisect_tol` (1e-3) of the largest certified radius on another path
        np.testing.assert_allclose(rr.lower[p][:2], first.lower[p], rtol=1e-3)
        assert not np.any(rr.lower[p] > rr.upper[p])  # NaN: no point found
