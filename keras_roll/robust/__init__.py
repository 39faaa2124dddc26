"""Certified robustness radii: bounds on each input's minimal adversarial perturbation.

`robust_radius` (`keras_roll.robust.api`) combines three methods, one module each:
`region` (exact inside the linear region), `walk` (adversarial points across
regions), `attacks` (a minimal-norm gradient attack from the walk's points),
`bounds` (a CROWN-style lower bound beyond the region, with interval
bounds as the fallback and baseline: the passes of `keras_roll.compile.bounds`
with the rounding bound of `float_error`); `search` the bracketing search, `result`
the `RobustRadius` they fill. `interval_bounds` is the same bound passes as a
differentiable function, for certified training. See docs/design.md, section
"Robustness radius".
"""

from keras_roll.compile.bounds import SlopeOptions
from keras_roll.robust.api import robust_radius
from keras_roll.robust.arguments import BranchOptions
from keras_roll.robust.attacks import AttackOptions, minimal_norm_attack
from keras_roll.robust.bounds import MarginBounds, interval_bounds
from keras_roll.robust.result import BoundSource, RobustMethod, RobustRadius

__all__ = ["AttackOptions", "BoundSource", "BranchOptions", "MarginBounds", "RobustMethod",
           "RobustRadius", "SlopeOptions", "interval_bounds", "minimal_norm_attack",
           "robust_radius"]
