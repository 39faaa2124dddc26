"""One entry point for the bound methods: lower bounds of linear functionals of a model's
output over an lp ball, by intervals, CROWN-IBP or CROWN.

* `BoundMethod.INTERVAL`: interval bound propagation (`keras_roll.compile.bounds.ibp`),
  the functionals folded into the last linear op (Gowal et al., 2018);
* `BoundMethod.CROWN_IBP`: the intervals bound every nonlinear op's input, and one
  backward pass of the linear relaxation bounds the functionals (Zhang et al., ICLR
  2020), kept where it beats the intervals;
* `BoundMethod.RELAXATION`: the relaxation bounds every nonlinear op's input too, layer
  by layer, intersected with the intervals (CROWN: Zhang et al., NeurIPS 2018);
* `BoundMethod.ALPHA_CROWN`: CROWN's intermediate bounds, and the final bound's lower
  slopes optimized per functional row (alpha-CROWN: Xu et al., ICLR 2021;
  `keras_roll.compile.bounds.alpha`), never looser than CROWN's; its budget is a
  `SlopeOptions` (`lower_bounds(..., slopes=)`).

`lower_bounds` checks the model's ops for the method's `BoundPass`es and runs the
method's pass from the table `METHOD_PASSES` (`{BoundMethod: MethodPass}`). It is pure
TensorFlow on the values of a `capture`: it runs in a caller's graph (a training step)
and is differentiable with respect to the model's weights.
docs/design.md, section "Robustness radius".

Example:

```python
values = capture(lin.interpreter, x)
low = lower_bounds(structure_of(lin.program), values, rows, eps, np.inf,
                   BoundMethod.CROWN_IBP, arithmetic)            # [B, C]
```
"""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping
from typing import Protocol

import tensorflow as tf

from keras_roll.compile.bounds.alpha import (
    SlopeOptions,
    optimize_lower_slopes,
    optimized_refiner,
)
from keras_roll.compile.bounds.crown import RelaxedOps, relaxation_refiner, relaxed_lower_bounds
from keras_roll.compile.bounds.ibp import interval_lower_bounds, interval_pass
from keras_roll.compile.bounds.rules import Arithmetic, BoundPass, bound_rule, check_bounds
from keras_roll.compile.bounds.traversal import Values
from keras_roll.compile.chunking import DEFAULT_EXAMPLES
from keras_roll.compile.structure import ProgramStructure

__all__ = ["DEFAULT_BUDGET", "METHOD_PASSES", "BoundMethod", "IntervalPasses", "MethodPass",
           "lower_bounds"]

DEFAULT_BUDGET = 64 * 2**20  # bytes of functionals per pull-back of CROWN's layer bounds


class BoundMethod(enum.Enum):
    """How `lower_bounds` bounds the functionals (see the module docstring)."""

    INTERVAL = "interval"
    CROWN_IBP = "crown_ibp"
    RELAXATION = "relaxation"
    ALPHA_CROWN = "alpha_crown"

    @property
    def passes(self) -> tuple:
        """The `BoundPass`es the method runs: the intervals alone, or with the relaxation
        (every method but `INTERVAL`)."""
        relaxed = self is not BoundMethod.INTERVAL
        return (BoundPass.INTERVAL, BoundPass.RELAXATION) if relaxed else (BoundPass.INTERVAL,)


def _output_rows(structure: ProgramStructure, values: Values, rows: tf.Tensor) -> tf.Tensor:
    """`rows` `[B, C, L]` shaped `[B, C, *output_shape]`."""
    out = values.value(structure, structure.output_key)
    return tf.reshape(rows, tf.concat([tf.shape(rows)[:2], tf.shape(out)[1:]], 0))


class IntervalPasses:
    """One interval pass over a batch, shared by the interval and CROWN-IBP bounds of
    any number of sets of functionals (certified training mixes both).

    Args:
        structure, values: the program's `ProgramStructure` and a `capture` of the batch.
        eps, p, arithmetic: as `lower_bounds`.

    Raises:
        UnsupportedModelError: an op the interval pass does not bound, naming it.

    Example:

    ```python
    passes = IntervalPasses(structure, values, 0.1, np.inf, arithmetic)
    ibp = passes.interval(shared_rows)              # [B, C]; rows [1, C, L] or [B, C, L]
    crown = passes.crown_ibp(rows)                  # [B, C]; the relaxation's pass
    ```
    """

    def __init__(self, structure: ProgramStructure, values: Values, eps, p,
                 arithmetic: Arithmetic):
        check_bounds(structure, BoundPass.INTERVAL, values.masks)
        self.structure, self.values, self.eps, self.p = structure, values, eps, p
        self.boxes = interval_pass(structure, values, eps, arithmetic)

    def interval(self, rows: tf.Tensor) -> tf.Tensor:
        """`[B, C]` interval lower bounds of `rows . (f(x') - f(x))` (`rows` `[B, C, L]`,
        or `[1, C, L]` shared by the batch)."""
        rows = _output_rows(self.structure, self.values, rows)
        return interval_lower_bounds(self.structure, self.values, self.boxes, rows)

    def crown_ibp(self, rows: tf.Tensor, interval: tf.Tensor | None = None) -> tf.Tensor:
        """`[B, C]` CROWN-IBP lower bounds of `rows . (f(x') - f(x))`: the relaxation's
        backward pass on the intervals' bounds of every nonlinear op's input, kept where
        it beats the intervals (`interval`: `self.interval(rows)` if the caller has it)."""
        structure, values = self.structure, self.values
        check_bounds(structure, BoundPass.RELAXATION, values.masks)
        lines = RelaxedOps(values)
        for i, node in enumerate(structure.nodes):
            if not bound_rule(node.op).linear:
                lines.set(i, node, self.boxes.boxes[node.inputs[0]])
        rows = _output_rows(structure, values, rows)
        low = relaxed_lower_bounds(structure, values, structure.output_key, rows, lines,
                                   self.boxes.deltas, self.eps, self.p)
        if interval is None:
            interval = interval_lower_bounds(structure, values, self.boxes, rows)
        return tf.maximum(low, interval)


# --------------------------------------------------------------------------- the methods' passes


class MethodPass(Protocol):
    """What `METHOD_PASSES` maps a `BoundMethod` to: `lower_bounds` after its checks,
    with `examples` resolved to an int."""

    def __call__(self, structure: ProgramStructure, values: Values, rows: tf.Tensor, eps, p,
                 arithmetic: Arithmetic, budget: int, examples: int,
                 slopes: SlopeOptions) -> tf.Tensor: ...


def _interval(structure, values, rows, eps, p, arithmetic, budget, examples, slopes):
    return IntervalPasses(structure, values, eps, p, arithmetic).interval(rows)


def _crown_ibp(structure, values, rows, eps, p, arithmetic, budget, examples, slopes):
    return IntervalPasses(structure, values, eps, p, arithmetic).crown_ibp(rows)


def _relaxation(structure, values, rows, eps, p, arithmetic, budget, examples, slopes,
                optimize=False):
    lines = RelaxedOps(values)
    refine = relaxation_refiner(structure, values, lines, eps, p, budget, examples)
    if optimize and slopes.intermediate:
        refine = optimized_refiner(refine, structure, values, lines, eps, p, budget, examples,
                                   slopes)
    boxes = interval_pass(structure, values, eps, arithmetic, refine=refine)
    rows = _output_rows(structure, values, rows)

    def bound():
        return (relaxed_lower_bounds(structure, values, structure.output_key, rows, lines,
                                     boxes.deltas, eps, p),)

    (low,) = optimize_lower_slopes(lines, bound, tf.shape(rows)[1], slopes) if optimize \
        else bound()
    return tf.maximum(low, interval_lower_bounds(structure, values, boxes, rows))


def _alpha_crown(structure, values, rows, eps, p, arithmetic, budget, examples, slopes):
    return _relaxation(structure, values, rows, eps, p, arithmetic, budget, examples, slopes,
                       optimize=True)


METHOD_PASSES: Mapping[BoundMethod, MethodPass] = types.MappingProxyType({
    BoundMethod.INTERVAL: _interval,
    BoundMethod.CROWN_IBP: _crown_ibp,
    BoundMethod.RELAXATION: _relaxation,
    BoundMethod.ALPHA_CROWN: _alpha_crown,
})
"""The pass of every `BoundMethod` (`lower_bounds` dispatches through it; read-only)."""


def lower_bounds(structure: ProgramStructure, values: Values, rows: tf.Tensor, eps, p,
                 method: BoundMethod, arithmetic: Arithmetic, budget: int = DEFAULT_BUDGET,
                 examples: int | None = None,
                 slopes: SlopeOptions | None = None) -> tf.Tensor:
    """`[B, C]` lower bounds of `rows . (f(x') - f(x))` over the lp ball of radius `eps`.

    Args:
        structure: the program's `ProgramStructure`.
        values: a `capture` of the batch `x`.
        rows: `[B, C, L]` functionals of the flattened output `f` (e.g. `e_y - e_j`).
        eps: `[B]` radii (or a scalar).
        p: the norm of the ball (1, 2 or `np.inf`); intervals use its bounding box.
        method: a `BoundMethod`.
        arithmetic: the ops' `|A|` and optional rounding (`Arithmetic`).
        budget: bytes of functionals per pull-back of CROWN's layer bounds.
        examples: examples per call, for CROWN's chunks (default the static batch
            size, else 64).
        slopes: the budget of `BoundMethod.ALPHA_CROWN`'s optimization, a
            `SlopeOptions` (default `SlopeOptions()`: 20 Adam steps); ignored by the
            other methods.

    Raises:
        UnsupportedModelError: an op the method's passes do not bound, naming it.

    Example:

    ```python
    low = lower_bounds(structure, values, rows, eps, 2, BoundMethod.RELAXATION, arithmetic)
    low = lower_bounds(structure, values, rows, eps, 2, BoundMethod.ALPHA_CROWN, arithmetic,
                       slopes=SlopeOptions(steps=50))
    ```
    """
    method = BoundMethod(method)
    check_bounds(structure, method.passes, values.masks)
    b = int(examples or values.x.shape[0] or DEFAULT_EXAMPLES)
    slopes = SlopeOptions() if slopes is None else SlopeOptions(*slopes).checked()
    return METHOD_PASSES[method](structure, values, rows, eps, p, arithmetic, budget, b, slopes)
