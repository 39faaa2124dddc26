"""Leaves of the branch and bound that are linear programs, solved exactly.

A subdomain of an l_inf ball on which every unstable unit is split is a polytope on
which the network is affine: the box `|x' - x| <= eps` cut by one half-space per split
unit, `s_j (z_j(x') - t_j) >= 0`, with `z_j` and the margins affine there
(`keras_roll.compile.bounds.splits.leaf_forms`). The smallest margin over it is a
linear program (scipy's HiGHS), and its dual, the multipliers of the split
constraints, are the split multipliers `beta` that make the relaxation's bound equal
to it (strong duality: the relaxation with multipliers is the Lagrangian of that
program). So the solver only proposes multipliers; the bound itself comes from the
sound pass with them, whatever the solver's tolerances:

* a feasible program whose minimum exceeds the gap: its multipliers verify the leaf;
* one whose minimum does not: its minimiser is a candidate adversarial point (the
  caller checks it on the model in its own dtype);
* an infeasible one (the splits contradict each other on the ball): the multipliers
  of the most violated mix of constraints (the dual of `max tau` subject to
  `s_j (z_j - t_j) >= tau`, whose optimum is negative), scaled until the bound
  exceeds the gap.

Without scipy, or for other norms, `solve_leaves` is not available (`available`) and
the search bounds such leaves again with more multiplier steps.

Example:

```python
if available(p):
    sol = solve_leaves(forms, splits, betas, lower, eps, gap)
    sol.betas, sol.points, sol.below
```
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

try:  # an optional dependency: without it complete leaves are bounded again
    from scipy.optimize import linprog
except ImportError:  # pragma: no cover - scipy is installed with the tests
    linprog = None

__all__ = ["LinearLeaves", "available", "solve_leaves"]


def available(p) -> bool:
    """Whether complete leaves of balls in norm `p` can be solved (l_inf and scipy)."""
    return linprog is not None and p == np.inf


class LinearLeaves(NamedTuple):
    """What `solve_leaves` found for `m` leaves (numpy).

    Attributes:
        betas: `[m, C, size]` the multipliers to bound the leaves with (the given ones
            where a row needed no program or the solver failed).
        points: `[m, n]` the minimiser of each leaf's smallest margin, relative to `x`
            (NaN rows where none is at most the gap).
        below: `[m]` the smallest program minimum per leaf (`+inf`: every row above the
            gap or infeasible).
    """

    betas: np.ndarray
    points: np.ndarray
    below: np.ndarray


def solve_leaves(forms: tuple, splits: np.ndarray, betas: np.ndarray, lower: np.ndarray,
                 eps: float, gap: float) -> LinearLeaves:
    """Solves the linear program of every row at most `gap` of `m` complete leaves.

    Args:
        forms: `(offset [m, C], lam [m, C, n], unit_offset [m, size], unit_lam
            [m, size, n], edge [size])`: the margins' and the units' affine forms
            relative to `x` (`keras_roll.compile.bounds.splits.leaf_forms`, flattened),
            and each unit's breakpoint relative to its value at `x`.
        splits: `[m, size]` +1, -1 or 0; betas: `[m, C, size]` the current multipliers.
        lower: `[m, C]` the current bounds (rows above `gap` are not solved).
        eps: the l_inf radius; gap: the margin needed.

    Returns:
        `LinearLeaves`.
    """
    offset, lam, u_off, u_lam, edge = forms
    m, n = lam.shape[0], lam.shape[2]
    betas = betas.copy()
    points, below = np.full((m, n), np.nan), np.full(m, np.inf)
    for i in range(m):
        on = np.flatnonzero(splits[i])
        s = splits[i, on].astype(np.float64)
        a_ub = -s[:, None] * u_lam[i, on]
        b_ub = s * (u_off[i, on] - edge[on])
        for c in np.flatnonzero(lower[i] <= gap):
            res = linprog(lam[i, c], A_ub=a_ub if len(on) else None,
                          b_ub=b_ub if len(on) else None, bounds=(-eps, eps), method="highs")
            if res.status == 2:  # infeasible: the leaf holds no point
                betas[i] = _farkas(a_ub, b_ub, offset[i], lam[i], eps, gap, on, betas[i])
                break
            if res.status != 0:
                continue
            betas[i, c, on] = np.maximum(-res.ineqlin.marginals, 0.0)
            value = offset[i, c] + res.fun
            if value <= gap and value < below[i]:
                below[i], points[i] = value, res.x
    return LinearLeaves(betas, points, below)


def _farkas(a_ub, b_ub, offset, lam, eps, gap, on, betas):
    """`[C, size]` multipliers that bound an infeasible leaf above `gap`: `K y`, with
    `y` the dual of `max tau` subject to `a_ub d + tau <= b_ub` on the box (`sum y = 1`,
    and `max_d y . s (z - t) = tau* < 0`), so the bound rises by `K |tau*|` over the
    box's minimum of each margin, `offset - eps |lam|_1`."""
    k = a_ub.shape[0]
    cost = np.zeros(a_ub.shape[1] + 1)
    cost[-1] = -1.0
    res = linprog(cost, A_ub=np.concatenate([a_ub, np.ones((k, 1))], 1), b_ub=b_ub,
                  bounds=[(-eps, eps)] * a_ub.shape[1] + [(None, 1.0)], method="highs")
    if res.status != 0 or -res.fun >= 0:
        return betas
    tau = -res.fun
    y = np.maximum(-res.ineqlin.marginals, 0.0)
    base = offset - eps * np.abs(lam).sum(axis=1)  # [C]
    scale = (2.0 * np.maximum(gap - base, 0.0) + 1.0) / -tau
    out = betas.copy()
    out[:, on] = scale[:, None] * y[None]
    return out
