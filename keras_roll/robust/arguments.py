"""The arguments of `robust_radius`, checked: the search budgets (`SearchOptions`,
`BranchOptions`),
the option types, the model's classes and the bound method a `RobustMethod` runs.

Example:

```python
search = SearchOptions(100, 1e-3, 1e-3)
bound = bound_method_of(twin, RobustMethod.BEST)       # BoundMethod.RELAXATION
```
"""

from __future__ import annotations

import numbers
import time
import warnings
from typing import NamedTuple

from keras_roll.compile.bounds import (
    BoundMethod,
    BoundPass,
    IntermediateBounds,
    SlopeOptions,
    check_bounds,
)
from keras_roll.compile.bounds.intermediate import DEFAULT_MAX_SECONDS
from keras_roll.compile.rules.activations import Link
from keras_roll.compile.structure import structure_of
from keras_roll.errors import UnsupportedModelError
from keras_roll.options import check_bisect_tol
from keras_roll.robust.attacks import AttackOptions
from keras_roll.robust.result import RobustMethod

__all__ = ["BranchOptions", "SearchOptions", "bound_method_of", "check_arguments",
           "check_classifier", "checked_options", "warn_saturating_link"]


def check_arguments(max_regions, bisect_tol, exact_rtol, pass_seconds):
    check_bisect_tol(bisect_tol)
    if pass_seconds is not None and not (isinstance(pass_seconds, numbers.Real)
                                         and pass_seconds > 0):
        raise ValueError(f"pass_seconds must be a positive number of seconds or None (no time "
                         f"budget), got {pass_seconds!r}.")
    if not isinstance(max_regions, numbers.Integral) or isinstance(max_regions, bool) \
            or max_regions < 1:
        raise ValueError(f"max_regions must be a positive integer, got {max_regions!r}.")
    if not (isinstance(exact_rtol, numbers.Real) and 0 <= exact_rtol < 1):
        raise ValueError(f"exact_rtol must be a relative tolerance in [0, 1), got "
                         f"{exact_rtol!r}.")


def checked_options(value, kind: type, arg: str, example: str):
    """`value` checked (`kind.checked`), `kind()` for None; a ValueError for another type."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise ValueError(f"{arg} must be a keras_roll.robust.{kind.__name__} (e.g. {example}) "
                         f"or None, got {value!r}.")
    return value.checked()


def check_classifier(lin) -> int:
    """The number of classes; refuses models whose output is not `[B, L]`, `L >= 2`."""
    shape = tuple(lin.model.outputs[0].shape[1:])
    if len(shape) != 1 or shape[0] is None or shape[0] < 2:
        raise ValueError(
            f"robust_radius needs a classifier whose output is [batch, classes] with at least "
            f"2 classes (the prediction is its argmax); model '{lin.model.name}' outputs "
            f"shape {shape}. For a single sigmoid unit, output two logits [-z, z].")
    return int(shape[0])


def warn_saturating_link(lin, rigor) -> None:
    """Warns where the guard cannot cover the output's rounding: several sigmoids."""
    if rigor.guarded and lin.output_link is Link.SIGMOID:
        warnings.warn(
            f"Model '{lin.model.name}' ends in a sigmoid: its prediction is the argmax of "
            f"sigmoid outputs, which round to 1.0 (and tie, argmax then keeping the lower "
            f"class) once a logit exceeds about 17 in float32. The lower bounds guard the "
            f"logits' rounding, not that saturation. For bounds that hold as Keras "
            f"evaluates the model, drop the final sigmoid (logits) or use a softmax.",
            stacklevel=3)


def bound_method_of(twin, method: RobustMethod) -> BoundMethod | None:
    """The bound pass of the lower bounds beyond the region, None where the method runs
    none; 'best' falls back to method 1 (None) if the passes do not cover the model."""
    if method not in (RobustMethod.BEST, RobustMethod.RELAXATION, RobustMethod.INTERVAL,
                      RobustMethod.ALPHA_CROWN):
        return None
    try:
        check_bounds(structure_of(twin.program), tuple(BoundPass))
    except UnsupportedModelError as e:
        if method is not RobustMethod.BEST:
            raise
        warnings.warn(f"robust_radius(method='best') bounds this model without the linear "
                      f"relaxation: {e}", stacklevel=3)
        return None
    return {RobustMethod.INTERVAL: BoundMethod.INTERVAL,
            RobustMethod.ALPHA_CROWN: BoundMethod.ALPHA_CROWN}.get(method,
                                                                   BoundMethod.RELAXATION)


class BranchOptions(NamedTuple):
    """Budgets of the branch and bound (`branch_radius`, `robust_radius(branch=...)`).

    Attributes:
        max_seconds: seconds per input and norm (default 30).
        max_leaves: leaves bounded per radius probed (default 20000).
        batch: leaves bounded per pass (default 64).
        beta_steps: gradient steps on the split multipliers per leaf (default 8).
        beta_rate: Adam's step on the multipliers (default 0.1).
        refine: recompute every leaf's layer bounds on its subdomain (default True;
            False keeps the ball's, cut by the splits: cheaper, looser).
        alpha: also optimize every leaf's lower slopes of the unstable units per
            margin (alpha-CROWN, with the multipliers; default True).
        candidates: units per leaf whose children one cheap pass compares before
            a split (filtered smart branching on the best BaBSR scores; default 3;
            1: BaBSR's best alone).
        layer_steps: gradient steps per layer bound of every leaf on its own split
            multipliers and slopes (beta-CROWN in the layer bounds; default 8; 0:
            CROWN's layer bounds on the cut intervals).
        clock: what `max_seconds` counts: "wall" (elapsed time, the default) or
            "cpu" (this process's CPU time, every thread's: a budget that a shared
            machine's load does not shrink).

    Example:

    ```python
    rr = keras_roll.robust_radius(model, x, y, branch=BranchOptions(max_seconds=10))
    ```
    """

    max_seconds: float = 30.0
    max_leaves: int = 20000
    batch: int = 64
    beta_steps: int = 8
    beta_rate: float = 0.1
    refine: bool = True
    alpha: bool = True
    candidates: int = 3
    layer_steps: int = 8
    clock: str = "wall"

    def now(self) -> float:
        """Seconds on the clock that `max_seconds` counts (`clock`)."""
        return time.process_time() if self.clock == "cpu" else time.monotonic()

    @staticmethod
    def of(value) -> BranchOptions | None:
        """`value` checked: None, or a `BranchOptions` (else a ValueError)."""
        if value is None:
            return None
        if not isinstance(value, BranchOptions):
            raise ValueError(f"branch must be a keras_roll.robust.BranchOptions (e.g. "
                             f"BranchOptions(max_seconds=10)) or None, got {value!r}.")
        return value.checked()

    def checked(self) -> BranchOptions:
        """The options, or a ValueError naming the bad one."""
        for name in ("max_leaves", "batch"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 2:
                raise ValueError(f"BranchOptions.{name} must be an integer >= 2, got {v!r}.")
        c = self.candidates
        if not isinstance(c, numbers.Integral) or isinstance(c, bool) or c < 1:
            raise ValueError(f"BranchOptions.candidates must be an integer >= 1, got {c!r}.")
        for name in ("beta_steps", "layer_steps"):
            steps = getattr(self, name)
            if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 0:
                raise ValueError(f"BranchOptions.{name} must be an integer >= 0, got "
                                 f"{steps!r}.")
        for name in ("max_seconds", "beta_rate"):
            v = getattr(self, name)
            if not (isinstance(v, numbers.Real) and v > 0):
                raise ValueError(f"BranchOptions.{name} must be a positive number, got {v!r}.")
        for name in ("refine", "alpha"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BranchOptions.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}.")
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"BranchOptions.clock must be 'wall' or 'cpu', got "
                             f"{self.clock!r}.")
        return self


class SearchOptions(NamedTuple):
    """The search budgets and tolerances of one call (see `robust_radius`)."""

    max_regions: int
    bisect_tol: float
    exact_rtol: float
    attack: AttackOptions = AttackOptions()
    intermediate: IntermediateBounds = IntermediateBounds.AUTO
    pass_seconds: float | None = DEFAULT_MAX_SECONDS
    branch: BranchOptions | None = None
    slopes: SlopeOptions = SlopeOptions()
