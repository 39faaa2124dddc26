"""The bound passes of `keras_roll.compile.bounds` with the rounding of the model's
evaluation: the relaxation and interval bounds of `robust_radius`, and `interval_bounds`,
the same passes as a differentiable function for certified training.

The compiler's passes ask their caller for an op's `|A|` and, under a rounding guard,
for the bound `Delta_l` of its rounding (`Arithmetic`); both come from the rounding
rules of `keras_roll.rounding` (`keras_roll.robust.float_error`); under rigor "float64"
the intervals, CROWN's layer bounds and the margins take the smaller of that worst case
and the probabilistic bound of the margins of method 1 (`_ProbableLoss`).
`intermediate_choice` resolves `robust_radius(intermediate=...)`. `margin_bounds` runs
the passes compiled, in chunks within the memory budget, on numpy batches (the
searches of `robust_radius`); `interval_bounds` runs them in the caller's graph on
tensors, so that `tape.gradient` of its bounds reaches the model's weights (IBP,
CROWN-IBP and CROWN training). docs/design.md, section "Robustness radius".

Example:

```python
with tf.GradientTape() as tape:
    bounds = interval_bounds(model, x, 0.1, y)                  # l_inf ball, IBP
    loss = keras.losses.sparse_categorical_crossentropy(y, -bounds.lower, from_logits=True)
grads = tape.gradient(loss, model.trainable_weights)
```
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds import (
    Arithmetic,
    BoundMethod,
    check_bounds,
    logit_margins,
    lower_bounds,
)
from keras_roll.compile.bounds.alpha import (
    SlopeOptions,
    optimize_lower_slopes,
    optimized_refiner,
)
from keras_roll.compile.bounds.crown import RelaxedOps, relaxation_refiner, relaxed_form
from keras_roll.compile.bounds.ibp import (
    RoundingLoss,
    abs_sum,
    interval_lower_bounds,
    interval_pass,
)
from keras_roll.compile.bounds.intermediate import (
    DEFAULT_MAX_SECONDS,
    IntermediateBounds,
    IntermediateChoice,
    choose_intermediate,
    interval_lines,
)
from keras_roll.compile.bounds.priors import flat_boxes, prior_boxes, prior_width
from keras_roll.compile.caches import cached
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.structure import structure_of
from keras_roll.compile.twin import linearize
from keras_roll.geometry import norm_code
from keras_roll.options import parse_norm
from keras_roll.robust.compiled import compile_batched
from keras_roll.robust.float_error import OpRounding
from keras_roll.robust.region import PROBABILISTIC_SAFETY, guard_mode
from keras_roll.rounding import rules
from keras_roll.rounding.guard import BOUND_SAFETY
from keras_roll.rounding.noise import LAMBDA
from keras_roll.rounding.precision import (
    evaluation_precision,
    gamma,
    underflow_unit,
    unit_roundoff,
)

__all__ = ["MarginBounds", "RelaxedMargins", "arithmetic_of", "example_chunk",
           "intermediate_choice", "interval_bounds", "margin_bounds", "relaxed_margins"]

_U64 = unit_roundoff("float64")
_ETA64 = underflow_unit("float64")
# The root of the linear bound is pulled in by this much, so that the bound is > 0 there
# in spite of the float64 rounding of the division.
ROOT_SAFETY = 1.0 - 2.0**-40
_MIN_ROWS = 128  # functionals per chunk of CROWN's layer bounds that keep the chunks efficient


def linear_magnitude(op, bounds, record, mask, values):
    """`|A| bounds` for the linear part of `op`: its rounding rule's `magnitude`."""
    return rules.magnitude(op, bounds, record, False, mask, values)


def arithmetic_of(twin, guard: bool) -> Arithmetic:
    """The `Arithmetic` of the bound passes on `twin`'s program: `|A|` from the rounding
    rules and, with `guard`, the rounding of the model's evaluation (`OpRounding`)."""
    if not guard:
        return Arithmetic(linear_magnitude)
    rounding = OpRounding(evaluation_precision(twin.program))
    for node in structure_of(twin.program).nodes:
        rounding.check(node)
    return Arithmetic(linear_magnitude, rounding)


class _NoiseRounding(OpRounding):
    """`OpRounding` under rigor "float64": per op output, the worst case `Delta` and the
    probabilistic scale `e` of the model's rounding on the same magnitudes (Higham &
    Mary's model) with the float64 twin's rigorous share `w` (kept in `noise` for
    `_ProbableLoss`). The bound it returns, which widens the intervals, is the smaller of
    `Delta` and `LAMBDA` standard deviations plus `w`: each element's rounding stays
    within it except with probability below 2.5e-14, as every margin's."""

    def __init__(self, precision):
        super().__init__(precision)
        self.noise: dict = {}

    def __call__(self, node, magnitudes, record, mask, affine=True, values=None):
        delta = super().__call__(node, magnitudes, record, mask, affine, values)
        if delta is None or not affine:
            return delta
        n = self.roundings(node, magnitudes)
        s = self.shift(node)
        m = rules.magnitude(node.op, [b + s for b in magnitudes], record, True, mask, values)
        dtype = self.precision.dtype_of(node.op)
        c = self.precision.noise_unit(node.op, n, rules.matmul_like(node.op))
        e = c * m + math.sqrt(n) * underflow_unit(dtype)
        w = gamma(n, _U64) * m + n * _ETA64
        self.noise[node.output] = (e, w)
        return tf.minimum(delta, (LAMBDA * PROBABILISTIC_SAFETY * e + w) * BOUND_SAFETY)


class _ProbableLoss(RoundingLoss):
    """The rounding terms of a pull-back under rigor "float64", op by op: the worst case
    `sum |Lambda| Delta` (of the elements' bounds), and `LAMBDA` standard deviations of
    the model's rounding in Higham & Mary's model plus the twin's rigorous error (as
    method 1's logit margins, `keras_roll.robust.region`); a bound is safe where either
    holds, so the smaller is subtracted. Used for the margins' final pull-back and for
    CROWN's bounds of every unit (`relaxation_refiner`'s `loss`, also on windows)."""

    def __init__(self, deltas, scales: dict):
        super().__init__(deltas)
        self.scales = scales  # `{value key: (e, w)}`, as `_NoiseRounding.noise`
        self.noise, self.twin = [], []

    def visit(self, node, index, lam):
        if self.delta(index) is None:
            return None
        super().visit(node, index, lam)
        e, w = self.scales[node.output]
        if self.crop is not None:
            e, w = self.crop(e, node.output), self.crop(w, node.output)
        self.noise.append(abs_sum(tf.square(lam), tf.square(e)))
        self.twin.append(abs_sum(lam, w))
        return None

    def total(self, zero):
        if not self.strict:
            return zero
        noise = (LAMBDA * PROBABILISTIC_SAFETY * tf.sqrt(tf.add_n(self.noise))
                 + tf.add_n(self.twin)) * BOUND_SAFETY
        return tf.minimum(tf.add_n(self.strict), noise)


def _loss_of(arithmetic: Arithmetic):
    """The `RoundingLoss` factory of an arithmetic's rounding (`relaxed_lower_bounds`)."""
    if isinstance(arithmetic.rounding, _NoiseRounding):
        return functools.partial(_ProbableLoss, scales=arithmetic.rounding.noise)
    return RoundingLoss


def _relaxed_terms(structure, values, rows, eps, p, arithmetic, budget, examples,
                   crown: bool = True, slopes=None, prior=None):
    """The relaxation of `lower_bounds` (CROWN, or CROWN-IBP where not `crown`), keeping
    its final bound's linear form in `eps`: `(lower, offset, slope)` `[B, C]` with
    `lower >= offset - eps * slope`, and the linear form a lower bound of the margins on
    every ball of radius `r <= eps` (the intermediate bounds of the ball of radius `eps`
    hold on the smaller balls). With `slopes` (a `SlopeOptions`), the final bound's
    lower slopes are optimized (alpha-CROWN). `prior`: `{op index: Box}`, bounds over a
    ball no smaller (`keras_roll.compile.bounds.priors`). Also returns the refined
    intervals (`priors.flat_boxes`)."""
    lines = RelaxedOps(values)
    loss = _loss_of(arithmetic)
    refine = None
    if crown:
        refine = relaxation_refiner(structure, values, lines, eps, p, budget, examples, loss,
                                    prior=prior)
        if slopes is not None and slopes.intermediate:
            refine = optimized_refiner(refine, structure, values, lines, eps, p, budget,
                                       examples, slopes)
    boxes = interval_pass(structure, values, eps, arithmetic, refine=refine)
    if not crown:  # CROWN-IBP: the lines on the intervals
        interval_lines(structure, values, boxes.boxes, lines)
    out = values.value(structure, structure.output_key)
    rows = tf.reshape(rows, tf.concat([tf.shape(rows)[:2], tf.shape(out)[1:]], 0))
    e = tf.cast(eps, rows.dtype)
    e = e[:, None] if e.shape.rank else e

    def bound():
        form = relaxed_form(structure, values, structure.output_key, rows, lines,
                            boxes.deltas, p, loss)
        return form.offset - e * form.slope, form.offset, form.slope

    low, offset, slope = bound() if slopes is None else optimize_lower_slopes(
        lines, bound, tf.shape(rows)[1], slopes)
    lower = tf.maximum(low, interval_lower_bounds(structure, values, boxes, rows))
    return lower, offset, slope, flat_boxes(structure, values, boxes.boxes)


def guard_arithmetic(twin, mode: str) -> Arithmetic:
    """The `Arithmetic` of the bound passes on `twin` under a guard mode ("none",
    "strict": the worst case, or "float64": the probabilistic bound with the worst case
    as a second guard; `keras_roll.robust.region.guard_mode`).

    Example:

    ```python
    arithmetic = guard_arithmetic(twin, "float64")
    ```
    """
    if mode != "float64":
        return arithmetic_of(twin, mode == "strict")
    rounding = _NoiseRounding(evaluation_precision(twin.program))
    for node in structure_of(twin.program).nodes:
        rounding.check(node)
    return Arithmetic(linear_magnitude, rounding)


def _bounds_fn(twin, method: BoundMethod, mode: str, budget: int, examples: int, slopes,
               x, pred, eps, norm, prior=None):
    """`[B, L-1]` lower bounds of the margins `f_y - f_j` over the ball, and the linear
    form of the relaxation's (offset and slope in `eps`; NaN for interval bounds),
    compiled. The norm is an input, its `norm_code` (a scalar int32 tensor): one trace
    serves the three norms (it enters the pass only through the dual norm at the
    input). `prior` (`[B, width]`, NaN where none): bounds over balls no smaller, for
    CROWN's layer bounds (`keras_roll.compile.bounds.priors`); the refined intervals
    are the fourth result (`[B, 0]` for interval bounds)."""
    lm = logit_margins(twin.interpreter, x, pred)
    arithmetic = guard_arithmetic(twin, mode)
    if method is BoundMethod.INTERVAL:
        low = lower_bounds(lm.structure, lm.values, lm.rows, eps, norm, method, arithmetic,
                           budget, examples)
        nan = tf.fill(tf.shape(low), tf.constant(np.nan, low.dtype))
        out = lm.margins + low, nan, nan
        return out if prior is None else (*out, tf.zeros([tf.shape(low)[0], 0], low.dtype))
    check_bounds(lm.structure, method.passes, lm.values.masks)
    held = (prior_boxes(lm.structure, lm.values, prior)
            if method is BoundMethod.RELAXATION and prior is not None else None)
    low, offset, slope, boxes = _relaxed_terms(
        lm.structure, lm.values, lm.rows, eps, norm, arithmetic, budget, examples,
        crown=method is not BoundMethod.CROWN_IBP,
        slopes=slopes if method is BoundMethod.ALPHA_CROWN else None, prior=held)
    out = lm.margins + low, lm.margins + offset, slope
    return out if prior is None else (*out, boxes)


def intermediate_choice(twin, x: np.ndarray, choice: IntermediateBounds | str,
                        memory_budget: int | None = None,
                        max_seconds: float | None = DEFAULT_MAX_SECONDS) -> IntermediateChoice:
    """`choose_intermediate` for the passes of `relaxed_margins` on inputs shaped like `x`:
    the margins' rows, the examples per call and the budget they run with; kept on the
    twin per input shape, budget and choice, so that AUTO's probe runs once.

    Args:
        twin: a float64 `Linearized`.
        x: `[B, *input_shape]` inputs (the first one is captured for the shapes).
        choice: an `IntermediateBounds` or its value.
        memory_budget: bytes of functionals per pull-back (default the twin's).
        max_seconds: the time AUTO allows one CROWN pass per input, or None.

    Example:

    ```python
    choice = intermediate_choice(twin, x, "auto")
    rm = relaxed_margins(twin, x, pred, eps, np.inf, method=choice.method)
    ```
    """
    budget = int(memory_budget or twin.memory_budget)
    shape = tuple(np.shape(x)[1:])
    chunk = example_chunk(twin, shape, budget)
    choice = IntermediateBounds.parse(choice, "intermediate")

    def make():
        lm = logit_margins(twin.interpreter, tf.constant(np.asarray(x[:1], np.float64)),
                           tf.zeros([1], tf.int64))
        return choose_intermediate(choice, lm.structure, lm.values, int(lm.rows.shape[1]),
                                   budget, chunk, max_seconds=max_seconds)

    return cached(twin, ("intermediate", shape, budget, choice, max_seconds), make)


class RelaxedMargins(NamedTuple):
    """What one bound pass says of the margins `f_y - f_j` over the balls (numpy).

    Attributes:
        lower: `[B, L-1]` lower bounds over the ball of the radius asked for.
        offset, slope: `[B, L-1]` the relaxation's final bound as a linear function of
            the radius, `offset - r * slope`, a lower bound of the margin on every ball
            of radius `r` up to the one asked for (NaN for interval bounds).
        boxes: `[B, width]` the refined intervals of every relaxed op's input
            (`keras_roll.compile.bounds.priors.flat_boxes`; no columns for interval
            bounds): the `prior` of a later pass on a ball no larger.
    """

    lower: np.ndarray
    offset: np.ndarray
    slope: np.ndarray
    boxes: np.ndarray | None = None

    def root(self, gap: float = 0.0) -> np.ndarray:
        """`[B]`: the radius below which the linear form keeps every margin above `gap`
        (`inf` where no margin depends on the input, NaN for interval bounds). Radii
        `r <= min(root, eps)` are certified by the same pass; beyond `eps` it only
        estimates where the pass stops certifying."""
        with np.errstate(divide="ignore", invalid="ignore"):
            a = self.offset - gap
            r = np.where(self.slope > 0, a / self.slope, np.where(a > 0, np.inf, -np.inf))
            r = np.min(r, axis=1) if r.shape[1] else np.full(r.shape[0], np.inf)
        return np.where(np.isfinite(r) & (r > 0), r * ROOT_SAFETY, r)


def relaxed_margins(twin, x: np.ndarray, pred: np.ndarray, eps: np.ndarray, p,
                    method: BoundMethod | str = BoundMethod.RELAXATION, guard=True,
                    memory_budget: int | None = None,
                    slopes: SlopeOptions | None = None,
                    prior: np.ndarray | None = None) -> RelaxedMargins:
    """The bound pass over the lp balls of radii `eps`, with the linear form of the
    relaxation's bound in the radius (numpy).

    Args:
        twin: a float64 `Linearized`.
        x: `[B, *input_shape]` inputs (run in chunks of `example_chunk` examples).
        pred: `[B]` the classes the margins are measured from.
        eps: `[B]` radii.
        p: the norm of the balls.
        method: the `BoundMethod` (or its value): "relaxation" (CROWN, the default),
            "alpha_crown" (CROWN with optimized slopes), "crown_ibp" (all three with
            the linear form) or "interval" (interval bounds alone);
            `intermediate_choice` chooses between CROWN and CROWN-IBP.
        guard: the rounding guard of the model's evaluation: a `Rigor` or its string
            ("float64": the probabilistic bound beside the worst case, for the
            intermediate bounds and the margins), or a bool (True: the worst case,
            False: none).
        memory_budget: bytes of functionals per pull-back.
        slopes: the optimization budget of method "alpha_crown" (`SlopeOptions`,
            default `SlopeOptions()`).
        prior: optional `[B, width]` bounds of a pass at radii no smaller around the
            same inputs (its `boxes`; NaN rows where none): CROWN's layer bounds skip
            the units they prove stable (`keras_roll.compile.bounds.priors`).

    Example:

    ```python
    rm = relaxed_margins(twin, x, pred, eps, p=np.inf, guard="float64")
    certified = (rm.lower > 0).all(axis=1)
    also = np.minimum(rm.root(), eps)      # certified by the same pass where > 0
    ```
    """
    budget = int(memory_budget or twin.memory_budget)
    x = np.asarray(x, np.float64)
    chunk = example_chunk(twin, x.shape[1:], budget)
    slopes = SlopeOptions() if slopes is None else SlopeOptions(*slopes).checked()
    key = (BoundMethod(method), guard_mode(guard), budget, chunk, slopes)
    fn = cached(twin, ("relaxation", *key), lambda: compile_batched(
        functools.partial(_bounds_fn, twin, *key), twin, "xyenb"))
    norm = tf.constant(norm_code(p), tf.int32)
    width = prior_width(twin, x.shape[1:]) if key[0] is BoundMethod.RELAXATION else 0
    if prior is None or not width:
        prior = np.full((x.shape[0], width), np.nan)
    out = []
    for s in range(0, x.shape[0], chunk):
        res = fn(tf.constant(x[s:s + chunk]),
                 tf.constant(np.asarray(pred[s:s + chunk], np.int64)),
                 tf.constant(np.asarray(eps[s:s + chunk], np.float64)), norm,
                 tf.constant(np.asarray(prior[s:s + chunk], np.float64)))
        out.append([r.numpy() for r in res])
    if not out:
        z = np.zeros((0, 0))
        return RelaxedMargins(z, z, z, z)
    return RelaxedMargins(*[np.concatenate(parts) for parts in zip(*out)])


def margin_bounds(twin, x: np.ndarray, pred: np.ndarray, eps: np.ndarray, p,
                  method: BoundMethod | str = BoundMethod.RELAXATION, guard=True,
                  memory_budget: int | None = None) -> np.ndarray:
    """`[B, L-1]` lower bounds of `f_y - f_j` over the lp balls of radii `eps` (numpy):
    `relaxed_margins(...).lower`, with the same arguments.

    Example:

    ```python
    lower = margin_bounds(twin, x, pred, eps, p=np.inf)
    certified = (lower > 0).all(axis=1)
    ```
    """
    return relaxed_margins(twin, x, pred, eps, p, method, guard, memory_budget).lower


def example_chunk(twin, example_shape, budget: int | None = None) -> int:
    """Examples per call of `margin_bounds` (64 at most) such that a chunk of CROWN's
    layer bounds holds `_MIN_ROWS` functionals of the widest activation within the
    memory budget (the layers' `2 n` rows run chunk by chunk; the functionals of an
    input affine in `x` are pulled back once for the call's examples)."""
    layout = twin.layout(example_shape)
    widest = max([int(np.prod(s)) for _, _, s in layout] + [1])
    largest = max(layout.input_size, widest)
    plan = plan_chunks(64, 2 * widest, 3 * 8 * largest, int(budget or twin.memory_budget),
                       min_directions=min(2 * widest, _MIN_ROWS))
    return plan.examples_per_chunk


class MarginBounds(NamedTuple):
    """Bounds on the logit margins `f_y(x') - f_j(x')` over a ball, `[B, L]` tensors each
    (column `y` is 0: `-lower` are the worst-case logits of IBP training).

    Attributes:
        lower: lower bounds; the ball is certified where every other column is > 0.
        upper: upper bounds.
    """

    lower: tf.Tensor
    upper: tf.Tensor


def interval_bounds(model, x, eps, labels, *, p=np.inf, method: BoundMethod | str = "interval",
                    guard: bool = False, dtype: str | None = None,
                    memory_budget: int | None = None) -> MarginBounds:
    """Bounds on the logit margins over the lp ball of radius `eps` around every `x`, as
    differentiable TensorFlow (for certified training: IBP, CROWN-IBP, CROWN).

    Args:
        model: a Keras model keras_roll can linearize, or its `Linearized`.
        x: `[B, *input_shape]` inputs (a tensor, in a training step too).
        eps: a radius, or `[B]` radii.
        labels: `[B]` integer classes `y`.
        p: the norm of the ball: 1, 2 or `np.inf` (or 'l1', 'l2', 'linf'); intervals
            use its bounding box (exact for l_inf).
        method: "interval" (IBP), "crown_ibp" or "relaxation" (CROWN), or a
            `keras_roll.compile.bounds.BoundMethod`.
        guard: also bound the rounding of the model's evaluation (as `robust_radius`
            does under a guarded rigor); off for training.
        dtype: the dtype of the pass (default the twin's, float32 for a float32
            model; "float64" for bounds to check against).
        memory_budget: bytes of functionals per pull-back of CROWN's layer bounds.

    Returns:
        `MarginBounds` of `[B, L]` tensors in the pass's dtype.

    Raises:
        keras_roll.UnsupportedModelError: a layer the passes do not bound, naming it.

    Example:

    ```python
    bounds = interval_bounds(model, x, 0.1, y, method="crown_ibp")
    certified = tf.reduce_all(bounds.lower + tf.one_hot(y, 10) > 0, axis=-1)
    ```
    """
    p = parse_norm(p)
    lin = linearize(model)
    twin = lin if dtype is None else lin.at_dtype(dtype)
    x = tf.cast(x, twin.dtype)
    lm = logit_margins(twin.interpreter, x, tf.cast(labels, tf.int32))
    rows = lm.margins.shape[-1]
    low = lower_bounds(lm.structure, lm.values, tf.concat([lm.rows, -lm.rows], 1), eps, p,
                       BoundMethod(method), arithmetic_of(twin, guard),
                       int(memory_budget or lin.memory_budget))
    # back to [B, L] with 0 in column y
    columns = tf.one_hot(lm.others, int(lm.logits.shape[-1]), dtype=lm.logits.dtype)
    lower = tf.einsum("bk,bkl->bl", lm.margins + low[:, :rows], columns)
    upper = tf.einsum("bk,bkl->bl", lm.margins - low[:, rows:], columns)
    return MarginBounds(lower, upper)


def guard_loss(arithmetic: Arithmetic, noise: dict | None = None):
    """The `RoundingLoss` factory of the pull-backs under `arithmetic` (the worst case,
    or under "float64" the probabilistic terms); `noise` (`{value key: (e, w)}`)
    replaces the noise scales its interval pass recorded, for pull-backs that run in
    another graph than that pass (the branch and bound's leaves).

    Example:

    ```python
    loss = guard_loss(arithmetic)
    lower = relaxed_lower_bounds(structure, values, key, rows, lines, deltas, eps, p, loss)
    ```
    """
    if noise is not None and isinstance(arithmetic.rounding, _NoiseRounding):
        return functools.partial(_ProbableLoss, scales=noise)
    return _loss_of(arithmetic)
