"""The largest certified radius, searched for every example at once.

A bound pass (`keras_roll.robust.bounds.relaxed_margins`) answers, for a radius
`eps`, with a lower bound `v(eps)` of the smallest margin `f_y - f_j` over the ball:
the ball is certified when `v(eps) > 0`. The search keeps what it has *verified*:
`lo` is always a radius a pass certified (or a lower bound known beforehand), `hi`
one it did not (or an upper bound: a confirmed adversarial point, such as the
walk's). It ends with `hi <= lo (1 + tol)` and answers `lo`.

**The root of the pass.** The relaxation's final bound is, with the intermediate
bounds of the ball of radius `eps` held fixed, linear in the radius: `a_j - r
||Lambda_j||_q` for every margin `j`, and since those intermediate bounds hold on every
smaller ball, so does the linear form. So a pass at `eps` certifies every radius up to
`min(eps, rho(eps))`, `rho(eps) = min_j a_j / ||Lambda_j||_q` (its *root*): a pass
that fails at `eps` still raises `lo` to `rho(eps)`, with no further pass. The largest
radius the passes certify is the fixed point `R = rho(R)`; the search runs the secant
method on `h(eps) = rho(eps) - eps` (positive where certified), whose slope near `R`
is about -1 (`rho` moves only through the intermediate bounds), and probes just above
its estimate of `R`, so that the probe's own root usually closes the bracket: two to
four passes per example where bisection needed ten or more.

**Where `h` is steep** (larger trained CNNs: near `R` the intermediate bounds loosen
so fast that `h` falls with slope -35 to -100, and each root overshoots `R` many
times over), the roots steer badly: the secants crawl up from below. There, and where
the passes have no root, a model of the relaxation's loss steers instead
(`_LossModel`): with `m0` the margin at `eps = 0`, `g = log(1 - v / m0)` grows
roughly linearly in `log eps` (the loss grows like a power of the radius, eps^1.5 to
eps^5), is negative where certified and 0 at `R`; its zero is estimated by inverse
quadratic interpolation through the nearest certified and failed probes, else
Illinois false position, else a step of an assumed slope, and probed a quarter of
`tol` below the estimate, or, once an end is that close, where the probe closes the
bracket whichever way it goes. On CNN-L this takes 5-7 passes per radius instead
of 11-12.

**Bracketing** (without roots or `m0`, and as the safeguard), a missing `hi`
is found by growing; a bracket wider than `WIDE` is halved in log space (`v` is far
from linear over it: flat while few units are unstable, then falling fast); a narrow
one shrinks by the Illinois variant of false position on `v` (Dahlquist & Bjorck,
*Numerical Methods*, Sec. 6.2.3). Every probe lies at least `tol / 2` inside the
bracket, so the search ends; the answer is a radius a pass certified, whatever the
shape of `v` (it need not be monotone).

**Nothing certified.** Where the passes fail at every radius (margins smaller than the
rounding guard, as on networks at initialisation), `hi` shrinks toward 0 and `lo`
stays 0, so the bracket never closes in relative terms: the search stops once `hi`
falls below `FLOOR` times the first end of the bracket (`upper`, else `scale`). A
radius below that was never worth the passes (a handful, where the 64 of `MAX_STEPS`
were spent before).

Example:

```python
res = search_certified(values, lower=np.zeros(b), upper=upper, scale=np.ones(b), tol=1e-3,
                       value_at_zero=margins)
res.lower, res.passes        # certified radii, bound passes spent per example
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

__all__ = ["FLOOR", "MAX_STEPS", "CertifiedSearch", "largest_certified", "search_certified"]

MAX_STEPS = 64  # bound passes per example at most
# The smallest radius worth a pass, as a share of the first end of the bracket (`upper`,
# else `scale`): below it the search stops, with what it certified (0 if nothing).
FLOOR = 1e-6
GROWTH = 4.0  # factor of the doubling phase
WIDE = 4.0  # a bracket wider than this ratio is halved in log space
# Where the root estimates the end of the certified radii, the probe goes this fraction
# of `tol` above it: failing there, the probe's own root usually closes the bracket.
ABOVE = 0.25
# Where the loss model estimates the end of the certified radii, the probe goes this
# fraction of `tol` below it (while `lo` is far from it) or above it (once `lo` is near):
# with an estimate good to a fraction of `tol`, two probes close the bracket.
AIM = 0.25
CLOSE = 0.9  # the share of `tol` a closing probe goes beyond an end of the bracket
# The slope of the loss model (`_LossModel`) assumed where one point on a side is
# known, and the range a measured slope is clipped to.
SLOPE_UP, SLOPE_DOWN = 1.5, 1.5
SLOPE_MAX = 5.0  # the largest slope assumed from one failed point
SLOPES = (0.5, 20.0)
# Beyond this steepness of `h` (its secant slope; about -1 where the roots steer
# well) the loss model steers instead.
STEEP = 8.0
# The first probe, as a share of the affine map's root (or of `hi` if smaller): where
# trained networks' passes stop certifying, typically 0.35-0.55 of either.
FIRST = 0.45


class CertifiedSearch(NamedTuple):
    """The result of `search_certified` (numpy, one entry per example).

    Attributes:
        lower: `[B]` float64 certified radii.
        passes: `[B]` int64 bound passes spent on each example.
    """

    lower: np.ndarray
    passes: np.ndarray


class _LossModel:
    """The relaxation's loss `1 - v / m0` (`m0` the margin at `eps = 0`) grows like a
    power of the radius (eps^1.5 to eps^5 near the answer on trained networks): in
    `g = log(1 - v / m0)` against `t = log eps` the probes lie near a line, increasing,
    with `g = 0` where the passes stop certifying. It keeps the certified probe with the
    largest radius and the failed one with the smallest (and one before each), and
    estimates the zero by inverse quadratic interpolation, else Illinois false position,
    else a step of an assumed slope from one side."""

    def __init__(self, m0):
        self.m0 = np.asarray(m0, np.float64).copy()
        nan = np.full(self.m0.shape + (2,), np.nan)
        self.c_t, self.c_g, self.u_t, self.u_g = nan, nan.copy(), nan.copy(), nan.copy()
        self.c_r = np.full(self.m0.shape, np.nan)  # log of the root at c_t[:, 0]

    def add(self, idx, eps, value, certified, root) -> None:
        """The probes' points (`certified`: `value > 0`; `root`: their roots or NaN)."""
        m0 = self.m0[idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            g = np.log1p(-value / m0)
            t = np.log(np.where(eps > 0, eps, 1.0))
            log_root = np.log(root)
        ok = np.isfinite(g) & (m0 > 0) & (eps > 0)
        for mask, ts, gs in ((ok & certified, self.c_t, self.c_g),
                             (ok & ~certified, self.u_t, self.u_g)):
            i = idx[mask]
            better = np.isnan(ts[i, 0]) | ((t[mask] > ts[i, 0]) if ts is self.c_t
                                           else (t[mask] < ts[i, 0]))
            j = i[better]
            ts[j, 1], gs[j, 1] = ts[j, 0], gs[j, 0]
            ts[j, 0], gs[j, 0] = t[mask][better], g[mask][better]
            if ts is self.c_t:
                self.c_r[j] = log_root[mask][better]

    def estimate(self, idx, halve_c, halve_u) -> np.ndarray:
        """`[k]` the zero's radius (NaN where unknown); `halve_c` / `halve_u`: Illinois'
        halving of the end kept twice in a row."""
        c_t, c_g, u_t, u_g = self.c_t[idx], self.c_g[idx], self.u_t[idx], self.u_g[idx]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            wc, wu = np.where(halve_c, 0.5, 1.0), np.where(halve_u, 0.5, 1.0)
            falsi = c_t[:, 0] - wc * c_g[:, 0] * (u_t[:, 0] - c_t[:, 0]) / (
                wu * u_g[:, 0] - wc * c_g[:, 0])
            slope_c = np.clip((c_g[:, 0] - c_g[:, 1]) / (c_t[:, 0] - c_t[:, 1]), *SLOPES)
            slope_u = np.clip((u_g[:, 0] - u_g[:, 1]) / (u_t[:, 0] - u_t[:, 1]), *SLOPES)
            from_c = c_t[:, 0] - c_g[:, 0] / np.where(np.isfinite(slope_c), slope_c, SLOPE_UP)
            # One certified point: no further than its own root.
            from_c = np.where(np.isnan(slope_c), np.fmin(from_c, self.c_r[idx]), from_c)
            # One failed point: the further it failed, the steeper the loss.
            guess = np.clip(SLOPE_DOWN * np.sqrt(1.0 + u_g[:, 0]), SLOPES[0], SLOPE_MAX)
            from_u = u_t[:, 0] - u_g[:, 0] / np.where(np.isfinite(slope_u), slope_u, guess)
            third_t = np.where(np.isfinite(c_g[:, 1]), c_t[:, 1], u_t[:, 1])
            third_g = np.where(np.isfinite(c_g[:, 1]), c_g[:, 1], u_g[:, 1])
            pts = ((c_t[:, 0], c_g[:, 0]), (u_t[:, 0], u_g[:, 0]), (third_t, third_g))
            iqi = sum(ti * np.prod([-gj / (gi - gj) for k, (_, gj) in enumerate(pts)
                                    if k != i], axis=0) for i, (ti, gi) in enumerate(pts))
        t = np.where((iqi > c_t[:, 0]) & (iqi < u_t[:, 0]), iqi, falsi)
        t = np.where(np.isfinite(t), t, np.where(np.isfinite(from_c), from_c, from_u))
        return np.exp(t)


class _State:
    """The brackets of every example."""

    def __init__(self, lower, upper, scale, tol, values_at_lower=None, root_at_zero=None,
                 value_at_zero=None):
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
        first = np.where(np.isfinite(self.hi) & (self.hi > 0), self.hi, self.scale)
        self.floor = FLOOR * first
        self.tol = tol
        # The last probes with a root, certified (h >= 0) and not (h < 0):
        # `h = root - eps`, whose zero is where the passes stop certifying.
        self.c_eps, self.c_h = np.full(self.lo.shape, np.nan), np.full(self.lo.shape, np.nan)
        self.u_eps, self.u_h = np.full(self.lo.shape, np.nan), np.full(self.lo.shape, np.nan)
        self.repeat = np.zeros(self.lo.shape, np.int64)  # probes in a row on one side
        self.widths = np.full(self.lo.shape + (2,), np.inf)  # log widths before the last 2
        self.p_eps = np.full(self.lo.shape + (3,), np.nan)  # the last 3 probes' eps, h
        self.p_h = np.full(self.lo.shape + (3,), np.nan)
        self.loss = _LossModel(np.full(self.lo.shape, np.nan) if value_at_zero is None
                               else value_at_zero)
        if root_at_zero is not None:
            self.p_eps[:, 0] = 0.0
            self.p_h[:, 0] = np.where(np.isfinite(root_at_zero), root_at_zero, np.nan)

    def done(self) -> np.ndarray:
        bracketed = np.isfinite(self.hi) & (self.hi <= self.lo * (1.0 + self.tol))
        lost = self.f_lo <= 0  # the pass does not certify the radius known beforehand
        return bracketed | lost | (self.hi <= self.floor) | (self.steps >= MAX_STEPS)

    def _root_estimate(self, idx) -> np.ndarray:
        """Where the passes stop certifying, from the roots (NaN where unknown): the
        zero of the parabola of `h` through the last three probes (`h` is concave:
        the intermediate bounds loosen faster as the radius grows), else of the secant
        through the last two, else of the one through the last certified and the last
        failed probe, else the last root."""
        lo, hi = self.lo[idx], self.hi[idx]
        e, h = self.p_eps[idx], self.p_h[idx]  # [k, 3], the newest first

        def inside(t):
            return np.isfinite(t) & (t >= lo) & (t < hi)

        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d01 = (h[:, 0] - h[:, 1]) / (e[:, 0] - e[:, 1])
            d12 = (h[:, 1] - h[:, 2]) / (e[:, 1] - e[:, 2])
            a = (d01 - d12) / (e[:, 0] - e[:, 2])
            # h ~ h0 + b t + a t^2 in t = eps - e0 (Newton's form about the newest probe)
            b = d01 + a * (e[:, 0] - e[:, 1])
            disc = b * b - 4.0 * a * h[:, 0]
            q = -(b + np.copysign(np.sqrt(np.maximum(disc, 0.0)), b)) / 2.0
            t1, t2 = e[:, 0] + q / a, e[:, 0] + h[:, 0] / q
            near = np.where(np.abs(t1 - e[:, 0]) <= np.abs(t2 - e[:, 0]), t1, t2)
            far = np.where(np.abs(t1 - e[:, 0]) <= np.abs(t2 - e[:, 0]), t2, t1)
            parabola = np.where(disc >= 0, np.where(inside(near), near, far), np.nan)
            secant = e[:, 0] - h[:, 0] / d01
            c_eps, c_h = self.c_eps[idx], self.c_h[idx]
            falsi = c_eps - c_h * (self.u_eps[idx] - c_eps) / (self.u_h[idx] - c_h)
            # Through the affine map's root at eps = 0 and one probe: the parabola
            # with h'(0) = -1 (the relaxation loses only O(eps^2) near eps = 0).
            a0 = (h[:, 0] - h[:, 1] + e[:, 0]) / (e[:, 0] * e[:, 0])
            disc0 = 1.0 - 4.0 * a0 * h[:, 1]
            tangent = np.where((e[:, 1] == 0) & np.isnan(e[:, 2]) & (disc0 >= 0),
                               2.0 * h[:, 1] / (1.0 + np.sqrt(np.maximum(disc0, 0.0))), np.nan)
        last = np.maximum(e[:, 0] + h[:, 0], lo)
        est = np.full(lo.shape, np.nan)
        for candidate in (last, falsi, secant, tangent, parabola):  # the last that fits wins
            est = np.where(inside(candidate), candidate, est)
        return est

    def next_radius(self, idx) -> np.ndarray:
        lo, hi, f_lo, f_hi = self.lo[idx], self.hi[idx], self.f_lo[idx], self.f_hi[idx]
        grow = np.maximum(GROWTH * lo, self.scale[idx])
        edge = 1.0 + self.tol / 2.0
        low_end = np.where(lo > 0, lo * edge, np.where(np.isfinite(hi), hi * 1e-3, 0.0))
        # A wide bracket is halved in log space (the margins' bound is far from linear
        # over it); a narrow one by false position. Without a value at hi (an
        # adversarial distance), the first guess is `scale`.
        with np.errstate(divide="ignore", invalid="ignore"):
            middle = np.sqrt(low_end * hi)
            chord = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        guess = np.isnan(f_hi) & (self.scale[idx] > low_end) & (self.scale[idx] < hi)
        narrow = hi <= WIDE * np.maximum(lo, 1e-300)
        pick = np.where(guess, self.scale[idx],
                        np.where(narrow & np.isfinite(chord), chord, middle))
        pick = np.where(np.isfinite(hi), pick, grow)
        # With a root: just above its estimate of the end of the certified radii.
        est = self._root_estimate(idx)
        # Safeguards: an estimate outside the bracket, or a second probe in a row on
        # the same side, leaves the step to the bracketing rules above.
        # Brent's safeguard: a bracket that did not halve (in log space) over the last
        # two probes gets a bracketing step.
        with np.errstate(divide="ignore", invalid="ignore"):
            width = np.where((lo > 0) & np.isfinite(hi), np.log(hi / lo), np.inf)
        slow = width > 0.5 * self.widths[idx, 1]
        self.widths[idx, 1], self.widths[idx, 0] = self.widths[idx, 0], width
        rooted = np.isfinite(est) & (self.repeat[idx] < 3) & ~slow
        pick = np.where(rooted, est * (1.0 + ABOVE * self.tol), pick)
        # Only the affine map's root at eps = 0 (or one root beyond the bracket): the
        # passes stop certifying well before it; `FIRST` of the way there (or to
        # `hi`) gives a second point of `h` without wasting a probe near `lo`.
        e0, h0 = self.p_eps[idx, 0], self.p_h[idx, 0]
        alone = np.isfinite(h0) & np.isnan(self.p_h[idx, 1]) & ((e0 == 0) | ~rooted)
        first = FIRST * np.fmin(e0 + h0, hi)
        pick = np.where(alone & np.isfinite(first) & (first > low_end), first, pick)
        pick = np.where(self._steep(idx, est) & ~alone, self._modelled(idx, pick, slow), pick)
        pick = np.clip(pick, low_end, np.where(np.isfinite(hi), hi / edge, np.inf))
        return np.where(np.isnan(f_lo), lo, pick)

    def _steep(self, idx, est) -> np.ndarray:
        """Where the loss model steers: no root estimate, or `h` steeper than `STEEP`
        between the last two probes with roots (the roots overshoot there)."""
        e, h = self.p_eps[idx], self.p_h[idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            slope = (h[:, 0] - h[:, 1]) / (e[:, 0] - e[:, 1])
        return ~np.isfinite(est) | (slope < -STEEP)

    def _modelled(self, idx, pick, slow) -> np.ndarray:
        """The loss model's probe (`pick` where it has no estimate in the bracket):
        near an end, the one that closes the bracket whichever way it goes; else just
        below the estimate (then `lo` is near)."""
        lo, hi = self.lo[idx], self.hi[idx]
        est = self.loss.estimate(idx, (self.side[idx] == -1) & (self.repeat[idx] >= 2),
                                 (self.side[idx] == 1) & (self.repeat[idx] >= 2))
        reach = 1.0 + CLOSE * self.tol
        near_hi = hi / reach <= est * (1.0 - AIM * self.tol)
        near_lo = lo * reach >= est * (1.0 + AIM * self.tol)
        aimed = np.where(near_hi, hi / reach,
                         np.where(near_lo, lo * reach, est * (1.0 - AIM * self.tol)))
        # Brent's safeguard (`slow`) spares a closing probe: it ends the search either way.
        ok = np.isfinite(est) & (est > lo) & (est < hi) & (~slow | near_hi | near_lo)
        return np.where(ok, aimed, pick)

    def update(self, idx, eps, value, root) -> None:
        first = np.isnan(self.f_lo[idx])
        up = ~first & (value > 0)
        down = ~first & ~(value > 0)
        side = np.where(up, 1, np.where(down, -1, 0))
        self.repeat[idx] = np.where((side != 0) & (side == self.side[idx]),
                                    self.repeat[idx] + 1, 1)
        i = idx[first]
        self.f_lo[i] = value[first]
        i = idx[up]
        self.f_hi[i[self.side[i] == 1]] /= 2.0
        self.lo[i], self.f_lo[i], self.side[i] = eps[up], value[up], 1
        i = idx[down]
        self.f_lo[i[self.side[i] == -1]] /= 2.0
        self.hi[i], self.f_hi[i], self.side[i] = eps[down], value[down], -1
        self.loss.add(idx[~first], eps[~first], value[~first], up[~first], root[~first])
        # The roots: a certified probe's estimates the end; a failed probe's is
        # certified by that same pass (up to its radius).
        known = np.isfinite(root)
        h = root - eps
        ok = known & (value > 0) & (h >= 0)
        self.c_eps[idx[ok]], self.c_h[idx[ok]] = eps[ok], h[ok]
        i = idx[known]
        self.p_eps[i, 1:], self.p_h[i, 1:] = self.p_eps[i, :-1], self.p_h[i, :-1]
        self.p_eps[i, 0], self.p_h[i, 0] = eps[known], h[known]
        ok = known & down
        self.u_eps[idx[ok]], self.u_h[idx[ok]] = eps[ok], np.minimum(h[ok], 0.0)
        gain = ok & (root > 0) & (np.minimum(root, eps) > self.lo[idx])
        i = idx[gain]
        self.lo[i] = np.minimum(root[gain], eps[gain])
        self.f_lo[i] = np.maximum(self.f_lo[i], np.finfo(np.float64).tiny)
        self.steps[idx] += 1


def search_certified(values: Callable, lower: np.ndarray, upper: np.ndarray,
                     scale: np.ndarray, tol: float = 1e-3,
                     progress: Callable | None = None,
                     values_at_lower: np.ndarray | None = None,
                     root_at_zero: np.ndarray | None = None,
                     value_at_zero: np.ndarray | None = None) -> CertifiedSearch:
    """Per example, a certified radius within `1 + tol` of where the pass stops certifying,
    and the passes it took.

    Args:
        values: `values(index, eps)`: the pass at radii `eps [k]` around the examples
            `index [k]`: either `[k]` lower bounds of the smallest margin over the
            balls (certified where > 0; at `eps = 0` the margin itself), or a pair of
            those and `[k]` roots: radii below which the same pass certifies every
            ball up to `eps` (NaN where it has none; see the module docstring).
        lower: `[B]` radii known to be certified (0 if none).
        upper: `[B]` radii known not to be (an adversarial distance), or inf / NaN.
        scale: `[B]` a guess of the answer (the first radius tried inside the bracket,
            or without `upper` the first one grown).
        tol: relative width of the final bracket.
        progress: optional `progress(k)`, called with the number of examples finished.
        values_at_lower: optional `[B]` estimates of `values` at `lower` (e.g. the
            margin at `eps = 0`), which spare a pass there: they only steer the search
            (an estimate <= 0 is ignored), `lower` is known to be certified anyway.
        root_at_zero: optional `[B]` the root of a pass at `eps = 0` (the distance to
            the nearest decision hyperplane of the affine map at `x`): a first point
            that steers the search, certifying nothing.
        value_at_zero: optional `[B]` the value of `values` at `eps = 0` (the margin
            at `x`): the scale of the loss model that steers the search where the roots
            do not (without it, the bracketing rules do).

    Returns:
        `CertifiedSearch`: `[B]` float64 certified radii (`lower` where the pass
        certifies no more) and the passes spent per example.

    Example:

    ```python
    res = search_certified(lambda i, e: c[i] - e, np.zeros(2), np.full(2, np.inf),
                           np.ones(2))
    ```
    """
    state = _State(lower, upper, scale, tol, values_at_lower, root_at_zero,
                   value_at_zero)
    finished = state.done()
    if progress is not None and finished.any():
        progress(int(finished.sum()))
    while not finished.all():
        idx = np.flatnonzero(~finished)
        eps = state.next_radius(idx)
        out = values(idx, eps)
        value, root = out if isinstance(out, tuple) else (out, np.full(idx.shape, np.nan))
        state.update(idx, eps, np.asarray(value, np.float64), np.asarray(root, np.float64))
        now = state.done()
        if progress is not None:
            progress(int((now & ~finished).sum()))
        finished = now
    return CertifiedSearch(state.lo, state.steps)


def largest_certified(values: Callable, lower: np.ndarray, upper: np.ndarray,
                      scale: np.ndarray, tol: float = 1e-3,
                      progress: Callable | None = None,
                      values_at_lower: np.ndarray | None = None) -> np.ndarray:
    """`search_certified(...).lower`, with the same arguments.

    Example:

    ```python
    lo = largest_certified(values, np.zeros(b), upper, np.ones(b), tol=1e-3)
    ```
    """
    return search_certified(values, lower, upper, scale, tol, progress,
                            values_at_lower).lower
