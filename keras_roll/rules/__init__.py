"""The rule registry and the built-in rules, one module per layer family."""

from keras_roll.rules import (  # noqa: F401  (registers the rules)
    activations,
    affine,
    pooling,
    recurrent,
    scornn,
)
from keras_roll.rules.activations import Activation, OutputLink
from keras_roll.rules.affine import Identity, LayerCall
from keras_roll.rules.base import Linear, Neurons, Op, Tangent
from keras_roll.rules.pooling import MaxWindows
from keras_roll.rules.recurrent import SimpleRNNOp
from keras_roll.rules.registry import (
    compile_layer,
    get_rule,
    register_rule,
    registered_classes,
    unregister_rule,
)

__all__ = [
    "Activation", "Identity", "LayerCall", "Linear", "MaxWindows", "Neurons", "Op",
    "OutputLink", "SimpleRNNOp", "Tangent", "compile_layer", "get_rule", "register_rule",
    "registered_classes", "unregister_rule",
]
