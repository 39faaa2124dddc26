"""The Caltech-256 folder tree: its layout, the split of its files (the paper's per
class 5 validation and 15 test images, or a fraction), the files that are skipped, and
a quick check of a tree before any image is read.

Expected layout (the extracted ``256_ObjectCategories.tar``)::

    256_ObjectCategories/
        001.ak47/001_0001.jpg ...
        ...
        256.toad/...
        257.clutter/...        (skipped: not one of the 256 object classes)
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

def index_caltech256(
    path: str | os.PathLike,
    scheme: str = "paper",
    val_per_class: int = PAPER_VAL_PER_CLASS,
    test_per_class: int = PAPER_TEST_PER_CLASS,
    val_fraction: float | None = None,
    seed: int = 0,
    max_per_class: int | None = None,
    verify: bool = True,
    verbose: int = 1,
) -> Caltech256Index:
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


def check_tree(path) -> Path:
    """A quick check of a Caltech-256 tree before any image is read: `path` is (or holds)
    a folder of class folders `NNN.name`, and every class folder holds at least one file
    with an image extension. Returns the ``256_ObjectCategories`` folder.

    Raises:
        FileNotFoundError: `path` does not exist, is the archive, or holds no class
            folders (the message says where to get Caltech-256 and its layout).
        ValueError: a class folder without image files (named, with how many are empty).

    Example:

    ```python
    root = check_tree("~/data/caltech256")   # .../256_ObjectCategories
    ```
    """
    root = _find_root(path)
    empty = [folder.name for _, _, folder in _class_dirs(root)
             if not any(f.suffix.lower() in IMAGE_EXTENSIONS for f in folder.iterdir())]
    if empty:
        shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise ValueError(f"{len(empty)} class folder(s) under {str(root)!r} hold no image "
                         f"files: {shown}. Restore their images or remove the folders. "
                         f"{WHERE_TO_GET}")
    return root


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
