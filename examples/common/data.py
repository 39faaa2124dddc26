"""The data of the image examples (MNIST, the comparison, the robustness radii): the
paper's split of any IDX / mnist.npz data set of square images, with its name, its
number of classes, the model's input normalisation and a fingerprint of the arrays.

Example:

```python
data = load_split(config)                        # config.data_dir, .dataset, .seed, ...
data.name, data.classes, data.normalize          # 'MNIST', 10, None
(x, y), (xv, yv), (xt, yt) = data.train, data.val, data.test
```
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from examples.common.app import UsageError
from examples.common.runs import data_fingerprint
from keras_roll.data import mnist_splits

__all__ = ["Data", "dataset_name", "load_split"]


class Data(NamedTuple):
    """The split data (each an `(x [n, D] in [0, 1], y [n])` pair) and what the model
    and the tables need to know about it."""

    train: tuple
    val: tuple
    test: tuple
    name: str
    classes: int
    normalize: tuple | None  # (mean, std) of the model's Normalization layer, or None
    fingerprint: str = ""  # of the split arrays (runs.data_fingerprint)


def dataset_name(config) -> str:
    """`config.dataset`, else the name of the `config.data_dir` folder or file, else
    MNIST."""
    if config.dataset:
        return config.dataset
    if config.data_dir:
        path = Path(os.path.expanduser(config.data_dir)).resolve()
        return path.stem if path.is_file() else path.name
    return "MNIST"


def load_split(config, normalize: tuple | str | None = None) -> Data:
    """The paper's split (`keras_roll.data.mnist_splits` of `config.data_dir`, seeded
    by `config.seed`, `config.val_size` validation images), cut to `config.train_size`
    / `config.test_size` (0: all).

    Args:
        config: an example's config (fields `data_dir`, `dataset`, `seed`, `val_size`,
            `train_size`, `test_size`).
        normalize: the model's normalisation `(mean, std)`, None, or "train": the
            mean and standard deviation of the training pixels.

    Raises:
        UsageError: no data set where `--data_dir` points (the message says where to
            get MNIST), or too few images for `--val_size`.
    """
    try:
        (xtr, ytr), (xv, yv), (xte, yte) = mnist_splits(config.data_dir, seed=config.seed,
                                                        val=config.val_size)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from e
    if config.train_size:
        xtr, ytr = xtr[:config.train_size], ytr[:config.train_size]
    if config.test_size:
        xte, yte = xte[:config.test_size], yte[:config.test_size]
    if normalize == "train":
        normalize = (float(np.mean(xtr)), float(np.std(xtr)))
    classes = int(max(ytr.max(), yv.max(), yte.max())) + 1
    return Data((xtr, ytr), (xv, yv), (xte, yte), dataset_name(config), classes, normalize,
                data_fingerprint(xtr, ytr, xv, yv, xte, yte))
