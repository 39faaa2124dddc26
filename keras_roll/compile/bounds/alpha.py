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

import tensorflow as tf

from keras_roll.compile.bounds.crown import RelaxedOps

__all__ = ["SlopeOptions", "optimize_lower_slopes"]


class SlopeOptions(NamedTuple):
    """The budget of the slopes' optimization (alpha-CROWN) per call.

    Attributes:
        steps: Adam steps (each one backward pass of the final bound and its gradient);
            0 gives CROWN's bound.
        lr: Adam's step size, in slope units (the slopes of ReLU lie in `[0, 1]`).
        decay: the step size is multiplied by it after every step.
        max_seconds: stop earlier once this much wall time has passed in the loop
            (per call, i.e. per chunk of examples); None: `steps` alone.

    Example:

    ```python
    SlopeOptions(steps=50, lr=0.2)
    ```
    """

    steps: int = 20
    lr: float = 0.1
    decay: float = 0.98
    max_seconds: float | None = None

    def checked(self) -> SlopeOptions:
        """The options, validated (raises `ValueError` naming the bad field)."""
        if not isinstance(self.steps, numbers.Integral) or isinstance(self.steps, bool) \
                or self.steps < 0:
            raise ValueError(f"SlopeOptions.steps must be an integer >= 0, got "
                             f"{self.steps!r}.")
        for name in ("lr", "decay"):
            value = getattr(self, name)
            if not (isinstance(value, numbers.Real) and 0 < value and math.isfinite(value)):
                raise ValueError(f"SlopeOptions.{name} must be a finite number > 0, got "
                                 f"{value!r}.")
        if self.max_seconds is not None and not (
                isinstance(self.max_seconds, numbers.Real) and self.max_seconds > 0):
            raise ValueError(f"SlopeOptions.max_seconds must be None or a number of seconds "
                             f"> 0, got {self.max_seconds!r}.")
        return self


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
                          options: SlopeOptions = SlopeOptions()) -> tuple:
    """Raises every row of `bound()` by its own lower slopes on every unstable unit.

    Args:
        lines: the `RelaxedOps` of the final pull-back, set (CROWN's intermediate
            bounds).
        bound: `bound() -> (lower, *extras)`, `[B, C]` tensors each, evaluated with the
            current slopes of `lines` (the final pull-back: row `c` must depend on the
            slopes of row `c` alone).
        rows: `C`, the functional rows of the pull-back (an int or a scalar tensor).
        options: a `SlopeOptions`.

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
    indices = lines.optimizable()
    if not indices or options.steps == 0:
        return tuple(bound())

    def per_row(t):  # [B, *shape] -> [B, C, *shape]
        t = t[:, None]
        return tf.broadcast_to(t, tf.concat([tf.shape(t)[:1], [rows], tf.shape(t)[2:]], 0))

    def evaluate(alphas):
        with tf.GradientTape() as tape:
            tape.watch(alphas)
            for i, a in zip(indices, alphas):
                lines.set_lower_slopes(i, a)
            out = tuple(bound())
            objective = tf.reduce_sum(tf.where(tf.math.is_finite(out[0]), out[0], 0.0))
        grads = tape.gradient(objective, alphas)
        return out, [tf.zeros_like(a) if g is None else g for a, g in zip(alphas, grads)]

    alphas = [per_row(lines.lower_slopes(i)) for i in indices]
    adam = _Adam(options, [tuple(per_row(r) for r in lines.slope_range(i)) for i in indices])
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
    return tuple(best)
