"""CROWN's layer bounds with those of a larger ball: a search that probes radius after
radius around the same inputs need not relax again what a larger ball already settled.

The bounds of every relaxed op's input over the ball of radius `R` around `x` hold on
every smaller ball around the same `x`. A pass at `r <= R` may therefore intersect its
intervals with them (its *prior*): a unit the larger ball proved stable (its interval
holds no breakpoint) is stable at `r` too, its lines are exact whatever its bounds, and
CROWN's rows of it are not pulled back again (`example_rows`: the rows of each example's
own open units, not the union over the batch). The units still open are bounded by
CROWN at `r` as without a prior, on intervals that are no wider, so their bounds are no
looser; the stable units keep the prior's (or the intervals') bounds, which only enter
later ops' rounding bounds (their magnitudes). `PriorStore` keeps every example's
bounds by radius and hands each probe the tightest that holds (the smallest radius at
least as large). docs/design.md, section "Robustness radius".

Example:

```python
store = PriorStore(b)
prior = store.get(index, eps)                 # [k, width], NaN where none holds
res = relaxed_margins(twin, x[index], pred[index], eps, np.inf, prior=prior)
store.add(index, eps, res.boxes)
```
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds.margins import logit_margins
from keras_roll.compile.bounds.rules import Box, bound_rule, plain_relu
from keras_roll.compile.caches import cached
from keras_roll.compile.rules.activations import Activation

__all__ = ["PriorStore", "example_rows", "flat_boxes", "prior_boxes", "prior_open",
           "prior_width", "relaxed_layout", "skips_inactive", "stable_skip"]


def relaxed_layout(structure, values) -> list:
    """`[(op index, units)]`: the ops whose input the interval pass refines (those that
    are not linear), in the pass's order, and the units of that input per example; a
    flat prior or result of `prior_boxes` holds their lower then upper bounds."""
    out = []
    for i, node in enumerate(structure.nodes):
        rule = bound_rule(node.op)
        if rule is not None and not rule.linear:
            out.append((i, int(np.prod(values.inputs[i][0].shape[1:]))))
    return out


def prior_width(twin, shape) -> int:
    """Columns of a flat prior of the relaxation pass of a classifier's float64 twin
    on inputs of `shape` (`relaxed_layout`), from one capture, kept on the twin."""
    def make():
        lm = logit_margins(twin.interpreter, tf.zeros([1, *shape], tf.float64),
                           tf.zeros([1], tf.int64))
        return 2 * sum(n for _, n in relaxed_layout(lm.structure, lm.values))

    return cached(twin, ("prior width", tuple(shape)), make)


def prior_boxes(structure, values, prior: tf.Tensor) -> dict:
    """`{op index: Box}` of a flat `[B, width]` prior (`relaxed_layout`'s order, the
    bounds relative to the values at `x`, as `interval_pass` keeps them; NaN where an
    example has none: -inf / inf)."""
    out, at = {}, 0
    big = tf.constant(np.inf, prior.dtype)
    for i, n in relaxed_layout(structure, values):
        shape = tf.shape(values.inputs[i][0])
        lo, hi = prior[:, at:at + n], prior[:, at + n:at + 2 * n]
        out[i] = Box(tf.reshape(tf.where(tf.math.is_nan(lo), -big, lo), shape),
                     tf.reshape(tf.where(tf.math.is_nan(hi), big, hi), shape))
        at += 2 * n
    return out


def flat_boxes(structure, values, boxes: dict) -> tf.Tensor:
    """`[B, width]`: the refined intervals of the relaxed ops' inputs (`Boxes.boxes`), in
    `relaxed_layout`'s order: the prior of a later pass at a radius no larger."""
    parts = []
    for i, _ in relaxed_layout(structure, values):
        box = boxes[structure.nodes[i].inputs[0]]
        b = tf.shape(values.x)[0]
        parts += [tf.reshape(box.lo + tf.zeros_like(values.inputs[i][0]), [b, -1]),
                  tf.reshape(box.hi + tf.zeros_like(values.inputs[i][0]), [b, -1])]
    return tf.concat(parts, 1) if parts else tf.zeros([tf.shape(values.x)[0], 0],
                                                      values.x.dtype)


def prior_open(z0: tf.Tensor, box: Box) -> tuple:
    """`(lower, upper)`, `[B, n]` bool each: per example, the units of a plain ReLU's
    input whose lower (upper) bound CROWN must compute: both where the interval `box`
    (a prior's intersected in, relative to `z0`) holds 0 strictly inside; the upper one
    also where it is positive (the magnitude that later ops' rounding bounds scale
    with: a prior's, from a larger ball, would loosen them; as `crown.open_units`)."""
    b = tf.shape(z0)[0]
    lo, hi = tf.reshape(z0 + box.lo, [b, -1]), tf.reshape(z0 + box.hi, [b, -1])
    return (lo < 0) & (hi > 0), hi > 0


def stable_skip(structure, node, z0: tf.Tensor, box: Box) -> tuple | None:
    """`(lower, upper)`, `[B, n]` bool each: per example, the units of op `node`'s input
    whose rows CROWN must pull back where the op is a plain ReLU and the only op that
    reads its input: those its interval `box` (relative to `z0`) does not prove
    inactive, both rows. An inactive unit's lines are exact whatever its bounds (0,
    `rules.exact_relu_line`) and its output is 0: its bounds reach nothing else. An
    active unit keeps its lower row: its lower bound reaches the next layer's
    intervals (a looser one may open units there). None (every row) otherwise."""
    if not skips_inactive(structure, node):
        return None
    _, positive = prior_open(z0, box)
    return positive, positive


def skips_inactive(structure, node) -> bool:
    """Whether `stable_skip` names rows for op `node`: a plain ReLU, the only op that
    reads its input."""
    key = node.inputs[0]
    readers = sum(key in n.inputs for n in structure.nodes)
    return isinstance(node.op, Activation) and plain_relu(node.op) and readers == 1


def example_rows(bounds_of: Callable, need_lo, need_hi, k: int, lo, hi):
    """Refines the flat bounds `lo, hi` (`[B, n]`) by `bounds_of(lam)` (`[B, m, n]`
    functionals per example -> `[B, m]` lower bounds) of each example's own rows `+e_j`
    (where `need_lo`) and `-e_j` (where `need_hi`), `k` rows per example and pull-back
    at most, in one traced loop. An example with fewer rows than the most fills its
    chunks with rows of its other units (valid bounds: max / min keep them sound)."""
    n, dtype = int(lo.shape[1]), lo.dtype
    flags = tf.concat([need_lo, need_hi], 1)  # [B, 2n]
    counts = tf.reduce_sum(tf.cast(flags, tf.int32), 1)
    m = tf.reduce_max(tf.concat([counts, [0]], 0))
    order = tf.argsort(tf.cast(~flags, tf.int32), axis=1, stable=True)  # the needed first
    chunks = (m + k - 1) // k
    per = (m + tf.maximum(chunks, 1) - 1) // tf.maximum(chunks, 1)  # balanced, <= k
    b = tf.shape(lo)[0]
    big = tf.constant(np.inf, dtype)

    def body(i, lo_t, hi_t):
        pick = tf.gather(order, (i * per + tf.range(per)) % tf.maximum(m, 1), axis=1)
        unit, up = pick % n, pick < n  # [B, per]
        sign = tf.where(up, tf.constant(1.0, dtype), tf.constant(-1.0, dtype))
        low = bounds_of(sign[..., None] * tf.one_hot(unit, n, dtype=dtype))  # [B, per]
        at = tf.stack([tf.repeat(tf.range(b), per), tf.reshape(unit, [-1])], 1)
        lo_t = tf.tensor_scatter_nd_max(lo_t, at, tf.reshape(tf.where(up, low, -big), [-1]))
        hi_t = tf.tensor_scatter_nd_min(hi_t, at, tf.reshape(tf.where(up, big, -low), [-1]))
        return i + 1, lo_t, hi_t

    _, lo, hi = tf.while_loop(lambda i, *_: i < chunks, body,
                              (tf.constant(0, tf.int32), lo, hi), parallel_iterations=1)
    return lo, hi


class PriorStore:
    """Every example's refined bounds by radius (numpy), for the probes of a search:
    `get` hands each probe the bounds of the smallest radius at least as large as its
    own (they hold on its ball), inf where there is none.

    Example:

    ```python
    store = PriorStore(4)
    store.add(np.arange(4), eps, boxes)            # boxes [4, width]
    prior = store.get(np.arange(4), eps / 2)
    ```
    """

    def __init__(self, examples: int):
        self.seen: list = [[] for _ in range(examples)]
        self.width = None

    def add(self, index, eps, boxes: np.ndarray) -> None:
        """Keeps `boxes[k]` as the bounds of example `index[k]` at radius `eps[k]`
        (nothing where `boxes` is None or has no columns)."""
        if boxes is None:
            return
        for k, (i, e) in enumerate(zip(np.asarray(index), np.asarray(eps))):
            if boxes.shape[1] and np.isfinite(e):
                self.seen[i].append((float(e), boxes[k]))
                self.width = boxes.shape[1]

    def get(self, index, eps) -> np.ndarray | None:
        """`[k, width]`: for each `index[k]`, the bounds kept at the smallest radius
        `>= eps[k]` (NaN where none is kept: `prior_boxes` reads no bound there); None
        while nothing is kept."""
        if self.width is None:
            return None
        out = np.full((len(index), self.width), np.nan)
        for k, (i, e) in enumerate(zip(np.asarray(index), np.asarray(eps))):
            held = [(r, bx) for r, bx in self.seen[i] if r >= e]
            if held:
                out[k] = min(held, key=lambda t: t[0])[1]
        return out
