"""Floating-point rounding guards of certificates (the three rigors).

* `precision`: unit roundoffs, underflow, TF32 and mixed precision;
* `rules` (and the built-in `layer_rules`): how each op rounds, in tables keyed
  by op type, with a rule derived from any other op's linear map;
* `worst_case`: the worst-case bound (`rigor="strict"`);
* `noise` (and `noise_transform`, `noise_recurrent`): the probabilistic bound
  (`rigor="float64"`);
* `tangent_error`: gradient norms from float32 tangents with a rigorous bound;
* `exact_norms`: exact float64 norms of a few neurons' gradients (reverse mode);
* `guard`: one `Guard` per rigor, what certificates call.

docs/design.md, section "The rounding bound".
"""

from keras_roll.rounding import layer_rules  # noqa: F401  (registers the built-in rules)
from keras_roll.rounding.guard import Guard, RoundingErrors, guard_for
from keras_roll.rounding.rules import (
    RoundingRule,
    register_rounding_rule,
    rounding_rule,
    unregister_rounding_rule,
)

__all__ = ["Guard", "RoundingErrors", "RoundingRule", "guard_for", "register_rounding_rule",
           "rounding_rule", "unregister_rounding_rule"]
