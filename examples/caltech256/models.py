"""The networks of the Caltech-256 example: the paper's ResNet-18
(`keras_roll.models.resnet18`) and, for tests of the pipeline, a two-convolution
network with the same interface (input normalisation named `normalize`, the stem
pooling, logits from `fc`).

Example:

```python
model = build_model(config, classes=256)
note = load_weights(model, "resnet18.npz")   # torchvision weights, or .weights.h5
```
"""

from __future__ import annotations

import os
from pathlib import Path

import keras

import keras_roll
from examples.caltech256.configs.default import Architecture, Config, Normalize, StemPool
from examples.common.app import UsageError
from keras_roll.models import input_normalization
from keras_roll.models.resnet import IMAGENET_MEAN, IMAGENET_STD, PAPER_STD

__all__ = ["build_model", "load_weights", "tiny"]


def build_model(config: Config, classes: int, dtype=None) -> keras.Model:
    """The configured network giving logits (the softmax is in the loss)."""
    shape = (config.image_size, config.image_size, 3)
    if config.model == Architecture.tiny:
        return tiny(shape, classes, config.normalize, config.stem_pool, dtype)
    return keras_roll.models.resnet18(
        shape, classes=classes, stem_pool=config.stem_pool.value,
        normalize=config.normalize.value, classifier_activation=None, dtype=dtype)


def tiny(input_shape, classes: int, normalize: Normalize, stem_pool: StemPool,
         dtype=None) -> keras.Model:
    """normalize -> conv(8, stride 2) -> BN -> ReLU -> pool -> conv(16) -> BN -> ReLU ->
    global average -> fc: ResNet-18's interface in a network that traces in seconds."""
    inp = keras.Input(input_shape, name="pixels")
    std = IMAGENET_STD if normalize == Normalize.imagenet else PAPER_STD
    h = input_normalization(IMAGENET_MEAN, std, dtype=dtype)(inp)
    h = keras.layers.Conv2D(8, 3, strides=2, use_bias=False, dtype=dtype, name="conv1")(h)
    h = keras.layers.BatchNormalization(dtype=dtype, name="bn1")(h)
    h = keras.layers.ReLU(dtype=dtype, name="relu1")(h)
    pool = (keras.layers.AveragePooling2D if stem_pool == StemPool.avg
            else keras.layers.MaxPooling2D)
    h = pool(2, dtype=dtype, name="pool")(h)
    h = keras.layers.Conv2D(16, 3, use_bias=False, dtype=dtype, name="conv2")(h)
    h = keras.layers.BatchNormalization(dtype=dtype, name="bn2")(h)
    h = keras.layers.ReLU(dtype=dtype, name="relu2")(h)
    h = keras.layers.GlobalAveragePooling2D(dtype=dtype, name="avgpool")(h)
    mixed = keras.mixed_precision.global_policy().compute_dtype != "float32"
    out = keras.layers.Dense(classes, dtype="float32" if mixed else dtype, name="fc")(h)
    return keras.Model(inp, out, name="tiny")


def load_weights(model: keras.Model, path) -> str:
    """Loads a torchvision `.npz` or a Keras `.weights.h5` file into the plain model;
    returns what was loaded, in words."""
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_file():
        raise UsageError(f"--weights={path}: no such file.")
    if p.name.endswith(".npz"):
        res = keras_roll.models.load_torchvision_resnet18(model, p)
        return f"torchvision weights {p} ({len(res.loaded)} tensors; skipped {res.skipped})"
    if p.name.endswith(".weights.h5"):
        model.load_weights(p)
        return f"Keras weights {p}"
    raise UsageError(f"--weights={path}: expected a torchvision state dict saved as .npz or "
                     "a Keras .weights.h5 file.")
