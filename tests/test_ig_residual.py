"""Exact integrated gradients on a small residual CNN (stride-1 "same" and "valid"
convolutions, whose input gradients the Conv2D rule computes as convolutions with the
flipped kernel, a strided convolution, batch normalization and an `Add`), against a
midpoint Riemann sum of 20,000 `tf.GradientTape` gradients of the Keras model itself;
and the rule's convolution gradients (first and second order) against TensorFlow's."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile.rules.affine import _conv_linear

L = keras.layers


def _net():
    keras.utils.set_random_seed(11)
    inp = keras.Input((6, 6, 2), dtype="float64")
    h = L.Conv2D(3, 3, padding="same", activation="relu", dtype="float64")(inp)
    r = L.BatchNormalization(dtype="float64")(L.Conv2D(3, 3, padding="same",
                                                       dtype="float64")(h))
    h = L.ReLU(dtype="float64")(L.Add(dtype="float64")([r, h]))
    h = L.Conv2D(4, 2, strides=2, activation="relu", dtype="float64")(h)
    h = L.Conv2D(4, 2, activation="relu", dtype="float64")(h)
    return keras.Model(inp, L.Dense(3, dtype="float64")(L.Flatten()(h)))


@pytest.mark.slow
def test_exact_ig_matches_a_fine_riemann_sum():
    """The walk's attributions equal a midpoint sum of 20,000 tape gradients along the
    same path to 1e-4 of their scale, and the path crosses several regions."""
    model = _net()
    rng = np.random.default_rng(3)
    x, base = rng.uniform(-1, 1, (1, 6, 6, 2)), rng.uniform(-1, 1, (6, 6, 2))
    y = np.array([1])
    ig = keras_roll.integrated_gradients(model, x, y, baseline=base, verbose=False)
    steps = 20000
    t = (np.arange(steps) + 0.5) / steps
    grads = []
    for chunk in np.array_split(t, 10):
        pts = tf.constant(base + chunk[:, None, None, None] * (x - base))
        with tf.GradientTape() as tape:
            tape.watch(pts)
            out = model(pts)[:, 1]
        grads.append(tape.gradient(out, pts).numpy().sum(0))
    riemann = (x[0] - base) * np.sum(grads, 0) / steps
    got = np.asarray(ig.maps)[0]
    assert int(np.asarray(ig.regions)[0]) > 3
    np.testing.assert_allclose(got, riemann, atol=1e-4 * np.abs(riemann).max())


@pytest.mark.parametrize("padding, k", [("same", 3), ("valid", 3), ("same", 4), ("valid", 1)])
def test_conv_gradients_equal_tensorflows(padding, k):
    """The input and kernel gradients, and the kernel gradient of a function of the input
    gradient (second order), equal those of `convolution_op` to float64 rounding."""
    layer = L.Conv2D(5, k, padding=padding, dtype="float64")
    layer.build((None, 7, 6, 3))
    rng = np.random.default_rng(k)
    x = tf.constant(rng.normal(size=(2, 7, 6, 3)))
    kernel = tf.constant(layer.kernel.numpy())
    w = tf.constant(rng.normal(size=layer.compute_output_shape((2, 7, 6, 3))))

    def grads(fn):
        with tf.GradientTape() as outer:
            outer.watch(kernel)
            with tf.GradientTape() as tape:
                tape.watch([x, kernel])
                s = tf.reduce_sum(fn(x, [kernel]) * w)
            gx, gk = tape.gradient(s, [x, kernel])
            r = tf.reduce_sum(gx**3)
        return gx, gk, outer.gradient(r, kernel)

    ours = grads(_conv_linear(layer))
    ref = grads(lambda v, ks: layer.convolution_op(v, ks[0]))
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10, atol=1e-11)
