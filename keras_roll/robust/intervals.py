"""Interval bounds over an lp ball: the fallback of the linear relaxation, and a method.

Interval bound propagation (Gowal et al., 2018) carries, for every value of the
network, an elementwise interval over the ball: through the linear part `A` of an op,
centre `A c` and radius `|A| r` (the op's rounding rule's `magnitude`, the same `|A|`
the rounding bound uses); through a ReLU-family activation, its range over the
interval (the extremes of a piecewise-linear function lie at the ends or at
breakpoints). Intervals are kept
relative to the values at `x` (`value(x') - value(x)`), which keeps them accurate in
float64 far below the values' own magnitudes, and widened by the rounding bound of
every op (`keras_roll.robust.float_error`) so that they hold for the model's own
evaluation. The ball enters as its bounding box (exact for l_inf, loose for l2 and
l1). The final margins `f_y - f_j` are bounded with the specification folded into the
last affine op (`margin_lower_bounds`). See docs/design.md, section "Robustness radius".

Example:

```python
boxes = interval_pass(graph, values, eps, rounding)
lower = margin_lower_bounds(graph, values, boxes, rows)    # [B, L-1]
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import tensorflow as tf

from keras_roll.compile.rules.activations import Activation
from keras_roll.compile.rules.affine import Identity, LayerCall
from keras_roll.compile.rules.base import NO_RECORD, Linear, Tangent
from keras_roll.errors import UnsupportedModelError
from keras_roll.robust.backward import OpGraph, Values, linear_transpose
from keras_roll.robust.float_error import abs_sum
from keras_roll.rounding import rules

__all__ = [
    "Box",
    "Boxes",
    "activation_vertices",
    "check_supported",
    "interval_pass",
    "margin_lower_bounds",
]

SUPPORTED = (Linear, LayerCall, Identity, Activation)


class Box(NamedTuple):
    """Elementwise bounds on `value(x') - value(x)` over the ball, `[B, *shape]` each."""

    lo: tf.Tensor
    hi: tf.Tensor


class Boxes(NamedTuple):
    """The result of `interval_pass`.

    Attributes:
        boxes: `{key: Box}` for every value (activation inputs tightened by `refine`).
        deltas: per node, the `[B, *out]` rounding bound of its output, or None.
    """

    boxes: dict
    deltas: list


def check_supported(graph: OpGraph, values: Values | None = None) -> None:
    """Refuses ops the relaxation does not bound, naming the layer.

    Raises:
        UnsupportedModelError: for max pooling, recurrent layers, masking, custom ops.
    """
    for i, node in enumerate(graph.nodes):
        masked = values is not None and values.masks[i] is not None
        if not isinstance(node.op, SUPPORTED) or masked:
            raise UnsupportedModelError(
                f"Layer '{node.name}' ({type(node.layer).__name__}) is not supported by the "
                f"linear relaxation and interval bounds of robust_radius, which cover "
                f"Dense, convolutions, BatchNormalization, average pooling, reshapes, "
                f"Add / Concatenate and ReLU-family activations"
                f"{' (without a sequence mask)' if masked else ''}. Use method='region' or "
                f"'walk' for this model; method='best' falls back to them.")


def activation_vertices(op: Activation, lo: tf.Tensor, hi: tf.Tensor) -> list:
    """The points where a piecewise-linear activation on `[lo, hi]` takes its extremes
    and where any linear function minus it does: the ends and the breakpoints inside
    (breakpoints outside are clipped to an end)."""
    out = [lo, hi]
    for b in op.breakpoints:
        out.append(tf.clip_by_value(tf.cast(b, lo.dtype) + tf.zeros_like(lo), lo, hi))
    return out


def _activation_box(op, z0, h0, box: Box) -> Box:
    lo, hi = z0 + box.lo, z0 + box.hi
    vals = [tf.cast(op.fn(v), lo.dtype) for v in activation_vertices(op, lo, hi)]
    return Box(tf.reduce_min(tf.stack(vals), 0) - h0, tf.reduce_max(tf.stack(vals), 0) - h0)


def _linear_box(node, boxes: list) -> Box:
    centres = [Tangent((b.lo + b.hi) / 2.0, shared=True) for b in boxes]
    radii = [(b.hi - b.lo) / 2.0 for b in boxes]
    c = node.op.tangent(centres, NO_RECORD, None)[0].value
    r = rules.magnitude(node.op, radii, NO_RECORD, False, None)
    return Box(c - r, c + r)


def interval_pass(graph: OpGraph, values: Values, eps: tf.Tensor, rounding=None,
                  refine: Callable | None = None) -> Boxes:
    """Intervals of every value over the lp ball of radius `eps` around `x`.

    Args:
        graph, values: the `OpGraph` and a `capture` of the batch.
        eps: `[B]` radii; the ball enters as the box `|x' - x| <= eps`.
        rounding: an `OpRounding`, or None for exact arithmetic.
        refine: optional `refine(node, index, box, boxes, deltas) -> Box` called on the
            input box of every activation before it is used (the linear
            relaxation tightens it); the result is intersected with the box.

    Returns:
        `Boxes`.
    """
    x = values.x
    e = tf.reshape(tf.cast(eps, x.dtype), tf.concat([[-1], tf.ones(tf.rank(x) - 1, tf.int32)],
                                                     0))
    boxes = {graph.input_key: Box(-e + tf.zeros_like(x), e + tf.zeros_like(x))}
    deltas: list = []
    for i, node in enumerate(graph.nodes):
        ins = [boxes[k] for k in node.inputs]
        if node.is_activation:
            if refine is not None:
                tight = refine(node, i, ins[0], boxes, deltas)
                ins = [Box(tf.maximum(ins[0].lo, tight.lo), tf.minimum(ins[0].hi, tight.hi))]
                boxes[node.inputs[0]] = ins[0]
            out = _activation_box(node.op, values.inputs[i][0], values.outputs[i], ins[0])
        else:
            out = _linear_box(node, ins)
        delta = None
        if rounding is not None:
            mags = [tf.maximum(tf.abs(a + b.lo), tf.abs(a + b.hi))
                    for a, b in zip(values.inputs[i], ins)]
            delta = rounding(node, mags, values.records[i], values.masks[i],
                             values=values.inputs[i])
        if delta is not None:
            out = Box(out.lo - delta, out.hi + delta)
        deltas.append(delta)
        boxes[node.output] = out
    return Boxes(boxes, deltas)


def margin_lower_bounds(graph: OpGraph, values: Values, result: Boxes, rows: tf.Tensor):
    """`[B, C]` lower bounds of `rows . (f(x') - f(x))` from intervals, the rows folded
    into the last op when it is affine (else applied to the output intervals)."""
    index = graph.producer[graph.output_key]
    node = graph.nodes[index]
    if node.is_activation:
        box = result.boxes[graph.output_key]
        return _box_lower(rows, box)
    lams = linear_transpose(node, rows, values.inputs[index])
    lower = tf.zeros(tf.shape(rows)[:2], rows.dtype)
    for key, lam in zip(node.inputs, lams):
        lower += _box_lower(lam, result.boxes[key])
    if result.deltas[index] is not None:
        lower -= abs_sum(rows, result.deltas[index])
    return lower


def _box_lower(lam, box: Box):
    """`[B, C]`: the minimum of `lam . v` over `v` in the box."""
    pos, neg = tf.maximum(lam, 0.0), tf.minimum(lam, 0.0)
    prod = pos * box.lo[:, None] + neg * box.hi[:, None]
    return tf.reduce_sum(tf.reshape(prod, tf.concat([tf.shape(prod)[:2], [-1]], 0)), -1)

