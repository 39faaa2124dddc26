"""MNIST from a Keras-layout ``mnist.npz`` or from tensorflow-datasets.

This module imports only numpy; tensorflow-datasets is imported on demand.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

NPZ_NAME = "mnist.npz"
SPLITS = ("train", "test")


def load_mnist(path=None, split="train", flatten=False, normalize=False, tfds_data_dir=None):
    """Loads the MNIST digits.

    Sources, in order:

    1. ``path``: a Keras-layout ``mnist.npz`` (arrays ``x_train``, ``y_train``,
       ``x_test``, ``y_test``) or a directory that contains one.
    2. With ``path=None``: the Keras cache ``$KERAS_HOME/datasets/mnist.npz`` (default
       ``~/.keras/datasets/mnist.npz``) if it exists, then an already prepared
       tensorflow-datasets copy (``tfds.load("mnist", download=False)``). Nothing is
       downloaded.

    Args:
        path: file or directory, or ``None`` (see above).
        split: ``"train"`` (60,000 images) or ``"test"`` (10,000 images).
        flatten: return ``x`` as ``[n, 784]`` instead of ``[n, 28, 28]``.
        normalize: divide the pixels by 255 (to ``[0, 1]``); otherwise they stay in raw
            pixel units ``0..255``.
        tfds_data_dir: ``data_dir`` passed to ``tfds.load`` (``None``: the tfds default,
            ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).

    Returns:
        A tuple ``(x, y)``: ``x`` float32 ``[n, 28, 28]`` (or ``[n, 784]``), ``y`` int64
        ``[n]`` digits ``0..9``.

    Raises:
        ValueError: for a bad ``split`` or an ``.npz`` without the expected arrays.
        FileNotFoundError: when ``path`` does not exist, or when ``path=None`` and no
            local copy is found.

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
        x, y = _load_npz(_resolve_npz(path), split)
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


def _resolve_npz(path):
    p = Path(os.path.expanduser(os.fspath(path)))
    if p.is_dir():
        file = p / NPZ_NAME
        if not file.is_file():
            raise FileNotFoundError(
                f"No {NPZ_NAME!r} in directory {str(p)!r}: expected a Keras-layout file "
                "with arrays x_train, y_train, x_test, y_test."
            )
        return file
    if not p.is_file():
        raise FileNotFoundError(
            f"MNIST path {str(p)!r} does not exist: pass a Keras-layout {NPZ_NAME} file "
            "or a directory holding one."
        )
    return p


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
    hint = (
        "MNIST was not found locally: pass path= to a Keras-layout mnist.npz or its "
        "directory (e.g. --data_dir ../shared/data), or prepare it with "
        "tensorflow-datasets (tfds.load('mnist', download=True))."
    )
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
