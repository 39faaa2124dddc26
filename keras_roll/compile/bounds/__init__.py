"""Bound passes over the compiled program, in the manner of jax_verify: one traversal, one
module per bound method.

    traversal.py   capture (the primal pass keeping every op's values), linear_transpose,
                   pull_back (the reverse walk)
    rules.py       BoundRule and its table (register_bound_rule), Box, RelaxationLines,
                   check_bounds
    ibp.py         interval bound propagation
    crown.py       the linear relaxation's backward pass (CROWN)
    alpha.py       optimized lower slopes (alpha-CROWN): SlopeOptions,
                   optimize_lower_slopes
    intermediate.py  IntermediateBounds: CROWN, intervals or an automatic choice for the
                   activations' bounds (choose_intermediate, crown_cost)
    methods.py     BoundMethod and lower_bounds: intervals, CROWN-IBP, CROWN, dispatched
                   through METHOD_PASSES; IntervalPasses (one interval pass, both bounds)
    margins.py     logit_margins: the capture, logits and rows e_y - e_j of a classifier

The passes walk the same `Program` the twin runs (`keras_roll.compile.structure` gives
its ops as nodes). docs/design.md, section "Robustness radius".
"""

from keras_roll.compile.bounds.alpha import SlopeOptions, optimize_lower_slopes
from keras_roll.compile.bounds.intermediate import (
    BoundCost,
    IntermediateBounds,
    IntermediateChoice,
    choose_intermediate,
    crown_cost,
)
from keras_roll.compile.bounds.margins import LogitMargins, logit_margins, margin_rows
from keras_roll.compile.bounds.methods import (
    METHOD_PASSES,
    BoundMethod,
    IntervalPasses,
    MethodPass,
    lower_bounds,
)
from keras_roll.compile.bounds.rules import (
    ActivationBounds,
    AffineBounds,
    Arithmetic,
    BoundPass,
    BoundRule,
    Box,
    RelaxationLines,
    bound_rule,
    check_bounds,
    register_bound_rule,
    relaxation_lines,
    supported_passes,
    unregister_bound_rule,
)
from keras_roll.compile.bounds.traversal import Values, capture, pull_back

__all__ = [
    "METHOD_PASSES", "ActivationBounds", "AffineBounds", "Arithmetic", "BoundCost", "BoundMethod",
    "BoundPass", "BoundRule", "Box", "IntermediateBounds", "IntermediateChoice", "IntervalPasses",
    "LogitMargins", "MethodPass", "RelaxationLines", "SlopeOptions", "Values", "bound_rule",
    "capture", "check_bounds", "choose_intermediate", "crown_cost", "logit_margins",
    "lower_bounds", "margin_rows", "optimize_lower_slopes", "pull_back", "register_bound_rule",
    "relaxation_lines", "supported_passes", "unregister_bound_rule",
]
