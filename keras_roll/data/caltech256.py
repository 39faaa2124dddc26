"""Caltech-256 from its standard folder tree, as ``tf.data`` pipelines, with the
split of Lee, Alvarez-Melis & Jaakkola (ICLR 2019, Appendix I): per class 5
validation and 15 test images drawn with a seed, the rest for training; images
resized to 299 x 299.

Expected layout (the extracted ``256_ObjectCategories.tar``)::

    256_ObjectCategories/
        001.ak47/001_0001.jpg ...
        002.american-flag/...
        ...
        256.toad/...
        257.clutter/...        (skipped: not one of the 256 object classes)

Files in a class folder that are not decodable images (stray text files, empty or
truncated JPEGs, sub-folders) are skipped, counted and reported, never fatal; a
class folder left without images is an error. `make_synthetic_caltech256` writes a
small tree of generated JPEGs in the same layout for tests and ``--quick`` runs.

TensorFlow is imported when a function that needs it is called, not when this
module is imported.
"""

from __future__ import annotations

import logging
import numbers
import os
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT_NAME = "256_ObjectCategories"
CLUTTER_ID = 257
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".gif", ".bmp")
SCHEMES = ("paper", "fraction")
SPLITS = ("train", "val", "test", "all")
PAPER_IMAGE_SIZE = 299
PAPER_VAL_PER_CLASS = 5
PAPER_TEST_PER_CLASS = 15
DEFAULT_VAL_FRACTION = 0.2
WHERE_TO_GET = (
    "Get Caltech-256 from https://data.caltech.edu/records/nyy15-4j048 "
    "(256_ObjectCategories.tar, 1.2 GB), extract it with "
    "'tar xf 256_ObjectCategories.tar', and pass the extracted folder or its parent with "
    "--data_dir in the examples (path= in Python). The layout is "
    f"{ROOT_NAME}/NNN.name/NNN_XXXX.jpg (for example {ROOT_NAME}/001.ak47/001_0001.jpg), "
    "256 class folders plus 257.clutter, which is not used. For a quick run without the "
    "data, use --quick (a generated tree, see make_synthetic_caltech256)."
)
_CLASS_DIR = re.compile(r"^(\d+)\.(.+)$")
_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM")
_SYNTHETIC_NAMES = (
    "ak47", "american-flag", "backpack", "baseball-bat", "baseball-glove",
    "basketball-hoop", "bat", "bathtub", "bear", "beer-mug",
)
_log = logging.getLogger(__name__)


class SkippedFile(NamedTuple):
    """A file of a class folder that was not used, and why."""

    path: str
    reason: str


class Caltech256Index(NamedTuple):
    """The files of a Caltech-256 tree, split and checked (no pixels loaded).

    Attributes:
        root: the ``256_ObjectCategories`` folder.
        class_names: names without the number prefix (``"ak47"``, ...); index = label.
        files: ``{"train", "val", "test", "all"} -> [paths]``; in every split the
            files are grouped by class, in the seeded order of the split.
        labels: the same keys -> int64 label arrays aligned with ``files``.
        skipped: every `SkippedFile` (not an image, empty, undecodable, a folder).
        scheme: ``"paper"`` or ``"fraction"``.
    """

    root: Path
    class_names: list
    files: dict
    labels: dict
    skipped: list
    scheme: str

    def counts(self) -> dict:
        """``{split: number of images}``, plus ``"skipped"``."""
        return {**{k: len(v) for k, v in self.files.items()}, "skipped": len(self.skipped)}


class Caltech256Splits(NamedTuple):
    """The paper's train / val / test pipelines (see `caltech256_splits`)."""

    train: object
    val: object
    test: object
    class_names: list
    index: Caltech256Index


def index_caltech256(
    path,
    scheme="paper",
    val_per_class=PAPER_VAL_PER_CLASS,
    test_per_class=PAPER_TEST_PER_CLASS,
    val_fraction=None,
    seed=0,
    max_per_class=None,
    verify=True,
    verbose=1,
):
    """Lists, checks and splits the images of a Caltech-256 tree.

    Every file of every object-class folder is checked: files without an image
    extension (``.jpg .jpeg .png .gif .bmp``), empty files and files whose first
    bytes are no JPEG / PNG / GIF / BMP signature are skipped; with ``verify=True``
    the remaining images are also decoded once (in parallel, with TensorFlow) and
    those that fail are skipped. Skipped files are counted, logged as a warning and
    listed in ``index.skipped``.

    Then, in every class, the usable file names are sorted, permuted with ``seed``
    (one ``numpy.random.default_rng(seed)`` drawn class after class) and cut to
    ``max_per_class``. ``scheme="paper"``: the first ``val_per_class`` go to
    ``"val"``, the next ``test_per_class`` to ``"test"``, the rest to ``"train"``.
    ``scheme="fraction"``: the first ``round(val_fraction * n)`` (at least one when
    ``val_fraction > 0`` and the class has two images or more) go to ``"val"`` and
    the rest to ``"train"``; ``"test"`` is the same as ``"val"``.

    Args:
        path: the ``256_ObjectCategories`` folder or the folder that contains it.
        scheme: ``"paper"`` (fixed counts per class) or ``"fraction"``.
        val_per_class, test_per_class: the paper scheme's counts (5 and 15).
        val_fraction: the fraction scheme's held-out fraction in ``[0, 1)``
            (default 0.2); only with ``scheme="fraction"``.
        seed: seed of the split.
        max_per_class: keep at most this many images per class (before the split).
        verify: also decode every image once to find corrupt ones.
        verbose: 0 silent; 1 a progress bar while verifying.

    Returns:
        A `Caltech256Index`.

    Raises:
        FileNotFoundError: ``path`` does not exist or holds no class folders (the
            message says where to get Caltech-256 and the layout).
        ValueError: bad arguments, a class folder without usable images, or a class
            too small for the requested split.

    Example:
        >>> from keras_roll.data import index_caltech256
        >>> index = index_caltech256("~/data/caltech256")
        >>> index.counts()
        {'train': 24526, 'val': 1280, 'test': 3840, 'all': 29646, 'skipped': 1}
    """
    _check_split_args(scheme, val_per_class, test_per_class, val_fraction, max_per_class, seed)
    if scheme == "fraction" and val_fraction is None:
        val_fraction = DEFAULT_VAL_FRACTION
    root = _find_root(path)
    class_dirs = _class_dirs(root)
    class_names = [name for _, name, _ in class_dirs]

    candidates, skipped = [], []
    for label, (_, _, folder) in enumerate(class_dirs):
        for entry in sorted(folder.iterdir()):
            reason = _cheap_check(entry)
            if reason:
                skipped.append(SkippedFile(str(entry), reason))
            else:
                candidates.append((label, entry.name, str(entry)))
    if verify and candidates:
        ok = _decodable([c[2] for c in candidates], verbose)
        skipped += [SkippedFile(c[2], "cannot be decoded as an image")
                    for c, good in zip(candidates, ok) if not good]
        candidates = [c for c, good in zip(candidates, ok) if good]

    per_class = [[] for _ in class_dirs]
    for label, name, _ in candidates:
        per_class[label].append(name)
    rng = np.random.default_rng(seed)
    files = {split: [] for split in SPLITS}
    labels = {split: [] for split in SPLITS}
    for label, ((_, _, folder), names) in enumerate(zip(class_dirs, per_class)):
        if not names:
            n_bad = sum(1 for s in skipped if Path(s.path).parent == folder)
            why = f"all {n_bad} of its files were skipped" if n_bad else "it is empty"
            raise ValueError(
                f"Class folder {str(folder)!r} holds no usable images ({why}); the "
                f"Caltech-256 tree under {str(root)!r} looks incomplete. Remove the folder "
                "or restore its images."
            )
        names = sorted(names)
        names = [names[i] for i in rng.permutation(len(names))]
        if max_per_class is not None:
            names = names[:max_per_class]
        parts = _split_class(names, scheme, val_per_class, test_per_class, val_fraction, folder)
        for split, chosen in parts.items():
            files[split] += [str(folder / n) for n in chosen]
            labels[split] += [label] * len(chosen)
    labels = {k: np.asarray(v, dtype=np.int64) for k, v in labels.items()}
    if skipped:
        shown = "; ".join(f"{s.path} ({s.reason})" for s in skipped[:5])
        more = f"; ... ({len(skipped) - 5} more)" if len(skipped) > 5 else ""
        _log.warning(
            "Caltech-256: skipped %d of %d files that are not decodable images: %s%s",
            len(skipped), len(skipped) + len(candidates), shown, more,
        )
    return Caltech256Index(root, class_names, files, labels, skipped, scheme)


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
    mode = _cache_mode(cache, len(files) * height * width * 3, _available_memory())

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
        budget = (_available_memory() or 0) // 2
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


# ----------------------------------------------------------------------------- helpers


def _check_split_args(scheme, val_per_class, test_per_class, val_fraction, max_per_class, seed):
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    for arg, value in (("val_per_class", val_per_class), ("test_per_class", test_per_class)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{arg} must be a non-negative integer, got {value!r}")
    if scheme == "paper" and val_fraction is not None:
        raise ValueError(
            f"val_fraction={val_fraction!r} applies to scheme='fraction'; the paper scheme "
            "holds out val_per_class and test_per_class images per class. Pass "
            "scheme='fraction' to hold out a fraction."
        )
    if val_fraction is not None and not (_is_real(val_fraction) and 0.0 <= val_fraction < 1.0):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if max_per_class is not None and (
        not isinstance(max_per_class, numbers.Integral) or max_per_class < 1
    ):
        raise ValueError(f"max_per_class must be a positive integer or None, got {max_per_class!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_batch_size(batch_size):
    if batch_size is not None and (
        not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool)
        or batch_size < 1
    ):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")


def _split_class(names, scheme, val_per_class, test_per_class, val_fraction, folder):
    n = len(names)
    if scheme == "paper":
        need = val_per_class + test_per_class + 1
        if n < need:
            raise ValueError(
                f"Class folder {str(folder)!r} has {n} usable images, fewer than "
                f"val_per_class + test_per_class + 1 = {need} (every Caltech-256 class has "
                "80 or more). Lower val_per_class / test_per_class, raise max_per_class, "
                "or use scheme='fraction'."
            )
        n_val, n_test = val_per_class, test_per_class
    else:
        n_val = int(round(val_fraction * n))
        if val_fraction > 0 and n > 1:
            n_val = min(max(n_val, 1), n - 1)
        n_test = 0
    val, test, train = names[:n_val], names[n_val : n_val + n_test], names[n_val + n_test :]
    if scheme == "fraction":
        test = val
    return {"train": train, "val": val, "test": test, "all": names}


def _cheap_check(entry):
    """Reason to skip ``entry`` without decoding it, or ``None``."""
    if entry.is_dir():
        return "a folder inside a class folder (not read)"
    if not entry.is_file():
        return "not a regular file"
    if entry.suffix.lower() not in IMAGE_EXTENSIONS:
        return f"not an image file (extension {entry.suffix or 'none'!r})"
    try:
        with open(entry, "rb") as f:
            head = f.read(8)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not head:
        return "empty file"
    if not any(head.startswith(s) for s in _SIGNATURES):
        return f"not a JPEG / PNG / GIF / BMP image (starts with {head[:4].hex(' ')})"
    return None


def _decodable(files, verbose):
    """[bool] per file: does ``tf.io.decode_image`` decode it? (parallel, one pass)"""
    import tensorflow as tf

    def check(i):
        image = tf.io.decode_image(tf.io.read_file(tf.gather(paths, i)), channels=3,
                                   expand_animations=False)
        return i, tf.size(image) > 0

    paths = tf.constant(files)
    ds = tf.data.Dataset.range(len(files)).map(check, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.ignore_errors(log_warning=False).prefetch(tf.data.AUTOTUNE)
    ok = np.zeros(len(files), dtype=bool)
    bar = _progress(len(files), verbose)
    for i, nonempty in ds.as_numpy_iterator():
        ok[i] = bool(nonempty)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return ok


def _progress(total, verbose):
    if not verbose or total < 500:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is an install requirement, but stay usable without it
        return None
    return tqdm(total=total, desc="Caltech-256: checking images", unit="img")


def _available_memory():
    """Bytes of memory available now (Linux / most Unix), or ``None`` if unknown."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _cache_mode(cache, nbytes, available):
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


def _find_root(path):
    p = Path(os.path.expanduser(os.fspath(path)))
    if p.is_file() and p.name.endswith((".tar", ".tar.gz", ".tgz")):
        raise FileNotFoundError(
            f"Caltech-256 path {str(p)!r} is the archive: extract it first "
            f"(tar xf {p.name}) and pass the extracted folder. {WHERE_TO_GET}"
        )
    if not p.is_dir():
        raise FileNotFoundError(
            f"Caltech-256 path {str(p)!r} is not a directory. {WHERE_TO_GET}"
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
        raise FileNotFoundError(f"No class folders (NNN.name) in {str(root)!r}. {WHERE_TO_GET}")
    found.sort(key=lambda t: (t[0], t[1]))
    numbers_ = [t[0] for t in found]
    if len(set(numbers_)) != len(numbers_):
        dup = sorted({n for n in numbers_ if numbers_.count(n) > 1})
        raise ValueError(
            f"Class numbers {dup} appear in more than one folder under {str(root)!r}; "
            "keep one folder per number."
        )
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
