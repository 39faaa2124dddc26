"""Optimized relaxations (alpha-CROWN): the lower slopes of the unstable activations
chosen per margin by projected gradient ascent on the bound.

CROWN picks every unstable unit's lower line by area (for ReLU the slope 0 or 1, or
the chord's). Any slope gives a sound line (`crown.RelaxedOps.set_lower_slopes`,
`crown.lower_offset`), so the slopes are parameters of the bound: the final backward
pass is differentiable in them, and each functional row (each logit margin) gets
its own slopes, raised by Adam steps on its own lower bound and projected back onto
the pieces' slope range (`[0, 1]` for ReLU, `[slope, 1]` for LeakyReLU). Xu et al.,
"Fast and Complete: Enabling Complete Neural Network Verification with Rapid and
Massively Parallel Incomplete Verifiers", ICLR 2021.

Scope: only the slopes of the final bound are optimized; the intermediate bounds
(every activation's input interval) stay CROWN's. alpha-CROWN as published also
optimizes the slopes of each intermediate bound, which tightens them further at
the cost of a gradient through every layer's bounds.

Every evaluation is sound whatever the slopes, so the best bound seen per row is
kept; the first evaluation is CROWN's own lines: the result is never looser than
CROWN's. The loop is a `tf.while_loop` (it runs compiled, inside a caller's graph).

Example:

```python
lines = RelaxedOps(values)
boxes = interval_pass(structure, values, eps, arithmetic,
                      refine=relaxation_refiner(structure, values, lines, eps, p, budget, b))
bound = lambda: (relaxed_lower_bounds(structure, values, key, rows, lines,
                                      boxes.deltas, eps, p),)
(lower,) = optimize_lower_slopes(lines, bound, rows.shape[1], SlopeOptions(steps=20))
```
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds.crown import RelaxedOps, relaxed_lower_bounds
from keras_roll.compile.bounds.rules import Box
from keras_roll.compile.bounds.traversal import Values
from keras_roll.compile.chunking import map_chunks, plan_chunks
from keras_roll.compile.structure import ProgramStructure

__all__ = ["MAX_LAYER_CHUNKS", "SlopeOptions", "optimize_lower_slopes", "optimized_refiner"]

MAX_LAYER_CHUNKS = 8  # chunks of rows per layer bound that optimized_refiner optimizes


class SlopeOptions(NamedTuple):
    """The budget of the slopes' optimization (alpha-CROWN) per call.

    Attributes:
        steps: Adam steps (each one backward pass of the final bound and its gradient);
            0 gives CROWN's bound.
        lr: Adam's step size, in slope units (the slopes of ReLU lie in `[0, 1]`).
        decay: the step size is multiplied by it after every step.
        max_seconds: stop earlier once this much wall time has passed in the loop
            (per call, i.e. per chunk of examples); None: `steps` alone.
        intermediate: also optimize, for every activation's input bound, the slopes
            of the activations before it (`optimized_refiner`: tighter intermediate
            bounds, at about `steps + 1` times CROWN's cost of each layer bound).

    Example:

    ```python
    SlopeOptions(steps=50, lr=0.2)
    ```
    """

    steps: int = 20
    lr: float = 0.1
    decay: float = 0.98
    max_seconds: float | None = None
    intermediate: bool = False

    def checked(self) -> SlopeOptions:
        """The options, validated (raises `ValueError` naming the bad field)."""
        for name, (ok, wanted) in _CHECKS.items():
            value = getattr(self, name)
            if not ok(value):
                raise ValueError(f"SlopeOptions.{name} must be {wanted}, got {value!r}.")
        return self


def _positive(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and 0 < v < math.inf


_CHECKS = {
    "steps": (lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0,
              "an integer >= 0 (0: CROWN's bound)"),
    "lr": (_positive, "a finite number > 0"),
    "decay": (_positive, "a finite number > 0"),
    "max_seconds": (lambda v: v is None or _positive(v), "None or a number of seconds > 0"),
    "intermediate": (lambda v: isinstance(v, bool), "True or False"),
}


class _Adam:
    """Projected Adam ascent on the slopes, as functions of the loop's state."""

    def __init__(self, options: SlopeOptions, ranges: list):
        self.options, self.ranges = options, ranges

    def step(self, t, alphas, grads, m, v):
        b1, b2 = 0.9, 0.999
        t1 = tf.cast(t + 1, alphas[0].dtype)
        lr = self.options.lr * tf.pow(tf.constant(self.options.decay, t1.dtype), t1 - 1.0)
        out_a, out_m, out_v = [], [], []
        for a, g, mi, vi, (lo, hi) in zip(alphas, grads, m, v, self.ranges):
            mi = b1 * mi + (1 - b1) * g
            vi = b2 * vi + (1 - b2) * tf.square(g)
            m_hat, v_hat = mi / (1 - b1**t1), vi / (1 - b2**t1)
            a = tf.clip_by_value(a + lr * m_hat / (tf.sqrt(v_hat) + 1e-8), lo, hi)
            out_a.append(a)
            out_m.append(mi)
            out_v.append(vi)
        return out_a, out_m, out_v


def optimize_lower_slopes(lines: RelaxedOps, bound: Callable[[], tuple], rows,
                          options: SlopeOptions = SlopeOptions(),
                          indices: list | None = None,
                          multipliers: tuple | None = None) -> tuple:
    """Raises every row of `bound()` by its own lower slopes on every unstable unit.

    Args:
        lines: the `RelaxedOps` of the final pull-back, set (CROWN's intermediate
            bounds).
        bound: `bound() -> (lower, *extras)`, `[B, C]` tensors each, evaluated with the
            current slopes of `lines` (the final pull-back: row `c` must depend on the
            slopes of row `c` alone).
        rows: `C`, the functional rows of the pull-back (an int or a scalar tensor).
        options: a `SlopeOptions`.
        indices: the ops whose slopes are optimized (default every
            `lines.optimizable()` op).
        multipliers: None, or `(beta, apply)`: further parameters `>= 0` raised with
            the slopes (`beta` their start, e.g. zeros; `apply(beta)` sets them where
            `bound()` reads them, `apply(None)` clears them at the end), such as the
            split constraints' Lagrange multipliers (`splits.SplitRelaxedOps`);
            `bound()` must be sound for every `beta >= 0`.

    Returns:
        `(lower, *extras)` of the evaluation with the largest `lower`, per row, over
        `options.steps + 1` evaluations, the first at CROWN's slopes (CROWN's lines:
        `crown.lower_offset` gives the same offsets). `lines` is left with CROWN's
        lines.

    Example:

    ```python
    lower, offset = optimize_lower_slopes(lines, lambda: terms(lines), 9, SlopeOptions())
    ```
    """
    options = SlopeOptions(*options).checked()
    indices = lines.optimizable() if indices is None else list(indices)
    if (not indices and multipliers is None) or options.steps == 0:
        return tuple(bound())

    def per_row(t):  # [B, *shape] -> [B, C, *shape]
        t = t[:, None]
        return tf.broadcast_to(t, tf.concat([tf.shape(t)[:1], [rows], tf.shape(t)[2:]], 0))

    def evaluate(params):
        with tf.GradientTape() as tape:
            tape.watch(params)
            for i, a in zip(indices, params):
                lines.set_lower_slopes(i, a)
            if multipliers is not None:
                multipliers[1](params[-1])
            out = tuple(bound())
            objective = tf.reduce_sum(tf.where(tf.math.is_finite(out[0]), out[0], 0.0))
        grads = tape.gradient(objective, params)
        return out, [tf.zeros_like(a) if g is None else g for a, g in zip(params, grads)]

    alphas = [per_row(lines.lower_slopes(i)) for i in indices]
    ranges = [tuple(per_row(r) for r in lines.slope_range(i)) for i in indices]
    if multipliers is not None:
        beta = tf.convert_to_tensor(multipliers[0])
        alphas.append(beta)
        ranges.append((tf.zeros_like(beta), tf.fill(tf.shape(beta),
                                                    tf.constant(np.inf, beta.dtype))))
    adam = _Adam(options, ranges)
    best, grads = evaluate(alphas)
    zeros = [tf.zeros_like(a) for a in alphas]
    start = tf.timestamp()
    limit = tf.constant(math.inf if options.max_seconds is None else options.max_seconds,
                        tf.float64)

    def cond(t, alphas, grads, m, v, best):
        return (t < options.steps) & (tf.timestamp() - start < limit)

    def body(t, alphas, grads, m, v, best):
        alphas, m, v = adam.step(t, alphas, grads, m, v)
        out, grads = evaluate(alphas)
        better = out[0] > best[0]
        best = tuple(tf.where(better, o, b) for o, b in zip(out, best))
        return t + 1, alphas, grads, m, v, best

    state = (tf.constant(0), alphas, grads, zeros, list(zeros), best)
    best = tf.while_loop(cond, body, state)[-1]
    for i in indices:
        lines.set_lower_slopes(i, None)
    if multipliers is not None:
        multipliers[1](None)
    return tuple(best)


def optimized_refiner(refine: Callable, structure: ProgramStructure, values: Values,
                      lines: RelaxedOps, eps, p, budget: int, examples: int,
                      options: SlopeOptions = SlopeOptions()) -> Callable:
    """`interval_pass`'s `refine` that tightens CROWN's bounds of every activation's
    input (`refine`'s, e.g. `relaxation_refiner`'s) by optimizing, per bound (each
    `+-e_i` row), the lower slopes of the activations before it
    (`optimize_lower_slopes`), and sets the op's lines from the tighter box. The rows
    run in chunks of at most `budget` bytes of slopes and functionals for `examples`
    examples (about 4 copies
    each: Adam's moments and the gradient), at most `MAX_LAYER_CHUNKS` chunks per
    layer; a layer that needs more keeps CROWN's bounds. The rounding terms are the
    worst case (`relaxed_lower_bounds`), sound under every rigor.

    Example:

    ```python
    crown = relaxation_refiner(structure, values, lines, eps, p, budget, b)
    refine = optimized_refiner(crown, structure, values, lines, eps, p, budget, b)
    boxes = interval_pass(structure, values, eps, arithmetic, refine=refine)
    ```
    """

    def tighter(node, index, box, boxes, deltas):
        tight = refine(node, index, box, boxes, deltas)
        before = [i for i in lines.optimizable() if i < index]
        shape = [int(d) for d in values.inputs[index][0].shape[1:]]
        n = int(np.prod(shape))
        b = int(values.x.shape[0] or examples)
        per_row = 8 * 4 * (sum(int(np.prod(lines.lower_slopes(i).shape[1:])) for i in before)
                           + max(int(np.prod(v.shape[1:]))
                                 for v in [values.x, *values.outputs[:index + 1]]))
        k = max(1, plan_chunks(b, 2 * n, per_row, budget, batch_size=b).per_chunk)
        if not before or n == 0 or -(-2 * n // k) > MAX_LAYER_CHUNKS:
            return tight
        dtype = values.x.dtype

        def chunk(start):
            rows = start + tf.range(k)
            sign = tf.where(rows < n, tf.constant(1.0, dtype), tf.constant(-1.0, dtype))
            lam = tf.reshape(sign[:, None] * tf.one_hot(rows % n, n, dtype=dtype),
                             [1, k, *shape])

            def bound():
                return (relaxed_lower_bounds(structure, values, node.inputs[0], lam, lines,
                                             deltas, eps, p),)

            return optimize_lower_slopes(lines, bound, k, options, before)[0]

        low = map_chunks(chunk, 2 * n, k, dtype)
        lo = tf.reshape(low[:, :n], [-1, *shape])
        hi = -tf.reshape(low[:, n:], [-1, *shape])
        tight = Box(tf.maximum(tight.lo, lo), tf.minimum(tight.hi, hi))
        lines.set(index, node, tight)
        return tight

    return tighter
