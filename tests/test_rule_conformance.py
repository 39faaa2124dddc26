"""Rule conformance: every registered layer class, in a small model, against tf.GradientTape.

In the manner of Keras's `run_layer_test`: one parametrized test per class in
`keras_roll.compile.rules.registered_classes()`. Each class appears in one of a few
shared models (`BUILDERS` maps the class to its model); a class with a rule but
no model fails the test, so a new rule comes with its conformance model. For
each model (built and checked once) the references are independent of the
twin's tangent rules:

* the logits (and a folded softmax / sigmoid) equal the Keras model's output;
* the output Jacobian equals `tf.GradientTape.batch_jacobian` of the Keras
  model's logits;
* the neuron Jacobians of the tangent pass equal the tape's Jacobian of the
  neurons' values `z` computed by the forward pass (reverse mode through the
  primal rules, forward mode through the tangent rules);
* the rows of every ReLU / LeakyReLU / PReLU / Activation layer equal the
  tape's Jacobian of the layer's Keras-visible input;
* in float64 (`lin.at_dtype("float64")`) the outputs and neuron Jacobians
  agree too, and the rounding bound of `keras_roll.rounding.worst_case` holds: magnitudes
  bound the neurons and their Jacobian rows, and the float32 neurons lie
  within the bound of the float64 ones;

and, per class, the ops' `training_dependent` flag equals what calling the layer
with `training=True` and `training=False` on the same input shows.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile import keras_internals
from keras_roll.compile.rules import registered_classes
from tests.model_zoo import randomize_batch_norm

L = keras.layers
VISIBLE_ACTIVATIONS = (L.ReLU, L.LeakyReLU, L.PReLU, L.Activation)
MERGE_LAYERS = (L.Add, L.Subtract, L.Average, L.Concatenate)

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
    """Masking and SimpleRNN over a variable-length (zero-padded) batch."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((4, 3))
    h = L.Masking(0.0)(inp)
    h = L.SimpleRNN(4, activation="relu", return_sequences=True, name="rnn")(h)
    h = L.GlobalAveragePooling1D()(h)
    out = L.Dense(2, name="logits")(h)
    return keras.Model(inp, out, name="rnn_model"), _padded()


def scornn_model():
    """keras_roll.layers.ScoRNN (registered by keras_roll.compile.rules.scornn)."""
    keras.utils.set_random_seed(6)
    inp = keras.Input((4, 3))
    h = L.Masking(0.0)(inp)
    h = keras_roll.layers.ScoRNN(4, activation="relu", name="scornn")(h)
    out = L.Dense(2, name="logits")(h)
    return keras.Model(inp, out, name="scornn_model"), _padded()


MODELS = {
    "dense": dense_model,
    "conv1d": conv1d_model,
    "conv2d": conv2d_model,
    "conv3d": conv3d_model,
    "rnn": rnn_model,
    "scornn": scornn_model,
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
    **dict.fromkeys([L.SimpleRNN, L.Masking], "rnn"),
    keras_roll.layers.ScoRNN: "scornn",
}

# --------------------------------------------------------------------------- references


def _close(actual, expected, rtol=1e-5):
    """Max |actual - expected| relative to max |expected| (0 when both vanish)."""
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-12)
    return float(np.max(np.abs(np.asarray(actual) - expected), initial=0.0)) / scale


def _batch_jacobian(fn, x):
    """`[B, n, D]` Jacobian of the flattened `fn(x)` by back-propagation."""
    xt = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out = fn(xt)
        flat = tf.reshape(out, (x.shape[0], -1))
    jac = tape.batch_jacobian(flat, xt)
    return flat.numpy(), tf.reshape(jac, (x.shape[0], flat.shape[1], -1)).numpy()


@functools.cache
def conformance(key):
    """Builds model `key` and returns `(model, x, lin, errors)`; each error is a
    relative max deviation from an independent reference."""
    model, x = MODELS[key]()
    lin = keras_roll.linearize(model)
    errors = {}
    out = model(x, training=False).numpy()
    errors["output"] = _close(lin.apply_output_link(lin(x)).numpy().reshape(out.shape), out)
    logits_model = model
    if lin.output_link is not None:  # the final layer is the folded link
        logits_model = keras.Model(model.inputs, model.layers[-1].input)
    _, ref = _batch_jacobian(lambda t: logits_model(t, training=False), x)
    errors["output jacobian"] = _close(lin.output_jacobian(x), ref)
    jac = lin.jacobian(x)
    z, ref = _batch_jacobian(lambda t: lin.primal(t).neurons.z, x)
    assert z.shape[1] > 0 and z.shape[1] == jac.shape[1]
    errors["neuron jacobians"] = _close(jac, ref)
    layout = lin.layout(x.shape[1:])
    units = {u.name for u in layout.units}
    for layer in model.layers:
        if isinstance(layer, VISIBLE_ACTIVATIONS) and layer.name in units:
            sub = keras.Model(model.inputs, layer.input)
            value, ref = _batch_jacobian(lambda t, s=sub: s(t, training=False), x)
            rows = layout.rows(layer.name)
            errors[f"{layer.name} pre-activations"] = _close(
                lin.forward(x).neurons.z.numpy()[:, rows], value)
            errors[f"{layer.name} jacobian"] = _close(jac[:, rows], ref)
    errors.update(_float64_errors(model, x, lin))
    return model, x, lin, errors


def _float64_errors(model, x, lin):
    """The float64 twin and the rounding bound of `keras_roll.rounding.worst_case`, per model.

    * the float64 twin's logits equal the model's, its neuron Jacobians the tape's
      Jacobian of its own float64 neurons;
    * the bound holds: `|z| <= at_x`, `sum_k |dz/dx_k| <= per_radius` (the
      Lipschitz part) and `|z32 - z64| <= (g_eval + g_exact) at_x` for the
      float32 twin's neurons (the model's own layer calls).

    A violated inequality is reported as its relative excess (0 when it holds).
    """
    twin = lin.at_dtype("float64")
    errors = {}
    out = model(x, training=False).numpy().astype(np.float64)
    errors["float64 output"] = _close(
        twin.apply_output_link(twin(x)).numpy().reshape(out.shape), out)
    jac = twin.jacobian(x)
    z, ref = _batch_jacobian(lambda t: twin.primal(t).neurons.z, x.astype(np.float64))
    errors["float64 neuron jacobians"] = _close(jac, ref)
    fwd = twin.forward(x)
    rb = twin.compiled.rounding(fwd.trace)
    at_x, per_r = rb.at_x.numpy(), rb.per_radius.numpy()
    bound = (rb.g_eval.numpy() + rb.g_exact.numpy()) * at_x
    z32 = lin.forward(x).neurons.z.numpy().astype(np.float64)
    valid = fwd.neurons.valid.numpy()
    scale = max(float(np.max(at_x, initial=0.0)), 1e-12)
    errors["magnitude bound"] = float(np.max(np.abs(z) - at_x, initial=0.0)) / scale
    errors["lipschitz bound"] = float(np.max(np.abs(jac).sum(-1) - per_r, initial=0.0)) / scale
    excess = np.where(valid, np.abs(z32 - z) - bound, 0.0)
    errors["rounding bound"] = max(float(np.max(excess, initial=0.0)), 0.0) / scale
    assert np.any(bound[valid] > 0) or not valid.any()  # the bound is not vacuous
    return errors


def _changes_in_training(layer, model, x) -> bool:
    """Whether `layer` computes something else with training=True (independent of rules)."""
    if not isinstance(layer, L.Layer):
        return False
    inputs = keras.Model(model.inputs, layer.input)(x, training=False)
    if isinstance(inputs, (list, tuple)) and not isinstance(layer, MERGE_LAYERS):
        inputs = inputs[0]  # a recurrent layer's input also lists its mask
    train = layer(inputs, training=True)
    infer = layer(inputs, training=False)
    return not np.allclose(keras.ops.convert_to_numpy(train), keras.ops.convert_to_numpy(infer))


def _param_id(cls):
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


# --------------------------------------------------------------------------- the test


@pytest.mark.parametrize("layer_class", registered_classes(), ids=_param_id)
def test_rule_matches_gradient_tape(layer_class):
    if layer_class not in BUILDERS:
        pytest.fail(f"{layer_class.__name__} has a registered rule but no conformance model: "
                    f"add it to a model in tests/test_rule_conformance.py and to BUILDERS.")
    model, x, lin, errors = conformance(BUILDERS[layer_class])
    steps = [s for s in lin.program.steps if type(s.layer) is layer_class]
    assert steps, f"model '{model.name}' has no {layer_class.__name__}"
    for name, err in errors.items():
        assert err <= 1e-5, f"{model.name}: {name} deviates by {err:.2e} (relative)"
    for step in steps:
        expected = _changes_in_training(step.layer, model, x)
        assert all(op.training_dependent == expected for op in step.ops), step.name
        if expected:
            assert not lin.inference_equals_training


def test_every_builder_class_is_registered():
    """BUILDERS names no class without a rule (a stale entry would test nothing)."""
    assert set(BUILDERS) <= set(registered_classes())
