"""The ``tf.data`` pipelines of a Caltech-256 tree: parallel decode and resize,
caching, batching, prefetch; the paper's three splits at once (`caltech256_splits`)
or one split (`load_caltech256`). TensorFlow is imported when a function that needs
it is called, not when this module is imported.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

from keras_roll.data.caltech256.tree import (
    PAPER_IMAGE_SIZE,
    PAPER_TEST_PER_CLASS,
    PAPER_VAL_PER_CLASS,
    SPLITS,
    Caltech256Index,
    index_caltech256,
)


class Caltech256Splits(NamedTuple):
    """The paper's train / val / test pipelines (see `caltech256_splits`)."""

    train: object
    val: object
    test: object
    class_names: list
    index: Caltech256Index

def caltech256_dataset(
    files,
    labels,
    image_size=PAPER_IMAGE_SIZE,
    batch_size=None,
    shuffle=False,
    seed=0,
    normalize=True,
    cache="auto",
    crop_to_aspect_ratio=False,
    shuffle_buffer=4096,
):
    """The ``tf.data`` pipeline: parallel decode and resize, caching, batching, prefetch.

    Stages: file names (pre-permuted with ``seed`` when ``shuffle``) -> parallel
    read, decode (grayscale expanded to RGB) and bilinear, antialiased resize to
    ``image_size``, stored as ``uint8`` -> cache -> per-epoch shuffle -> float32
    (``/ 255`` when ``normalize``) -> batch -> prefetch. Without a cache the file
    names are fully reshuffled every epoch before decoding; with one, the cached
    images (already in a seeded random order) are reshuffled through a buffer of
    ``shuffle_buffer``.

    Args:
        files: image paths.
        labels: int labels aligned with ``files``.
        image_size: an int (square, 299 in the paper) or ``(height, width)``.
        batch_size: batch the dataset (the last batch may be smaller), or ``None``.
        shuffle: reshuffle every epoch.
        seed: seed of the shuffling.
        normalize: pixels in ``[0, 1]`` (what ``keras_roll.models.resnet18``
            expects) instead of ``[0, 255]``.
        cache: ``"auto"``: keep the resized ``uint8`` images in memory when they take
            at most half of the memory available now, otherwise no cache;
            ``True`` / ``"memory"``: in memory; a file path (a ``pathlib.Path`` or a
            string with a ``/``): a file cache (``tf.data.Dataset.cache(path)``, its
            folder must exist; one path per pipeline); ``False`` / ``None``: no
            cache (decode every epoch).
        crop_to_aspect_ratio: center-crop every image to the target aspect ratio
            before resizing (no distortion) instead of stretching it.
        shuffle_buffer: size of the shuffle buffer after a cache.

    Returns:
        A ``tf.data.Dataset`` of ``(image, label)``: float32 ``[H, W, 3]`` and int64
        (batched: a leading batch dimension).

    Raises:
        ValueError: bad arguments, or ``files`` and ``labels`` of different lengths.

    Example:

    ```python
    index = keras_roll.data.index_caltech256(path)
    ds = caltech256_dataset(index.files["val"], index.labels["val"], batch_size=64)
    ```
    """
    import tensorflow as tf

    height, width = _image_size(image_size)
    files = [os.fspath(f) for f in files]
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(files) != len(labels):
        raise ValueError(f"files and labels differ in length: {len(files)} != {len(labels)}.")
    if not files:
        raise ValueError("No files: the split is empty.")
    _check_batch_size(batch_size)
    if not isinstance(shuffle_buffer, numbers.Integral) or shuffle_buffer < 1:
        raise ValueError(f"shuffle_buffer must be a positive integer, got {shuffle_buffer!r}.")
    mode = cache_mode(cache, len(files) * height * width * 3, available_memory())

    if shuffle and mode is not None:  # the cache keeps this order: make it random
        order = np.random.default_rng(seed).permutation(len(files))
        files, labels = [files[i] for i in order], labels[order]
    ds = tf.data.Dataset.from_tensor_slices((tf.constant(files), tf.constant(labels)))
    if shuffle and mode is None:
        ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)

    def load(file, label):
        image = tf.io.decode_image(tf.io.read_file(file), channels=3, expand_animations=False)
        image.set_shape([None, None, 3])
        if crop_to_aspect_ratio:
            image = _center_crop(tf, image, height / width)
        image = tf.image.resize(image, (height, width), method="bilinear", antialias=True)
        return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8), label

    ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if mode == "memory":
        ds = ds.cache()
    elif mode is not None:
        ds = ds.cache(mode)
    if shuffle and mode is not None:
        ds = ds.shuffle(min(len(files), shuffle_buffer), seed=seed, reshuffle_each_iteration=True)
    scale = 1.0 / 255.0 if normalize else 1.0
    ds = ds.map(lambda image, label: (tf.cast(image, tf.float32) * scale, label),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if batch_size is not None:
        ds = ds.batch(int(batch_size), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)

def caltech256_splits(
    path,
    image_size=PAPER_IMAGE_SIZE,
    batch_size=32,
    seed=0,
    val_per_class=PAPER_VAL_PER_CLASS,
    test_per_class=PAPER_TEST_PER_CLASS,
    max_per_class=None,
    normalize=True,
    cache="auto",
    crop_to_aspect_ratio=False,
    verify=True,
    verbose=1,
):
    """The paper's Caltech-256 data: train / val / test pipelines at 299 x 299.

    `index_caltech256` with ``scheme="paper"`` (per class ``val_per_class`` = 5
    validation and ``test_per_class`` = 15 test images drawn with ``seed``, the
    rest for training; undecodable files skipped and counted), then one
    `caltech256_dataset` per split: the training set reshuffled every epoch, the
    others in class order.

    Args:
        path: the ``256_ObjectCategories`` folder or its parent.
        image_size: 299 in the paper; an int or ``(height, width)``.
        batch_size: examples per batch, or ``None`` for single examples.
        seed: seed of the split and of the shuffling.
        val_per_class, test_per_class, max_per_class, verify, verbose: see
            `index_caltech256`.
        normalize, cache, crop_to_aspect_ratio: see `caltech256_dataset`; with
            ``cache="auto"`` the three splits share one budget (half the memory
            available now), filled by val, test, then train.

    Returns:
        A `Caltech256Splits` ``(train, val, test, class_names, index)``.

    Raises:
        FileNotFoundError: no Caltech-256 tree at ``path`` (the message says where to
            get it and the expected layout).
        ValueError: bad arguments, an empty class folder or too small a class.

    Example:

    ```python
    from keras_roll.data import caltech256_splits
    data = caltech256_splits("~/data", batch_size=64)
    model = keras_roll.models.resnet18(classes=len(data.class_names))
    model.fit(data.train, validation_data=data.val, epochs=30)
    print(data.index.counts())   # {'train': ..., 'val': 1280, 'test': 3840, ...}
    ```
    """
    index = index_caltech256(
        path, scheme="paper", val_per_class=val_per_class, test_per_class=test_per_class,
        seed=seed, max_per_class=max_per_class, verify=verify, verbose=verbose,
    )
    height, width = _image_size(image_size)
    kwargs = dict(image_size=image_size, batch_size=batch_size, seed=seed, normalize=normalize,
                  crop_to_aspect_ratio=crop_to_aspect_ratio)
    caches = {split: cache for split in ("train", "val", "test")}
    if cache == "auto":  # share one budget: val and test first (small, read every epoch)
        budget = (available_memory() or 0) // 2
        for split in ("val", "test", "train"):
            nbytes = len(index.files[split]) * height * width * 3
            caches[split] = "memory" if nbytes <= budget else False
            budget -= nbytes if nbytes <= budget else 0
    parts = {}
    for split in ("train", "val", "test"):
        if not index.files[split]:
            parts[split] = None  # e.g. test_per_class=0
            continue
        parts[split] = caltech256_dataset(
            index.files[split], index.labels[split], shuffle=split == "train",
            cache=caches[split], **kwargs,
        )
    return Caltech256Splits(parts["train"], parts["val"], parts["test"], index.class_names, index)

def load_caltech256(
    path,
    image_size=PAPER_IMAGE_SIZE,
    split="train",
    scheme="paper",
    val_per_class=PAPER_VAL_PER_CLASS,
    test_per_class=PAPER_TEST_PER_CLASS,
    val_fraction=None,
    seed=0,
    batch_size=None,
    max_per_class=None,
    shuffle=None,
    crop_to_aspect_ratio=False,
    normalize=False,
    cache=False,
    verify=True,
):
    """Reads one split of the Caltech-256 image folders into a ``tf.data.Dataset``.

    Used for the ResNet-18 experiment of Lee, Alvarez-Melis & Jaakkola, ICLR 2019.
    The split is stratified and deterministic, see `index_caltech256`: by default
    the paper's (per class 5 validation and 15 test images, the rest for training);
    ``scheme="fraction"`` holds out ``val_fraction`` of every class instead.
    `caltech256_splits` builds all three pipelines of the paper at once.

    Args:
        path: the ``256_ObjectCategories`` folder or the folder that contains it.
        image_size: output size, an int (square) or ``(height, width)``.
        split: ``"train"``, ``"val"``, ``"test"`` or ``"all"`` (with
            ``scheme="fraction"``, ``"test"`` is the same as ``"val"``).
        scheme, val_per_class, test_per_class, val_fraction, seed, max_per_class,
            verify: see `index_caltech256`.
        batch_size: if given, the dataset is batched (the last batch may be smaller).
        shuffle: reshuffle the examples every epoch; ``None`` means ``True`` for
            ``"train"`` and ``False`` otherwise (then the order is by class).
        crop_to_aspect_ratio: center-crop to the target aspect ratio before resizing.
        normalize: pixels in ``[0, 1]`` (the input of ``keras_roll.models.resnet18``)
            instead of ``[0, 255]``.
        cache: see `caltech256_dataset` (here off by default).

    Returns:
        A tuple ``(dataset, class_names)``: ``dataset`` yields ``(image, label)`` with
        ``image`` float32 ``[H, W, 3]`` and ``label`` int64 in ``0..255`` (batched:
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
        (TensorShape([32, 299, 299, 3]), 256)
    """
    if not isinstance(split, str) or split.lower() not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    split = split.lower()
    if scheme == "fraction" and split == "test":
        split = "val"
    index = index_caltech256(
        path, scheme=scheme, val_per_class=val_per_class, test_per_class=test_per_class,
        val_fraction=val_fraction, seed=seed, max_per_class=max_per_class, verify=verify,
        verbose=0,
    )
    if not index.files[split]:
        raise ValueError(
            f"The {split!r} split is empty (scheme={scheme!r}, val_fraction={val_fraction!r}, "
            f"val_per_class={val_per_class!r}, test_per_class={test_per_class!r}, "
            f"max_per_class={max_per_class!r})."
        )
    if shuffle is None:
        shuffle = split == "train"
    ds = caltech256_dataset(
        index.files[split], index.labels[split], image_size=image_size, batch_size=batch_size,
        shuffle=shuffle, seed=seed, normalize=normalize, cache=cache,
        crop_to_aspect_ratio=crop_to_aspect_ratio,
    )
    return ds, index.class_names

def _check_batch_size(batch_size):
    if batch_size is not None and (
        not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool)
        or batch_size < 1
    ):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")

def available_memory():
    """Bytes of memory available now (Linux / most Unix), or ``None`` if unknown."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None

def cache_mode(cache, nbytes, available):
    """``None`` (no cache), ``"memory"`` or a cache file path."""
    if cache is None or cache is False:
        return None
    if cache is True or cache == "memory":
        return "memory"
    if cache == "auto":
        return "memory" if available is not None and nbytes <= available // 2 else None
    is_path = isinstance(cache, os.PathLike) or (
        isinstance(cache, str) and ("/" in cache or os.sep in cache)
    )
    if is_path:
        p = Path(os.path.expanduser(os.fspath(cache)))
        if not p.parent.is_dir():
            raise ValueError(
                f"cache={str(cache)!r}: the folder {str(p.parent)!r} does not exist; create "
                "it or pass cache='memory', 'auto' or False."
            )
        return str(p)
    raise ValueError(
        f"cache must be 'auto', 'memory', True, False, None or a file path (a pathlib.Path "
        f"or a string with a '/', e.g. './caltech.cache'), got {cache!r}"
    )

def _image_size(image_size):
    size = (image_size, image_size) if np.ndim(image_size) == 0 else tuple(image_size)
    if len(size) != 2 or any(
        not isinstance(s, numbers.Integral) or isinstance(s, bool) or s < 1 for s in size
    ):
        raise ValueError(
            f"image_size must be a positive int or a (height, width) pair, got {image_size!r}"
        )
    return int(size[0]), int(size[1])

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
