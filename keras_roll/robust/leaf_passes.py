"""The compiled bound passes that the branch and bound runs on batches of leaves
(subdomains of one ball, `keras_roll.robust.subdomains`): the layer bounds of each
leaf (`LeafPasses.boxes`), the margins' bounds with the gradient of their multipliers
and slopes (`LeafPasses.bounds`), and the affine forms of leaves whose every unstable
unit is split (`LeafPasses.forms`, for `keras_roll.robust.leaf_lp`).

Example:

```python
passes = LeafPasses(twin, np.inf, True, twin.memory_budget, 64)
los, his, deltas, empty = passes.boxes(x, eps, splits)
```
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds import capture, logit_margins
from keras_roll.compile.bounds.alpha import SlopeOptions
from keras_roll.compile.bounds.ibp import Boxes
from keras_roll.compile.bounds.rules import Box, bound_rule
from keras_roll.compile.bounds.splits import (
    SplitRelaxedOps,
    leaf_forms,
    root_boxes,
    split_layout,
    split_lower_bounds,
)
from keras_roll.compile.structure import structure_of
from keras_roll.robust.arguments import BranchOptions
from keras_roll.robust.bounds import guard_arithmetic, guard_loss
from keras_roll.robust.region import guard_mode

__all__ = ["LeafPasses"]


class LeafPasses:
    """The compiled bound passes of one twin, norm and guard: the layer bounds of a
    batch of leaves (`boxes`) and their final bounds with the multipliers' gradient
    (`bounds`)."""

    def __init__(self, twin, p, guarded, budget: int, batch: int,
                 layer_steps: int = BranchOptions().layer_steps):
        self.twin, self.p, self.budget, self.batch = twin, p, budget, batch
        self.layer_options = SlopeOptions(steps=layer_steps) if layer_steps else None
        self.structure = structure_of(twin.program)
        # the rounding guard: True (the worst case), False, or a mode of `guard_mode`
        self.mode = guarded if guarded in ("none", "strict", "float64") else guard_mode(guarded)
        self.arithmetic = guard_arithmetic(twin, self.mode)
        zero = tf.zeros([1, *twin.input_shape], tf.float64)
        values = capture(twin.interpreter, zero)
        self.layout = split_layout(self.structure, values)
        out = values.value(self.structure, self.structure.output_key)
        self.rows = int(np.prod(out.shape[1:])) - 1  # the margins f_y - f_j
        self.relaxed = tuple(i for i, node in enumerate(self.structure.nodes)
                             if not bound_rule(node.op).linear)
        shape = [1, *twin.input_shape]
        f64 = tf.float64
        self.boxes = tf.function(self._boxes, autograph=False, input_signature=[
            tf.TensorSpec(shape, f64), tf.TensorSpec([], f64),
            tf.TensorSpec([None, self.layout.size], f64)])
        self._compiled_bounds = self._compiled_forms = None

    def bounds(self, x, pred, eps, los, his, deltas, splits, betas, alphas=None, rows=None):
        """`(lower [B, C], d lower / d (betas, alphas), the worst row's input
        functional, scores, the slopes used)` of a batch of `B` leaves (compiled once:
        every batch dimension is None); `alphas` `[B, C, size]` lower slopes (NaN,
        the default: CROWN's); `rows` `[B]` the rows of `los, his, deltas` that are
        these leaves' (default: all, in order)."""
        if self._compiled_bounds is None:
            def spec(t):
                return tf.TensorSpec([None, *t.shape[1:]], t.dtype)

            f64 = tf.float64
            self._compiled_bounds = tf.function(self._bounds, autograph=False, input_signature=[
                tf.TensorSpec(x.shape, f64), tf.TensorSpec([1], tf.int64),
                tf.TensorSpec([], f64), *[tf.nest.map_structure(spec, s) for s in
                                          (tuple(los), tuple(his), tuple(deltas))],
                tf.TensorSpec([None, self.layout.size], f64),
                tf.TensorSpec([None, self.rows, self.layout.size], f64),
                tf.TensorSpec([None, self.rows, self.layout.size], f64),
                tf.TensorSpec([None], tf.int32)])
        if alphas is None:
            alphas = np.full(np.shape(betas), np.nan)
        if rows is None:
            rows = np.arange(np.shape(splits)[0])
        return self._compiled_bounds(x, pred, eps, tuple(los), tuple(his), tuple(deltas),
                                     tf.constant(splits, tf.float64),
                                     tf.constant(betas, tf.float64),
                                     tf.constant(alphas, tf.float64),
                                     tf.constant(rows, tf.int32))

    def _boxes(self, x, eps, splits):
        values = capture(self.twin.interpreter, x)
        lines = SplitRelaxedOps(values, self.layout, splits)
        res = root_boxes(self.structure, values, eps, self.p, self.arithmetic, self.budget,
                         lines, examples=self.batch, loss=guard_loss(self.arithmetic),
                         layer_options=self.layer_options)
        lead = tf.shape(splits)[:1]
        keys = [self.structure.nodes[i].inputs[0] for i in self.relaxed]

        def full(t):
            return tf.broadcast_to(t, tf.concat([lead, tf.shape(t)[1:]], 0))

        los = tuple(full(res.boxes[k].lo) for k in keys)
        his = tuple(full(res.boxes[k].hi) for k in keys)
        # the rounding bounds that exist (their places are the same in every call)
        self.delta_slots = tuple(i for i, d in enumerate(res.deltas) if d is not None)
        self.nodes = len(res.deltas)
        deltas = tuple(full(res.deltas[i]) for i in self.delta_slots)
        # under "float64", the noise scales of the probabilistic guard ride with them
        noise = getattr(self.arithmetic.rounding, "noise", None) or {}
        self.noise_keys = tuple(sorted(noise))
        deltas += tuple(full(noise[k][j]) for j in (0, 1) for k in self.noise_keys)
        return los, his, deltas, lines.empty

    def _setup(self, x, pred, los, his, deltas):
        """`(logit margins, Boxes of the leaves, the margins' rows, the rounding loss)`
        inside a pass."""
        lm = logit_margins(self.twin.interpreter, x, pred)
        keys = [self.structure.nodes[i].inputs[0] for i in self.relaxed]
        deltas, noise = deltas[:len(self.delta_slots)], deltas[len(self.delta_slots):]
        k = len(self.noise_keys)
        loss = guard_loss(self.arithmetic, {key: (noise[j], noise[k + j]) for j, key in
                                            enumerate(self.noise_keys)} if k else None)
        full = [None] * self.nodes
        for i, d in zip(self.delta_slots, deltas):
            full[i] = d
        boxes = Boxes({k: Box(lo, hi) for k, lo, hi in zip(keys, los, his)}, full)
        out = lm.values.value(self.structure, self.structure.output_key)
        rows = tf.reshape(lm.rows, tf.concat([tf.shape(lm.rows)[:2], tf.shape(out)[1:]], 0))
        return lm, boxes, rows, loss

    def forms(self, x, pred, los, his, deltas, splits) -> tuple:
        """The affine forms of a batch of leaves (`leaf_lp.solve_leaves`'s `forms`,
        numpy): the margins' (with their values at `x`) and the splittable units'
        (compiled once)."""
        if self._compiled_forms is None:
            self._compiled_forms = tf.function(self._forms, autograph=False,
                                               reduce_retracing=True)
        return tuple(t.numpy() for t in self._compiled_forms(
            x, pred, tuple(los), tuple(his), tuple(deltas), tf.constant(splits, tf.float64)))

    def _forms(self, x, pred, los, his, deltas, splits):
        lm, boxes, rows, loss = self._setup(x, pred, los, his, deltas)
        res = leaf_forms(self.structure, lm.values, rows, boxes, self.layout, splits, self.p,
                         loss)
        b = tf.shape(splits)[0]
        flat = [tf.reshape(t, [b, tf.shape(t)[1], -1]) for t in
                (res.lam_input, *(lam for _, lam in res.units))]
        edge = self.layout.flat({i: t - lm.values.inputs[i][0] for i, t in
                                 zip(self.layout.indices, self.layout.breakpoints)}, [1])[0]
        return (lm.margins + res.offset, flat[0], tf.concat([o for o, _ in res.units], 1),
                tf.concat(flat[1:], 1), edge)

    def _bounds(self, x, pred, eps, los, his, deltas, splits, betas, alphas, leaves):
        los, his, deltas = (tuple(tf.gather(t, leaves) for t in part)
                            for part in (los, his, deltas))
        lm, boxes, rows, loss = self._setup(x, pred, los, his, deltas)
        with tf.GradientTape() as tape:
            tape.watch([betas, alphas])
            res = split_lower_bounds(self.structure, lm.values, rows, boxes, self.layout,
                                     splits, betas, eps, self.p, alphas, loss)
            lower = lm.margins + res.lower
            total = tf.reduce_sum(tf.where(tf.math.is_finite(lower), lower, 0.0))
        grads = tape.gradient(total, [betas, alphas],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        worst = tf.argmin(lower, axis=1, output_type=tf.int32)
        g = tf.gather(res.lam_input, worst, axis=1, batch_dims=1)
        return lower, tf.concat(grads, -1), g, res.scores, res.alphas
