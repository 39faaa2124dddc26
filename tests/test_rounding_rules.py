"""The per-op rounding rules: tables by op type, and the rule derived for custom ops.

A custom layer registered with `keras_roll.register_rule` whose op is neither a
`Linear` nor a built-in op type gets `DerivedRule`: its linear map read off the
op's own tangent. Checked against the same bound written out with numpy from
the layer's weights, and end to end: the guarded rigors certify a model with
such ops (no refusal), and their bound covers the error of the Keras model's
own float32 evaluation at every neuron.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile.records import Record
from keras_roll.compile.rules import NO_RECORD, Neurons, Op, Tangent
from keras_roll.compile.rules.base import apply_linear, flatten_directions, flatten_examples
from keras_roll.rounding import rules
from keras_roll.rounding.layer_rules import ActivationRule, WeightedSumRule

M = np.array([[0.5, -1.25, 2.0], [-0.75, 0.25, 1.5], [1.0, 0.5, -0.5]], np.float32)
C = np.array([0.1, -0.2, 0.3], np.float32)
T = 0.05  # the breakpoint of Hinge


class Shear(keras.layers.Layer):
    """`x M + c`: affine with coefficients of both signs."""

    def call(self, x):
        return keras.ops.matmul(x, M) + C


class ShearOp(Op):
    """A custom op without pattern (not a `Linear`)."""

    def forward(self, inputs, mask):
        x = inputs[0]
        return tf.matmul(x, tf.cast(M, x.dtype)) + tf.cast(C, x.dtype), NO_RECORD

    def tangent(self, tangents, record, mask):
        return apply_linear(lambda xs: tf.matmul(xs[0], tf.cast(M, xs[0].dtype)), tangents), None


class Hinge(keras.layers.Layer):
    """`T + s (x - T)` with slope 1 above the breakpoint `T` and 0.3 below."""

    def call(self, x):
        return T + keras.ops.where(x > T, 1.0, 0.3) * (x - T)


@dataclasses.dataclass(frozen=True, eq=False)
class HingeRecord(Record):
    z: tf.Tensor
    slope: tf.Tensor


class HingeOp(Op):
    """A custom op with a pattern that owns neurons (not an `Activation`)."""

    owns_neurons = True

    def forward(self, inputs, mask):
        z = inputs[0]
        slope = tf.where(z > T, tf.ones_like(z), 0.3 * tf.ones_like(z))
        return T + slope * (z - T), HingeRecord(z, slope)

    def tangent(self, tangents, record, mask):
        pre = tangents[0].per_example(tf.shape(record.z)[0])
        return Tangent(pre * record.slope[:, None]), flatten_directions(pre)

    def neurons(self, record):
        d = record.z - T
        inf = tf.fill(tf.shape(d), tf.constant(np.inf, d.dtype))
        return Neurons(flatten_examples(d), flatten_examples(tf.where(d > 0, d, inf)),
                       flatten_examples(tf.where(d <= 0, -d, inf)),
                       flatten_examples(tf.ones_like(d, tf.bool)),
                       flatten_examples(tf.cast(d > 0, tf.int32)))

    def neuron_shape(self, record):
        return tuple(int(d) for d in record.z.shape[1:])


@pytest.fixture(scope="module")
def custom_model():
    keras_roll.register_rule(Shear, ShearOp, override=True)
    keras_roll.register_rule(Hinge, HingeOp, override=True)
    keras.utils.set_random_seed(3)
    inp = keras.Input((4,))
    h = keras.layers.Dense(3, name="d0")(inp)
    h = Shear(name="shear")(h)
    h = Hinge(name="hinge")(h)
    h = keras.layers.Dense(5, name="d1")(h)
    h = keras.layers.ReLU(name="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(2, name="logits")(h))
    x = np.random.default_rng(3).normal(size=(16, 4)).astype("float32")
    yield model, x
    keras_roll.compile.rules.unregister_rule(Shear)
    keras_roll.compile.rules.unregister_rule(Hinge)


def _op(lin, name):
    return next(op for step in lin.program.steps for op in step.ops if op.name == name)


def test_rules_are_looked_up_by_op_type_and_layer_class(custom_model):
    model, _ = custom_model
    lin = keras_roll.linearize(model)
    assert isinstance(rules.rounding_rule(_op(lin, "d0")), WeightedSumRule)
    assert isinstance(rules.rounding_rule(_op(lin, "relu")), ActivationRule)
    assert isinstance(rules.rounding_rule(_op(lin, "shear")), rules.DerivedRule)
    assert isinstance(rules.rounding_rule(_op(lin, "hinge")), rules.DerivedRule)
    assert rules.roundings(_op(lin, "d0"), [tf.zeros((1, 4))]) == 4 + 2
    assert rules.matmul_like(_op(lin, "d0")) and not rules.matmul_like(_op(lin, "relu"))


def test_derived_rule_equals_the_bound_written_out(custom_model):
    """`|A| m + |b|` of the custom ops, against numpy from the layer's own constants."""
    model, x = custom_model
    lin = keras_roll.linearize(model).at_dtype("float64")
    m = np.abs(np.random.default_rng(0).normal(size=(5, 3)))
    shear = _op(lin, "shear")
    got = rules.magnitude(shear, [tf.constant(m)], NO_RECORD, True).numpy()
    np.testing.assert_allclose(got, m @ np.abs(M.astype(np.float64)) + np.abs(C), rtol=1e-12)
    got = rules.magnitude(shear, [tf.constant(m)], NO_RECORD, False).numpy()
    np.testing.assert_allclose(got, m @ np.abs(M.astype(np.float64)), rtol=1e-12)
    # A fan-in of 3 products per output, + 2.
    assert rules.roundings(shear, [tf.zeros((1, 3), tf.float64)]) == 3 + 2
    # With a pattern: the recorded slope and the offset |T - s T| at the actual inputs.
    hinge = _op(lin, "hinge")
    a = tf.constant(np.random.default_rng(1).normal(scale=0.1, size=(5, 3)))
    _, record = hinge.forward([a], None)
    slope = np.where(a.numpy() > T, 1.0, 0.3)
    offset = np.abs(T - slope * T)
    got = rules.magnitude(hinge, [tf.abs(a)], record, True, values=[a]).numpy()
    np.testing.assert_allclose(got, slope * np.abs(a.numpy()) + offset, rtol=1e-9, atol=1e-15)
    got = rules.rounding_rule(hinge).neuron_magnitude(hinge, [tf.abs(a)], record, True,
                                                      values=[a]).numpy()
    np.testing.assert_allclose(got, np.abs(a.numpy()) + T, rtol=1e-9)
    with pytest.raises(ValueError, match="input values"):
        rules.magnitude(hinge, [tf.abs(a)], record, True)


@pytest.mark.parametrize("rigor", ["float64", "strict"])
def test_guarded_rigors_certify_custom_ops(custom_model, rigor):
    """No refusal; the guard covers the model's own float32 error at every neuron (the
    inputs of the custom Hinge and of the ReLU, read off the Keras model)."""
    model, x = custom_model
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    fwd = lin64.forward(x)
    err = keras_roll.rounding.guard_for(rigor).errors(lin64, fwd)
    layout = lin64.layout(x.shape[1:])
    sub = keras.Model(model.input, [model.get_layer(n).input for n in ("hinge", "relu")])
    z64 = fwd.neurons.z.numpy()
    for name, own, shift in zip(("hinge", "relu"), sub(x), (T, 0.0)):
        rows = layout.rows(name)
        diff = np.abs(own.numpy().astype(np.float64) - shift - z64[:, rows])
        assert np.all(diff <= err.at_x[:, rows])
    cert = keras_roll.certify(model, x, verbose=False, rigor=rigor)
    cert32 = keras_roll.certify(model, x, verbose=False, rigor="float32")
    for p in (1, 2, np.inf):
        assert np.all(cert.margins[p] <= cert32.margins[p] * (1 + 1e-5))
        assert np.median(cert.margins[p] / cert32.margins[p]) > 0.99


def test_register_rounding_rule_replaces_the_derived_one(custom_model):
    model, _ = custom_model

    class Loose(rules.RoundingRule):
        def magnitude(self, op, bounds, record, affine, mask=None, values=None):
            return 10.0 * tf.reduce_sum(bounds[0], -1, keepdims=True) * tf.ones([1, 3],
                                                                                 bounds[0].dtype)

        def roundings(self, op, inputs):
            return 7

    lin = keras_roll.linearize(model)
    with pytest.raises(ValueError, match="already registered"):
        rules.register_rounding_rule(keras.layers.BatchNormalization, Loose())
    try:
        rules.register_rounding_rule(ShearOp, Loose())
        assert rules.roundings(_op(lin, "shear"), [tf.zeros((1, 3))]) == 7
    finally:
        rules.register_rounding_rule(ShearOp, rules.DerivedRule(), override=True)
    with pytest.raises(TypeError, match="RoundingRule"):
        rules.register_rounding_rule(ShearOp, "loose")


# --------------------------------------------------------------------------- extension points
# `register_error_growth` (rigor "strict") and `register_noise_rule` (rigor "float64") for
# an op that rounds in its own way: a scaled identity whose registered rule is checked to
# reach the guard.


class ScaledIdentity(keras.layers.Layer):
    """`s x`."""

    def __init__(self, s=2.0, **kwargs):
        super().__init__(**kwargs)
        self.s = s

    def call(self, x):
        return self.s * x


class ScaledOp(Op):
    """The op of `ScaledIdentity` (its own class, so that rules keyed by it touch nothing else)."""

    def forward(self, inputs, mask):
        return self.layer.s * inputs[0], NO_RECORD

    def tangent(self, tangents, record, mask):
        return apply_linear(lambda xs: self.layer.s * xs[0], tangents), None


def _scaled_model(seed=5):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((3,))
    h = keras.layers.Dense(4, name="d0")(inp)
    h = ScaledIdentity(2.0, name="scaled")(h)
    h = keras.layers.ReLU(name="relu")(h)  # its neurons: the scaled values
    return keras.Model(inp, keras.layers.Dense(2, name="logits")(h))


@pytest.fixture
def scaled_rule():
    keras_roll.register_rule(ScaledIdentity, ScaledOp, override=True)
    yield
    keras_roll.compile.rules.unregister_rule(ScaledIdentity)


def _guard_errors(rigor, model, x):
    guard = keras_roll.rounding.guard_for(rigor)
    twin = guard.twin(keras_roll.linearize(model))
    return guard.errors(twin, twin.forward(x)), twin.forward(x).neurons.z.numpy()


def test_a_registered_error_growth_reaches_the_strict_guard(scaled_rule):
    from keras_roll.rounding.worst_case import ErrorGrowth, register_error_growth

    x = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    before, z = _guard_errors("strict", _scaled_model(), x)
    assert before.at_x.max() < 1e-4  # a few float32 roundings of values of order 1

    class QuarterError(ErrorGrowth):
        """Claims a relative error of 1/4 on the op's outputs (and so on the ReLU's
        neurons, which read them)."""

        def relative(self, op, g_in, gamma_fn, inputs):
            return 0.25 + 0.0 * g_in, g_in

    register_error_growth(ScaledOp, QuarterError())
    after, z_after = _guard_errors("strict", _scaled_model(), x)  # a fresh model and twin
    np.testing.assert_array_equal(z_after, z)
    # |error_j| <= g_j m_j with m_j >= |z_j|: the guard covers a quarter of every neuron.
    assert np.all(after.at_x >= 0.25 * np.abs(z))
    with pytest.raises(TypeError, match="Expected an ErrorGrowth"):
        register_error_growth(ScaledOp, object())


def _amplifying_noise_rule(factor):
    """A noise rule for `ScaledOp`: exact scaling (no rounding of its own), its inputs'
    rounding noise multiplied by `factor`."""
    from keras_roll.rounding.noise_transform import Edge

    def rule(transform, op, inputs, mask, record):
        (edge,) = inputs
        s = abs(op.layer.s)
        value = tf.cast(op.forward([edge.value], mask)[0], transform.dtype)
        scaled = [None if t is None else s * t for t in (edge.pr, edge.w0, edge.w1)]
        noise = transform.input_noise(inputs)
        if noise is not None:
            noise, _ = op.tangent(noise, record, mask)
            noise = Tangent(noise.value * factor, noise.shared)
        return Edge(value, *scaled, noise)

    return rule


def test_a_registered_noise_rule_reaches_the_float64_guard(scaled_rule):
    from keras_roll.rounding.noise_transform import register_noise_rule

    x = np.random.default_rng(1).normal(size=(6, 3)).astype("float32")
    register_noise_rule(ScaledOp, _amplifying_noise_rule(1.0))
    plain, z = _guard_errors("float64", _scaled_model(), x)
    register_noise_rule(ScaledOp, _amplifying_noise_rule(1000.0))
    loud, _ = _guard_errors("float64", _scaled_model(), x)  # a fresh model and twin
    # The probabilistic share (the guard less the float64 twin's rigorous one) is the
    # first Dense layer's rounding noise carried through the op: 1000 x larger.
    noisy = plain.at_x - plain.exact_at_x
    assert np.all(noisy > 0)
    ratio = (loud.at_x - loud.exact_at_x) / noisy
    assert np.all((ratio > 250) & (ratio < 4000)), ratio
    np.testing.assert_allclose(loud.exact_at_x, plain.exact_at_x, rtol=1e-12)
    with pytest.raises(TypeError, match="expects an Op subclass"):
        register_noise_rule(ScaledIdentity, _amplifying_noise_rule(1.0))
