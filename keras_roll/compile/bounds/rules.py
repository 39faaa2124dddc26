"""How each op is bounded over a set of inputs: the per-op rules of the bound passes.

The bound passes (`keras_roll.compile.bounds.ibp`, intervals;
`keras_roll.compile.bounds.crown`, the linear relaxation) walk the program's ops and,
at every op, ask its `BoundRule`, in the manner of jax_verify's per-primitive bound
rules:

* `interval`: from elementwise intervals of the op's inputs (relative to their values
  at `x`, `Box`), an interval of its output (relative too);
* `linear`: whether the op is linear in its inputs on the whole set (then the
  relaxation pulls functionals back through the transpose of its own tangent, and
  nothing else is needed);
* `lines`: otherwise, two lines below and above the op on an interval of its input
  (`RelaxationLines`), for an elementwise op.

Rules are kept in a table keyed by op class (the class itself or its nearest base
class with a rule): `Activation` (every ReLU-family activation) gets
`ActivationBounds`; any other op that says it is `affine` (`Linear`, `LayerCall`,
`Identity`, and the ops of a custom rule built from them) gets `AffineBounds`.
`register_bound_rule` adds or replaces a rule. An op without one (max pooling,
recurrent layers, masking, a custom `Op`) makes `check_bounds` raise an
`UnsupportedModelError` that names the layer and the pass (docs/design.md, sections
"Robustness radius" and "Extension points").

What the passes need of an op's arithmetic beyond its own rules (`|A| m` for the
linear part `A` of an affine op, and optionally the rounding of the model's
evaluation) is given by the caller as an `Arithmetic`: `keras_roll.robust` takes both
from the rounding rules of `keras_roll.rounding`.

Example:

```python
rule = bound_rule(op)                       # None: no pass bounds this op
box = rule.interval(op, [Box(-r, r)], at, arithmetic)
```
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.rules.activations import Activation
from keras_roll.compile.rules.base import NO_RECORD, Op, Tangent
from keras_roll.errors import UnsupportedModelError

__all__ = [
    "ActivationBounds",
    "AffineBounds",
    "Arithmetic",
    "BoundPass",
    "BoundRule",
    "Box",
    "OpValues",
    "RelaxationLines",
    "activation_vertices",
    "bound_rule",
    "check_bounds",
    "exact_relu_line",
    "nondecreasing",
    "plain_relu",
    "register_bound_rule",
    "relaxation_lines",
    "supported_passes",
    "unregister_bound_rule",
]

_U64 = 2.0**-53  # the unit roundoff of float64, in which the bounds are computed


class BoundPass(enum.Enum):
    """The bound passes over a program, by the name their errors use."""

    INTERVAL = "interval bounds"
    RELAXATION = "linear relaxation"


class Box(NamedTuple):
    """Elementwise bounds on `value(x') - value(x)` over the set, `[B, *shape]` each."""

    lo: tf.Tensor
    hi: tf.Tensor


class RelaxationLines(NamedTuple):
    """`a_l z + b_l <= op(z) <= a_u z + b_u` on an interval of `z`, `[B, *shape]` each."""

    a_l: tf.Tensor
    b_l: tf.Tensor
    a_u: tf.Tensor
    b_u: tf.Tensor


class OpValues(NamedTuple):
    """What a rule sees of an op at `x`: its input values, output, record and mask."""

    inputs: list
    output: tf.Tensor
    record: object = NO_RECORD
    mask: object = None


class Arithmetic(NamedTuple):
    """What the bound passes need of an op's arithmetic, supplied by their caller.

    Attributes:
        magnitude: `magnitude(op, bounds, record, mask, values) -> [B, *out]`, a bound
            on `|A d|` for the linear part `A` of an affine op given `|d| <= bounds`
            (one `[B, *in]` tensor per input): `|A| bounds`.
        rounding: optional `rounding(node, magnitudes, record, mask, values=...)
            -> [B, *out] or None`, a bound on the rounding error of the op's output in
            the model's evaluation given bounds on the absolute values of its inputs
            (None: exact arithmetic).
    """

    magnitude: Callable
    rounding: Callable | None = None


class BoundRule:
    """How one kind of op is bounded. Subclass it and override what the passes need.

    Attributes:
        linear: whether the op is linear in its inputs everywhere (its frozen-pattern
            tangent is its linear map): the relaxation then needs no `lines`.
        passes: the `BoundPass`es the rule serves.

    Example:

    ```python
    class NegateBounds(BoundRule):
        linear = True
        passes = frozenset(BoundPass)

        def interval(self, op, boxes, at, arithmetic):
            return Box(-boxes[0].hi, -boxes[0].lo)

    register_bound_rule(NegateOp, NegateBounds())
    ```
    """

    linear = False
    passes: frozenset = frozenset()

    def interval(self, op: Op, boxes: list, at: OpValues, arithmetic: Arithmetic) -> Box:
        """The interval of `op(x') - op(x)` given `boxes` of its inputs' differences.

        Must contain `op(a') - op(a)` for every `a'` with `a' - a` in the boxes, where
        `a` are the inputs at `x` (`at.inputs`) and `op(a) = at.output`.
        """
        raise NotImplementedError

    def lines(self, op: Op, lo: tf.Tensor, hi: tf.Tensor) -> RelaxationLines:
        """Sound lines below and above an elementwise op on `[lo, hi]` (absolute values)."""
        raise NotImplementedError

    def centred_interval(self, op: Op, radius: tf.Tensor, at: OpValues,
                         arithmetic: Arithmetic) -> Box | None:
        """`interval` on the box `|a' - a| <= radius` around every input (the input set
        of the passes, before any op), or None to let the pass call `interval`.

        `radius` is a scalar or `[B]`. A rule may answer without per-example
        work where the box's centre offset is 0 and its radius the same on every axis
        (`AffineBounds`: centre 0, radius `radius * |A| 1`).
        """
        return None


class AffineBounds(BoundRule):
    """An affine op `y = A a + b`: centre `A c`, radius `|A| r` (`Arithmetic.magnitude`)."""

    linear = True
    passes = frozenset(BoundPass)

    def interval(self, op, boxes, at, arithmetic):
        centres = [Tangent((b.lo + b.hi) / 2.0, shared=True) for b in boxes]
        radii = [(b.hi - b.lo) / 2.0 for b in boxes]
        c = op.tangent(centres, NO_RECORD, None)[0].value
        r = arithmetic.magnitude(op, radii, NO_RECORD, None, None)
        return Box(c - r, c + r)

    def centred_interval(self, op, radius, at, arithmetic):
        """Centre offset `A 0 = 0` and radius `radius * (|A| 1)`: one product of `|A|`
        with ones for the whole batch instead of two products per example (`|A|` is
        linear, so `|A| (radius 1) = radius (|A| 1)` up to rounding). A subclass that
        overrides `interval` gets its own `interval` here too."""
        if type(self).interval is not AffineBounds.interval:
            return None
        ones = [tf.ones(tf.concat([[1], tf.shape(a)[1:]], 0), a.dtype) for a in at.inputs]
        shape = tf.shape(at.output)
        if radius.shape.rank != 0:  # [B] -> [B, 1, ...] in the output's rank
            radius = tf.reshape(radius, tf.concat([[-1], tf.ones_like(shape[1:])], 0))
        r = radius * arithmetic.magnitude(op, ones, NO_RECORD, None, None)
        r = tf.broadcast_to(r, shape)
        return Box(-r, r)


class ActivationBounds(BoundRule):
    """A pointwise piecewise-linear `Activation`: its range over the vertices of the
    interval, and the adaptive lines of `relaxation_lines`."""

    passes = frozenset(BoundPass)

    def interval(self, op, boxes, at, arithmetic):
        z0, h0, box = at.inputs[0], at.output, boxes[0]
        lo, hi = z0 + box.lo, z0 + box.hi
        if nondecreasing(op):  # the extremes are at the ends (ReLU, leaky ReLU, ReLU6)
            return Box(tf.cast(op.fn(lo), lo.dtype) - h0, tf.cast(op.fn(hi), lo.dtype) - h0)
        vals = tf.stack([tf.cast(op.fn(v), lo.dtype) for v in activation_vertices(op, lo, hi)])
        return Box(tf.reduce_min(vals, 0) - h0, tf.reduce_max(vals, 0) - h0)

    def lines(self, op, lo, hi):
        return relaxation_lines(op, lo, hi)


_NONDECREASING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def nondecreasing(op: Activation) -> bool:
    """Whether the piecewise-linear `op.fn` never decreases: every piece's slope is a
    number `>= 0` and at no breakpoint does it jump down (checked once per op, eagerly,
    at the breakpoint and the next float above it). Then its range over `[lo, hi]` is
    `[fn(lo), fn(hi)]`."""
    known = _NONDECREASING.get(op)
    if known is not None:
        return known
    result = all(isinstance(s, (int, float)) and s >= 0 for s in op.slopes)
    if result and op.breakpoints:
        at = np.asarray(op.breakpoints, np.float64)
        values = _eager_fn(op, np.concatenate([at, np.nextafter(at, np.inf)]))
        result = values is not None and bool(np.all(values[len(at):] >= values[:len(at)]))
    _NONDECREASING[op] = result
    return result


def activation_vertices(op: Activation, lo: tf.Tensor, hi: tf.Tensor) -> list:
    """The points where a piecewise-linear activation on `[lo, hi]` takes its extremes
    and where any linear function minus it does: the ends, and each breakpoint inside
    with the next float above it (a ReLU with a threshold jumps there: the value just
    above is the limit from the right, within the lines' float64 safety); breakpoints
    outside are clipped to an end."""
    out = [lo, hi]
    for b in op.breakpoints:
        at = tf.cast(b, lo.dtype) + tf.zeros_like(lo)
        above = tf.math.nextafter(at, tf.fill(tf.shape(at), tf.constant(np.inf, lo.dtype)))
        out += [tf.clip_by_value(at, lo, hi), tf.clip_by_value(above, lo, hi)]
    return out


def relaxation_lines(op, lo: tf.Tensor, hi: tf.Tensor) -> RelaxationLines:
    """Sound lines below and above `op.fn` on `[lo, hi]` (docs/design.md, "Robustness
    radius"): for each candidate slope (the chord, the slopes of the pieces at `lo` and
    at `hi`) the offsets are the extremes of `fn(v) - a v` over the vertices, so any
    slope is sound; the line with the smaller area to the function wins (CROWN's
    adaptive choice). The offsets get a float64 safety of `8 u` of their terms (none on a
    plain ReLU's pieces: slope 0 or 1 and offset 0 are exact).

    Args:
        op: an `Activation` (breakpoints, slopes, `fn`).
        lo, hi: `[B, *shape]` bounds of its input (`lo <= hi`).

    Example:

    ```python
    a_l, b_l, a_u, b_u = relaxation_lines(relu_op, lo, hi)
    ```
    """
    relu = plain_relu(op)
    if relu:
        # fn(v) - a v is convex for the candidates' a in [0, 1]: its maximum over the
        # vertices is at an end and the next float above 0 is never an extreme, so the
        # same offsets come from the ends and clip(0) alone (the same values; where
        # vertices tie, at lo = 0 exactly, the gradient picks another subgradient).
        verts = [lo, hi, tf.minimum(tf.maximum(tf.zeros_like(lo), lo), hi)]
        scale = tf.maximum(tf.abs(lo), tf.abs(hi))
    else:
        verts = activation_vertices(op, lo, hi)
    vals = [tf.cast(op.fn(v), lo.dtype) for v in verts]
    f_lo, f_hi = vals[0], vals[1]
    width = hi - lo
    flat = width <= 1e-12 * (1.0 + tf.abs(lo) + tf.abs(hi))
    chord = tf.where(flat, op.slope(lo), (f_hi - f_lo) / tf.where(flat, tf.ones_like(width), width))
    mid = (lo + hi) / 2.0
    if not relu:
        scale = tf.reduce_max(tf.stack([tf.abs(v) for v in vals + verts]), 0)
    best_l = best_u = None
    for a in (chord, op.slope(lo), op.slope(hi)):
        a = tf.cast(a, lo.dtype) + tf.zeros_like(lo)
        gaps = [f - a * v for f, v in zip(vals, verts)]
        safety = 8.0 * _U64 * scale * (1.0 + tf.abs(a))
        if relu:
            raw_l = tf.minimum(tf.minimum(gaps[0], gaps[1]), gaps[2])
            raw_u = tf.maximum(gaps[0], gaps[1])
        else:
            raw_l, raw_u = tf.reduce_min(tf.stack(gaps), 0), tf.reduce_max(tf.stack(gaps), 0)
        line_l, line_u = (a, raw_l - safety, raw_l), (a, raw_u + safety, raw_u)
        if best_l is None:
            best_l, best_u = line_l, line_u
            continue
        better_l = a * mid + line_l[1] > best_l[0] * mid + best_l[1]
        better_u = a * mid + line_u[1] < best_u[0] * mid + best_u[1]
        best_l = tuple(tf.where(better_l, n, o) for n, o in zip(line_l, best_l))
        best_u = tuple(tf.where(better_u, n, o) for n, o in zip(line_u, best_u))
    if relu:  # a piece's line is exact in float64: no safety
        best_l = (best_l[0], tf.where(exact_relu_line(best_l[0], best_l[2], lo, hi, False),
                                      tf.zeros_like(lo), best_l[1]))
        best_u = (best_u[0], tf.where(exact_relu_line(best_u[0], best_u[2], lo, hi, True),
                                      tf.zeros_like(lo), best_u[1]))
    return RelaxationLines(best_l[0], best_l[1], best_u[0], best_u[1])


_TINY = float(np.finfo(np.float64).tiny)  # the smallest normal float64


def exact_relu_line(a, gaps, lo, hi, upper: bool) -> tf.Tensor:
    """Where the line `a z` lies below (above, `upper`) a plain ReLU on `[lo, hi]` exactly,
    with no float64 safety: `gaps` (the extreme of `fn(v) - a v` over the vertices) is 0
    and the line is a piece the ReLU keeps on the whole interval (slope 0 where
    `hi <= 0`, slope 1 where `lo` is a positive normal number, so that no flushed
    subnormal breaks it; below, slope 0 anywhere). Its relative offset `a z0 - fn(z0)`
    is exact too. Where these hold, a bound of the interval changes nothing of the line."""
    zero, one = tf.equal(a, 0.0), tf.equal(a, 1.0)
    if upper:
        piece = (zero & (hi <= 0.0)) | (one & (lo >= _TINY))
    else:
        piece = zero | (one & ((lo >= _TINY) | (hi <= 0.0)))
    return tf.equal(gaps, 0.0) & piece


_PLAIN_RELU: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plain_relu(op: Activation) -> bool:
    """Whether `op` is `max(z, 0)`: one breakpoint at 0, slopes 0 and 1, and
    `fn(-1, 0, 1) = (0, 0, 1)` (checked once per op, eagerly)."""
    known = _PLAIN_RELU.get(op)
    if known is None:
        known = op.breakpoints == (0.0,) and all(
            isinstance(s, (int, float)) for s in op.slopes) and tuple(op.slopes) == (0.0, 1.0)
        if known:
            values = _eager_fn(op, np.array([-1.0, 0.0, 1.0]))
            known = values is not None and bool(np.all(values == [0.0, 0.0, 1.0]))
        _PLAIN_RELU[op] = known
    return known


def _eager_fn(op: Activation, points: np.ndarray) -> np.ndarray | None:
    """`op.fn` at `points`, evaluated eagerly (also while a graph is traced) in float64,
    or None where the function cannot be evaluated so (the generic path then runs)."""
    try:
        with tf.init_scope():
            return np.asarray(tf.cast(op.fn(tf.constant(points, tf.float64)), tf.float64))
    except Exception:  # noqa: BLE001 - any failure means: do not take the shortcut
        return None


_AFFINE = AffineBounds()
_RULES: dict[type, BoundRule] = {Activation: ActivationBounds()}


def register_bound_rule(op_class: type, rule: BoundRule, *, override: bool = False) -> BoundRule:
    """Registers how the bound passes bound the ops of `op_class` (and of its subclasses
    without a rule of their own).

    Args:
        op_class: an `Op` subclass (what a rule made with `keras_roll.register_rule`
            returns).
        rule: a `BoundRule` instance.
        override: allow replacing a registered rule.

    Returns:
        The rule.

    Example:

    ```python
    keras_roll.compile.bounds.register_bound_rule(NegateOp, NegateBounds())
    ```
    """
    if not (isinstance(op_class, type) and issubclass(op_class, Op)):
        raise TypeError(f"register_bound_rule expects an Op subclass, got {op_class!r}; rules "
                        f"are keyed by the op class a layer's rule returns.")
    if not isinstance(rule, BoundRule):
        raise TypeError(f"A bound rule must be a BoundRule instance, got {rule!r} of type "
                        f"{type(rule).__name__}.")
    if op_class in _RULES and not override and _RULES[op_class] is not rule:
        raise ValueError(f"A bound rule for {op_class.__name__} is already registered; pass "
                         f"override=True to replace it.")
    _RULES[op_class] = rule
    return rule


def unregister_bound_rule(op_class: type) -> None:
    """Removes the bound rule registered for `op_class` (no error if absent)."""
    _RULES.pop(op_class, None)


def bound_rule(op: Op) -> BoundRule | None:
    """The `BoundRule` of `op`: its class's or nearest base class's, `AffineBounds` for
    another op that says it is `affine`, else None."""
    for cls in type(op).__mro__:
        rule = _RULES.get(cls)
        if rule is not None:
            return rule
    return _AFFINE if op.affine else None


def supported_passes(op: Op) -> frozenset:
    """The `BoundPass`es that bound `op` (without a Keras mask)."""
    rule = bound_rule(op)
    return frozenset() if rule is None else frozenset(rule.passes)


def check_bounds(structure, bound_pass: BoundPass, masks=None) -> None:
    """Refuses an op that `bound_pass` cannot bound, naming the layer and the pass.

    Args:
        structure: the program's `ProgramStructure`.
        bound_pass: the pass (`BoundPass`), or a collection of passes.
        masks: optional per-node Keras masks (`Values.masks`); a masked op is refused.

    Raises:
        UnsupportedModelError: for max pooling, recurrent layers, masking, custom ops
            without a bound rule, sequence masks.
    """
    passes = [bound_pass] if isinstance(bound_pass, BoundPass) else list(bound_pass)
    for i, node in enumerate(structure.nodes):
        masked = masks is not None and masks[i] is not None
        missing = [p for p in passes if p not in supported_passes(node.op)]
        if missing or masked:
            what = " and ".join(p.value for p in (missing or passes))
            raise UnsupportedModelError(
                f"Layer '{node.name}' ({type(node.layer).__name__}, op "
                f"{type(node.op).__name__}) is not supported by the {what} of keras_roll, "
                f"which cover Dense, convolutions, BatchNormalization, average pooling, "
                f"reshapes, Add / Concatenate, ReLU-family activations and any op with a "
                f"bound rule (keras_roll.compile.bounds.register_bound_rule)"
                f"{' (without a sequence mask)' if masked else ''}. For robust_radius, use "
                f"method='region' or 'walk' for this model; method='best' falls back to them.")
