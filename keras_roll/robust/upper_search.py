"""The attack's side of the radius search: upper bounds shrunk by probes at fixed radii.

An attack's best point bounds the radius from above; a certified radius (the bound
passes', `keras_roll.robust.search`) from below. `shrink_upper` bisects between
them: a probe at a radius either finds an adversarial point within it (a new upper
bound) or not (the radius is the new floor of the bracket it keeps). Budgets grow as
the bracket narrows, where points are hardest to find.

Example:

```python
res = shrink_upper(probe, lower=certified, upper=attacked, steps=50, max_steps=400)
res.upper, res.steps        # the shrunk upper bounds, the attack steps spent
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

__all__ = ["WIDTH", "UpperSearch", "shrink_upper"]

# The first probe's bracket is the top `WIDTH` of the
# upper bound (or down to the certified radius, where that is closer).
WIDTH = 1.0 / 64


class UpperSearch(NamedTuple):
    """The result of `shrink_upper` (numpy, one entry per example).

    Attributes:
        upper: `[B]` float64 the smallest distance of a point the probes found (the
            `upper` given where none was closer).
        steps: `[B]` int64 attack steps the probes spent on each example.
        probes: `[B]` int64 probes run on each example.
    """

    upper: np.ndarray
    steps: np.ndarray
    probes: np.ndarray


def shrink_upper(probe: Callable, lower: np.ndarray, upper: np.ndarray, *, steps: int,
                 max_steps: int, tol: float = 1e-3) -> UpperSearch:
    """Shrinks attacked upper bounds by probes at fixed radii between both ends.

    The bracket of each example is `[floor, upper]`: `upper` the distance of its best
    adversarial point, `floor` the largest of its certified radius `lower`, the top
    `WIDTH` of `upper`, and the radii where a probe failed. Each probe bisects the
    bracket: the attack at that radius either finds a point (its distance, at most the
    radius, is the new `upper`) or not (the radius is the new `floor`). A probe's
    budget is `steps` times the number of halvings of the bracket so far, plus one:
    it grows as the bracket narrows, where points are hardest to find. The search
    ends where `upper <= floor (1 + tol)` or the next probe would exceed `max_steps`.

    Args:
        probe: `probe(index, eps, steps)`: the attack at radii `eps [k]` around the
            examples `index [k]` with `steps [k]` steps each; returns `[k]` distances
            of the points it found (NaN where none), or a pair of those and `[k]` the
            steps it ran (a probe that ends early, at its first point, is charged
            those; without them, its whole budget).
        lower: `[B]` certified radii (0 if none).
        upper: `[B]` distances of known adversarial points (NaN / inf: skipped).
        steps: the first probe's steps.
        max_steps: the steps all probes of one example may spend together.
        tol: relative width of the final bracket.

    Returns:
        `UpperSearch`: the upper bounds, the steps (as the probes report them) and
        the probes spent.

    Example:

    ```python
    res = shrink_upper(lambda i, e, s: np.where(e > 1.0, 1.0, np.nan), np.zeros(2),
                       np.full(2, 2.0), steps=10, max_steps=100)
    ```
    """
    lower = np.asarray(lower, np.float64)
    up = np.asarray(upper, np.float64).copy()
    floor = np.maximum(lower, (1.0 - WIDTH) * up)
    with np.errstate(invalid="ignore"):
        width0 = up - floor  # NaN where no upper bound: never probed
    spent = np.zeros(up.shape, np.int64)
    probes = np.zeros(up.shape, np.int64)

    def budget():
        with np.errstate(divide="ignore", invalid="ignore"):
            halvings = np.log2(width0 / np.maximum(up - floor, 1e-300))
        return steps * (1 + np.floor(np.nan_to_num(np.maximum(halvings, 0.0))).astype(np.int64))

    def active():
        return np.isfinite(up) & (up > floor * (1.0 + tol)) & (spent + budget() <= max_steps)

    todo = active()
    while todo.any():
        idx = np.flatnonzero(todo)
        eps = 0.5 * (floor[idx] + up[idx])
        cost = budget()[idx]
        out = probe(idx, eps, cost)
        dist, ran = out if isinstance(out, tuple) else (out, cost)
        dist = np.asarray(dist, np.float64)
        spent[idx] += np.minimum(np.asarray(ran, np.int64), cost)
        probes[idx] += 1
        hit = np.isfinite(dist) & (dist < up[idx])
        up[idx[hit]] = dist[hit]
        floor[idx[~hit]] = eps[~hit]
        below = idx[hit & (dist <= floor[idx])]  # past the floor: a new top bracket
        floor[below] = np.maximum(lower[below], (1.0 - WIDTH) * up[below])
        todo = active()
    return UpperSearch(up, spent, probes)
