"""Method 3, beyond the region: a sound lower bound by linear relaxation (CROWN).

Over an lp ball of radius `eps` around `x`, every ReLU-family unit whose input stays
in `[l, u]` lies between two lines, `a_L z + b_L <= sigma(z) <= a_U z + b_U`. Pulling the
margins `f_y - f_j` back through the network (`keras_roll.robust.backward`), each
activation passes `Lambda+ a_L + Lambda- a_U` on for a lower bound and adds the
matching offsets; at the input the linear function is minimised over the ball in
closed form, `-eps ||Lambda_x||_q` (Zhang et al., "Efficient Neural Network
Robustness Certification with General Activation Functions", NeurIPS 2018; Singh et
al., DeepPoly, POPL 2019). The bounds `[l, u]` of every activation's input come from
the same backward pass started at that input (all its units, both signs),
intersected with interval bounds (`keras_roll.robust.intervals`), layer by layer.

Lines: the upper line of a convex piece is the chord; for the lower line the slopes
of the pieces at `l` and `u` and the chord are candidates, and the one with the
smaller area between line and function wins (CROWN's adaptive choice; for a ReLU,
slope 1 if `u >= -l` else 0). Offsets are the extremes of `sigma(v) - a v` over the
vertices (the ends and the breakpoints inside), so any slope gives a sound line, for
every piecewise-linear activation (ReLU with max_value / threshold, LeakyReLU,
PReLU of either sign).

Rounding: the rounding bound of every op (`keras_roll.robust.float_error`) enters
as `- sum |Lambda_l| Delta_l` (and widens the intervals), so that the bound holds
for the model as Keras evaluates it. See docs/design.md, section "Robustness
radius".

Example:

```python
lower = relaxation_margins(twin, x, pred, eps, p=np.inf, rigor="float64")
certified = (lower > 0).all(axis=1)
```
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from keras_roll.compile.caches import cached
from keras_roll.compile.chunking import plan_chunks
from keras_roll.robust.backward import Values, capture, compile_batched, op_graph, pull_back
from keras_roll.robust.float_error import OpRounding, abs_sum
from keras_roll.robust.intervals import (
    Box,
    activation_vertices,
    check_supported,
    interval_pass,
    margin_lower_bounds,
)
from keras_roll.robust.region import margin_rows
from keras_roll.rounding.precision import evaluation_precision, unit_roundoff

__all__ = ["Lines", "example_chunk", "margin_bounds", "relaxation_lines"]

_U64 = unit_roundoff("float64")


def relaxation_lines(op, lo: tf.Tensor, hi: tf.Tensor) -> tuple:
    """`(a_L, b_L, a_U, b_U)`: sound lines below and above `op.fn` on `[lo, hi]`.

    Args:
        op: an `Activation` (breakpoints, slopes, `fn`).
        lo, hi: `[B, *shape]` bounds of its input (`lo <= hi`).
    """
    verts = activation_vertices(op, lo, hi)
    vals = [tf.cast(op.fn(v), lo.dtype) for v in verts]
    f_lo, f_hi = vals[0], vals[1]
    width = hi - lo
    flat = width <= 1e-12 * (1.0 + tf.abs(lo) + tf.abs(hi))
    chord = tf.where(flat, op.slope(lo), (f_hi - f_lo) / tf.where(flat, tf.ones_like(width), width))
    mid = (lo + hi) / 2.0
    scale = tf.reduce_max(tf.stack([tf.abs(v) for v in vals + verts]), 0)
    best_l = best_u = None
    for a in (chord, op.slope(lo), op.slope(hi)):
        a = tf.cast(a, lo.dtype) + tf.zeros_like(lo)
        gaps = tf.stack([f - a * v for f, v in zip(vals, verts)])
        safety = 8.0 * _U64 * scale * (1.0 + tf.abs(a))
        b_l = tf.reduce_min(gaps, 0) - safety
        b_u = tf.reduce_max(gaps, 0) + safety
        if best_l is None:
            best_l, best_u = (a, b_l), (a, b_u)
            continue
        better_l = a * mid + b_l > best_l[0] * mid + best_l[1]
        better_u = a * mid + b_u < best_u[0] * mid + best_u[1]
        best_l = (tf.where(better_l, a, best_l[0]), tf.where(better_l, b_l, best_l[1]))
        best_u = (tf.where(better_u, a, best_u[0]), tf.where(better_u, b_u, best_u[1]))
    return best_l[0], best_l[1], best_u[0], best_u[1]


class Lines:
    """The relaxation of every activation, relative to the values at `x`, filled in as
    the layers are bounded; its `__call__` is `pull_back`'s `activation`."""

    def __init__(self, values: Values):
        self.values = values
        self.lines: dict = {}

    def set(self, index: int, node, box: Box) -> None:
        z0, h0 = self.values.inputs[index][0], self.values.outputs[index]
        a_l, b_l, a_u, b_u = relaxation_lines(node.op, z0 + box.lo, z0 + box.hi)
        # sigma(z) - h0 >= a_L (z - z0) + (a_L z0 + b_L - h0), likewise above.
        self.lines[index] = (a_l, a_l * z0 + b_l - h0, a_u, a_u * z0 + b_u - h0)

    def __call__(self, node, lam, values, index):
        a_l, c_l, a_u, c_u = self.lines[index]
        pos, neg = tf.maximum(lam, 0.0), tf.minimum(lam, 0.0)
        new = pos * a_l[:, None] + neg * a_u[:, None]
        const = pos * c_l[:, None] + neg * c_u[:, None]
        const = tf.reduce_sum(tf.reshape(const, tf.concat([tf.shape(const)[:2], [-1]], 0)), -1)
        return new, const


def _dual(lam_input, p):
    flat = tf.reshape(lam_input, tf.concat([tf.shape(lam_input)[:2], [-1]], 0))
    if p == 2:
        return tf.sqrt(tf.reduce_sum(flat * flat, -1))
    if p == 1:
        return tf.reduce_max(tf.abs(flat), -1)
    return tf.reduce_sum(tf.abs(flat), -1)


def _lower(graph, values, key, lam, lines, deltas, eps, p):
    """`[B, C]` lower bounds of `lam . (value(x') - value(x))` over the ball."""

    def visit(node, index, out_lam):
        d = deltas[index] if index < len(deltas) else None
        return None if d is None else -abs_sum(out_lam, d)

    res = pull_back(graph, values, key, lam, activation=lines, visit=visit)
    return res.const - tf.cast(eps, lam.dtype)[:, None] * _dual(res.lam_input, p)


def _rows_per_chunk(values, index, n, budget, b) -> int:
    """Functionals per pull-back for the `2 n` bounds of one activation input (`b`
    examples at most per call)."""
    largest = max([int(np.prod(values.x.shape[1:]))]
                  + [int(np.prod(v.shape[1:])) for v in values.outputs[:index + 1]])
    plan = plan_chunks(b, 2 * n, 3 * 8 * largest, budget, batch_size=b)
    return max(1, min(plan.per_chunk, n))


def _refiner(graph, values, lines: Lines, eps, p, budget, examples):
    """`interval_pass`'s `refine`: the relaxation's bounds of an activation's input."""

    def refine(node, index, box, boxes, deltas):
        key = node.inputs[0]
        shape = [int(d) for d in values.inputs[index][0].shape[1:]]
        n = int(np.prod(shape))
        if n == 0:
            return box
        k = _rows_per_chunk(values, index, n, budget, examples)
        dtype = values.x.dtype
        bounds = []
        for sign in (1.0, -1.0):
            parts = []
            for start in range(0, n, k):
                eye = sign * tf.one_hot(tf.range(start, min(start + k, n)), n, dtype=dtype)
                # One copy for the batch: the functionals stay shared until an
                # activation makes them per example (broadcasting does the rest).
                lam = tf.reshape(eye, [1, -1, *shape])
                parts.append(_lower(graph, values, key, lam, lines, deltas, eps, p))
            bounds.append(sign * tf.reshape(tf.concat(parts, 1), [-1, *shape]))
        tight = Box(tf.maximum(box.lo, bounds[0]), tf.minimum(box.hi, bounds[1]))
        lines.set(index, node, tight)
        return tight

    return refine


def _bounds_fn(twin, p, relax: bool, guard: bool, budget: int, examples: int, x, pred,
               eps):
    """`[B, L-1]` lower bounds of the margins `f_y - f_j` over the ball (compiled)."""
    graph = op_graph(twin.program)
    values = capture(twin.interpreter, x)
    check_supported(graph, values)
    logits = values.value(graph, graph.output_key)
    logits = tf.reshape(logits, [-1, int(np.prod(logits.shape[1:]))])
    rows, _ = margin_rows(pred, int(logits.shape[-1]), logits.dtype)
    m0 = tf.reduce_sum(rows * logits[:, None], -1)
    rounding = None
    if guard:
        rounding = OpRounding(evaluation_precision(twin.program))
        for node in graph.nodes:
            rounding.check(node)
    if not relax:
        result = interval_pass(graph, values, eps, rounding)
        return m0 + margin_lower_bounds(graph, values, result, rows)
    lines = Lines(values)
    result = interval_pass(graph, values, eps, rounding,
                           refine=_refiner(graph, values, lines, eps, p, budget,
                                                  examples))
    low = _lower(graph, values, graph.output_key, rows, lines, result.deltas, eps, p)
    return m0 + tf.maximum(low, margin_lower_bounds(graph, values, result, rows))


def margin_bounds(twin, x: np.ndarray, pred: np.ndarray, eps: np.ndarray, p,
                  relax: bool = True, guard: bool = True,
                  memory_budget: int | None = None) -> np.ndarray:
    """`[B, L-1]` lower bounds of `f_y - f_j` over the lp balls of radii `eps` (numpy).

    Args:
        twin: a float64 `Linearized`.
        x: `[B, *input_shape]` inputs (run in chunks of `example_chunk` examples).
        pred: `[B]` the classes the margins are measured from.
        eps: `[B]` radii.
        p: the norm of the balls.
        relax: the linear relaxation (True) or interval bounds alone (False).
        guard: bound the rounding of the model's evaluation.
        memory_budget: bytes of functionals per pull-back.
    """
    budget = int(memory_budget or twin.memory_budget)
    x = np.asarray(x, np.float64)
    chunk = example_chunk(twin, x.shape[1:], budget)
    key = (p, bool(relax), bool(guard), budget, chunk)
    fn = cached(twin, ("relaxation", *key), lambda: compile_batched(
        functools.partial(_bounds_fn, twin, *key), twin, "xye"))
    out = []
    for s in range(0, x.shape[0], chunk):
        out.append(fn(tf.constant(x[s:s + chunk]),
                            tf.constant(np.asarray(pred[s:s + chunk], np.int64)),
                            tf.constant(np.asarray(eps[s:s + chunk], np.float64))).numpy())
    return np.concatenate(out) if out else np.zeros((0, 0))


def example_chunk(twin, example_shape, budget: int | None = None) -> int:
    """Examples per call of `margin_bounds` such that the widest activation's `2 n`
    functionals fit in the memory budget."""
    layout = twin.layout(example_shape)
    widest = max([int(np.prod(s)) for _, _, s in layout] + [1])
    largest = max(layout.input_size, widest)
    plan = plan_chunks(64, 2 * widest, 3 * 8 * largest, int(budget or twin.memory_budget),
                       min_directions=2 * widest)
    return plan.examples_per_chunk
