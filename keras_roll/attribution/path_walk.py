"""The exact integrated-gradients walk: the linear regions of a straight path.

Along the path `x0 + t d`, `t in [0, 1]`, a piecewise-linear network is linear
on intervals of `t`, one per linear region the path crosses. A *probe* at a
point `t` of the path (one batched, compiled call: forward pass, the frozen-pattern
tangent along `d`, and the input gradient of the label logit) returns the
interval `[t - back, t + forward]` of its region (its directional margins both
ways along the path), the region's gradient and a key of its activation
pattern. The walk covers `[0, 1]` with such intervals:

* every round probes all uncovered gaps of all paths at once: next to both ends
  of each gap (a region found there either reaches the end, or the gap shrinks
  to the part between them and the next probe goes half as far), and, in gaps
  longer than the average region, evenly spaced inside;
* the average region width is estimated from the inside probes (a region holding
  a uniformly placed probe is length-biased; the mean of `1 / width` is not);
* a region claims its interval up to the edges already claimed by its
  neighbours, so the claimed intervals partition `[0, 1]`; gaps narrower than
  64 machine epsilons of `t` (slivers) go to the region that closes them.

A path that crosses more than `max_regions` regions, or whose estimated count
(regions found per length covered, after `ESTIMATE_AFTER` of them) is more than
`OVER_FACTOR` times `max_regions`, stops early and is reported as over the cap
(`exact_walk`'s `over`): its caller raises or integrates it otherwise.

The integral of the gradient is the sum of each region's gradient times its
claimed length. The cost is one probe per region crossed plus the probes that
land in a region found already (about a third), in about `log2` of the largest
gap's region count rounds of batched calls. See docs/design.md, section
"Exact integrated gradients".
"""

from __future__ import annotations

import bisect

import numpy as np
import tensorflow as tf

from keras_roll.attribution.path_program import PathTwin, first_crossings, in_hyperplanes

__all__ = ["exact_walk"]

SLIVER_EPSILONS = 64  # path-parameter gaps thinner than this many epsilons are merged
FIRST_PROBES = 16  # probes of a path's first round, evenly spaced
_MAX_IDLE_ROUNDS = 200  # rounds in a row without a new region before giving up
ESTIMATE_AFTER = 8  # regions found before a path's estimated count may stop it
OVER_FACTOR = 2.0  # a path stops when its estimated count passes this times max_regions


class _Path:
    """The claimed intervals of one path, sorted, disjoint, and their pattern keys."""

    __slots__ = ("left", "right", "keys", "covered", "idle")

    def __init__(self):
        self.left: list[float] = []
        self.right: list[float] = []
        self.keys: list[tuple] = []
        self.covered = 0.0  # claimed length
        self.idle = 0

    def density(self) -> float:
        """Estimated regions per unit of `t`: claimed regions per claimed length (an
        underestimate, as regions holding an inside probe are longer than average)."""
        if not self.keys or self.covered <= 0.0:
            return float(FIRST_PROBES)
        return len(self.keys) / self.covered

    def gaps(self, tol: float) -> list[tuple[float, float]]:
        edges = [0.0, *self.right], [*self.left, 1.0]
        return [(a, b) for a, b in zip(*edges) if b - a > tol]

    def claim(self, p: float, lo: float, hi: float, key: tuple, tol: float) -> float:
        """Claims the region `[lo, hi]` found at `p`; returns its claimed length (0: a
        region claimed already)."""
        i = bisect.bisect_right(self.left, p)
        if i and p <= self.right[i - 1]:
            return 0.0
        a = self.right[i - 1] if i else 0.0
        b = self.left[i] if i < len(self.left) else 1.0
        left = a if lo <= a + tol else lo
        right = b if hi >= b - tol else hi
        if right <= left:
            return 0.0
        self.left.insert(i, left)
        self.right.insert(i, right)
        self.keys.insert(i, key)
        self.covered += right - left
        return right - left

    def regions(self) -> int:
        """Regions crossed: runs of equal pattern keys (a segment ended early by
        round-off continues the same region)."""
        return sum(1 for i, k in enumerate(self.keys) if i == 0 or k != self.keys[i - 1])


def _plan(path: _Path, tau0: float, tol: float) -> tuple[list[float], list[bool]]:
    """The probes of a path's next round and whether each is an inside probe."""
    points, inside = [], []
    rho = path.density()
    for a, b in path.gaps(tol):
        length = b - a
        step = min(tau0, length / 2)
        points.append(a + step)
        inside.append(False)
        expected = length * rho
        if expected > 1.0:
            points.append(b - step)
            inside.append(False)
            k = int(expected) - 1
            points.extend(a + length * (np.arange(k) + 1.0) / (k + 1))
            inside.extend([True] * k)
    return points, inside


def exact_walk(engine, x, base, weights, max_regions, budget, bar):
    """Exact integrated gradients of a batch (see the module docstring).

    Args:
        engine: the `LogitGradients` of the model.
        x, base: `[n, *input_shape]` inputs and baselines (model dtype).
        weights: `[n, L]` the attributed weighted sum of logits of each example.
        max_regions: the most regions a path may cross.
        budget: bytes per compiled call, or None.
        bar: a progress bar over examples.

    Returns:
        `(attributions [n, *input_shape] float64, regions [n] int64, over [n] bool)`:
        `over` marks the paths stopped at `max_regions` (see the module docstring),
        whose attributions are partial and whose `regions` is the estimated count.
    """
    n, ex_shape = x.shape[0], x.shape[1:]
    dtype = np.dtype(engine.lin.dtype)
    eps_f = float(np.finfo(dtype).eps)
    tol = SLIVER_EPSILONS * eps_f
    tau0 = float(np.sqrt(eps_f))  # probe step beyond a covered end
    b64 = base.reshape(n, -1).astype(np.float64)
    d64 = x.reshape(n, -1).astype(np.float64) - b64
    twin = PathTwin.of(engine)
    u0, u1 = twin.ends(base.astype(dtype), d64.astype(dtype).reshape(x.shape))
    crossings = None
    if twin.hoists_first_unit:
        u0, u1 = in_hyperplanes(u0.numpy(), u1.numpy(), twin.first.breakpoints)
        crossings = first_crossings(u0, u1, twin.first.breakpoints)
        u0, u1 = tf.constant(u0), tf.constant(u1)
    walk = _Walk(twin, u0, u1, crossings, weights.astype(dtype), tol)
    paths = walk.paths
    active = list(range(n))
    over = np.zeros(n, bool)
    done = [0.0] * n  # share of each path walked, as the progress bar shows it
    # A probe's tangent pass runs after its gradient, on the kept forward records: its
    # peak per point measured below the plain gradient's estimate (0.65 of it on
    # ResNet-18, 0.86 on a 48k-neuron CNN, 0.5 on an MLP), so the chunks take that estimate.
    chunk = engine.chunk_size(ex_shape, budget)
    while active:
        owner, points, inside = [], [], []
        for e in active:
            pts, ins = _plan(paths[e], tau0, tol)
            owner.extend([e] * len(pts))
            points.extend(pts)
            inside.extend(ins)
        owner, points = np.asarray(owner), np.asarray(points, np.float64)
        for c0 in range(0, owner.size, chunk):
            walk.run(owner[c0:c0 + chunk], points[c0:c0 + chunk], inside[c0:c0 + chunk])
        still, shown = [], 0.0
        for e in active:
            before = done[e]
            if paths[e].gaps(tol) and not _over(paths[e], max_regions):
                _check_idle(paths[e], e)
                still.append(e)
                done[e] = min(paths[e].covered, 0.99)  # the share of the path walked
            else:
                over[e] = bool(paths[e].gaps(tol))
                done[e] = 1.0
            shown += done[e] - before
        bar.update(shown)  # in examples, a walked share at a time: the bar's ETA moves
        active = still
    grad = twin.pull_back(walk.total, ex_shape).reshape(n, -1)
    attr = (d64 * grad).reshape(n, *ex_shape)
    regions = [max(len(p.keys), round(p.density())) if o else p.regions()
               for p, o in zip(paths, over)]
    return attr, np.array(regions, np.int64), over


class _Walk:
    """Runs rounds of probes and claims their regions; sums the weighted gradients."""

    def __init__(self, twin, u0, u1, crossings, weights, tol):
        self.twin, self.u0, self.u1 = twin, u0, u1
        self.crossings = crossings
        self.weights, self.tol = weights, tol
        n = int(u0.shape[0])
        self.paths = [_Path() for _ in range(n)]
        self.total = np.zeros((n, int(np.prod(u0.shape[1:]))))

    def run(self, owner, points, inside):
        forward, back, keys, grad = self.twin.probe(self.u0, self.u1, owner, points,
                                                    self.weights[owner])
        lo = points - back.astype(np.float64)
        hi = points + forward.astype(np.float64)
        keys = keys.tolist()
        if self.crossings is not None:
            lo, hi, keys = self._first_unit(owner, points, lo, hi, keys)
        weights = np.zeros(owner.size)
        for j, (e, p, a, b) in enumerate(zip(owner.tolist(), points.tolist(), lo.tolist(),
                                             hi.tolist())):
            path = self.paths[e]
            a, b = max(a, 0.0), min(b, 1.0)
            weights[j] = path.claim(p, a, b, tuple(keys[j]), self.tol)
        grad = grad.reshape(owner.size, -1)
        for e in np.unique(owner[weights > 0]):
            rows = np.flatnonzero(owner == e)
            self.total[e] += weights[rows] @ grad[rows].astype(np.float64)
            self.paths[e].idle = 0

    def _first_unit(self, owner, points, lo, hi, keys):
        """Adds the first activation's crossings (known for the whole path)."""
        lo, hi = lo.copy(), hi.copy()
        for e in np.unique(owner):
            rows = np.flatnonzero(owner == e)
            times = np.concatenate([[-np.inf], self.crossings[e], [np.inf]])
            k = np.searchsorted(times, points[rows], side="right")  # >= 1
            after, before = times[k], times[k - 1]
            hi[rows] = np.minimum(hi[rows], after)
            lo[rows] = np.maximum(lo[rows], before)
            for j, kk in zip(rows.tolist(), k.tolist()):
                keys[j] = (*keys[j], kk)
        return lo, hi, keys


def _over(path: _Path, max_regions: int) -> bool:
    """Whether the path has crossed `max_regions` regions, or is estimated to cross more
    than `OVER_FACTOR` times as many."""
    found = len(path.keys)
    return found >= max_regions or (found >= ESTIMATE_AFTER
                                    and path.density() > OVER_FACTOR * max_regions)


def _check_idle(path: _Path, e: int):
    path.idle += 1
    if path.idle > _MAX_IDLE_ROUNDS:
        a, _ = path.gaps(0.0)[0]
        raise RuntimeError(
            f"Could not find the linear region after t={a:.17g} on the path of example {e} "
            f"in {_MAX_IDLE_ROUNDS} rounds of probes; use steps=k for a Riemann sum.")
