"""Certified robustness radii: bounds on each input's minimal adversarial perturbation.

`robust_radius` (`keras_roll.robust.api`) combines three methods, one module each:
`region` (exact inside the linear region), `walk` (adversarial points across
regions), `relaxation` (a CROWN-style lower bound beyond the region, with
`intervals` as the fallback and baseline); `backward` is the backward pass they
share, `float_error` the rounding bound, `search` the bisection, `result` the
`RobustRadius` they fill. See docs/design.md, section "Robustness radius".
"""

from keras_roll.robust.api import robust_radius
from keras_roll.robust.result import RobustMethod, RobustRadius

__all__ = ["RobustMethod", "RobustRadius", "robust_radius"]
