"""Data set loaders used by the keras_roll examples and benchmarks.

* :func:`load_japanese_vowels`: UCI Japanese Vowels (embedded copy, ``.ts`` or UCI files).
* :func:`load_mnist`: MNIST from a Keras-layout ``mnist.npz``, the four IDX files, or
  tensorflow-datasets; :func:`mnist_splits`: the paper's 55,000 / 5,000 / 10,000 split.
* :func:`make_toy2d`: deterministic 2-D binary toy problems.
* Caltech-256 folder tree: :func:`caltech256_splits` (the paper's per-class 5 / 15
  split at 299 x 299, ``tf.data`` pipelines), :func:`load_caltech256` (one split),
  :func:`index_caltech256` (files, split, skipped files), :func:`caltech256_dataset`
  (the pipeline) and :func:`make_synthetic_caltech256` (a generated tree for tests).

Only the Caltech-256 functions need TensorFlow, and they import it when called.

Example:
    >>> from keras_roll.data import load_japanese_vowels, make_toy2d
    >>> x, y, lengths = load_japanese_vowels(split="test")
    >>> x2, y2 = make_toy2d(n=100, kind="xor")
"""

from keras_roll.data.caltech256 import (
    Caltech256Index,
    Caltech256Splits,
    SkippedFile,
    caltech256_dataset,
    caltech256_splits,
    index_caltech256,
    load_caltech256,
    make_synthetic_caltech256,
)
from keras_roll.data.japanese_vowels import load_japanese_vowels
from keras_roll.data.mnist import MnistSplits, load_mnist, mnist_splits
from keras_roll.data.toy2d import make_toy2d

__all__ = [
    "Caltech256Index",
    "Caltech256Splits",
    "MnistSplits",
    "SkippedFile",
    "caltech256_dataset",
    "caltech256_splits",
    "index_caltech256",
    "load_caltech256",
    "load_japanese_vowels",
    "load_mnist",
    "make_synthetic_caltech256",
    "make_toy2d",
    "mnist_splits",
]
