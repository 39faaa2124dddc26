"""Data set loaders used by the keras_roll examples and benchmarks.

* :func:`load_japanese_vowels`: UCI Japanese Vowels (embedded copy, ``.ts`` or UCI files).
* :func:`load_mnist`: MNIST from a Keras-layout ``mnist.npz`` or tensorflow-datasets.
* :func:`make_toy2d`: deterministic 2-D binary toy problems.
* :func:`load_caltech256`: Caltech-256 folder tree as a ``tf.data.Dataset``.

Only :func:`load_caltech256` needs TensorFlow, and it imports it when called.

Example:
    >>> from keras_roll.data import load_japanese_vowels, make_toy2d
    >>> x, y, lengths = load_japanese_vowels(split="test")
    >>> x2, y2 = make_toy2d(n=100, kind="xor")
"""

from keras_roll.data.caltech256 import load_caltech256
from keras_roll.data.japanese_vowels import load_japanese_vowels
from keras_roll.data.mnist import load_mnist
from keras_roll.data.toy2d import make_toy2d

__all__ = ["load_caltech256", "load_japanese_vowels", "load_mnist", "make_toy2d"]
