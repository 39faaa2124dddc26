"""The largest certified radius, searched for every example at once.

A bound pass (`keras_roll.robust.bounds.margin_bounds`) answers, for a radius
`eps`, with a lower bound `v(eps)` of the smallest margin `f_y - f_j` over the ball:
the ball is certified when `v(eps) > 0`. The search keeps what it has *verified*:
`lo` is always a radius the pass certified (or a lower bound known beforehand),
`hi` one it did not (or an upper bound: a confirmed adversarial point). A missing
`hi` is found by doubling; a bracket wider than `WIDE` is halved in log space
(`v` is far from linear over it: flat while few units are unstable, then falling
fast); a narrow one shrinks by the Illinois variant of false position on `v`
(Dahlquist & Bjorck, *Numerical Methods*, Sec. 6.2.3): the next radius is where the
chord of `v` crosses 0, and the value kept twice on the same side is halved, which
makes it converge superlinearly from both sides. Every step moves at least
`tol / 2` inside the bracket, so it ends with `hi <= lo (1 + tol)`. The answer is
`lo` (`v` need not be monotone: the answer is a radius that was certified, whatever
the order).

Example:

```python
lo = largest_certified(values, lower=np.zeros(b), upper=upper, scale=np.ones(b), tol=1e-3)
```
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["MAX_STEPS", "largest_certified"]

MAX_STEPS = 64  # bound passes per example at most
GROWTH = 4.0  # factor of the doubling phase
WIDE = 4.0  # a bracket wider than this ratio is halved in log space


class _State:
    """The brackets of every example."""

    def __init__(self, lower, upper, scale, tol, values_at_lower=None):
        self.lo = np.asarray(lower, np.float64).copy()
        hi = np.asarray(upper, np.float64)
        self.hi = np.maximum(np.where(np.isfinite(hi), hi, np.inf), self.lo)
        self.f_lo = np.full(self.lo.shape, np.nan)
        if values_at_lower is not None:
            self.f_lo = np.where(np.asarray(values_at_lower) > 0, values_at_lower, np.nan)
        self.f_hi = np.full(self.lo.shape, np.nan)
        self.side = np.zeros(self.lo.shape, np.int64)
        self.steps = np.zeros(self.lo.shape, np.int64)
        self.scale = np.where(np.isfinite(scale) & (scale > 0), scale, 1.0)
        self.tol = tol
        self.given = self.lo.copy()

    def done(self) -> np.ndarray:
        bracketed = np.isfinite(self.hi) & (self.hi <= self.lo * (1.0 + self.tol))
        lost = self.f_lo <= 0  # the pass does not certify the radius known beforehand
        return bracketed | lost | (self.hi <= 0) | (self.steps >= MAX_STEPS)

    def next_radius(self, idx) -> np.ndarray:
        lo, hi, f_lo, f_hi = self.lo[idx], self.hi[idx], self.f_lo[idx], self.f_hi[idx]
        grow = np.maximum(GROWTH * lo, self.scale[idx])
        edge = 1.0 + self.tol / 2.0
        low_end = np.where(lo > 0, lo * edge, hi * 1e-3)
        # A wide bracket is halved in log space (the margins' bound is far from linear
        # over it); a narrow one by false position. Without a value at hi (an
        # adversarial distance), the first guess is `scale`.
        middle = np.sqrt(low_end * hi)
        with np.errstate(divide="ignore", invalid="ignore"):
            chord = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        guess = np.isnan(f_hi) & (self.scale[idx] > low_end) & (self.scale[idx] < hi)
        narrow = hi <= WIDE * np.maximum(lo, 1e-300)
        pick = np.where(guess, self.scale[idx],
                        np.where(narrow & np.isfinite(chord), chord, middle))
        pick = np.clip(pick, low_end, hi / edge)
        return np.where(np.isnan(f_lo), lo, np.where(np.isfinite(hi), pick, grow))

    def update(self, idx, eps, value) -> None:
        first = np.isnan(self.f_lo[idx])
        up = ~first & (value > 0)
        down = ~first & ~(value > 0)
        i = idx[first]
        self.f_lo[i] = value[first]
        i = idx[up]
        self.f_hi[i[self.side[i] == 1]] /= 2.0
        self.lo[i], self.f_lo[i], self.side[i] = eps[up], value[up], 1
        i = idx[down]
        self.f_lo[i[self.side[i] == -1]] /= 2.0
        self.hi[i], self.f_hi[i], self.side[i] = eps[down], value[down], -1
        self.steps[idx] += 1


def largest_certified(values: Callable, lower: np.ndarray, upper: np.ndarray,
                      scale: np.ndarray, tol: float = 1e-3,
                      progress: Callable | None = None,
                      values_at_lower: np.ndarray | None = None) -> np.ndarray:
    """Per example, a certified radius within `1 + tol` of where the pass stops certifying.

    Args:
        values: `values(index, eps) -> [k]`, the pass's lower bound of the smallest
            margin over the balls of radii `eps [k]` around the examples `index [k]`
            (certified where > 0; at `eps = 0` the margin itself).
        lower: `[B]` radii known to be certified (0 if none).
        upper: `[B]` radii known not to be (an adversarial distance), or inf / NaN.
        scale: `[B]` a guess of the answer (the first radius tried inside the bracket,
            or without `upper` the first one doubled).
        tol: relative width of the final bracket.
        progress: optional `progress(k)`, called with the number of examples finished.
        values_at_lower: optional `[B]` estimates of `values` at `lower` (e.g. the
            margin at `eps = 0`), which spare a pass there: they only steer the search
            (an estimate <= 0 is ignored), `lower` is known to be certified anyway.

    Returns:
        `[B]` float64 certified radii (`lo`; `lower` where the pass certifies no more).
    """
    state = _State(lower, upper, scale, tol, values_at_lower)
    finished = state.done()
    if progress is not None and finished.any():
        progress(int(finished.sum()))
    while not finished.all():
        idx = np.flatnonzero(~finished)
        eps = state.next_radius(idx)
        state.update(idx, eps, np.asarray(values(idx, eps), np.float64))
        now = state.done()
        if progress is not None:
            progress(int((now & ~finished).sum()))
        finished = now
    return state.lo
