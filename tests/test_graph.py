"""The graph pass and the rule registry: what is accepted, what is refused and how."""

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll import UnsupportedModelError
from tests import model_zoo as zoo


def _model(*layers, shape=(4,)):
    inp = keras.Input(shape)
    h = inp
    for layer in layers:
        h = layer(h)
    return keras.Model(inp, h)


@pytest.mark.parametrize("act", ["sigmoid", "tanh", "gelu"])
def test_hidden_smooth_activation_is_refused_with_the_layer_named(act):
    model = _model(keras.layers.Dense(3, activation=act, name="hidden"), keras.layers.Dense(2))
    with pytest.raises(UnsupportedModelError, match=rf"'hidden'.*Dense.*'{act}'.*ReLU"):
        keras_roll.linearize(model)


def test_lambda_layer_is_refused_with_a_pointer_to_register_rule():
    model = _model(keras.layers.Lambda(lambda t: t * 2.0, name="double"), keras.layers.Dense(2))
    with pytest.raises(UnsupportedModelError, match=r"'double'.*Lambda.*register_rule"):
        keras_roll.linearize(model)


def test_subclassed_model_is_refused():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(2)

        def call(self, x):
            return self.d(x)

    net = Net()
    net(np.zeros((1, 3)))
    with pytest.raises(UnsupportedModelError, match="subclassed.*functional API"):
        keras_roll.linearize(net)


def test_unbuilt_sequential_gets_a_clear_error():
    model = keras.Sequential([keras.layers.Dense(3), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not been built"):
        keras_roll.linearize(model)


def test_sequential_with_input_is_supported():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    lin = keras_roll.linearize(model)
    assert lin.output_link == "softmax"
    assert len(lin.neuron_names) == 4


def test_softmax_inside_the_network_is_refused():
    model = _model(keras.layers.Dense(3), keras.layers.Softmax(name="sm"), keras.layers.Dense(2))
    with pytest.raises(UnsupportedModelError, match="'sm'.*'softmax'.*only as the final output"):
        keras_roll.linearize(model)


def test_final_sigmoid_is_folded():
    model = _model(keras.layers.Dense(3, activation="relu"), keras.layers.Dense(1),
                   keras.layers.Activation("sigmoid"))
    lin = keras_roll.linearize(model)
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    logits = keras.Model(model.inputs[0], model.layers[-2].output)(x).numpy()
    np.testing.assert_allclose(lin(x).numpy(), logits, rtol=1e-6)
    assert lin.output_link == "sigmoid"


def test_stateful_and_return_state_rnn_are_refused():
    inp = keras.Input((3, 2), batch_size=2)
    out = keras.layers.SimpleRNN(3, stateful=True, activation="relu")(inp)
    with pytest.raises(UnsupportedModelError, match="stateful=True"):
        keras_roll.linearize(keras.Model(inp, out))
    inp = keras.Input((3, 2))
    out = keras.layers.SimpleRNN(3, activation="tanh")(inp)
    with pytest.raises(UnsupportedModelError, match="activation='relu'"):
        keras_roll.linearize(keras.Model(inp, out))


def test_multi_input_models_are_refused():
    a, b = keras.Input((2,)), keras.Input((2,))
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([a, b]))
    with pytest.raises(UnsupportedModelError, match="2 inputs.*single input"):
        keras_roll.linearize(keras.Model([a, b], out))


def test_subclass_of_a_supported_layer_needs_its_own_rule():
    class MyDense(keras.layers.Dense):
        pass

    model = _model(MyDense(3, name="mine"), keras.layers.Dense(2))
    with pytest.raises(UnsupportedModelError, match="'mine'.*subclasses Dense.*own rule"):
        keras_roll.linearize(model)


def test_register_rule_for_a_custom_affine_layer():
    class Scale(keras.layers.Layer):
        def call(self, x):
            return 3.0 * x + 1.0

    try:
        keras_roll.register_rule(Scale, lambda layer: keras_roll.compile.rules.Linear(
            layer, lambda xs: 3.0 * xs[0]))
        with pytest.raises(ValueError, match="already registered"):
            keras_roll.register_rule(Scale, lambda layer: None)
        model = _model(keras.layers.Dense(3, name="d"), Scale(), keras.layers.ReLU(name="r"),
                       keras.layers.Dense(2))
        lin = keras_roll.linearize(model)
        x = np.random.default_rng(0).normal(size=(2, 4)).astype("float32")
        jac = lin.jacobian(x)
        kernel = model.get_layer("d").kernel.numpy()
        np.testing.assert_allclose(jac, np.broadcast_to(3.0 * kernel.T, (2, 3, 4)), rtol=1e-6)
        np.testing.assert_allclose(lin(x).numpy(), model(x).numpy(), rtol=1e-6)
    finally:
        keras_roll.compile.rules.unregister_rule(Scale)


def test_shared_layer_gets_one_step_per_call():
    shared = keras.layers.Dense(4, activation="relu", name="shared")
    inp = keras.Input((4,))
    h = shared(shared(inp))
    model = keras.Model(inp, keras.layers.Dense(2)(h))
    lin = keras_roll.linearize(model)
    names = [n for n, _ in lin.neuron_names]
    assert names == ["shared"] * 4 + ["shared@1"] * 4
    x = np.random.default_rng(1).normal(size=(3, 4)).astype("float32")
    np.testing.assert_allclose(lin(x).numpy(), model(x).numpy(), rtol=1e-6)


def test_keras_operations_for_residual_adds():
    inp = keras.Input((3,))
    a = keras.layers.Dense(3, activation="relu")(inp)
    out = keras.layers.Dense(2)(a + inp)
    model = keras.Model(inp, out)
    lin = keras_roll.linearize(model)
    x = np.random.default_rng(2).normal(size=(3, 3)).astype("float32")
    np.testing.assert_allclose(lin(x).numpy(), model(x).numpy(), rtol=1e-6)


def test_bad_inputs_get_clear_errors():
    lin = keras_roll.linearize(zoo.mlp())
    with pytest.raises(ValueError, match=r"expects inputs of shape \(batch, 6\).*\(3, 5\)"):
        lin.jacobian(np.zeros((3, 5)))
    with pytest.raises(ValueError, match="non-finite"):
        lin.jacobian(np.full((2, 6), np.nan))
    with pytest.raises(TypeError, match="numeric"):
        lin.forward(np.array([["a"] * 6]))
    with pytest.raises(ValueError, match="Directions"):
        lin.jvp(np.zeros((2, 6)), np.zeros((2, 3, 5)))
    assert lin.jacobian(np.zeros((0, 6))).shape[0] == 0
    with pytest.raises(ValueError, match="memory_budget"):
        keras_roll.linearize(zoo.mlp(), memory_budget=0)


def test_summary_lists_every_step():
    lines = []
    keras_roll.linearize(zoo.cnn()).summary(print_fn=lines.append)
    text = "\n".join(lines)
    for name in ("conv0", "bn0", "maxpool", "MaxWindows", "dense"):
        assert name in text
