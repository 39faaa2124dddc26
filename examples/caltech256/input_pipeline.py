"""The data of the Caltech-256 example: the paper's split of the tree (a generated
tree for `--quick` without `--data_dir`), one epoch's batches in an order fixed by
`(seed, epoch)`, and decoded images as numpy arrays.

Example:

```python
data = prepare_data(config, out)
ds = train_epoch_dataset(config, data.index, epoch=0, steps=100, skip=0)
```
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from examples.caltech256.configs import quick
from examples.caltech256.configs.default import Cache, Config
from examples.common import app
from keras_roll.data.caltech256 import (
    caltech256_dataset,
    caltech256_splits,
    make_synthetic_caltech256,
)

__all__ = ["monitor_images", "numpy_images", "prepare_data", "train_epoch_dataset"]


def generated_tree(out: Path, worker: str | None = None) -> Path:
    """The generated tree of `--quick` under `out` (per worker but the chief), made on
    first use."""
    parent = out / "quick_data" if worker is None else out / "workers" / worker / "quick_data"
    if not (parent / "256_ObjectCategories").is_dir():
        app.log(f"--quick: generating {quick.CLASSES} classes x {quick.IMAGES_PER_CLASS} "
                f"synthetic JPEGs under {parent}")
        make_synthetic_caltech256(parent, classes=quick.CLASSES,
                                  images_per_class=quick.IMAGES_PER_CLASS, seed=0)
    return parent


def prepare_data(config: Config, out: Path, worker: str | None = None):
    """The paper's split (`keras_roll.data.caltech256_splits`) of `--data_dir`, or of the
    generated tree when it is unset.

    Raises:
        UsageError: a tree the split cannot use (too few images per class, an empty
            split), with the message of the loader.
    """
    data_dir = config.data_dir or generated_tree(out, worker)
    cache = {Cache.auto: "auto", Cache.memory: "memory", Cache.none: False}[config.cache]
    try:
        data = caltech256_splits(
            data_dir, image_size=config.image_size, batch_size=config.batch_size,
            seed=config.seed, val_per_class=config.val_per_class,
            test_per_class=config.test_per_class, max_per_class=config.max_per_class,
            cache=cache, verbose=1)
    except (FileNotFoundError, ValueError) as e:
        raise app.UsageError(str(e)) from e
    for split in ("train", "val", "test"):
        if not data.index.files[split] and not (split == "test" and config.test_per_class == 0):
            raise app.UsageError(f"The {split} split of {data.index.root} is empty; check "
                                 "--val_per_class / --test_per_class / --max_per_class.")
    return data


def train_epoch_dataset(config: Config, index, epoch: int, steps: int, skip: int):
    """The batches of one epoch, in an order fixed by `(seed, epoch)`, the first `skip`
    batches left out (a resumed epoch); every batch is full."""
    files = np.asarray(index.files["train"])
    labels = index.labels["train"]
    order = np.random.default_rng([config.seed, epoch]).permutation(len(files))
    order = order[skip * config.batch_size: steps * config.batch_size]
    return caltech256_dataset(files[order].tolist(), labels[order],
                              image_size=config.image_size, batch_size=config.batch_size,
                              shuffle=False, cache=False)


def numpy_images(config: Config, files, labels):
    """Decoded `[n, H, W, 3]` images in [0, 1] and their labels."""
    ds = caltech256_dataset(list(files), labels, image_size=config.image_size, batch_size=None,
                            cache=False)
    xs, ys = zip(*ds.as_numpy_iterator())
    return np.stack(xs).astype(np.float32), np.asarray(ys, np.int64)


def monitor_images(config: Config, index):
    """`--monitor_images` validation images spread over the classes (the split is in
    class order), or None."""
    if not config.monitor_images:
        return None
    files, labels = index.files["val"], index.labels["val"]
    pick = np.unique(np.linspace(0, len(files) - 1, config.monitor_images).round().astype(int))
    return numpy_images(config, [files[i] for i in pick], labels[pick])[0]
