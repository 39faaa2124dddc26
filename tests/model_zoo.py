"""Small models covering every supported layer family, for the tests.

Each builder returns a built Keras model with deterministic weights. Activations
are separate layers where the tests need Keras-visible pre-activations
(`preactivation_tensors`); `fused=True` variants put them into `activation=`.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np


@contextlib.contextmanager
def float64_layers():
    """Layers built inside take float64 weights and compute in float64.

    `keras.backend.set_floatx` alone is not enough: Keras caches its global dtype
    policy from `floatx` at the first layer built in the process, so it sets the
    policy too, and restores both on exit.
    """
    floatx, policy = keras.config.floatx(), keras.config.dtype_policy()
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        yield
    finally:
        keras.config.set_floatx(floatx)
        keras.config.set_dtype_policy(policy)


def _seed(seed):
    keras.utils.set_random_seed(seed)


def mlp(fused=False, dtype="float32", seed=0, in_dim=6, widths=(8, 7), out=3):
    _seed(seed)
    inp = keras.Input((in_dim,), dtype=dtype)
    h = inp
    for i, w in enumerate(widths):
        if fused:
            h = keras.layers.Dense(w, activation="relu", dtype=dtype, name=f"dense{i}")(h)
        else:
            h = keras.layers.Dense(w, dtype=dtype, name=f"dense{i}")(h)
            h = keras.layers.ReLU(dtype=dtype, name=f"relu{i}")(h)
    out_t = keras.layers.Dense(out, activation="softmax", dtype=dtype, name="logits")(h)
    return keras.Model(inp, out_t, name=f"mlp_{'fused' if fused else 'split'}")


def cnn(seed=0):
    """Conv + BatchNorm + average and max pooling + dense head."""
    _seed(seed)
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Rescaling(1 / 4.0, offset=-0.5)(inp)
    h = keras.layers.Conv2D(4, 3, padding="same", name="conv0")(h)
    h = keras.layers.BatchNormalization(name="bn0")(h)
    h = keras.layers.ReLU(name="relu0")(h)
    h = keras.layers.MaxPooling2D(2, name="maxpool")(h)
    h = keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(h)
    h = keras.layers.LeakyReLU(0.1, name="leaky")(h)
    h = keras.layers.AveragePooling2D(2, name="avgpool")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dropout(0.3)(h)
    h = keras.layers.Dense(5, name="dense")(h)
    h = keras.layers.ReLU(name="relu1")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    model = keras.Model(inp, out, name="cnn")
    randomize_batch_norm(model)
    return model


def residual(seed=0):
    """A residual block with a projection shortcut, ReLU6 and PReLU."""
    _seed(seed)
    inp = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", name="conv_a")(inp)
    h = keras.layers.ReLU(max_value=6.0, name="relu6")(h)
    h = keras.layers.Conv2D(4, 3, padding="same", name="conv_b")(h)
    s = keras.layers.Conv2D(4, 1, name="shortcut")(inp)
    h = keras.layers.Add(name="add")([h, s])
    h = keras.layers.PReLU(alpha_initializer=keras.initializers.Constant(0.25),
                           name="prelu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    out = keras.layers.Dense(3, name="logits")(h)
    return keras.Model(inp, out, name="residual")


def rnn(activation="relu", return_sequences=False, seed=0, steps=5, channels=3):
    """Masking + SimpleRNN (variable length through zero padding)."""
    _seed(seed)
    inp = keras.Input((steps, channels))
    h = keras.layers.Masking(0.0)(inp)
    act = "relu" if activation == "relu" else keras.activations.leaky_relu
    h = keras.layers.SimpleRNN(6, activation=act, return_sequences=return_sequences,
                               name="rnn")(h)
    if return_sequences:
        h = keras.layers.GlobalAveragePooling1D()(h)
    out = keras.layers.Dense(2, name="logits")(h)
    return keras.Model(inp, out, name=f"rnn_{activation}")


def nested(seed=0):
    """A functional model inside a Sequential inside a functional model."""
    _seed(seed)
    block_in = keras.Input((5,))
    b = keras.layers.Dense(6, name="inner_dense")(block_in)
    b = keras.layers.ReLU(name="inner_relu")(b)
    block = keras.Model(block_in, b, name="block")
    seq = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, name="seq_dense"),
                            keras.layers.ReLU(name="seq_relu")], name="seq")
    inp = keras.Input((5,))
    h = block(inp)
    h = seq(h)
    out = keras.layers.Dense(2, name="logits")(h)
    return keras.Model(inp, out, name="nested")


def randomize_batch_norm(model, seed=0):
    """Non-trivial BatchNormalization statistics and affine weights (returns `model`)."""
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.moving_mean.shape[0]
            layer.moving_mean.assign(rng.normal(0, 0.3, n))
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, n))
            layer.gamma.assign(rng.uniform(0.5, 1.5, n))
            layer.beta.assign(rng.normal(0, 0.2, n))
    return model


def padded_sequences(batch=4, steps=5, channels=3, seed=0):
    """Random sequences of lengths 2..steps, zero-padded at the end."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, steps, channels)).astype("float32")
    lengths = rng.integers(2, steps + 1, size=batch)
    lengths[0] = steps
    for i, n in enumerate(lengths):
        x[i, n:] = 0.0
    return x, lengths


def kitchen_sink(seed=0):
    """Every remaining supported layer once: 1-D and 3-D convs, separable convs,
    Normalization, paddings, croppings, permutes, merges, dropouts, max pooling 1-D
    and global max pooling."""
    _seed(seed)
    inp = keras.Input((12, 4))
    norm = keras.layers.Normalization(mean=[0.1, -0.2, 0.3, 0.0],
                                      variance=[1.5, 0.5, 2.0, 1.0], name="norm")
    h = norm(inp)
    h = keras.layers.GaussianNoise(0.5)(h)
    a = keras.layers.Conv1D(5, 3, padding="causal", name="conv1d")(h)
    a = keras.layers.ReLU(negative_slope=0.05, threshold=0.1, name="relu_thr")(a)
    b = keras.layers.SeparableConv1D(5, 3, padding="same", name="sep1d")(h)
    b = keras.layers.LeakyReLU(0.3, name="leaky1d")(b)
    h = keras.layers.Subtract()([a, b])
    h = keras.layers.ZeroPadding1D(1)(h)
    h = keras.layers.Cropping1D((0, 2))(h)
    h = keras.layers.SpatialDropout1D(0.2)(h)
    p = keras.layers.MaxPooling1D(2, name="maxpool1d")(h)
    q = keras.layers.AveragePooling1D(2)(h)
    h = keras.layers.Average()([p, q])
    h = keras.layers.Permute((2, 1))(h)
    h = keras.layers.Reshape((5, 6, 1))(h)
    h = keras.layers.SeparableConv2D(3, 2, name="sep2d")(h)
    h = keras.layers.ReLU(name="relu_sep2d")(h)
    h = keras.layers.ZeroPadding2D(1)(h)
    h = keras.layers.Cropping2D(((1, 0), (0, 1)))(h)
    g = keras.layers.GlobalMaxPooling2D(name="gmax")(h)
    h3 = keras.layers.Reshape((5, 6, 1, 3))(h)
    h3 = keras.layers.Conv3D(2, (2, 2, 1), name="conv3d")(h3)
    h3 = keras.layers.ReLU(name="relu3d")(h3)
    h3 = keras.layers.Flatten()(h3)
    h = keras.layers.Concatenate()([g, h3])
    h = keras.layers.Dense(4, name="dense")(h)
    h = keras.layers.ReLU(name="relu_dense")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    return keras.Model(inp, out, name="kitchen_sink")


def roll_mlp(seed=0):
    """5-8-6-3 MLP (ReLU, LeakyReLU, softmax) of the distributed ROLL helpers
    (`tests/_roll_distribute.py`, `tests/_roll_multiworker.py`)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((5,))
    h = keras.layers.Dense(8, name="d0")(inp)
    h = keras.layers.ReLU(name="r0")(h)
    h = keras.layers.Dense(6, name="d1")(h)
    h = keras.layers.LeakyReLU(0.1, name="r1")(h)
    out = keras.layers.Dense(3, activation="softmax", name="logits")(h)
    return keras.Model(inp, out)


def roll_batch(n):
    """`(x, y)`: `n` standard normal inputs for `roll_mlp` and labels in 0..2 (seed 0)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.integers(0, 3, size=n).astype("int32")
    return x, y
