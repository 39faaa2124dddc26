"""A small generated Caltech-256 tree (the real layout and class names, images a small
network can tell apart) for tests and ``--quick`` runs."""

from __future__ import annotations

import numbers
import os
from pathlib import Path

import numpy as np

from keras_roll.data.caltech256.tree import CLUTTER_ID, ROOT_NAME

_SYNTHETIC_NAMES = (
    "ak47", "american-flag", "backpack", "baseball-bat", "baseball-glove",
    "basketball-hoop", "bat", "bathtub", "bear", "beer-mug",
)


def make_synthetic_caltech256(
    directory,
    classes=4,
    images_per_class=24,
    min_size=32,
    max_size=64,
    seed=0,
    clutter=True,
):
    """Writes a small Caltech-256-like tree of generated JPEGs (for tests, ``--quick``).

    ``directory/256_ObjectCategories/NNN.name/NNN_XXXX.jpg`` with the first real
    class names (``001.ak47``, ``002.american-flag``, ...). Every class has its own
    colour and stripe orientation plus noise, so a small network can learn it; the
    sizes vary in ``[min_size, max_size]`` and every seventh image is grayscale
    (Caltech-256 has grayscale images too). With ``clutter`` a ``257.clutter``
    folder of two images is added (the loaders leave it out).

    Args:
        directory: where to create ``256_ObjectCategories`` (created if missing).
        classes: number of classes, ``>= 1``.
        images_per_class: images per class, ``>= 1`` (the paper's split needs 21).
        min_size, max_size: range of the image heights and widths in pixels.
        seed: seed of the images.
        clutter: also write ``257.clutter``.

    Returns:
        The ``Path`` of the ``256_ObjectCategories`` folder.

    Raises:
        ValueError: for bad sizes or counts.
        FileExistsError: when ``directory/256_ObjectCategories`` already exists.

    Example:

    ```python
    root = make_synthetic_caltech256("/tmp/caltech_quick", classes=4, images_per_class=30)
    data = caltech256_splits(root, image_size=64, val_per_class=2, test_per_class=4)
    ```
    """
    import tensorflow as tf

    for arg, value in (("classes", classes), ("images_per_class", images_per_class),
                       ("min_size", min_size), ("max_size", max_size)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{arg} must be a positive integer, got {value!r}.")
    if classes > 256:
        raise ValueError(f"classes must be at most 256, got {classes}.")
    if max_size < min_size or min_size < 8:
        raise ValueError(
            f"Need 8 <= min_size <= max_size, got min_size={min_size}, max_size={max_size}."
        )
    root = Path(os.path.expanduser(os.fspath(directory))) / ROOT_NAME
    if root.exists():
        raise FileExistsError(f"{str(root)!r} already exists; pass an empty directory.")
    rng = np.random.default_rng(seed)
    folders = [
        (c + 1, _SYNTHETIC_NAMES[c] if c < len(_SYNTHETIC_NAMES) else f"class-{c + 1:03d}",
         images_per_class)
        for c in range(classes)
    ]
    if clutter:
        folders.append((CLUTTER_ID, "clutter", 2))
    for number, name, count in folders:
        folder = root / f"{number:03d}.{name}"
        folder.mkdir(parents=True)
        colour = rng.uniform(40, 215, size=3)
        angle = np.pi * (number % 8) / 8
        for i in range(count):
            h, w = (int(v) for v in rng.integers(min_size, max_size + 1, size=2))
            yy, xx = np.mgrid[0:h, 0:w]
            stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 2 * np.pi / 8)
            image = colour + 40 * stripes[..., None] + rng.normal(0, 20, size=(h, w, 3))
            image = np.clip(image, 0, 255).astype(np.uint8)
            if i % 7 == 6:
                image = image.mean(axis=-1, keepdims=True).astype(np.uint8)
            data = tf.io.encode_jpeg(tf.constant(image), quality=90).numpy()
            (folder / f"{number:03d}_{i + 1:04d}.jpg").write_bytes(data)
    return root
