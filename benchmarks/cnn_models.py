"""The MNIST CNNs of the CNN benchmarks, randomly initialised with a fixed seed.

* `cnn_s`: conv 16 4x4 s2, conv 32 4x4 s2, dense 100, dense 10 (4.8k hidden neurons);
* `cnn_l`: the "large" model of the CROWN-IBP paper (Zhang et al., ICLR 2020): conv 32
  3x3, conv 32 4x4 s2, conv 64 3x3, conv 64 4x4 s2, dense 512, dense 512, dense 10
  (about 48k hidden neurons, 2M weights).

Both take 28x28x1 inputs in 0..255 through a leading `Rescaling(1/255, name="rescale")`
(as the examples feed MNIST; `wrt="rescale"` reads radii in [0, 1] pixels) and use
ReLU. `width` multiplies every hidden layer's channels and units (the memory sweep of
`benchmarks/cnn.py`).

Example:

```python
from benchmarks.cnn_models import cnn_l
model = cnn_l()
keras_roll.robust_radius(model, x[:1], y[:1], norms=(np.inf,))
```
"""

from __future__ import annotations

import keras

__all__ = ["CNNS", "cnn_l", "cnn_s"]

L = keras.layers


def _cnn(name: str, convs, dense, seed: int, width: float = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((28, 28, 1))
    h = L.Rescaling(1.0 / 255, name="rescale")(inp)
    for filters, size, stride in convs:
        h = L.Conv2D(max(1, round(width * filters)), size, strides=stride,
                     activation="relu")(h)
    h = L.Flatten()(h)
    for units in dense:
        h = L.Dense(max(1, round(width * units)), activation="relu")(h)
    suffix = "" if width == 1 else f"_x{width:g}"
    return keras.Model(inp, L.Dense(10)(h), name=name + suffix)


def cnn_s(seed: int = 0, width: float = 1) -> keras.Model:
    """CNN-S: conv 16 4x4 s2, conv 32 4x4 s2, dense 100, dense 10 (randomly initialised;
    `width` multiplies the hidden channels and units)."""
    return _cnn("cnn_s", [(16, 4, 2), (32, 4, 2)], [100], seed, width)


def cnn_l(seed: int = 0, width: float = 1) -> keras.Model:
    """CNN-L: conv 32 3x3, conv 32 4x4 s2, conv 64 3x3, conv 64 4x4 s2, dense 512,
    dense 512, dense 10 (randomly initialised; `width` as in `cnn_s`)."""
    return _cnn("cnn_l", [(32, 3, 1), (32, 4, 2), (64, 3, 1), (64, 4, 2)], [512, 512], seed,
                width)


CNNS = {"cnn_s": cnn_s, "cnn_l": cnn_l}
