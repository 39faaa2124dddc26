"""Caltech-256 from its standard folder tree, as a ``tf.data.Dataset``.

Expected layout (the extracted ``256_ObjectCategories.tar``)::

    256_ObjectCategories/
        001.ak47/001_0001.jpg ...
        002.american-flag/...
        ...
        256.toad/...
        257.clutter/...        (skipped: not one of the 256 object classes)

TensorFlow is imported when the loader is called, not when this module is imported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

ROOT_NAME = "256_ObjectCategories"
CLUTTER_ID = 257
IMAGE_EXTENSIONS = (".jpg", ".jpeg")
SPLITS = ("train", "val", "all")
_CLASS_DIR = re.compile(r"^(\d+)\.(.+)$")


def load_caltech256(
    path,
    image_size=224,
    split="train",
    val_fraction=0.2,
    seed=0,
    batch_size=None,
    max_per_class=None,
    shuffle=None,
    crop_to_aspect_ratio=False,
):
    """Reads the Caltech-256 image folders into a ``tf.data.Dataset``.

    Used for the ResNet-18 experiment of Lee, Alvarez-Melis & Jaakkola, ICLR 2019.
    The split is stratified and deterministic: in every class the files are sorted,
    permuted with ``seed``, cut to ``max_per_class`` and the first
    ``round(val_fraction * n_class)`` (at least one when ``val_fraction > 0`` and the
    class has two images or more) go to ``"val"``, the rest to ``"train"``.

    Args:
        path: the ``256_ObjectCategories`` folder or the folder that contains it.
        image_size: output size, an int (square) or ``(height, width)``.
        split: ``"train"``, ``"val"`` (alias ``"test"``) or ``"all"``.
        val_fraction: fraction of every class held out for ``"val"``, in ``[0, 1)``.
        seed: seed of the split and of the shuffling.
        batch_size: if given, the dataset is batched (the last batch may be smaller).
        max_per_class: keep at most this many images per class (before the split);
            handy for quick experiments.
        shuffle: reshuffle the examples every epoch; ``None`` means ``True`` for
            ``"train"`` and ``False`` otherwise (then the order is by class).
        crop_to_aspect_ratio: center-crop every image to the target aspect ratio before
            resizing (no distortion) instead of stretching it.

    Returns:
        A tuple ``(dataset, class_names)``: ``dataset`` yields ``(image, label)`` with
        ``image`` float32 ``[H, W, 3]`` in ``[0, 255]`` (bilinear resize; grayscale
        images are expanded to 3 channels) and ``label`` int64 in ``0..255`` (batched:
        leading batch dimension); ``class_names`` lists the names without the number
        prefix (``"ak47"``, ...), index = label.

    Raises:
        FileNotFoundError: when ``path`` does not exist or holds no class folders.
        ValueError: for bad arguments, an empty class folder or an empty split.

    Example:
        >>> from keras_roll.data import load_caltech256
        >>> ds, names = load_caltech256("~/data/caltech256", split="val", batch_size=32)
        >>> images, labels = next(iter(ds))
        >>> images.shape, len(names)
        (TensorShape([32, 224, 224, 3]), 256)
    """
    split = _check_args(split, val_fraction, batch_size, max_per_class)
    height, width = _image_size(image_size)
    root = _find_root(path)
    class_dirs = _class_dirs(root)
    class_names = [name for _, name, _ in class_dirs]

    rng = np.random.default_rng(seed)
    files, labels = [], []
    for label, (_, _, folder) in enumerate(class_dirs):
        images = sorted(
            f.name for f in folder.iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file()
        )
        if not images:
            raise ValueError(
                f"Class folder {str(folder)!r} holds no .jpg images; the Caltech-256 tree "
                f"under {str(root)!r} looks incomplete."
            )
        images = [images[i] for i in rng.permutation(len(images))]
        if max_per_class is not None:
            images = images[:max_per_class]
        n_val = int(round(val_fraction * len(images)))
        if val_fraction > 0 and len(images) > 1:
            n_val = min(max(n_val, 1), len(images) - 1)
        chosen = {"train": images[n_val:], "val": images[:n_val], "all": images}[split]
        files += [str(folder / name) for name in chosen]
        labels += [label] * len(chosen)
    if not files:
        raise ValueError(
            f"The {split!r} split is empty (val_fraction={val_fraction!r}, "
            f"max_per_class={max_per_class!r})."
        )

    import tensorflow as tf

    if shuffle is None:
        shuffle = split == "train"
    ds = tf.data.Dataset.from_tensor_slices(
        (tf.constant(files), tf.constant(labels, dtype=tf.int64))
    )
    if shuffle:
        ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)

    def load(file, label):
        image = tf.io.decode_image(tf.io.read_file(file), channels=3, expand_animations=False)
        image.set_shape([None, None, 3])
        if crop_to_aspect_ratio:
            image = _center_crop(tf, image, height / width)
        image = tf.image.resize(image, (height, width), method="bilinear")
        image = tf.clip_by_value(image, 0.0, 255.0)
        return image, label

    ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if batch_size is not None:
        ds = ds.batch(batch_size)
    return ds.prefetch(tf.data.AUTOTUNE), class_names


def _check_args(split, val_fraction, batch_size, max_per_class):
    if isinstance(split, str) and split.lower() == "test":
        split = "val"
    if not isinstance(split, str) or split.lower() not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} (or 'test' for 'val'), got {split!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if batch_size is not None and (int(batch_size) != batch_size or batch_size < 1):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    if max_per_class is not None and (int(max_per_class) != max_per_class or max_per_class < 1):
        raise ValueError(f"max_per_class must be a positive integer or None, got {max_per_class!r}")
    return split.lower()


def _image_size(image_size):
    size = (image_size, image_size) if np.ndim(image_size) == 0 else tuple(image_size)
    if len(size) != 2 or any(int(s) != s or s < 1 for s in size):
        raise ValueError(
            f"image_size must be a positive int or a (height, width) pair, got {image_size!r}"
        )
    return int(size[0]), int(size[1])


def _find_root(path):
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_dir():
        raise FileNotFoundError(
            f"Caltech-256 path {str(p)!r} is not a directory: pass the extracted "
            f"{ROOT_NAME!r} folder (from 256_ObjectCategories.tar) or its parent."
        )
    if p.name != ROOT_NAME and (p / ROOT_NAME).is_dir():
        return p / ROOT_NAME
    return p


def _class_dirs(root):
    """Returns [(number, name, folder)] of the object classes, sorted by number."""
    found = []
    for d in root.iterdir():
        m = _CLASS_DIR.match(d.name)
        if m and d.is_dir() and int(m.group(1)) != CLUTTER_ID:
            found.append((int(m.group(1)), m.group(2), d))
    if not found:
        raise FileNotFoundError(
            f"No class folders in {str(root)!r}: expected {ROOT_NAME}/NNN.name/NNN_XXXX.jpg "
            "(for example 001.ak47/001_0001.jpg)."
        )
    found.sort(key=lambda t: (t[0], t[1]))
    numbers = [t[0] for t in found]
    if len(set(numbers)) != len(numbers):
        dup = sorted({n for n in numbers if numbers.count(n) > 1})
        raise ValueError(f"Class numbers {dup} appear in more than one folder under {str(root)!r}")
    return found


def _center_crop(tf, image, aspect):
    """Crops ``image`` [h, w, 3] around its centre to height / width == aspect."""
    shape = tf.shape(image)
    h = tf.cast(shape[0], tf.float32)
    w = tf.cast(shape[1], tf.float32)
    crop_h = tf.cast(tf.minimum(h, w * aspect), tf.int32)
    crop_w = tf.cast(tf.minimum(w, h / aspect), tf.int32)
    crop_h = tf.maximum(crop_h, 1)
    crop_w = tf.maximum(crop_w, 1)
    top = (shape[0] - crop_h) // 2
    left = (shape[1] - crop_w) // 2
    return image[top : top + crop_h, left : left + crop_w]
