"""Interval bound propagation over the program: elementwise intervals of every value over
the box around `x`.

Interval bound propagation (Gowal et al., 2018) carries, for every value of the
network, an elementwise interval over the set of inputs, op by op through each op's
`BoundRule` (`keras_roll.compile.bounds.rules`): through an affine op, centre `A c` and
radius `|A| r`; through a ReLU-family activation, its range over the interval (the
extremes of a piecewise-linear function lie at the ends or at breakpoints). Intervals
are kept relative to the values at `x` (`value(x') - value(x)`), which keeps them
accurate in float64 far below the values' own magnitudes, and widened by the rounding
bound of every op when the `Arithmetic` has one. The input set enters as the box
`|x' - x| <= eps` (the bounding box of any lp ball: exact for l_inf). Linear
functionals of the output are bounded with the specification folded into the last
linear op (`interval_lower_bounds`). See docs/design.md, section "Robustness radius".

Example:

```python
boxes = interval_pass(structure, values, eps, arithmetic)
lower = interval_lower_bounds(structure, values, boxes, rows)     # [B, C]
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import tensorflow as tf

from keras_roll.compile.bounds.rules import (
    Arithmetic,
    BoundPass,
    Box,
    OpValues,
    bound_rule,
    check_bounds,
)
from keras_roll.compile.bounds.traversal import Values, linear_transpose
from keras_roll.compile.structure import ProgramStructure

__all__ = ["Boxes", "RoundingLoss", "abs_sum", "box_lower", "interval_lower_bounds",
           "interval_pass"]


class Boxes(NamedTuple):
    """The result of `interval_pass`.

    Attributes:
        boxes: `{key: Box}` for every value (activation inputs tightened by `refine`).
        deltas: per node, the `[B, *out]` rounding bound of its output, or None.
    """

    boxes: dict
    deltas: list


def interval_pass(structure: ProgramStructure, values: Values, eps: tf.Tensor,
                  arithmetic: Arithmetic, refine: Callable | None = None) -> Boxes:
    """Intervals of every value over the box of radius `eps` around `x`.

    Args:
        structure, values: the program's `ProgramStructure` and a `capture` of the batch.
        eps: `[B]` radii (or a scalar); the set enters as the box `|x' - x| <= eps`.
        arithmetic: the ops' `|A|` and, optionally, their rounding (`Arithmetic`).
        refine: optional `refine(node, index, box, boxes, deltas) -> Box` called on the
            input box of every op that is not linear before it is used (the linear
            relaxation tightens it); the result is intersected with the box.

    Returns:
        `Boxes`.

    Raises:
        UnsupportedModelError: an op without a bound rule, or under a Keras mask.

    Example:

    ```python
    boxes = interval_pass(structure, values, tf.fill([b], 0.1), arithmetic)
    ```
    """
    check_bounds(structure, BoundPass.INTERVAL, values.masks)
    x = values.x
    radius = tf.cast(eps, x.dtype)  # a scalar or [B]
    e = radius
    if e.shape.rank != 0:
        e = tf.reshape(e, tf.concat([[-1], tf.ones(tf.rank(x) - 1, tf.int32)], 0))
    ball = Box(-e + tf.zeros_like(x), e + tf.zeros_like(x))
    boxes = {structure.input_key: ball}
    deltas: list = []
    for i, node in enumerate(structure.nodes):
        rule = bound_rule(node.op)
        ins = [boxes[k] for k in node.inputs]
        at = OpValues(values.inputs[i], values.outputs[i], values.records[i], values.masks[i])
        if refine is not None and not rule.linear:
            tight = refine(node, i, ins[0], boxes, deltas)
            ins = [Box(tf.maximum(ins[0].lo, tight.lo), tf.minimum(ins[0].hi, tight.hi))]
            boxes[node.inputs[0]] = ins[0]
        out = None
        if boxes[structure.input_key] is ball and all(k == structure.input_key
                                                      for k in node.inputs):
            out = rule.centred_interval(node.op, radius, at, arithmetic)
        if out is None:
            out = rule.interval(node.op, ins, at, arithmetic)
        delta = None
        if arithmetic.rounding is not None:
            mags = [tf.maximum(tf.abs(a + b.lo), tf.abs(a + b.hi))
                    for a, b in zip(values.inputs[i], ins)]
            delta = arithmetic.rounding(node, mags, values.records[i], values.masks[i],
                                        values=values.inputs[i])
        if delta is not None:
            out = Box(out.lo - delta, out.hi + delta)
        deltas.append(delta)
        boxes[node.output] = out
    return Boxes(boxes, deltas)


def interval_lower_bounds(structure: ProgramStructure, values: Values, result: Boxes,
                          rows: tf.Tensor) -> tf.Tensor:
    """`[B, C]` lower bounds of `rows . (f(x') - f(x))` from intervals, the rows folded
    into the last op when it is linear (else applied to the output intervals).

    Example:

    ```python
    lower = interval_lower_bounds(structure, values, interval_pass(...), rows)
    ```
    """
    index = structure.producer[structure.output_key]
    node = structure.nodes[index]
    if not bound_rule(node.op).linear:
        return box_lower(rows, result.boxes[structure.output_key])
    lams = linear_transpose(node, rows, values.inputs[index])
    lower = tf.zeros(tf.shape(rows)[:2], rows.dtype)
    for key, lam in zip(node.inputs, lams):
        lower += box_lower(lam, result.boxes[key])
    if result.deltas[index] is not None:
        lower -= abs_sum(rows, result.deltas[index])
    return lower


def box_lower(lam: tf.Tensor, box: Box) -> tf.Tensor:
    """`[B, C]`: the minimum of `lam . v` over `v` in the box, `Lambda+ lo + Lambda- hi`
    summed by products (one matmul for functionals shared by the batch, `B = 1`)."""
    pos = tf.maximum(lam, 0.0)
    pos, neg = _flat_rows(pos), _flat_rows(lam - pos)  # lam - pos = min(lam, 0), exactly
    lo, hi = _flat_rows(box.lo[:, None])[:, 0], _flat_rows(box.hi[:, None])[:, 0]
    if lam.shape[0] == 1:
        return (tf.matmul(lo, pos[0], transpose_b=True)
                + tf.matmul(hi, neg[0], transpose_b=True))
    return tf.einsum("bcn,bn->bc", pos, lo) + tf.einsum("bcn,bn->bc", neg, hi)


def _flat_rows(t: tf.Tensor) -> tf.Tensor:
    return tf.reshape(t, tf.concat([tf.shape(t)[:2], [-1]], 0))


def abs_sum(lam: tf.Tensor, delta: tf.Tensor) -> tf.Tensor:
    """`[B, C]`: `sum |Lambda| Delta` over the elements of every row, as products (one
    matmul for functionals shared by the batch, `B = 1`; no `[B, C, n]` temporary)."""
    a = _flat_rows(tf.abs(lam))
    d = tf.reshape(delta, tf.stack([tf.shape(delta)[0], -1]))
    if lam.shape[0] == 1:
        return tf.matmul(d, a[0], transpose_b=True)
    return tf.linalg.matvec(a, d)


class RoundingLoss:
    """What functionals pulled back through the ops lose to the ops' rounding: the worst
    case `sum_l |Lambda_l| Delta_l` over the `deltas` of `interval_pass` (`Boxes.deltas`).
    `visit` is `pull_back`'s `visit`, `total` the loss once the pull-back is done. A
    caller with a tighter model of rounding subclasses it (the default rigor of
    `keras_roll.robust` does: `keras_roll.robust.bounds`).

    Example:

    ```python
    loss = RoundingLoss(boxes.deltas)
    res = pull_back(structure, values, key, lam, relax=lines, visit=loss.visit)
    lower = res.const - loss.total(tf.zeros_like(res.const))
    ```
    """

    def __init__(self, deltas: list):
        self.deltas = deltas
        self.strict: list = []
        # `fn(tensor, key)` that cuts a subclass's own per-op tensors the way `deltas`
        # were cut, in a pull-back on windows (`keras_roll.compile.bounds.windows`)
        self.crop = None

    def delta(self, index: int):
        """Op `index`'s rounding bound, or None (no rounding, or not bounded yet)."""
        return self.deltas[index] if index < len(self.deltas) else None

    def visit(self, node, index: int, lam: tf.Tensor) -> None:
        d = self.delta(index)
        if d is not None:
            self.strict.append(abs_sum(lam, d))

    def total(self, zero: tf.Tensor) -> tf.Tensor:
        """`[B, C]`: what the functionals lose (`zero` where nothing rounds)."""
        return tf.add_n(self.strict) if self.strict else zero
