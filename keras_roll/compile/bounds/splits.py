"""The linear relaxation on subdomains of the ball fixed by splits of activation units
(branch and bound, beta-CROWN).

A *split* of an activation unit `j` with one breakpoint `t` (ReLU: `t = 0`) restricts
the ball to the half where its pre-activation `z_j` stays on one side: `s_j = +1`
(active, `z_j >= t`) or `s_j = -1` (inactive, `z_j <= t`). On that subdomain the unit
is linear, so its input interval is cut at `t` (`[max(l, t), u]` or `[l, min(u, t)]`)
and the relaxation's lines on the cut interval are the unit's own piece: every bound
of the relaxation stays sound on the subdomain, since it is a subset of the ball.

The split constraints `s_j (z_j - t) >= 0` enter the final backward pass as Lagrange
terms (Wang et al., "Beta-CROWN: Efficient Bound Propagation with Per-neuron Split
Constraints for Neural Network Robustness Verification", NeurIPS 2021): for any
`beta_j >= 0`, `f(x') >= f(x') - sum_j beta_j s_j (z_j(x') - t)` on the subdomain, so
the pull-back adds `-beta_j s_j` to the functional at `z_j` and the matching offset.
Every `beta >= 0` gives a sound bound; the search maximises the bound over them.

Subdomains are a batch: `B` rows of splits for the one input `x` the values were
captured at (batch 1), each with its own lines (`SplitRelaxedOps`), pulled back
together.

Example:

```python
layout = split_layout(structure, values)
boxes = root_boxes(structure, values, eps, p, arithmetic, budget)
res = split_lower_bounds(structure, values, rows, boxes, layout, splits, betas, eps, p)
res.lower          # [B, C] bounds of rows . (f(x') - f(x)) on every subdomain
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds.alpha import MAX_LAYER_CHUNKS, SlopeOptions, optimize_lower_slopes
from keras_roll.compile.bounds.crown import (
    RelaxedOps,
    relaxation_refiner,
    relaxed_form,
    relaxed_lower_bounds,
)
from keras_roll.compile.bounds.ibp import Boxes, RoundingLoss, interval_pass
from keras_roll.compile.bounds.rules import Arithmetic, Box, bound_rule
from keras_roll.compile.bounds.traversal import Values
from keras_roll.compile.rules.activations import Activation
from keras_roll.compile.structure import ProgramStructure

# Functional entries per leaf (2 n rows of the widest value) up to which a layer's
# bounds are optimized on every leaf: on a 2-D 16-16 net (512) the optimized bounds
# cut the leaves of a ball 20-fold; on a 784-100-100-10 MLP (157k) 8 steps made each
# pass about 8 times dearer and, in 30 s per image, moved no bound (docs/results.md).
MAX_LAYER_ENTRIES = 2**16

__all__ = ["MAX_LAYER_ENTRIES", "LeafForms", "SplitBounds", "SplitLayout", "SplitRelaxedOps",
           "leaf_forms", "root_boxes", "split_layout", "split_lower_bounds", "split_refiner",
           "split_row_bounds"]


class SplitLayout(NamedTuple):
    """The units that can be split: activations with one breakpoint, flattened in
    program order into one vector of `size` neurons.

    Attributes:
        indices: the node index of every splittable op.
        shapes: per op, the per-example shape of its input.
        offsets: per op, the position of its first neuron in the flat vector.
        breakpoints: per op, its breakpoint `t`.
        size: neurons in all.
    """

    indices: tuple
    shapes: tuple
    offsets: tuple
    breakpoints: tuple
    size: int

    def per_node(self, flat: tf.Tensor) -> dict:
        """`{node index: [..., *shape]}` slices of `flat` `[..., size]`."""
        lead = tf.shape(flat)[:-1]
        out = {}
        for index, shape, start in zip(self.indices, self.shapes, self.offsets):
            n = int(np.prod(shape))
            out[index] = tf.reshape(flat[..., start:start + n], tf.concat([lead, shape], 0))
        return out

    def flat(self, per_node: dict, lead) -> tf.Tensor:
        """The inverse of `per_node`: `[*lead, size]`."""
        parts = [tf.reshape(per_node[i], tf.concat([lead, [-1]], 0)) for i in self.indices]
        return tf.concat(parts, -1) if parts else tf.zeros(tf.concat([lead, [0]], 0))


def split_layout(structure: ProgramStructure, values: Values) -> SplitLayout:
    """The `SplitLayout` of a program (shapes from a `capture`).

    Example:

    ```python
    layout = split_layout(structure_of(twin.program), capture(twin.interpreter, x))
    layout.size        # neurons that can be split
    ```
    """
    indices, shapes, offsets, points = [], [], [], []
    total = 0
    for index, node in enumerate(structure.nodes):
        op = node.op
        if isinstance(op, Activation) and len(op.breakpoints) == 1:
            shape = tuple(int(d) for d in values.inputs[index][0].shape[1:])
            indices.append(index)
            shapes.append(shape)
            offsets.append(total)
            points.append(float(op.breakpoints[0]))
            total += int(np.prod(shape))
    return SplitLayout(tuple(indices), tuple(shapes), tuple(offsets), tuple(points), total)


class SplitRelaxedOps(RelaxedOps):
    """`RelaxedOps` on `B` subdomains: each splittable op's input interval is cut by the
    splits before its lines are set, and with `betas` the final pull-back carries the
    split constraints' Lagrange terms.

    Args:
        values: a `capture` of the one input `x` (batch 1).
        layout: the program's `SplitLayout`.
        splits: `[B, size]` +1 (active), -1 (inactive) or 0 (not split).
        betas: None, or `[B, C, size]` multipliers `>= 0` for `C` functionals
            (read by `__call__` once `use_betas` is set).

    Example:

    ```python
    lines = SplitRelaxedOps(values, layout, splits, betas)
    for index, box in boxes.items():
        lines.set(index, structure.nodes[index], box)
    lines.use_betas = True
    ```
    """

    def __init__(self, values: Values, layout: SplitLayout, splits: tf.Tensor,
                 betas: tf.Tensor | None = None):
        super().__init__(values)
        self.layout = layout
        self.signs = layout.per_node(tf.cast(splits, values.x.dtype))
        self.betas = None if betas is None else layout.per_node(betas)
        self.points = dict(zip(layout.indices, layout.breakpoints))
        self.use_betas = False
        self.seen: dict = {}  # the functionals of each relaxed op's output, last pass
        self.cut: dict = {}   # the input intervals the lines were set on (relative)
        self.empty = tf.zeros(tf.shape(splits)[:1], tf.bool)

    def edge(self, index: int) -> tf.Tensor:
        """`[1, *shape]`: the breakpoint of op `index` relative to its input at `x`."""
        return self.points[index] - self.values.inputs[index][0]

    def restrict(self, index: int, box: Box) -> Box:
        """`box` cut by the splits of op `index` (unchanged for other ops); a subdomain
        whose cut is empty is marked in `empty` (it holds no point)."""
        if index not in self.signs:
            return box
        s, edge = self.signs[index], self.edge(index)
        lo = tf.where(s > 0, tf.maximum(box.lo, edge), box.lo + tf.zeros_like(s))
        hi = tf.where(s < 0, tf.minimum(box.hi, edge), box.hi + tf.zeros_like(s))
        axes = tuple(range(1, lo.shape.rank))
        self.empty = self.empty | tf.reduce_any(lo > hi, axis=axes)
        return Box(lo, tf.maximum(lo, hi))

    def set(self, index: int, node, box: Box) -> None:
        box = self.restrict(index, box)
        self.cut[index] = box
        super().set(index, node, box)

    def __call__(self, node, lam, values, index):
        out = super().__call__(node, lam, values, index)
        if out is None:
            return None
        self.seen[index] = lam
        if not self.use_betas or self.betas is None or index not in self.signs:
            return out
        new, const = out
        bs = self.betas[index] * self.signs[index][:, None]  # [B, C, *shape]
        new = new - bs
        term = bs * (-self.edge(index))[:, None]  # beta s (z0 - t)
        const = const - tf.reduce_sum(tf.reshape(term, tf.concat([tf.shape(term)[:2], [-1]],
                                                                 0)), -1)
        return new, const

    def scores(self, worst: tf.Tensor) -> tf.Tensor:
        """`[B, size]` BaBSR scores of the last pass (Bunel et al., "Branch and Bound for
        Piecewise Linear Neural Network Verification", JMLR 2020): for an unstable
        unsplit unit, the offset its upper line costs the bound of row `worst` `[B]`,
        `max(-Lambda_j, 0) * b_U,j`, plus a share of its interval's narrower side (so
        that every unstable unit scores above the stable ones); 0 for the others."""
        parts = {}
        for index in self.layout.indices:
            lam = self.seen.get(index)
            box = self.cut.get(index)
            if lam is None or box is None:
                parts[index] = tf.zeros_like(self.signs[index])
                continue
            lam = tf.gather(lam, worst, axis=1, batch_dims=1)  # [B, *shape]
            a_l, c_l, a_u, c_u = self.lines[index]
            z0, h0 = self.values.inputs[index][0], self.values.outputs[index]
            b_u = c_u - a_u * z0 + h0 - (c_l - a_l * z0 + h0)  # the lines' offset gap at 0
            edge = self.edge(index)
            open_ = (box.lo < edge) & (box.hi > edge) & tf.equal(self.signs[index], 0.0)
            side = tf.minimum(edge - box.lo, box.hi - edge)
            score = tf.maximum(-lam, 0.0) * tf.abs(b_u) + 1e-9 * side
            parts[index] = tf.where(open_, score, tf.zeros_like(score))
        return self.layout.flat(parts, tf.shape(self.empty))


def root_boxes(structure: ProgramStructure, values: Values, eps, p, arithmetic: Arithmetic,
               budget: int, lines: RelaxedOps | None = None, examples: int = 1,
               loss=RoundingLoss, layer_options: SlopeOptions | None = None) -> Boxes:
    """The layer bounds of CROWN over the ball (`relaxation_refiner` on every nonlinear
    op's input, intersected with intervals), on `lines` (default plain `RelaxedOps`;
    a `SplitRelaxedOps` cuts every split unit's interval, so the bounds of later
    layers hold on each subdomain and are tighter there). `loss`: how CROWN's
    pull-backs sum the rounding terms (`relaxation_refiner`'s). `layer_options`
    (with a `SplitRelaxedOps`): each layer bound raised further by its own split
    multipliers and slopes (`split_refiner`).

    Example:

    ```python
    boxes = root_boxes(structure, values, eps, np.inf, arithmetic, 64 * 2**20)
    ```
    """
    lines = RelaxedOps(values) if lines is None else lines
    refine = relaxation_refiner(structure, values, lines, eps, p, budget, examples, loss)
    if not isinstance(lines, SplitRelaxedOps):
        return interval_pass(structure, values, eps, arithmetic, refine=refine)
    if layer_options is not None and layer_options.steps > 0:
        refine = split_refiner(refine, structure, values, lines, eps, p, loss, layer_options,
                               budget, examples)

    def cut(node, index, box, boxes, deltas):
        refine(node, index, box, boxes, deltas)
        return lines.cut[index]

    return interval_pass(structure, values, eps, arithmetic, refine=cut)


def split_refiner(refine: Callable, structure: ProgramStructure, values: Values,
                  lines: SplitRelaxedOps, eps, p, loss, options: SlopeOptions,
                  budget: int, examples: int) -> Callable:
    """`interval_pass`'s `refine` on subdomains: `refine`'s bounds of a splittable op's
    input (CROWN on the cut intervals), then, for the units unstable on some
    subdomain, each bound (row `+e_j` or `-e_j`) raised by its own Lagrange
    multipliers `beta >= 0` of the splits of earlier ops and its own lower slopes of
    earlier activations (`alpha.optimize_lower_slopes`, `options.steps` Adam steps):
    beta-CROWN's split constraints and alpha-CROWN's slopes in the layer bounds,
    sound for any values; the best per row is kept. Each step costs a pull-back of
    `2 n` rows per leaf, so a layer whose rows of the widest value exceed
    `MAX_LAYER_ENTRIES` entries per leaf keeps `refine`'s bounds, as does one whose
    functionals for `examples` leaves (not chunked) would exceed `MAX_LAYER_CHUNKS`
    times `budget` bytes.

    Example:

    ```python
    refine = split_refiner(crown_refine, structure, values, lines, eps, np.inf,
                           RoundingLoss, SlopeOptions(steps=8), 64 * 2**20, 64)
    ```
    """
    widest = max(int(np.prod(v.shape[1:])) for v in [values.x, *values.outputs])

    def tighter(node, index, box, boxes, deltas):
        tight = refine(node, index, box, boxes, deltas)
        shape = [int(d) for d in values.inputs[index][0].shape[1:]]
        n = int(np.prod(shape))
        if (index not in lines.signs or 2 * n * widest > MAX_LAYER_ENTRIES
                or 2 * n * widest * examples * 8 > MAX_LAYER_CHUNKS * budget):
            return tight
        b = tf.shape(lines.empty)[0]
        z0 = tf.reshape(values.inputs[index][0], [1, n])
        cut = lines.cut[index]
        edge = lines.points[index]
        lo0, hi0 = z0 + tf.reshape(cut.lo, [-1, n]), z0 + tf.reshape(cut.hi, [-1, n])
        units = tf.cast(tf.where(tf.reduce_any((lo0 < edge) & (hi0 > edge), 0))[:, 0], tf.int32)
        r = tf.size(units)
        eye = tf.one_hot(units, n, dtype=z0.dtype)
        lam = tf.reshape(tf.concat([eye, -eye], 0), tf.concat([[1, 2 * r], shape], 0))
        now = {}

        def apply(beta):
            now["beta"] = beta

        def bound():
            return (split_row_bounds(structure, values, lines, index, lam, now["beta"], deltas,
                                     eps, p, loss),)

        beta0 = tf.zeros(tf.stack([b, 2 * r, lines.layout.size]), z0.dtype)
        (low,) = optimize_lower_slopes(lines, bound, 2 * r, options,
                                       [i for i in lines.optimizable() if i < index],
                                       (beta0, apply))
        lo = tf.tensor_scatter_nd_max(tf.transpose(tf.reshape(tight.lo, [-1, n]) + tf.zeros(
            [b, 1], z0.dtype)), units[:, None], tf.transpose(low[:, :r]))
        hi = tf.tensor_scatter_nd_min(tf.transpose(tf.reshape(tight.hi, [-1, n]) + tf.zeros(
            [b, 1], z0.dtype)), units[:, None], -tf.transpose(low[:, r:]))
        new = Box(tf.reshape(tf.transpose(lo), [-1, *shape]),
                  tf.reshape(tf.transpose(hi), [-1, *shape]))
        lines.set(index, node, new)
        return new

    return tighter


def split_row_bounds(structure: ProgramStructure, values: Values, lines: SplitRelaxedOps,
                     index: int, lam: tf.Tensor, betas: tf.Tensor, deltas: list, eps, p,
                     loss=RoundingLoss) -> tf.Tensor:
    """`[B, C]` lower bounds of `lam . (z(x') - z(x))` on every subdomain of `lines`,
    `z` the input of op `index`, with the Lagrange terms of the splits of op `index`
    and of earlier ops (`betas` `[B, C, size]`, `>= 0`; other entries are ignored):
    on the subdomain `s_j (z_j - t) >= 0`, so `lam . z >= lam . z - sum_j beta_j s_j
    (z_j - t)`, sound for any `betas >= 0` and any lower slopes set on `lines`. The
    terms of op `index` itself act on the functional of `z` before the pull-back.

    Example:

    ```python
    low = split_row_bounds(structure, values, lines, index, rows, betas, boxes.deltas,
                           eps, np.inf)
    ```
    """
    b, c = tf.shape(lines.empty)[0], tf.shape(betas)[1]
    mask = lines.layout.flat({i: tf.abs(lines.signs[i]) * float(i <= index)
                              for i in lines.layout.indices}, [b])[:, None]
    saved = lines.betas, lines.use_betas
    lines.betas, lines.use_betas = lines.layout.per_node(betas * mask), True
    own = lines.betas[index] * lines.signs[index][:, None]  # [B, C, *shape]
    low = relaxed_lower_bounds(structure, values, structure.nodes[index].inputs[0], lam - own,
                               lines, deltas, eps, p, loss)
    lines.betas, lines.use_betas = saved
    term = tf.reshape(own * lines.edge(index)[:, None], tf.stack([b, c, -1]))
    return low + tf.reduce_sum(term, -1)


class SplitBounds(NamedTuple):
    """What `split_lower_bounds` returns (tensors).

    Attributes:
        lower: `[B, C]` lower bounds of the functionals on every subdomain (`+inf`
            where the subdomain is empty).
        lam_input: `[B, C, *input_shape]` the final bound's functional of the input:
            its minimiser over the ball is the relaxation's optimum.
        scores: `[B, size]` BaBSR scores of row `argmin(lower)` (0: cannot split).
        alphas: `[B, C, size]` the lower slopes the bound used (None without
            `alphas`): the given ones clipped to each unit's slope range, CROWN's
            where they were NaN.
    """

    lower: tf.Tensor
    lam_input: tf.Tensor
    scores: tf.Tensor
    alphas: tf.Tensor | None = None


def split_lower_bounds(structure: ProgramStructure, values: Values, rows: tf.Tensor,
                       boxes: Boxes, layout: SplitLayout, splits: tf.Tensor,
                       betas: tf.Tensor | None, eps, p,
                       alphas: tf.Tensor | None = None, loss=RoundingLoss) -> SplitBounds:
    """Bounds of `rows . (f(x') - f(x))` over each subdomain of the ball of radius `eps`.

    Args:
        structure, values: the program's structure and a `capture` of one input.
        rows: `[1, C, *output_shape]` functionals of the output.
        boxes: the input intervals of the relaxed ops over the ball (`root_boxes`,
            shared by the subdomains), with the rounding bounds of its pass.
        layout, splits, betas: as `SplitRelaxedOps`.
        eps: the radius; p: the norm of the ball.
        alphas: None (CROWN's lower lines), or `[B, C, size]` lower slopes of the
            unstable units per functional row (alpha-CROWN; NaN: CROWN's slope),
            clipped to each unit's slope range: sound for any value.
        loss: how the rounding terms of `boxes.deltas` are summed (`RoundingLoss`,
            the worst case, or a subclass).

    Returns:
        `SplitBounds`.

    Example:

    ```python
    res = split_lower_bounds(structure, values, rows, boxes, layout, splits, None, eps, 2)
    ```
    """
    lines = SplitRelaxedOps(values, layout, splits, betas)
    for index, node in enumerate(structure.nodes):
        key = node.inputs[0] if node.inputs else None
        if key in boxes.boxes and _relaxed(node):
            lines.set(index, node, boxes.boxes[key])
    lines.use_betas = True
    b = tf.shape(splits)[0]
    lam = tf.broadcast_to(rows, tf.concat([[b], tf.shape(rows)[1:]], 0))
    used = None if alphas is None else _set_slopes(lines, layout, alphas)
    form = relaxed_form(structure, values, structure.output_key, lam, lines, boxes.deltas, p,
                        loss)
    lower = form.offset - tf.cast(eps, rows.dtype) * form.slope
    lower = tf.where(lines.empty[:, None], tf.constant(np.inf, lower.dtype), lower)
    worst = tf.argmin(lower, axis=1, output_type=tf.int32)
    return SplitBounds(lower, form.lam_input, lines.scores(worst), used)


def _set_slopes(lines: SplitRelaxedOps, layout: SplitLayout, alphas: tf.Tensor) -> tf.Tensor:
    """Sets the lower slopes `alphas` `[B, C, size]` (NaN: CROWN's) on every splittable
    op of `lines`, clipped to its slope range; returns the slopes set, flat."""
    lead = tf.shape(alphas)[:2]
    parts = layout.per_node(alphas)
    used = {}
    for index in layout.indices:
        a = parts[index]
        if index not in lines.intervals:
            used[index] = tf.zeros_like(a)
            continue
        lo, hi = (r[:, None] for r in lines.slope_range(index))
        crown = lines.lower_slopes(index)[:, None] + tf.zeros_like(a)
        a = tf.where(tf.math.is_nan(a), crown, tf.clip_by_value(a, lo, hi))
        lines.set_lower_slopes(index, a)
        used[index] = a
    return layout.flat(used, lead)


def _relaxed(node) -> bool:
    rule = bound_rule(node.op)
    return rule is not None and not rule.linear


class LeafForms(NamedTuple):
    """The affine forms of a batch of subdomains (`leaf_forms`, tensors): on a subdomain
    where every relaxed unit is stable or split, each form is the value itself
    (`form(x') = offset + lam_input . (x' - x)`, less the rounding terms).

    Attributes:
        offset: `[B, C]` the functionals' offsets (relative to `x`).
        lam_input: `[B, C, *input_shape]` their input functionals.
        units: per splittable op (`layout.indices`), `(offset [B, n], lam_input
            [B, n, *input_shape])` of its input's units relative to `x`.
    """

    offset: tf.Tensor
    lam_input: tf.Tensor
    units: tuple


def leaf_forms(structure: ProgramStructure, values: Values, rows: tf.Tensor, boxes: Boxes,
               layout: SplitLayout, splits: tf.Tensor, p, loss=RoundingLoss) -> LeafForms:
    """The relaxation's lower forms of `rows . (f(x') - f(x))` and of every splittable
    unit's input on each subdomain (no multipliers, CROWN's slopes): where a
    subdomain leaves no unit unstable, the lines are the units' own pieces and the
    forms are exact, so the subdomain is the polytope of the ball where every split
    unit's form lies on its side (a linear program; `keras_roll.robust.leaf_lp`).

    Example:

    ```python
    forms = leaf_forms(structure, values, rows, boxes, layout, splits, np.inf)
    forms.units[0][1]        # [B, n, *input_shape]: the first op's units
    ```
    """
    lines = SplitRelaxedOps(values, layout, splits)
    for index, node in enumerate(structure.nodes):
        key = node.inputs[0] if node.inputs else None
        if key in boxes.boxes and _relaxed(node):
            lines.set(index, node, boxes.boxes[key])
    b = tf.shape(splits)[0]
    lam = tf.broadcast_to(rows, tf.concat([[b], tf.shape(rows)[1:]], 0))
    form = relaxed_form(structure, values, structure.output_key, lam, lines, boxes.deltas, p,
                        loss)
    units = []
    for index, shape in zip(layout.indices, layout.shapes):
        n = int(np.prod(shape))
        eye = tf.broadcast_to(tf.reshape(tf.eye(n, dtype=rows.dtype), [1, n, *shape]),
                              [b, n, *shape])
        unit = relaxed_form(structure, values, structure.nodes[index].inputs[0], eye, lines,
                            boxes.deltas, p, loss)
        units.append((unit.offset, unit.lam_input))
    return LeafForms(form.offset, form.lam_input, tuple(units))
