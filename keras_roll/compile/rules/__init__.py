"""The rule registry and the built-in rules, one module per layer family."""

from keras_roll.compile.rules import (  # noqa: F401  (registers the rules)
    activations,
    affine,
    pooling,
    recurrent,
    scales,
    scornn,
)
from keras_roll.compile.rules.activations import Activation, ActivationRecord, Link, OutputLink
from keras_roll.compile.rules.affine import Identity, LayerCall
from keras_roll.compile.rules.base import (
    NO_RECORD,
    Linear,
    Neurons,
    NoRecord,
    Op,
    Tangent,
    WeightedSum,
)
from keras_roll.compile.rules.pooling import MaxRecord, MaxWindows
from keras_roll.compile.rules.recurrent import MaskingRecord, SimpleRNNOp
from keras_roll.compile.rules.registry import (
    compile_layer,
    get_rule,
    register_rule,
    registered_classes,
    unregister_rule,
)

__all__ = [
    "NO_RECORD", "Activation", "ActivationRecord", "Identity", "LayerCall", "Linear",
    "Link", "MaskingRecord", "MaxRecord", "MaxWindows", "Neurons", "NoRecord", "Op", "OutputLink",
    "SimpleRNNOp", "Tangent", "WeightedSum", "compile_layer", "get_rule", "register_rule",
    "registered_classes", "unregister_rule",
]
