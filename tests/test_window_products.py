"""The Conv2D rule's products of windows (`keras_roll.compile.rules.window_products`),
used where a "valid" convolution has at most four output positions: the output, the
input and kernel gradients, and the kernel gradient of a function of the input
gradient (second order) equal those of the layer's own `convolution_op` to float64
rounding; and a twin of a small CNN with such layers gives the Keras model's logits
and `tf.GradientTape` input gradients."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.attribution.gradients import LogitGradients
from keras_roll.compile.rules.affine import _conv_linear

L = keras.layers


def _grads(fn, x, kernel, w):
    with tf.GradientTape() as outer:
        outer.watch(kernel)
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = fn(x, [kernel])
            s = tf.reduce_sum(y * w)
        gx, gk = tape.gradient(s, [x, kernel])
        r = tf.reduce_sum(gx**3)
    return y, gx, gk, outer.gradient(r, kernel)


@pytest.mark.parametrize("size, k, stride", [
    ((3, 3), 3, 1),   # 1x1 output (ResNet-18's layer4 at 32x32)
    ((4, 4), 3, 2),   # 1x1 output from a strided window, last row and column unread
    ((4, 4), 3, 1),   # 2x2 output
    ((2, 2), 1, 2),   # a strided 1x1 kernel (a downsampling shortcut)
    ((5, 3), 3, 2),   # 2x1 output
    ((6, 6), 3, 1),   # 4x4 output: the convolution itself (fallback)
])
def test_window_products_equal_the_convolution(size, k, stride):
    layer = L.Conv2D(5, k, strides=stride, dtype="float64")
    layer.build((None, *size, 3))
    rng = np.random.default_rng(k + stride)
    x = tf.constant(rng.normal(size=(2, *size, 3)))
    kernel = tf.constant(layer.kernel.numpy())
    w = tf.constant(rng.normal(size=layer.compute_output_shape((2, *size, 3))))
    linear = _conv_linear(layer)
    graph = tf.function(lambda v: linear(v, [kernel])).get_concrete_function(x).graph
    convolved = "Conv2D" in {op.type for op in graph.get_operations()}
    assert convolved == (size == (6, 6))  # the product where the output is small
    ours = _grads(linear, x, kernel, w)
    ref = _grads(lambda v, ks: layer.convolution_op(v, ks[0]), x, kernel, w)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-11)


def test_window_products_for_unknown_spatial_shapes_fall_back():
    """Traced with the spatial axes unknown, the rule is the convolution."""
    layer = L.Conv2D(4, 3, dtype="float64")
    layer.build((None, 3, 3, 2))
    linear = _conv_linear(layer)
    fn = tf.function(lambda v: linear(v, [layer.kernel]),
                     input_signature=[tf.TensorSpec([None, None, None, 2], tf.float64)])
    x = np.random.default_rng(0).normal(size=(3, 3, 3, 2))
    np.testing.assert_allclose(fn(x).numpy(), layer.convolution_op(x, layer.kernel).numpy(),
                               rtol=1e-12)


def test_twin_of_a_cnn_with_small_outputs_matches_the_model():
    """A CNN whose last convolutions have 2x2 and 1x1 outputs: the twin's logits and
    input gradients equal the Keras model's (`tf.GradientTape`)."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((6, 6, 2))
    h = L.Conv2D(6, 3, activation="relu")(inp)                  # 4x4
    h = L.Conv2D(8, 3, strides=2, activation="relu")(L.ZeroPadding2D(1)(h))  # 3x3 -> 2x2
    h = L.Conv2D(8, 3, strides=1, activation="relu")(L.ZeroPadding2D(1)(h))  # 2x2
    h = L.Conv2D(8, 2, activation="relu")(h)                    # 1x1
    model = keras.Model(inp, L.Dense(3)(L.Flatten()(h)))
    x = np.random.default_rng(1).normal(size=(5, 6, 6, 2)).astype("float32")
    y = np.array([0, 1, 2, 0, 1])
    grad, logits = LogitGradients.of(keras_roll.linearize(model)).gradients(
        x, y, np.ones(5))
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out = model(xt)
        picked = tf.reduce_sum(tf.gather(out, y, axis=1, batch_dims=1))
    np.testing.assert_allclose(logits, out.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, tape.gradient(picked, xt).numpy(), rtol=1e-4,
                               atol=1e-5)
