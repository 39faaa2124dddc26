"""keras_roll: certify, train for and inspect the local linearity of
piecewise-linear Keras networks.

Reference: G.-H. Lee, D. Alvarez-Melis, T. S. Jaakkola, "Towards Robust, Locally
Linear Deep Networks", ICLR 2019.
"""

from keras_roll import rules
from keras_roll.errors import UnsupportedModelError
from keras_roll.rules import register_rule
from keras_roll.twin import Linearized, linearize

__version__ = "0.1.0"

__all__ = [
    "Linearized",
    "UnsupportedModelError",
    "linearize",
    "register_rule",
    "rules",
]
