"""The models the benchmarks share, randomly initialised with a fixed seed."""

from __future__ import annotations

import keras


def mlp(dtype: str = "float32") -> keras.Model:
    """The paper's 784-300x4-10 ReLU network, randomly initialised (seed 0)."""
    keras.utils.set_random_seed(0)
    bias = keras.initializers.RandomNormal(stddev=0.05)
    inp = keras.Input((784,), dtype=dtype)
    h = inp
    for i in range(4):
        h = keras.layers.Dense(300, activation="relu", bias_initializer=bias, name=f"fc{i}",
                               dtype=dtype)(h)
    return keras.Model(inp, keras.layers.Dense(10, name="logits", dtype=dtype)(h),
                       name="mlp_784_300x4_10")


def small_cnn(dtype: str = "float32") -> keras.Model:
    """28x28x1 -> conv 16 -> conv 32 / 2 -> dense 100 -> 10, randomly initialised."""
    keras.utils.set_random_seed(0)
    bias = keras.initializers.RandomNormal(stddev=0.05)
    inp = keras.Input((28, 28, 1), dtype=dtype)
    h = keras.layers.Conv2D(16, 3, activation="relu", bias_initializer=bias, dtype=dtype)(inp)
    h = keras.layers.Conv2D(32, 3, strides=2, activation="relu", bias_initializer=bias,
                            dtype=dtype)(h)
    h = keras.layers.Flatten(dtype=dtype)(h)
    h = keras.layers.Dense(100, activation="relu", bias_initializer=bias, dtype=dtype)(h)
    return keras.Model(inp, keras.layers.Dense(10, dtype=dtype)(h), name="small_cnn")
