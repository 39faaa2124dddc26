"""ROLL in the paper's units: `wrt=<leading Rescaling / Normalization layer>`.

The reference for every value is the same network *without* that layer (a
Keras model from the layer's output to the model output, sharing the weights)
fed the layer's outputs: its loss through `roll_loss` on the body model, and,
independently of keras_roll's tangent pass, Eq. 9 written out in numpy on
`tf.GradientTape` Jacobians of the body's pre-activations
(`tests/test_roll.py` helpers).
"""

from __future__ import annotations

import json
import os
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.roll import loss as roll
from keras_roll.roll.entry import tangent_entry
from tests.test_roll import _jacobian, mlp_groups, reference_loss, relu_group

# --------------------------------------------------------------------------- models


def norm_mlp(seed=0, variance=(0.04, 0.25, 1.5, 0.09, 2.0, 0.5)):
    """Normalization (per feature) -> Dense -> ReLU -> Dense -> ReLU -> Dense(softmax)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6,))
    h = keras.layers.Normalization(mean=np.linspace(-0.5, 0.5, 6).tolist(),
                                   variance=list(variance), name="norm")(inp)
    h = keras.layers.Dense(8, name="d0")(h)
    h = keras.layers.ReLU(name="r0")(h)
    h = keras.layers.Dense(7, name="d1")(h)
    h = keras.layers.ReLU(name="r1")(h)
    out = keras.layers.Dense(3, activation="softmax", name="logits")(h)
    return keras.Model(inp, out, name="norm_mlp")


def image_net(entry="rescale", seed=0):
    """Per-channel Rescaling or Normalization -> Conv -> ReLU -> MaxPool -> Dense."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6, 6, 3))
    if entry == "rescale":
        first = keras.layers.Rescaling(scale=np.array([4.0, 0.5, 2.0], "float32"),
                                       offset=np.array([-1.0, 0.2, 0.0], "float32"),
                                       name="rescale")
    else:
        first = keras.layers.Normalization(mean=[0.485, 0.456, 0.406],
                                           variance=[0.229**2, 0.224**2, 0.225**2],
                                           name="normalize")
    h = first(inp)
    h = keras.layers.Conv2D(4, 3, padding="same", name="conv")(h)
    h = keras.layers.ReLU(name="relu")(h)
    h = keras.layers.MaxPooling2D(2, name="pool")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(5, name="dense")(h)
    h = keras.layers.ReLU(name="relu_dense")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    return keras.Model(inp, out, name=f"image_{entry}")


def body(model, name):
    """The network after layer `name`, taking that layer's output: fresh layers of
    the same names, classes and configs with the weights copied."""
    layer = model.get_layer(name)
    inp = keras.Input(layer.output.shape[1:])
    h = inp
    started = False
    for la in model.layers:
        if la is layer:
            started = True
            continue
        if started and not isinstance(la, keras.layers.InputLayer):
            clone = la.__class__.from_config(la.get_config())
            h = clone(h)
            clone.set_weights(la.get_weights())
    return keras.Model(inp, h, name=f"{model.name}_body")


def _x(shape, seed=0):
    return np.random.default_rng(seed).uniform(0.0, 1.0, size=shape).astype("float32")


# --------------------------------------------------------------------------- exact loss


def test_exact_loss_equals_the_body_on_normalised_inputs():
    model = norm_mlp()
    x = _x((5, 6))
    u = model.get_layer("norm")(x).numpy()
    net = body(model, "norm")
    np.testing.assert_allclose(net(u).numpy(), model(x).numpy(), rtol=1e-6, atol=1e-7)
    # independent reference: GradientTape Jacobians of the body's pre-activations
    want = reference_loss(mlp_groups(net, u, ["d0", "d1"]), C=0.7, gamma=100.0)
    for gamma in (100.0, 40.0):
        got = roll.roll_loss(model, x, C=0.7, gamma=gamma, wrt="norm").numpy()
        np.testing.assert_allclose(got, roll.roll_loss(net, u, C=0.7, gamma=gamma).numpy(),
                                   rtol=1e-5, atol=1e-6)
    got = roll.roll_loss(model, x, C=0.7, wrt="norm").numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_wrt_rescales_the_gradient_term_by_the_variance():
    """One std sigma for every feature: ||grad_x z||^2 = ||grad_u z||^2 / sigma^2."""
    sigma = 0.3081
    model = norm_mlp(variance=[sigma**2] * 6)
    x = _x((4, 6))
    raw = roll.roll_loss(model, x, C=0.0).numpy()
    units = roll.roll_loss(model, x, C=0.0, wrt="norm").numpy()
    assert np.all(units > 0)
    np.testing.assert_allclose(raw * sigma**2, units, rtol=1e-5)


@pytest.mark.parametrize("entry", ["rescale", "normalize"])
def test_per_channel_scales_exact_sampled_and_probes(entry):
    model = image_net(entry)
    x = _x((3, 6, 6, 3), seed=1)
    u = model.get_layer(entry)(x).numpy()
    net = body(model, entry)
    np.testing.assert_allclose(net(u).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    # exact: against the body and against tape Jacobians of the body (relu, dense)
    zs, js = _jacobian(net, [net.get_layer("dense").output], u)
    exact_body = roll.roll_loss(net, u).numpy()
    got = roll.roll_loss(model, x, wrt=entry).numpy()
    np.testing.assert_allclose(got, exact_body, rtol=1e-5, atol=1e-6)
    dense_sq = relu_group(zs[0], js[0]).sq
    assert np.all(dense_sq.sum(1) > 0)
    # the same seed draws the same axes / probes of u: equal to the body's estimate
    for kwargs in ({"samples": 5, "strata": "channel", "seed": 3},
                   {"samples": 7, "seed": 4},
                   {"samples": 4, "estimator": "gaussian", "seed": 5},
                   {"samples": 4, "estimator": "rademacher", "seed": 6}):
        np.testing.assert_allclose(roll.roll_loss(model, x, wrt=entry, **kwargs).numpy(),
                                   roll.roll_loss(net, u, **kwargs).numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=str(kwargs))
    # all axes of every channel: exact
    np.testing.assert_allclose(
        roll.roll_loss(model, x, wrt=entry, samples=36, strata="channel", seed=0).numpy(),
        exact_body, rtol=1e-5, atol=1e-6)


def test_sampled_wrt_is_unbiased_for_the_body_loss():
    model = image_net("rescale")
    x = _x((2, 6, 6, 3), seed=2)
    net = body(model, "rescale")
    exact = roll.roll_loss(net, model.get_layer("rescale")(x)).numpy().astype(np.float64)
    copies = 300
    tiled = np.tile(x, (copies, 1, 1, 1))
    draws = roll.roll_loss(model, tiled, wrt="rescale", samples=3, strata="channel",
                           seed=9).numpy().reshape(copies, 2).astype(np.float64)
    se = draws.std(0, ddof=1) / np.sqrt(copies)
    assert np.all(se > 0)
    np.testing.assert_array_less(np.abs(draws.mean(0) - exact), 4 * se + 1e-6)


def test_chain_of_leading_affine_layers_and_nested_models():
    keras.utils.set_random_seed(0)
    pre = keras.Sequential([keras.Input((6,)), keras.layers.Rescaling(1 / 255.0, name="to_unit"),
                            keras.layers.Normalization(mean=0.5, variance=0.09, name="std")],
                           name="pre")
    inp = keras.Input((6,))
    h = pre(inp)
    h = keras.layers.Dense(8, activation="relu", name="d0")(h)
    model = keras.Model(inp, keras.layers.Dense(2, name="out")(h))
    lin = keras_roll.linearize(model)
    assert tangent_entry(lin.program, "pre/to_unit") == 1
    assert tangent_entry(lin.program, "std") == 2  # a unique layer name works too
    x = _x((4, 6)) * 255.0
    u = pre(x).numpy()
    inner = keras.Input((6,))
    net = keras.Model(inner, model.get_layer("out")(model.get_layer("d0")(inner)))
    np.testing.assert_allclose(roll.roll_loss(model, x, wrt="std").numpy(),
                               roll.roll_loss(net, u).numpy(), rtol=1e-5)


# --------------------------------------------------------------------------- refusals


def _residual_from_input():
    inp = keras.Input((4,))
    s = keras.layers.Rescaling(2.0, name="scale")(inp)
    h = keras.layers.Dense(4, activation="relu", name="d")(s)
    return keras.Model(inp, keras.layers.Add(name="skip")([h, inp]))


def _late_norm():
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, activation="relu", name="first")(inp)
    h = keras.layers.Normalization(mean=0.0, variance=1.0, name="late")(h)
    return keras.Model(inp, keras.layers.Dense(2, name="out")(h))


@pytest.mark.parametrize("build,wrt,words", [
    (norm_mlp, "nope", ["wrt='nope'", "no layer of that name", "'d0'", "['norm']"]),
    (norm_mlp, "d0", ["wrt='d0'", "a Dense", "['norm']"]),
    (_late_norm, "late", ["wrt='late'", "does not lead", "this model has none"]),
    (_residual_from_input, "scale", ["wrt='scale'", "does not lead", "only layer that reads"]),
])
def test_bad_wrt_is_refused_with_the_valid_names(build, wrt, words):
    model = build()
    x = _x((2, 6)) if build is norm_mlp else _x((2, 4))
    for call in (lambda: keras_roll.wrap(model, wrt=wrt),
                 lambda: roll.roll_loss(model, x, wrt=wrt),
                 lambda: roll.memory_plan(model, x, wrt=wrt)):
        with pytest.raises(ValueError) as err:
            call()
        for word in words:
            assert word in str(err.value), (word, str(err.value))
    with pytest.raises(ValueError, match="wrt=3"):
        keras_roll.wrap(model, wrt=3)


def test_rescaling_that_does_not_broadcast_elementwise_is_refused():
    inp = keras.Input((6,))
    layer = keras.layers.Rescaling(np.ones((2, 6), "float32"), name="wide")
    h = layer(inp)  # scale [2, 6]: the output would be [2, 6] for every batch
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    with pytest.raises(ValueError, match=r"scale of shape \(2, 6\)"):
        roll.roll_loss(model, _x((2, 6)), wrt="wide")


# --------------------------------------------------------------------------- training


def test_fit_step_with_wrt_equals_the_body_on_normalised_inputs():
    x = _x((16, 6), seed=3)
    y = (x[:, 0] > 0.5).astype("int32")

    def step(use_wrt):
        model = norm_mlp(seed=5)
        if use_wrt:
            net, data = model, x
            target = keras_roll.wrap(model, lam=2.0, C=0.25, wrt="norm")
        else:
            net, data = body(model, "norm"), model.get_layer("norm")(x).numpy()
            target = keras_roll.wrap(net, lam=2.0, C=0.25)
        target.compile(keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy")
        hist = target.fit(data, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
        return [v.numpy() for v in net.trainable_variables], hist

    w1, h1 = step(True)
    w2, h2 = step(False)
    w0 = [v.numpy() for v in norm_mlp(seed=5).trainable_variables]
    assert max(np.max(np.abs(a - b)) for a, b in zip(w1, w0)) > 1e-2  # the step moved them
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert h1["roll_loss"][0] == pytest.approx(h2["roll_loss"][0], rel=1e-5)


def test_wrt_is_stored_in_the_config_and_survives_save_load(tmp_path):
    model = norm_mlp()
    wrapped = keras_roll.wrap(model, lam=1.0, wrt="norm", samples=3, seed=2)
    layer = wrapped.get_layer("roll_regularizer")
    assert layer.wrt == "norm" and layer.roll_config.wrt == "norm"
    assert layer.get_config()["wrt"] == "norm"
    path = os.path.join(tmp_path, "wrapped.keras")
    wrapped.save(path)
    with zipfile.ZipFile(path) as zf:
        saved = json.loads(zf.read("config.json"))
    assert saved["registered_name"] == "keras_roll>RollModel"
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, keras_roll.RollModel)
    assert loaded.get_layer("roll_regularizer").wrt == "norm"
    x = _x((4, 6))
    np.testing.assert_allclose(
        roll.roll_loss(keras_roll.unwrap(loaded), x, wrt="norm", samples=3, seed=1).numpy(),
        roll.roll_loss(model, x, wrt="norm", samples=3, seed=1).numpy(), rtol=1e-6)


@pytest.mark.graph
def test_wrt_under_tf_function_with_a_dynamic_batch():
    model = image_net("normalize")
    x = _x((3, 6, 6, 3))
    lin = keras_roll.linearize(model, memory_budget=20_000)  # several chunks
    assert roll.memory_plan(lin, x, wrt="normalize").chunks > 1
    fn = tf.function(lambda t: roll.roll_loss(lin, t, wrt="normalize"),
                     input_signature=[tf.TensorSpec([None, 6, 6, 3])])
    net = body(model, "normalize")
    want = roll.roll_loss(net, model.get_layer("normalize")(x)).numpy()
    np.testing.assert_allclose(fn(x).numpy(), want, rtol=1e-5, atol=1e-6)
