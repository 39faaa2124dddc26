"""Ties at max pooling follow TensorFlow: on exactly tied windows the twin's
gradients (forward mode, and keras_roll's reverse-mode saliency) equal the
gradients `tf.GradientTape` gives for the Keras model itself.

TensorFlow's `MaxPool` gradient gives a tied window's gradient to its first
maximal element in row-major order (MaxPooling1D/2D); the gradient of
`reduce_max` (GlobalMaxPooling1D/2D) shares it equally among the maxima. The
reference here is the tape, not those rules.
"""

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.testing import tape_jacobian

L = 3  # logits


def _model(pool, shape, seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input(shape)
    h = pool(inp)
    if len(h.shape) > 2:
        h = keras.layers.Flatten()(h)
    return keras.Model(inp, keras.layers.Dense(L)(h))


def _tape_jacobian(model, x) -> np.ndarray:
    """`[B, L, D]` per-example input Jacobians of the logits, by tf.GradientTape."""
    return tape_jacobian(lambda t: model(t, training=False), x)[1].reshape(x.shape[0], L, -1)


def _tied_images():
    """Flat windows (all zero), two equal maxima in one window, a flat plateau."""
    x = np.zeros((3, 6, 6, 1), np.float32)
    x[1, 0, 0, 0] = x[1, 1, 1, 0] = 1.0  # a tie between two corners of a 2x2 window
    x[2, 2:, 2:, 0] = 0.5  # a plateau: ties in every window it covers
    x[2, 4, 5, 0] = 0.75
    return x


POOLS_2D = [
    ("max2x2", lambda: keras.layers.MaxPooling2D(2)),
    ("max3x3_stride1", lambda: keras.layers.MaxPooling2D(3, strides=1)),
    ("max3x3_same", lambda: keras.layers.MaxPooling2D(3, strides=2, padding="same")),
    ("global2d", lambda: keras.layers.GlobalMaxPooling2D()),
]
POOLS_1D = [
    ("max1d", lambda: keras.layers.MaxPooling1D(2)),
    ("max1d_same", lambda: keras.layers.MaxPooling1D(3, strides=2, padding="same")),
    ("global1d", lambda: keras.layers.GlobalMaxPooling1D()),
]


def _sequences():
    x = np.zeros((3, 7, 2), np.float32)
    x[1, :3] = 1.0  # three equal maxima in a row
    x[2, ::2, 0] = 2.0  # ties across windows
    return x


@pytest.mark.parametrize("name, pool", POOLS_2D + POOLS_1D, ids=lambda v: v if
                         isinstance(v, str) else "")
def test_tied_windows_give_the_tape_gradient(name, pool):
    x = _tied_images() if name in dict(POOLS_2D) else _sequences()
    model = _model(pool(), x.shape[1:])
    want = _tape_jacobian(model, x)
    lin = keras_roll.linearize(model)
    for twin in (lin, lin.at_dtype("float64")):  # forward mode, in both dtypes
        got = twin.output_jacobian(x)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    # keras_roll's reverse-mode gradients (saliency, IG, distortion) agree too.
    sal = keras_roll.saliency(model, x, y=np.array([0, 1, 2]))
    rows = want[np.arange(3), [0, 1, 2]].reshape(x.shape)
    np.testing.assert_allclose(sal.gradient, rows, rtol=0, atol=1e-6 * np.abs(rows).max())


def test_tied_windows_are_region_boundaries():
    """A tie is a boundary whatever the rule: its radius is 0, and moving one tied
    element up changes the gradient (checked on the tape)."""
    x = _tied_images()[1:2]
    for pool in (keras.layers.MaxPooling2D(2), keras.layers.GlobalMaxPooling2D()):
        model = _model(pool, x.shape[1:])
        cert = keras_roll.certify(model, x, rigor="float32", verbose=False)
        assert cert.margins[2][0] == 0
        assert cert.zero_cause[2][0] is keras_roll.ZeroCause.MAX_POOL_TIE
        up = x.copy()
        up[0, 1, 1, 0] += 1e-3
        assert np.abs(_tape_jacobian(model, up) - _tape_jacobian(model, x)).max() > 1e-3


def test_cnn_on_flat_background_matches_the_tape():
    """A conv - max pool - conv - global max CNN on images with a flat zero
    background (the ties of clean MNIST): the twin's gradients are the tape's."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((10, 10, 1))
    h = keras.layers.Conv2D(3, 3, padding="same", activation="relu")(inp)
    h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalMaxPooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(L)(h))
    x = np.zeros((4, 10, 10, 1), np.float32)
    rng = np.random.default_rng(0)
    for i in range(4):
        r, c = rng.integers(2, 6, size=2)
        x[i, r:r + 3, c:c + 3, 0] = rng.uniform(0.2, 1.0, size=(3, 3))
    want = _tape_jacobian(model, x)
    got = keras_roll.linearize(model).at_dtype("float64").output_jacobian(x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
