"""MNIST from a Keras-layout ``mnist.npz``, the four IDX files, or tensorflow-datasets,
and the paper's 55,000 / 5,000 / 10,000 split.

This module imports only numpy; tensorflow-datasets is imported on demand.
"""

from __future__ import annotations

import gzip
import numbers
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

NPZ_NAME = "mnist.npz"
SPLITS = ("train", "test")
N_TRAIN = 60000
# IDX file names as published (gzip-compressed or not; some mirrors use a '.' before idx).
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
WHERE_TO_GET = (
    "Get MNIST as https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz "
    "(Keras layout) or as the four IDX files train-images-idx3-ubyte.gz, "
    "train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz "
    "(https://ossci-datasets.s3.amazonaws.com/mnist/), and pass the file or its folder "
    "with --data_dir in the examples (path= in Python); or prepare it with "
    "tensorflow-datasets (tfds.load('mnist', download=True))."
)
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class MnistSplits(NamedTuple):
    """The paper's MNIST split, each part an ``(x, y)`` pair of numpy arrays."""

    train: tuple
    val: tuple
    test: tuple


def load_mnist(path=None, split="train", flatten=False, normalize=False, tfds_data_dir=None):
    """Loads the MNIST digits.

    Sources, in order:

    1. ``path``: a Keras-layout ``mnist.npz`` (arrays ``x_train``, ``y_train``,
       ``x_test``, ``y_test``), or a directory that holds one, or a directory that
       holds the four IDX files (``train-images-idx3-ubyte.gz``,
       ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``,
       ``t10k-labels-idx1-ubyte.gz``; uncompressed files work too).
    2. With ``path=None``: the Keras cache ``$KERAS_HOME/datasets/mnist.npz`` (default
       ``~/.keras/datasets/mnist.npz``) if it exists, then an already prepared
       tensorflow-datasets copy (``tfds.load("mnist", download=False)``). Nothing is
       downloaded.

    Args:
        path: file or directory, or ``None`` (see above).
        split: ``"train"`` (60,000 images) or ``"test"`` (10,000 images).
        flatten: return ``x`` as ``[n, 784]`` instead of ``[n, 28, 28]``.
        normalize: divide the pixels by 255 (to ``[0, 1]``, what
            ``keras_roll.models.fc`` expects); otherwise they stay in raw pixel units
            ``0..255``.
        tfds_data_dir: ``data_dir`` passed to ``tfds.load`` (``None``: the tfds default,
            ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).

    Returns:
        A tuple ``(x, y)``: ``x`` float32 ``[n, 28, 28]`` (or ``[n, 784]``), ``y`` int64
        ``[n]`` digits ``0..9``.

    Raises:
        ValueError: for a bad ``split`` or a file without the expected contents.
        FileNotFoundError: when ``path`` does not exist or holds no MNIST files, or
            when ``path=None`` and no local copy is found (the message says where to
            get MNIST and which flag takes the path).

    Example:
        >>> from keras_roll.data import load_mnist
        >>> x, y = load_mnist("../shared/data", split="test", normalize=True)
        >>> x.shape, x.dtype, float(x.max()), y[:3]
        ((10000, 28, 28), dtype('float32'), 1.0, array([7, 2, 1]))
    """
    if not isinstance(split, str) or split.lower() not in SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    split = split.lower()
    if path is not None:
        x, y = _load_path(path, split)
    else:
        cached = _keras_cache_file()
        if cached.is_file():
            x, y = _load_npz(cached, split)
        else:
            x, y = _load_tfds(split, tfds_data_dir)
    x = np.asarray(x, dtype=np.float32)
    if normalize:
        x /= np.float32(255.0)
    if flatten:
        x = x.reshape(len(x), -1)
    return x, np.asarray(y, dtype=np.int64).reshape(-1)


def mnist_splits(path=None, seed=0, val=5000, flatten=True, normalize=True, tfds_data_dir=None):
    """The paper's MNIST split: 55,000 train / 5,000 validation / 10,000 test.

    The 60,000 training images are permuted with ``numpy.random.default_rng(seed)``;
    the first ``val`` of the permutation are the validation set, the rest (in the
    permuted order) the training set. The test set is MNIST's own 10,000 images.

    Args:
        path, tfds_data_dir: where the data is, as in `load_mnist`.
        seed: seed of the permutation (the same seed gives the same split).
        val: number of validation images, ``0 <= val < 60000``.
        flatten: ``x`` as ``[n, 784]`` (the input of ``keras_roll.models.fc()``)
            instead of ``[n, 28, 28]``.
        normalize: pixels in ``[0, 1]`` (the models' input units) instead of ``0..255``.

    Returns:
        A `MnistSplits` ``(train, val, test)``, each an ``(x, y)`` pair as returned by
        `load_mnist`.

    Raises:
        ValueError: for a bad ``val`` or ``seed``.
        FileNotFoundError: when MNIST is not found (see `load_mnist`).

    Example:
        >>> from keras_roll.data import mnist_splits
        >>> (x_train, y_train), (x_val, y_val), (x_test, y_test) = mnist_splits(
        ...     "../shared/data", seed=0)
        >>> len(x_train), len(x_val), len(x_test), x_train.shape[1], float(x_train.max())
        (55000, 5000, 10000, 784, 1.0)
    """
    if not isinstance(val, numbers.Integral) or isinstance(val, bool) or val < 0:
        raise ValueError(f"val must be a non-negative integer, got {val!r}.")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
    kwargs = dict(flatten=flatten, normalize=normalize, tfds_data_dir=tfds_data_dir)
    x, y = load_mnist(path, split="train", **kwargs)
    if val >= len(x):
        raise ValueError(
            f"val={val} leaves no training images: the training split has {len(x)}."
        )
    order = np.random.default_rng(seed).permutation(len(x))
    held, kept = order[:val], order[val:]
    test = load_mnist(path, split="test", **kwargs)
    return MnistSplits((x[kept], y[kept]), (x[held], y[held]), test)


def load_idx(file):
    """Reads one IDX file (``.gz`` or uncompressed) into a numpy array.

    Args:
        file: path of the file.

    Returns:
        The array, with the IDX file's dtype (``uint8`` for MNIST) and shape.

    Raises:
        ValueError: when the header is not IDX or the size does not match it.

    Example:
        >>> from keras_roll.data.mnist import load_idx
        >>> load_idx("t10k-labels-idx1-ubyte.gz")[:3]
        array([7, 2, 1], dtype=uint8)
    """
    file = Path(file)
    opener = gzip.open if file.suffix == ".gz" else open
    try:
        with opener(file, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{str(file)!r} cannot be read ({e}); is it an IDX file?") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(
            f"{str(file)!r} is not an IDX file: it does not start with the magic number "
            f"00 00 <type> <ndim> (first bytes {raw[:4].hex(' ')!r})."
        )
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{str(file)!r}: IDX header truncated ({len(raw)} bytes).")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(
            f"{str(file)!r}: the IDX header announces shape {shape} ({expected} bytes in "
            f"all) but the file has {len(raw)} bytes; it is truncated or corrupt."
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def _load_path(path, split):
    p = Path(os.path.expanduser(os.fspath(path)))
    if p.is_file() and "idx" in p.name and p.suffix != ".npz":
        p = p.parent  # one of the IDX files: read the four from its folder
    if p.is_file():
        return _load_npz(p, split)
    if not p.is_dir():
        raise FileNotFoundError(f"MNIST path {str(p)!r} does not exist. {WHERE_TO_GET}")
    if (p / NPZ_NAME).is_file():
        return _load_npz(p / NPZ_NAME, split)
    files = [_find_idx(p, name) for name in IDX_FILES[split]]
    if all(files):
        return _load_idx_pair(*files)
    raise FileNotFoundError(
        f"No MNIST in directory {str(p)!r}: expected {NPZ_NAME} (arrays x_train, y_train, "
        f"x_test, y_test) or the IDX files {', '.join(n + '.gz' for n in IDX_FILES[split])}. "
        f"{WHERE_TO_GET}"
    )


def _find_idx(directory, name):
    stem, kind = name.rsplit("-", 1)[0], name.rsplit("-", 1)[1]  # 'train-images-idx3', 'ubyte'
    dotted = stem.rsplit("-", 1)[0] + "." + stem.rsplit("-", 1)[1] + "-" + kind
    for candidate in (name, dotted):
        for suffix in (".gz", ""):
            f = directory / (candidate + suffix)
            if f.is_file():
                return f
    return None


def _load_idx_pair(images_file, labels_file):
    x, y = load_idx(images_file), load_idx(labels_file)
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
        raise ValueError(
            f"{str(images_file)!r} has shape {x.shape} and {str(labels_file)!r} has shape "
            f"{y.shape}; expected [n, 28, 28] images and [n] labels."
        )
    return x, y


def _load_npz(file, split):
    keys = (f"x_{split}", f"y_{split}")
    try:
        data = np.load(file, allow_pickle=False)
    except (OSError, EOFError, ValueError) as e:  # not a zip / truncated / pickled
        raise ValueError(f"{file}: cannot be read as an .npz file ({e})") from e
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(
            f"{file}: holds a single array, not an .npz archive with x_train, y_train, "
            "x_test, y_test"
        )
    with data:
        missing = [k for k in keys if k not in data.files]
        if missing:
            raise ValueError(
                f"{file}: missing arrays {missing}; found {sorted(data.files)}. "
                "Expected the Keras mnist.npz layout (x_train, y_train, x_test, y_test)."
            )
        x, y = data[keys[0]], data[keys[1]]
    if x.ndim < 2 or len(x) != len(y):
        raise ValueError(
            f"{file}: {keys[0]} has shape {x.shape} and {keys[1]} has shape {y.shape}; "
            "expected [n, 28, 28] images and [n] labels"
        )
    return x, y


def _keras_cache_file():
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return Path(home) / "datasets" / NPZ_NAME


def _load_tfds(split, data_dir):
    hint = f"MNIST was not found locally (no path= given, no Keras cache). {WHERE_TO_GET}"
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise FileNotFoundError(f"{hint} (tensorflow-datasets is not installed)") from e
    try:
        data = tfds.load("mnist", split=split, batch_size=-1, download=False, data_dir=data_dir)
        data = tfds.as_numpy(data)
    except Exception as e:  # tfds raises assorted errors when the data is not prepared
        raise FileNotFoundError(f"{hint} (tensorflow-datasets: {type(e).__name__}: {e})") from e
    x = np.asarray(data["image"])
    if x.ndim == 4 and x.shape[-1] == 1:
        x = x[..., 0]
    return x, np.asarray(data["label"])
