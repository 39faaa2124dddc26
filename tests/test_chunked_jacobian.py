"""The twin's Jacobian chunks and the distortion's populations run chunk by chunk through
one compiled function: a run in many chunks traces it as often as a run in two (the
graph does not grow with the number of chunks), and gives the results of one chunk and
of `tf.GradientTape`.

The subject is a small float64 CNN with a residual Add (6x6x2 inputs: 72 input axes).
With `batch_size=B`, a twin budget of `fit * B * tangent_bytes` cuts the 72 axes into
`ceil(72 / fit)` chunks: 2 for `fit=36`, 24 for `fit=3`."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_roll.attribution.distortion import gradient_distortion
from keras_roll.attribution.gradients import LogitGradients
from keras_roll.certification.gradient_norms import iter_gradient_norms
from keras_roll.compile.streaming import axis_plan
from keras_roll.compile.twin import Linearized

L = keras.layers
B = 2
AXES = 6 * 6 * 2


def _residual_cnn(seed=7):
    keras.utils.set_random_seed(seed)
    bias = keras.initializers.RandomNormal(stddev=0.3)
    inp = keras.Input((6, 6, 2), dtype="float64")
    h1 = L.Conv2D(4, 3, padding="same", activation="relu", bias_initializer=bias,
                  dtype="float64")(inp)
    h2 = L.Conv2D(4, 3, padding="same", activation="relu", bias_initializer=bias,
                  dtype="float64")(h1)
    h = L.Flatten(dtype="float64")(L.Add(dtype="float64")([h1, h2]))
    return keras.Model(inp, L.Dense(3, dtype="float64")(h))


def _x():
    return np.random.default_rng(0).uniform(0, 1, (B, 6, 6, 2))


def _twin(model):
    """A fresh twin (its own compiled passes) and the bytes of one axis of B examples."""
    lin = Linearized(model, memory_budget=2**40)
    return lin, B * lin.layout((6, 6, 2)).tangent_bytes(8)


def _chunks(lin) -> int:
    return axis_plan(lin.layout((6, 6, 2)), B, "float64", lin.memory_budget, batch_size=B).chunks


def _tape_jacobian(model, x):
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out = model(xt)
    return tape.batch_jacobian(out, xt).numpy().reshape(B, 3, AXES)


@pytest.mark.graph
def test_jacobian_chunks_trace_once_and_equal_one_chunk_and_the_tape():
    """The output Jacobian streamed in 2 chunks, then in 24 by the same twin: one trace
    of the compiled axis pass for both (and no other), the same columns, those of
    tf.GradientTape."""
    model, x = _residual_cnn(), _x()
    tape = _tape_jacobian(model, x)
    lin, per_axis = _twin(model)
    traces, got = {}, {}
    for fit in (36, 3):
        lin.memory_budget = fit * per_axis
        chunks = _chunks(lin)
        got[chunks] = lin.output_jacobian(x, batch_size=B)
        np.testing.assert_allclose(got[chunks], tape, rtol=1e-12, atol=1e-12)
        traces[chunks] = (lin.compiled.axes_tangent.experimental_get_tracing_count(),
                          lin.compiled.primal.experimental_get_tracing_count())
    assert sorted(traces) == [2, 24]
    np.testing.assert_allclose(got[24], got[2], rtol=1e-13, atol=1e-14)
    assert traces[2] == traces[24], traces
    assert traces[24][0] == 1, traces


def test_gradient_norm_chunks_equal_one_chunk_and_the_tape():
    """The per-neuron gradient norms of `certify`, reduced chunk by chunk (24 chunks),
    equal those of the dense tf.GradientTape Jacobian of every pre-activation."""
    model, x = _residual_cnn(), _x()
    lin, per_axis = _twin(model)
    lin.memory_budget = 3 * per_axis
    assert _chunks(lin) == 24
    (part,) = list(iter_gradient_norms(lin, x, batch_size=B))
    c1, c2 = (layer for layer in model.layers if isinstance(layer, L.Conv2D))
    xt = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xt)
        z1 = tf.nn.conv2d(xt, c1.kernel, 1, "SAME") + c1.bias  # the pre-activations
        z2 = tf.nn.conv2d(tf.nn.relu(z1), c2.kernel, 1, "SAME") + c2.bias
        outs = [tf.reshape(z, (B, -1)) for z in (z1, z2)]
    jac = np.concatenate([tape.batch_jacobian(o, xt).numpy().reshape(B, -1, AXES)
                          for o in outs], axis=1)  # [B, N, D]
    np.testing.assert_allclose(part.norms.l2, np.sqrt((jac**2).sum(-1)), rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_allclose(part.norms.l1, np.abs(jac).sum(-1), rtol=1e-12, atol=1e-12)


def _dense_model(seed=0):
    keras.utils.set_random_seed(seed)
    bias = keras.initializers.RandomNormal(stddev=0.3)
    inp = keras.Input((10,), dtype="float64")
    h = L.Dense(16, activation="relu", bias_initializer=bias, dtype="float64")(inp)
    return keras.Model(inp, L.Dense(4, dtype="float64")(h))


@pytest.mark.graph
@pytest.mark.parametrize("mode", ["expected", pytest.param("max", marks=pytest.mark.slow)])
def test_distortion_chunks_trace_as_often_as_two_and_match(mode):
    """The distortion of 2 examples (40 draws each, or a population of 40 over 2
    generations) evaluated in chunks of 40 points or of 4 (2 or 20 chunks per pass):
    the compiled distance function is traced once or twice either way (once more for a
    smaller last chunk: no more for more chunks), and the results are the same, those
    of the same candidates scored by tf.GradientTape (the callback's candidates).
    ("max" is slow: 13 s.)"""
    x = np.random.default_rng(1).uniform(0.2, 0.8, (2, 10))
    y = np.array([0, 3])
    kw = dict(eps=0.3, mode=mode, samples=40, population=40, generations=2, seed=0,
              verbose=False)
    results, traces = {}, {}
    for points in (40, 4):
        model = _dense_model()  # a fresh engine: its own traces
        engine = LogitGradients.of(model)
        budget = points * _bytes_per_point(engine)
        assert engine.chunk_size((10,), budget) == points
        seen = []
        results[points] = gradient_distortion(
            model, x, y, memory_budget=budget,
            callback=lambda ex, c, d, seen=seen: seen.append((ex, c, d)), **kw)
        traces[points] = engine._dist_fn.experimental_get_tracing_count()
        calls = len(seen)
    assert traces[4] <= traces[40] <= 2, traces
    assert calls == 2 * results[4].evaluations // 4  # chunks of 4 points
    ex, cands, dist = (np.concatenate(p) for p in zip(*seen))
    np.testing.assert_allclose(dist, _tape_distances(model, x, y, ex, cands), rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(results[4].distortion, results[40].distortion, rtol=1e-12)
    if mode == "max":
        np.testing.assert_array_equal(results[4].points, results[40].points)


def _bytes_per_point(engine) -> int:
    """About the bytes `LogitGradients.chunk_size` counts per point (from above, within
    a millionth: `points` times it makes chunks of `points`)."""
    return 10**9 // engine.chunk_size((10,), 10**9)


def _tape_distances(model, x, y, ex, cands):
    def grads(points, labels):
        pt = tf.constant(points)
        with tf.GradientTape() as tape:
            tape.watch(pt)
            total = tf.reduce_sum(tf.gather(model(pt), labels, axis=1, batch_dims=1))
        return tape.gradient(total, pt).numpy()

    ref = grads(x, y)
    return np.abs(grads(cands, y[ex]) - ref[ex]).sum(axis=1)
