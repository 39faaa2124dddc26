"""The linear relaxation's backward pass (CROWN): sound lower bounds of linear functionals
of any value over an lp ball.

Over the ball of radius `eps` around `x`, every op that is not linear and whose input
stays in `[l, u]` lies between two lines, `a_L z + b_L <= sigma(z) <= a_U z + b_U` (its
`BoundRule.lines`). Pulling functionals `Lambda` of a value back through the network
(`keras_roll.compile.bounds.traversal.pull_back`), such an op passes
`Lambda+ a_L + Lambda- a_U` on for a lower bound and adds the matching offsets; every
linear op passes `Lambda A` on (the transpose of its own tangent); at the input the
linear function is minimised over the ball in closed form, `-eps ||Lambda_x||_q`
(Zhang et al., "Efficient Neural Network Robustness Certification with General
Activation Functions", NeurIPS 2018; Singh et al., DeepPoly, POPL 2019). The bounds
`[l, u]` of every relaxed op's input come either from the same backward pass started
at that input (all its units, both signs), intersected with interval bounds, layer by
layer (`relaxation_refiner`: CROWN), or from the interval bounds alone (CROWN-IBP,
Zhang et al., ICLR 2020).

Rounding: with an `Arithmetic.rounding`, the bound of every op's rounding enters as
`- sum |Lambda_l| Delta_l` (and widens the intervals). See docs/design.md, section
"Robustness radius".

Example:

```python
lines = RelaxedOps(values)
boxes = interval_pass(structure, values, eps, arithmetic,
                      refine=relaxation_refiner(structure, values, lines, eps, p, budget, b))
lower = relaxed_lower_bounds(structure, values, structure.output_key, rows, lines,
                             boxes.deltas, eps, p)
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds.ibp import RoundingLoss
from keras_roll.compile.bounds.priors import example_rows, prior_open, stable_skip
from keras_roll.compile.bounds.rules import (
    ActivationBounds,
    Box,
    activation_vertices,
    bound_rule,
    exact_relu_line,
    plain_relu,
)
from keras_roll.compile.bounds.traversal import Values, pull_back
from keras_roll.compile.bounds.windows import conv_windows
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.rules.activations import Activation
from keras_roll.compile.rules.base import NO_RECORD
from keras_roll.compile.structure import ProgramStructure
from keras_roll.geometry import dual_norm

__all__ = ["RelaxedForm", "RelaxedOps", "affine_in_input", "layer_plan", "layer_rows_per_chunk",
           "lower_offset", "open_units", "relaxation_refiner", "relaxed_form",
           "relaxed_lower_bounds"]

_U64 = 2.0**-53  # the unit roundoff of float64 (the lines' safety, as in rules.py)


class RelaxedOps:
    """The lines of every relaxed op, relative to the values at `x`, filled in as the
    layers are bounded; its `__call__` is `pull_back`'s `relax`.

    The lower line of a piecewise-linear activation (`Activation`) may be given its
    slope per unit (`set_lower_slopes`; alpha-CROWN, `keras_roll.compile.bounds.alpha`):
    on the units whose interval holds a breakpoint (`unstable`), the line of slope
    `a` has the offset `min (fn(v) - a v)` over the interval's vertices, sound for any
    `a`; the other units keep the lines of `set`. Slopes in `slope_range` are the
    useful ones (ReLU `[0, 1]`, LeakyReLU `[slope, 1]`).

    Example:

    ```python
    lines = RelaxedOps(values)
    lines.set(index, node, box)            # box: the op's input interval, relative
    mask = lines.unstable(index)           # [B, *shape] bool
    lines.set_lower_slopes(index, alpha)   # [B, *shape], or [B, C, *shape] per row
    ```
    """

    def __init__(self, values: Values):
        self.values = values
        self.lines: dict = {}
        self.intervals: dict = {}  # index -> (op, lo, hi), absolute, for the slopes
        self.slopes: dict = {}

    def set(self, index: int, node, box: Box) -> None:
        """Relaxes op `index` on the interval `box` of its input (relative to `x`)."""
        z0, h0 = self.values.inputs[index][0], self.values.outputs[index]
        lo, hi = z0 + box.lo, z0 + box.hi
        a_l, b_l, a_u, b_u = bound_rule(node.op).lines(node.op, lo, hi)
        # sigma(z) - h0 >= a_L (z - z0) + (a_L z0 + b_L - h0), likewise above.
        self.lines[index] = (a_l, a_l * z0 + b_l - h0, a_u, a_u * z0 + b_u - h0)
        if isinstance(node.op, Activation) and isinstance(bound_rule(node.op),
                                                          ActivationBounds):
            self.intervals[index] = (node.op, lo, hi)

    def optimizable(self) -> list:
        """The indices of the relaxed ops whose lower slopes `set_lower_slopes` takes."""
        return sorted(self.intervals)

    def unstable(self, index: int) -> tf.Tensor:
        """`[B, *shape]`: the units of op `index` whose input interval holds a
        breakpoint strictly inside (where a lower slope matters)."""
        op, lo, hi = self._interval(index)
        out = tf.zeros(tf.shape(lo), tf.bool)
        for b in op.breakpoints:
            out = out | ((lo < b) & (hi > b))
        return out

    def slope_range(self, index: int) -> tuple:
        """`(smallest, largest)` slope of op `index`'s pieces, `[B, *shape]` each:
        the range of useful lower slopes (`[0, 1]` for ReLU)."""
        op, lo, _ = self._interval(index)
        slopes = tf.stack([tf.cast(s, lo.dtype) + tf.zeros_like(lo) for s in op.slopes])
        return tf.reduce_min(slopes, 0), tf.reduce_max(slopes, 0)

    def lower_slopes(self, index: int) -> tf.Tensor:
        """`[B, *shape]`: the lower slopes `set` chose (CROWN's adaptive choice)."""
        self._interval(index)
        return self.lines[index][0]

    def set_lower_slopes(self, index: int, alpha: tf.Tensor | None) -> None:
        """Lower slopes for the unstable units of op `index`: `[B, *shape]` (every
        functional row), `[B, C, *shape]` (one per row of the pull-back), or None
        (back to `set`'s lines). Sound for any values."""
        self._interval(index)
        if alpha is None:
            self.slopes.pop(index, None)
        else:
            self.slopes[index] = alpha

    def _interval(self, index):
        if index not in self.intervals:
            raise ValueError(f"Op {index} has no lower slopes to set: it is not a relaxed "
                             f"piecewise-linear activation; use one of "
                             f"RelaxedOps.optimizable() = {self.optimizable()}.")
        return self.intervals[index]

    def _lower_rows(self, index, alpha, a_l, c_l):
        """The lower lines `(slope, offset)` of the slopes `alpha`, per row where
        `alpha` is `[B, C, *shape]` (then `[B, C, *shape]` each, else `[B, *shape]`)."""
        op, lo, hi = self.intervals[index]
        z0, h0 = self.values.inputs[index][0], self.values.outputs[index]
        unstable = self.unstable(index)
        if alpha.shape.rank == lo.shape.rank + 1:
            lo, hi, z0, h0 = lo[:, None], hi[:, None], z0[:, None], h0[:, None]
            unstable, a_l, c_l = unstable[:, None], a_l[:, None], c_l[:, None]
        alpha = tf.cast(alpha, lo.dtype)
        offset = lower_offset(op, lo, hi, alpha)
        return (tf.where(unstable, alpha, a_l),
                tf.where(unstable, alpha * z0 + offset - h0, c_l))

    def __call__(self, node, lam, values, index):
        lines = self.lines.get(index)
        if lines is None:
            return None
        a_l, c_l, a_u, c_u = lines
        alpha = self.slopes.get(index)
        per_row = False
        if alpha is not None:
            a_l, c_l = self._lower_rows(index, alpha, a_l, c_l)
            per_row = alpha.shape.rank == lam.shape.rank
        if not per_row:
            a_l, c_l = a_l[:, None], c_l[:, None]
        # Lambda+ a_L + Lambda- a_U as one product by the slope each sign picks
        below = lam >= 0
        new = tf.where(below, a_l, a_u[:, None]) * lam
        const = tf.where(below, c_l, c_u[:, None]) * lam
        const = tf.reduce_sum(tf.reshape(const, tf.concat([tf.shape(const)[:2], [-1]], 0)), -1)
        return new, const


def lower_offset(op: Activation, lo: tf.Tensor, hi: tf.Tensor, a: tf.Tensor) -> tf.Tensor:
    """The offset `b` of the lower line `a z + b <= op.fn(z)` on `[lo, hi]`: the minimum
    of `fn(v) - a v` over the vertices (`activation_vertices`: a piecewise-linear
    function minus a line takes its minimum at one), less the float64 safety of
    `relaxation_lines` (so CROWN's own slope gives CROWN's own line). Sound for any `a`.

    Example:

    ```python
    b = lower_offset(relu_op, lo, hi, alpha)        # -8 u max(|lo|, |hi|) (1 + alpha)
    ```
    """
    if plain_relu(op):
        verts = [lo, hi, tf.minimum(tf.maximum(tf.zeros_like(lo), lo), hi)]
        scale = tf.maximum(tf.abs(lo), tf.abs(hi))
        vals = [tf.cast(op.fn(v), lo.dtype) for v in verts]
    else:
        verts = activation_vertices(op, lo, hi)
        vals = [tf.cast(op.fn(v), lo.dtype) for v in verts]
        scale = tf.reduce_max(tf.stack([tf.abs(v) for v in vals + verts]), 0)
    gaps = tf.reduce_min(tf.stack([f - a * v for f, v in zip(vals, verts)]), 0)
    offset = gaps - 8.0 * _U64 * scale * (1.0 + tf.abs(a))
    if plain_relu(op):  # a piece's line is exact (as `rules.relaxation_lines`'s)
        offset = tf.where(exact_relu_line(a, gaps, lo, hi, False), tf.zeros_like(gaps), offset)
    return offset


class RelaxedForm(NamedTuple):
    """A relaxed pull-back's lower bound as a linear function of the radius: over the
    ball of radius `eps`, `lam . (value(x') - value(x)) >= offset - eps * slope`.

    Attributes:
        offset: `[B, C]` the relaxation's constant terms less the rounding terms.
        slope: `[B, C]` the dual norm of `lam_input`.
        lam_input: `[B, C, *input_shape]` the functionals pulled back to the input.
    """

    offset: tf.Tensor
    slope: tf.Tensor
    lam_input: tf.Tensor


def relaxed_form(structure: ProgramStructure, values: Values, key: int, lam: tf.Tensor,
                 lines: RelaxedOps, deltas: list, p,
                 loss: Callable[[list], RoundingLoss] = RoundingLoss) -> RelaxedForm:
    """The `RelaxedForm` of functionals `lam` of the value `key` (see
    `relaxed_lower_bounds` for the arguments).

    Example:

    ```python
    form = relaxed_form(structure, values, structure.output_key, rows, lines, deltas, 2)
    lower = form.offset - eps[:, None] * form.slope
    ```
    """
    rounding = loss(deltas)
    res = pull_back(structure, values, key, lam, relax=lines, visit=rounding.visit)
    axes = tuple(range(2, res.lam_input.shape.rank))  # [B, C, *input_shape]
    return RelaxedForm(res.const - rounding.total(tf.zeros_like(res.const)),
                       dual_norm(res.lam_input, p, axis=axes), res.lam_input)


def relaxed_lower_bounds(structure: ProgramStructure, values: Values, key: int,
                         lam: tf.Tensor, lines: RelaxedOps, deltas: list, eps, p,
                         loss: Callable[[list], RoundingLoss] = RoundingLoss) -> tf.Tensor:
    """`[B, C]` lower bounds of `lam . (value(x') - value(x))` over the ball.

    Args:
        structure, values: the program's structure and a `capture` of the batch.
        key: the value the functionals act on.
        lam: `[B, C, *shape]` functionals (`B = 1`: shared by the batch).
        lines: the relaxation of every op `key` depends on through a nonlinear op.
        deltas: per node, the rounding bound of its output or None (`Boxes.deltas`).
        eps: `[B]` radii; p: the norm of the ball.
        loss: how the rounding terms of `deltas` are summed (`RoundingLoss`, the worst
            case, or a subclass).
    """
    form = relaxed_form(structure, values, key, lam, lines, deltas, p, loss)
    eps = tf.cast(eps, lam.dtype)
    eps = eps[:, None] if eps.shape.rank else eps
    return form.offset - eps * form.slope


def layer_rows_per_chunk(values, index, n, budget, b, signs: int = 2) -> int:
    """Functionals per pull-back for the `signs * n` bounds of one op's input (`b`
    examples at most per call), balanced over the rows."""
    largest = max([int(np.prod(values.x.shape[1:]))]
                  + [int(np.prod(v.shape[1:])) for v in values.outputs[:index + 1]])
    plan = plan_chunks(b, signs * n, 3 * 8 * largest, budget, batch_size=b)
    return max(1, plan.per_chunk)


def affine_in_input(structure: ProgramStructure, values: Values, key: int) -> tuple[bool, bool]:
    """`(affine, shared)` of the value `key`: whether it is an affine function of the
    model input alone (every op it depends on is linear, `BoundRule.linear`), and
    whether its functionals stay shared by the batch when pulled back (no op on the
    way has a record or a mask)."""
    affine = shared = True
    todo, seen = [key], set()
    while todo:
        k = todo.pop()
        if k == structure.input_key or k in seen:
            continue
        seen.add(k)
        i = structure.producer[k]
        rule = bound_rule(structure.nodes[i].op)
        if rule is None or not rule.linear:
            return False, False
        shared = shared and values.records[i] is NO_RECORD and values.masks[i] is None
        todo.extend(structure.nodes[i].inputs)
    return affine, shared


def layer_plan(structure: ProgramStructure, values: Values, index: int, budget: int,
               examples: int, affine_shortcut: bool = True) -> tuple[int, int, int]:
    """`(signs, rows per chunk, examples per pull-back)` of CROWN's bounds of op `index`'s
    input: both signs of `I` pulled back, or only `+I` where the input is affine in the
    model input (`affine_in_input`); functionals shared by the batch take one example's
    memory."""
    n = int(np.prod(values.inputs[index][0].shape[1:]))
    affine, shared = affine_in_input(structure, values, structure.nodes[index].inputs[0])
    signs = 1 if affine and affine_shortcut else 2
    b = 1 if signs == 1 and shared else examples
    return signs, layer_rows_per_chunk(values, index, n, budget, b, signs), b


def open_units(node, lines: RelaxedOps, index: int, box: Box) -> tuple:
    """`(lower, upper)`, `[n]` bool each: the units of op `index`'s input whose lower
    (upper) bound CROWN must compute, the union over the batch. A plain ReLU needs
    both only where the interval `box` (relative to `x`) holds 0 strictly inside,
    and the upper one where it is positive (the magnitude that later ops' rounding
    bounds scale with); elsewhere its lines are one of its pieces, exact whatever
    the bounds, and the interval stays the unit's bound (sound). Any other relaxed
    op needs them all.

    Example:

    ```python
    lower, upper = open_units(node, lines, index, box)   # rows of +e_j, of -e_j
    ```
    """
    z0 = lines.values.inputs[index][0]
    flat = tf.reshape(z0, [tf.shape(z0)[0], -1])
    if not (isinstance(node.op, Activation) and plain_relu(node.op)):
        every = tf.ones(tf.shape(flat)[1:], tf.bool)
        return every, every
    n = tf.shape(flat)[1]
    lo, hi = tf.reshape(z0 + box.lo, [-1, n]), tf.reshape(z0 + box.hi, [-1, n])
    return tf.reduce_any((lo < 0) & (hi > 0), 0), tf.reduce_any(hi > 0, 0)


def _row_bounds(bounds_of, units, plus, affine: bool, k: int, lo, hi):
    """Refines the flat bounds `lo, hi` (`[B, n]`) by `bounds_of(lam)` of the rows
    `+e_j` (where `plus`) or `-e_j` of the `units` (`[r]` each, dynamic `r`; `affine`:
    `hi = -lo` from the `+e_j` rows), `k` rows per pull-back at most, one pull-back
    at a time in one traced loop whatever `r`. Rows past `r` in the last chunk
    repeat earlier ones (max / min make that harmless). The bounds' batch grows to
    the pull-back's where that is larger (the subdomains of split lines)."""
    n, dtype = int(lo.shape[1]), lo.dtype
    total = tf.size(units)
    chunks = (total + k - 1) // k
    per = (total + tf.maximum(chunks, 1) - 1) // tf.maximum(chunks, 1)  # balanced, <= k

    def body(i, lo_t, hi_t):
        rows = (i * per + tf.range(per)) % total
        unit, up = tf.gather(units, rows)[:, None], tf.gather(plus, rows)[:, None]
        sign = tf.where(up, tf.constant(1.0, dtype), tf.constant(-1.0, dtype))
        low = tf.transpose(bounds_of(sign * tf.one_hot(unit[:, 0], n, dtype=dtype)))
        b = tf.maximum(tf.shape(lo_t)[1], tf.shape(low)[1])
        lo_t, hi_t = tf.broadcast_to(lo_t, [n, b]), tf.broadcast_to(hi_t, [n, b])
        low = tf.broadcast_to(low, [tf.shape(low)[0], b])
        big = tf.constant(np.inf, dtype)
        lo_t = tf.tensor_scatter_nd_max(lo_t, unit, low if affine else tf.where(up, low, -big))
        hi_t = tf.tensor_scatter_nd_min(hi_t, unit, -low if affine else tf.where(up, big, -low))
        return i + 1, lo_t, hi_t

    _, lo_t, hi_t = tf.while_loop(lambda i, *_: i < chunks, body,
                                  (tf.constant(0, tf.int32), tf.transpose(lo), tf.transpose(hi)),
                                  shape_invariants=(tf.TensorShape([]), tf.TensorShape([n, None]),
                                                    tf.TensorShape([n, None])),
                                  parallel_iterations=1)
    return tf.transpose(lo_t), tf.transpose(hi_t)


def _window_pull(structure: ProgramStructure, key: int, p, loss):
    """`ConvWindows.bounds`'s `pull`: CROWN's lower bounds of the rows on the windows,
    with `loss`'s own per-op tensors cut the same way (`RoundingLoss.crop`)."""

    def pull(cut, cut_lines, cut_deltas, rows, radii, at):
        ops = RelaxedOps(cut)
        ops.lines = cut_lines

        def cut_loss(d):
            rounding = loss(d)
            rounding.crop = at
            return rounding

        return relaxed_lower_bounds(structure, cut, key, rows, ops, cut_deltas, radii, p,
                                    cut_loss)

    return pull


def relaxation_refiner(structure: ProgramStructure, values: Values, lines: RelaxedOps,
                       eps, p, budget: int, examples: int,
                       loss: Callable[[list], RoundingLoss] = RoundingLoss,
                       affine_shortcut: bool = True, skip_stable: bool = True,
                       windows: bool = True, prior: dict | None = None):
    """`interval_pass`'s `refine` for CROWN: the relaxation's bounds of a nonlinear op's
    input (`+-I` rows pulled back, in chunks of at most `budget` bytes for `examples`
    examples, run one at a time in one traced loop), intersected with its interval; the
    op's lines are set from the result. `loss` sums the rounding terms (as
    `relaxed_lower_bounds`).

    Only the rows of units that are not stable on their interval are pulled back
    (`open_units`, `skip_stable=True`, as auto_LiRPA does), and the upper rows of the
    positive ones (the magnitude the rounding bounds of later ops see): a stable
    unit's lines are exact whatever its bounds, and it keeps its interval. The loop's
    graph does not depend on how many units are open. An affine input (below) keeps
    every unit's rows: they are cheap and exact.

    The units of a convolution (`keras_roll.compile.bounds.windows`) pull their rows
    back through their receptive fields instead (`windows=True`): the same bounds for
    a fraction of the work (auto_LiRPA's "patches" serve the same purpose), each
    example's own rows of the units its interval does not prove inactive
    (`priors.stable_skip`, where the ReLU alone reads its input; else every row), the
    same bounds wherever they reach.

    An input that is an affine function of the model input alone (`affine_in_input`,
    the first layer's pre-activation) needs no relaxation: its pull-back is exact, and
    the bound of `-e_j` is the bound of `e_j` (the same rounding terms and dual norm),
    so only the `+I` rows are pulled back and `hi = -lo`: the same bounds for half the
    work (`affine_shortcut=False` pulls back both signs, for comparison).

    `prior` (`{op index: Box}`, relative; `keras_roll.compile.bounds.priors`): bounds of
    the same inputs over a ball no smaller, intersected with each interval first; a
    plain ReLU's dense rows are then each example's own open units (`example_rows`).

    Example:

    ```python
    refine = relaxation_refiner(structure, values, lines, eps, p, 64 * 2**20, 64)
    ```
    """

    def refine(node, index, box, boxes, deltas):
        key = node.inputs[0]
        shape = [int(d) for d in values.inputs[index][0].shape[1:]]
        n = int(np.prod(shape))
        if n == 0:
            return box
        signs, k, _ = layer_plan(structure, values, index, budget, examples, affine_shortcut)
        held = (prior or {}).get(index)
        if held is not None:
            box = Box(tf.maximum(box.lo, held.lo), tf.minimum(box.hi, held.hi))
        view = (conv_windows(structure, values, key) if windows
                and type(lines) is RelaxedOps and not lines.slopes else None)
        if view is not None:
            need = stable_skip(structure, node, values.inputs[index][0], box) if (
                skip_stable and signs == 2) else None
            lo, hi = view.bounds(lines.lines, deltas, eps, budget, examples,
                                 _window_pull(view.windowed, key, p, loss), need, signs == 1)
            tight = Box(tf.maximum(box.lo, tf.reshape(lo, tf.shape(box.lo))),
                        tf.minimum(box.hi, tf.reshape(hi, tf.shape(box.hi))))
            lines.set(index, node, tight)
            return tight
        if held is not None and signs == 2 and skip_stable and plain_relu(node.op):
            return _prior_rows(structure, values, lines, eps, p, loss, deltas, node, index,
                               box, k)
        every = tf.ones([n], tf.bool)
        need_lo, need_hi = (open_units(node, lines, index, box) if skip_stable and signs == 2
                            else (every, every))
        if signs == 1:
            need_hi = tf.zeros([n], tf.bool)
        units = tf.cast(tf.concat([tf.where(need_lo)[:, 0], tf.where(need_hi)[:, 0]], 0),
                        tf.int32)
        plus = tf.range(tf.size(units)) < tf.reduce_sum(tf.cast(need_lo, tf.int32))

        def bounds_of(eye):  # [rows, n] -> [B, rows]
            lam = tf.reshape(eye, tf.concat([[1, tf.shape(eye)[0]], shape], 0))
            low = relaxed_lower_bounds(structure, values, key, lam, lines, deltas, eps, p,
                                       loss)
            return tf.broadcast_to(low, [tf.shape(low)[0], tf.shape(eye)[0]])

        lo, hi = _row_bounds(bounds_of, units, plus, signs == 1, k,
                             tf.reshape(box.lo, [-1, n]), tf.reshape(box.hi, [-1, n]))
        tight = Box(tf.reshape(lo, [-1, *shape]), tf.reshape(hi, [-1, *shape]))
        lines.set(index, node, tight)
        return tight

    return refine


def _prior_rows(structure, values, lines, eps, p, loss, deltas, node, index, box, k):
    """`relaxation_refiner`'s dense rows of a plain ReLU's input under a prior: each
    example's own open units (`priors.example_rows`), `k` rows per pull-back."""
    key, z0 = node.inputs[0], values.inputs[index][0]
    shape = [int(d) for d in z0.shape[1:]]
    need_lo, need_hi = prior_open(z0, box)

    def bounds_of(eye):  # [B, m, n] -> [B, m]
        lam = tf.reshape(eye, tf.concat([tf.shape(eye)[:2], shape], 0))
        return relaxed_lower_bounds(structure, values, key, lam, lines, deltas, eps, p, loss)

    n = int(np.prod(shape))
    lo, hi = example_rows(bounds_of, need_lo, need_hi, k,
                          tf.reshape(box.lo + tf.zeros_like(z0), [-1, n]),
                          tf.reshape(box.hi + tf.zeros_like(z0), [-1, n]))
    tight = Box(tf.reshape(lo, tf.shape(z0)), tf.reshape(hi, tf.shape(z0)))
    lines.set(index, node, tight)
    return tight
