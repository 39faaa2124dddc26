"""The rounding guard's compiled passes trace once for every batch size.

`certify` under the default rigor traced its noise, worst-case and exact-norm passes
again at the first batch of a new size (seconds per pass on a CNN); the graphs now
take any batch size from the first trace, with the same radii.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile.caches import batch_polymorphic
from keras_roll.rounding import exact_norms, noise, worst_case


def _traced(calls: list):
    def fn(x, scale):
        calls.append(1)
        return tf.reduce_sum(x * scale, axis=-1)
    return tf.function(fn, reduce_retracing=True, autograph=False)


@pytest.mark.graph  # counts traces: functions run as graphs
def test_one_trace_for_every_batch_size():
    plain_calls, wrapped_calls = [], []
    plain, wrapped = _traced(plain_calls), batch_polymorphic(_traced(wrapped_calls))
    rng = np.random.default_rng(0)
    for b in (1, 4, 2, 7):
        x = tf.constant(rng.normal(size=(b, 3)))
        want = np.sum(x.numpy() * 2.0, axis=-1)
        np.testing.assert_allclose(wrapped(x, 2.0).numpy(), want, rtol=1e-12)
        np.testing.assert_allclose(plain(x, 2.0).numpy(), want, rtol=1e-12)
    assert len(plain_calls) >= 2  # reduce_retracing alone: traced at 1, again at 4
    assert len(wrapped_calls) == 1
    wrapped(tf.constant(rng.normal(size=(5, 3))), 3.0)  # another Python argument
    wrapped(tf.constant(rng.normal(size=(5, 4))), 3.0)  # another trailing shape
    assert len(wrapped_calls) == 3


def _residual_cnn():
    keras.utils.set_random_seed(3)
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, activation="relu")(inp)
    s = keras.layers.Conv2D(4, 3, padding="same")(h)
    h = keras.layers.ReLU()(keras.layers.Add()([h, s]))
    h = keras.layers.Dense(6, activation="relu")(keras.layers.Flatten()(h))
    return keras.Model(inp, keras.layers.Dense(3)(h))


def _rounding_traces() -> int:
    fns = [*noise._COMPILED.values(), *worst_case._COMPILED.values(),
           *exact_norms._COMPILED.values()]
    return sum(f.python_function.experimental_get_tracing_count() for f in fns)


@pytest.mark.slow  # three traces of the guard's passes: about 10 s
@pytest.mark.graph
def test_certify_reuses_the_rounding_graphs_at_a_new_batch_size():
    model = _residual_cnn()
    x = np.random.default_rng(0).normal(size=(3, 8, 8, 2)).astype("float32")
    singles = [keras_roll.certify(model, x[i:i + 1], verbose=False) for i in range(3)]
    before = _rounding_traces()
    assert before > 0
    batch = keras_roll.certify(model, x, verbose=False)
    assert _rounding_traces() == before
    for p in ("l1", "l2", "linf"):
        one_by_one = np.concatenate([np.asarray(c.margins[p]) for c in singles])
        assert np.all(one_by_one > 0)  # the guarded tangent path ran, not zero radii
        np.testing.assert_array_equal(np.asarray(batch.margins[p]), one_by_one)


def test_nothing_is_traced_while_functions_run_eagerly():
    """The default suite runs functions eagerly: the wrapper then traces no graph
    ahead (a trace for nothing cost test_margins a third of its time)."""
    calls = []
    fn = _traced(calls)
    wrapped = batch_polymorphic(fn)
    eager = tf.config.functions_run_eagerly()  # False under `make test-all`
    tf.config.run_functions_eagerly(True)
    try:
        x = tf.constant(np.arange(6.0).reshape(2, 3))
        np.testing.assert_allclose(wrapped(x, 2.0).numpy(), [6.0, 24.0])
        wrapped(x, 2.0)
    finally:
        tf.config.run_functions_eagerly(eager)
    assert fn.experimental_get_tracing_count() == 0 and len(calls) == 2  # Python, twice


class _Recorder:
    """A stand-in `tf.function`: records the specs it is traced ahead for."""

    def __init__(self):
        self.specs = []

    def get_concrete_function(self, *specs):
        self.specs.append(specs)

    def __call__(self, x, scale):
        return np.sum(np.asarray(x) * scale, axis=-1)


@pytest.mark.graph  # traces ahead only when functions do not run eagerly
def test_arrays_are_keyed_by_shape_not_by_identity():
    """Many arrays of one trailing shape: one trace ahead, with the batch axis free
    (keyed by each array's identity, every call would trace again and be remembered
    for good)."""
    fn = _Recorder()
    wrapped = batch_polymorphic(fn)
    rng = np.random.default_rng(0)
    for b in (3, 1, 3, 5, 2, 3):
        x = rng.normal(size=(b, 4))
        np.testing.assert_allclose(wrapped(x, 2.0), 2.0 * x.sum(-1))
    assert fn.specs == [(tf.TensorSpec([None, 4], tf.float64), 2.0)]
    wrapped(rng.normal(size=(2, 5)).astype(np.float32), 2.0)  # another trailing shape
    assert fn.specs[-1] == (tf.TensorSpec([None, 5], tf.float32), 2.0)
    with pytest.raises(TypeError, match="type set .*neither a tensor, an array nor hashable"):
        wrapped(rng.normal(size=(2, 4)), {1, 2})
