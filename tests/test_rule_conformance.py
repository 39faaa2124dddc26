"""Rule conformance: every registered layer class, in a small model, checked by
`keras_roll.testing.check_rule` against tf.GradientTape.

One parametrized test per class in `keras_roll.compile.rules.registered_classes()`.
Each class appears in one of a few shared models (`BUILDERS` maps the class to its
model); a class with a rule but no model fails the test, so a new rule comes with
its conformance model. Each model is checked once (outputs, output and neuron
Jacobians, visible pre-activations, the float64 twin, the rounding guards, the
`training_dependent` flags: see `keras_roll.testing`); each class's test then
asserts that its model holds the class and that its layer calls passed.
`check_rule` itself is tested on user rules, right and deliberately wrong.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile import keras_internals
from keras_roll.compile.rules import registered_classes, unregister_rule
from keras_roll.testing import check_rule, tape_jacobian
from tests.model_zoo import randomize_batch_norm

L = keras.layers

# --------------------------------------------------------------------------- models


def dense_model():
    """Dense, the scales, activation layers, dropouts / noise, merges and Softmax."""
    keras.utils.set_random_seed(1)
    inp = keras.Input((5,))
    h = L.Rescaling(0.5, offset=0.1)(inp)
    h = L.Normalization(mean=[0.1, -0.2, 0.3, 0.0, 0.2],
                        variance=[1.5, 0.5, 2.0, 1.0, 0.8])(h)
    h = L.Dense(8, name="d0")(h)
    h = L.BatchNormalization(name="bn")(h)
    h = L.ReLU(negative_slope=0.05, threshold=0.1, max_value=3.0, name="relu")(h)
    h = L.Dropout(0.3)(h)
    a = L.Dense(6, name="a")(h)
    b = L.Dense(6, name="b")(h)
    h = L.Add()([a, b])
    h = L.LeakyReLU(0.2, name="leaky")(h)
    h = L.AlphaDropout(0.3)(h)
    c = L.Dense(6, name="c")(h)
    h = L.Subtract()([c, h])
    h = L.GaussianDropout(0.3)(h)
    h = L.PReLU(alpha_initializer=keras.initializers.Constant(0.25), name="prelu")(h)
    h = L.GaussianNoise(0.3)(h)
    e = L.Dense(6, name="e")(h)
    h = e + h  # keras.ops Add
    h = h - L.Dense(6, name="f")(h)  # keras.ops Subtract
    h = L.ActivityRegularization(l1=0.01)(h)
    h = L.Identity()(h)
    h = L.Activation("relu", name="act")(h)
    h = L.RepeatVector(2)(h)
    h = L.Flatten()(h)
    h = L.Dense(3, name="logits")(h)
    out = L.Softmax(name="softmax")(h)
    x = np.random.default_rng(1).normal(size=(4, 5)).astype("float32")
    return randomize_batch_norm(keras.Model(inp, out, name="dense_model")), x


def conv1d_model():
    """1-D convolutions, paddings, croppings, up-sampling and poolings."""
    keras.utils.set_random_seed(2)
    inp = keras.Input((8, 3))
    h = L.Conv1D(4, 3, padding="causal", name="conv")(inp)
    h = L.ReLU(name="r0")(h)
    h = L.DepthwiseConv1D(3, padding="same", name="dw")(h)
    h = L.ReLU(name="r1")(h)
    h = L.SeparableConv1D(4, 3, padding="same", name="sep")(h)
    h = L.LeakyReLU(0.1, name="r2")(h)
    h = L.ZeroPadding1D(1)(h)
    h = L.Cropping1D((1, 1))(h)
    h = L.UpSampling1D(2)(h)
    h = L.MaxPooling1D(2, name="maxpool")(h)
    h = L.AveragePooling1D(2)(h)
    h = L.SpatialDropout1D(0.3)(h)
    p = L.GlobalMaxPooling1D(name="gmax")(h)
    q = L.GlobalAveragePooling1D()(h)
    h = L.Concatenate()([p, q])
    h = L.Dense(4, name="dense")(h)
    h = L.ReLU(name="r3")(h)
    out = L.Dense(2, name="logits")(h)
    x = np.random.default_rng(2).normal(size=(3, 8, 3)).astype("float32")
    return keras.Model(inp, out, name="conv1d_model"), x


def conv2d_model():
    """2-D convolutions, paddings, croppings, up-sampling, poolings and a Permute."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((5, 5, 2))
    h = L.Conv2D(3, 3, padding="same", name="conv")(inp)
    h = L.ReLU(name="r0")(h)
    h = L.DepthwiseConv2D(3, padding="same", name="dw")(h)
    h = L.ReLU(name="r1")(h)
    h = L.SeparableConv2D(3, 2, name="sep")(h)
    h = L.ReLU(name="r2")(h)
    h = L.ZeroPadding2D(1)(h)
    h = L.Cropping2D(((1, 0), (0, 1)))(h)
    h = L.UpSampling2D(2)(h)
    h = L.MaxPooling2D(2, name="maxpool")(h)
    h = L.AveragePooling2D(2, padding="same")(h)
    h = L.SpatialDropout2D(0.3)(h)
    h = L.Permute((2, 1, 3))(h)
    p = L.GlobalMaxPooling2D(name="gmax")(h)
    q = L.GlobalAveragePooling2D()(h)
    h = L.Average()([p, q])
    h = L.Reshape((3, 1))(h)
    h = L.Flatten()(h)
    h = L.Dense(4, name="dense")(h)
    h = L.ReLU(name="r3")(h)
    out = L.Dense(2, name="logits")(h)
    x = np.random.default_rng(3).normal(size=(3, 5, 5, 2)).astype("float32")
    return keras.Model(inp, out, name="conv2d_model"), x


def conv3d_model():
    """3-D convolution, padding, cropping, up-sampling, average pooling, sigmoid head."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((3, 3, 3, 2))
    h = L.Conv3D(2, 2, padding="same", name="conv")(inp)
    h = L.ReLU(name="r0")(h)
    h = L.ZeroPadding3D(1)(h)
    h = L.Cropping3D(((1, 0), (0, 1), (1, 1)))(h)
    h = L.UpSampling3D(2)(h)
    h = L.AveragePooling3D(2)(h)
    h = L.SpatialDropout3D(0.3)(h)
    h = L.ReLU(name="r1")(h)
    h = L.GlobalAveragePooling3D()(h)
    h = L.Dense(3, name="dense")(h)
    h = L.ReLU(name="r2")(h)
    h = L.Dense(1, name="logits")(h)
    out = L.Activation("sigmoid", name="sigmoid")(h)
    x = np.random.default_rng(4).normal(size=(2, 3, 3, 3, 2)).astype("float32")
    return keras.Model(inp, out, name="conv3d_model"), x


def _padded(batch=3, steps=4, channels=3, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, steps, channels)).astype("float32")
    x[1, 3:] = 0.0
    x[2, 2:] = 0.0
    return x


def rnn_model():
    """Masking, SimpleRNN and keras_roll.layers.ScoRNN over a variable-length
    (zero-padded) batch, and a masked global average."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((4, 3))
    h = L.Masking(0.0)(inp)
    h = L.SimpleRNN(4, activation="relu", return_sequences=True, name="rnn")(h)
    h = keras_roll.layers.ScoRNN(4, activation="relu", return_sequences=True, name="scornn")(h)
    h = L.GlobalAveragePooling1D()(h)
    out = L.Dense(2, name="logits")(h)
    return keras.Model(inp, out, name="rnn_model"), _padded()


MODELS = {
    "dense": dense_model,
    "conv1d": conv1d_model,
    "conv2d": conv2d_model,
    "conv3d": conv3d_model,
    "rnn": rnn_model,
}


_KNP_ADD = keras_internals.numpy_operation("Add")  # `x + y` on Keras tensors
_KNP_SUBTRACT = keras_internals.numpy_operation("Subtract")

BUILDERS = {
    **dict.fromkeys([L.Dense, L.ReLU, L.LeakyReLU, L.PReLU, L.Activation, L.Softmax,
                     L.BatchNormalization, L.Rescaling, L.Normalization, L.Add, L.Subtract,
                     L.RepeatVector, L.Flatten, L.Dropout, L.AlphaDropout, L.GaussianDropout,
                     L.GaussianNoise, L.ActivityRegularization, L.Identity, _KNP_ADD,
                     _KNP_SUBTRACT], "dense"),
    **dict.fromkeys([L.Conv1D, L.DepthwiseConv1D, L.SeparableConv1D, L.ZeroPadding1D,
                     L.Cropping1D, L.UpSampling1D, L.MaxPooling1D, L.AveragePooling1D,
                     L.SpatialDropout1D, L.GlobalMaxPooling1D, L.GlobalAveragePooling1D,
                     L.Concatenate], "conv1d"),
    **dict.fromkeys([L.Conv2D, L.DepthwiseConv2D, L.SeparableConv2D, L.ZeroPadding2D,
                     L.Cropping2D, L.UpSampling2D, L.MaxPooling2D, L.AveragePooling2D,
                     L.SpatialDropout2D, L.Permute, L.GlobalMaxPooling2D,
                     L.GlobalAveragePooling2D, L.Average, L.Reshape], "conv2d"),
    **dict.fromkeys([L.Conv3D, L.ZeroPadding3D, L.Cropping3D, L.UpSampling3D,
                     L.AveragePooling3D, L.SpatialDropout3D, L.GlobalAveragePooling3D],
                    "conv3d"),
    **dict.fromkeys([L.SimpleRNN, L.Masking, keras_roll.layers.ScoRNN], "rnn"),
}

# --------------------------------------------------------------------------- the test


@functools.cache
def conformance(key):
    """`(model, RuleCheck, linearized model)` of model `key`, checked once."""
    model, x = MODELS[key]()
    return model, check_rule(model, input_data=x), keras_roll.linearize(model)


def _param_id(cls):
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


@pytest.mark.parametrize("layer_class", registered_classes(), ids=_param_id)
def test_rule_matches_gradient_tape(layer_class):
    if layer_class not in BUILDERS:
        pytest.fail(f"{layer_class.__name__} has a registered rule but no conformance model: "
                    f"add it to a model in tests/test_rule_conformance.py and to BUILDERS.")
    model, result, lin = conformance(BUILDERS[layer_class])
    steps = {s.name for s in lin.program.steps if type(s.layer) is layer_class}
    assert steps, f"model '{model.name}' has no {layer_class.__name__}"
    assert result.errors and max(result.errors.values()) <= 1e-5
    flags = {name: (flag, actual) for name, flag, actual in result.training_flags}
    for name in steps & set(flags):
        assert flags[name][0] == flags[name][1], name


def test_every_builder_class_is_registered():
    """BUILDERS names no class without a rule (a stale entry would test nothing)."""
    assert set(BUILDERS) <= set(registered_classes())


# --------------------------------------------------------------------------- user rules


class Scale(keras.layers.Layer):
    """`x * factor`, plus `shift` in training only (a layer with a training mode)."""

    def __init__(self, factor=2.0, shift=0.0, **kwargs):
        super().__init__(**kwargs)
        self.factor, self.shift = factor, shift

    def call(self, x, training=None):
        return x * self.factor + (self.shift if training else 0.0)


@pytest.fixture
def scale_rule():
    """Registers a `Scale` rule for one test: `scale_rule(linear, **linear_kwargs)`."""

    def register(linear, **kwargs):
        keras_roll.register_rule(
            Scale, lambda layer: keras_roll.compile.rules.Linear(
                layer, lambda xs: linear(layer, xs[0]), **kwargs), override=True)

    yield register
    unregister_rule(Scale)


def test_check_rule_passes_a_right_user_rule(scale_rule):
    scale_rule(lambda layer, x: x * layer.factor)
    result = check_rule(Scale(1.5, name="scale"), input_shape=(4,))
    assert max(result.errors.values()) <= 1e-5
    assert ("scale", False, False) in result.training_flags


def test_check_rule_catches_a_wrong_tangent(scale_rule):
    """The tangent doubles the slope; the forward pass (the layer's own call) is right."""
    scale_rule(lambda layer, x: 2.0 * x * layer.factor)
    with pytest.raises(AssertionError, match=r"(?s)layer 'scale' of class Scale.*"
                       r"first layer whose output Jacobian differs: 'scale' \(Scale\).*"
                       r"output jacobian: off by"):
        check_rule(Scale(1.5, name="scale"), input_shape=(4,), rounding=False)


def test_check_rule_catches_a_wrong_training_flag(scale_rule):
    scale_rule(lambda layer, x: x * layer.factor)
    with pytest.raises(AssertionError, match="'scale': its ops say training_dependent=False"):
        check_rule(Scale(1.5, shift=1.0, name="scale"), input_shape=(4,), rounding=False)
    scale_rule(lambda layer, x: x * layer.factor, training_dependent=True)
    result = check_rule(Scale(1.5, shift=1.0, name="scale"), input_shape=(4,), rounding=False)
    assert ("scale", True, True) in result.training_flags
    assert not any(name.startswith("rounding") for name in result.errors)


def test_check_rule_catches_a_wrong_rounding_magnitude(scale_rule):
    """A rounding rule that claims the layer's outputs are 0: the observed float32
    error exceeds the guard built on it."""
    scale_rule(lambda layer, x: x * layer.factor)

    class Zero(keras_roll.rounding.RoundingRule):
        def magnitude(self, op, bounds, record, affine, mask=None, values=None):
            return 0.0 * bounds[0]

        def roundings(self, op, inputs):
            return 1

    keras_roll.rounding.register_rounding_rule(Scale, Zero())
    try:
        with pytest.raises(AssertionError, match="rounding guard of rigor 'strict': off by"):
            check_rule(Scale(1.1, name="scale"), input_shape=(4,))
    finally:
        keras_roll.rounding.unregister_rounding_rule(Scale)


def test_check_rule_refuses_what_it_cannot_check():
    with pytest.raises(ValueError, match="needs `input_shape`"):
        check_rule(L.Dense(2))
    with pytest.raises(TypeError, match="takes a keras.layers.Layer or a keras.Model"):
        check_rule(np.zeros(3), input_shape=(3,))
    with pytest.raises(keras_roll.UnsupportedModelError):
        check_rule(L.Dense(2, activation="tanh"), input_shape=(3,))


# One block of rows (2048) is what check_rule runs in every conformance test above, whose
# references it is; the tiled blocks (40) only here.
@pytest.mark.parametrize("rows_per_pass", [pytest.param(2048, marks=pytest.mark.slow), 40])
def test_tape_jacobian_equals_the_tapes_batch_jacobian(rows_per_pass):
    """`tape_jacobian` (tiled reverse passes) against `tape.batch_jacobian`, for two
    outputs of a small CNN, in one block of rows and in blocks of 13 outputs (3
    examples, 40 rows), concatenated and per output."""
    model, x = conv2d_model()
    cut = keras.Model(model.inputs[0], [model.get_layer("conv").output, model.output])

    def fn(t):
        return cut(t, training=False)

    values, jac = tape_jacobian(fn, x, rows_per_pass=rows_per_pass)
    xt = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xt)
        outs = [tf.reshape(o, (x.shape[0], -1)) for o in fn(xt)]
    want = np.concatenate([tape.batch_jacobian(o, xt).numpy().reshape(x.shape[0], o.shape[1], -1)
                           for o in outs], axis=1)
    np.testing.assert_allclose(values, np.concatenate([o.numpy() for o in outs], 1), rtol=1e-6)
    assert jac.shape == want.shape and np.abs(want).max() > 0
    np.testing.assert_allclose(jac, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    blocks, jacs = tape_jacobian(fn, x, rows_per_pass=rows_per_pass, per_output=True)
    assert [b.shape[1] for b in blocks] == [o.shape[1] for o in outs]
    np.testing.assert_array_equal(np.concatenate(blocks, 1), values)
    np.testing.assert_array_equal(np.concatenate(jacs, 1), jac)
