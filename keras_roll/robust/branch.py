"""Branch and bound on activation splits: certified radii as tight as the network's
true minimal perturbation, where the search has the time.

The search over one ball (leaves, splits, multipliers and slopes) is
`keras_roll.robust.subdomains.verify_ball`.

`branch_radius` brackets the minimal perturbation by probing radii between a known
lower bound and a known adversarial distance, bisecting in log space: a certified probe
raises the lower bound, an adversarial point (shrunk further by the minimal-norm
attack) lowers the upper bound, an undecided probe caps the next ones. Where the
attack's point is likely minimal, the probe just below it comes first with most of
the time; the others get a small share, growing as the bracket narrows
(`_probe_seconds`). Where
the bracket closes within `exact_rtol` the radius is known. Each probe starts from
the leaves that certified the last certified one (`BallVerdict.cover`: the same tree,
grown further), not from the whole ball. docs/design.md, section
"Robustness radius".

Example:

```python
res = branch_radius(model, twin, x, pred, np.inf, lower, upper, adversarial,
                    options=BranchOptions(max_seconds=10))
res.lower, res.upper            # [B] each, a bracket at least as narrow
```
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from keras_roll.compile.caches import cached
from keras_roll.robust.adversarial import lp_norm, predict_classes
from keras_roll.robust.arguments import BranchOptions
from keras_roll.robust.attacks import AttackOptions, minimal_norm_attack
from keras_roll.robust.region import guard_mode
from keras_roll.robust.subdomains import BallVerdict, LeafPasses, verify_ball

__all__ = ["BallVerdict", "BranchOptions", "BranchRadius", "branch_radius", "verify_ball"]


SHRINK_STEPS = 50  # steps of the minimal-norm attack from an adversarial leaf's point


class BranchRadius(NamedTuple):
    """What `branch_radius` found (numpy, one entry per input).

    Attributes:
        lower: certified radii (at least the given lower bounds).
        upper: adversarial distances (at most the given upper bounds; NaN: none).
        adversarial: the points of `upper` (NaN rows where none).
        improved_lower, improved_upper: where the search moved each bound.
        leaves: leaves bounded per input.
        runner_up: the class the model gives each point of `upper` (-1 where none).
        passes, attack_steps, probes: per input, the batched bound passes, the
            attacks' gradient steps and the radii probed (the budget spent).
    """

    lower: np.ndarray
    upper: np.ndarray
    adversarial: np.ndarray
    improved_lower: np.ndarray
    improved_upper: np.ndarray
    leaves: np.ndarray
    runner_up: np.ndarray
    passes: np.ndarray
    attack_steps: np.ndarray
    probes: np.ndarray

    def write(self, rr, p, at: np.ndarray) -> None:
        """Writes the moved bounds into rows `at` of a `RobustRadius` for norm `p`, with
        "branch" as their method, and adds the budget spent to its `bound_passes` and
        `attack_steps`."""
        rr.bound_passes[p][at] += self.passes
        rr.attack_steps[p][at] += self.attack_steps
        lower, upper = at[self.improved_lower], at[self.improved_upper]
        rr.lower[p][lower] = self.lower[self.improved_lower]
        rr.lower_method[p][lower] = "branch"
        rr.upper[p][upper] = self.upper[self.improved_upper]
        rr.adversarial[p][upper] = self.adversarial[self.improved_upper]
        rr.runner_up[p][upper] = self.runner_up[self.improved_upper]
        rr.upper_method[p][upper] = "branch"


NEAR = 1.5  # probe just below the upper bound first where it is within this of the lower
PROBE_SHARE = 1 / 32  # the first probe's share of max_seconds in the widest bracket
FIRST_SHARE = 3 / 4  # the share of the probe just below the upper bound (it closes the
# bracket where the attack found the minimal point, the common case where U < NEAR L;
# on the ROLL-tuned MNIST MLP 9 of 10 brackets closed at 5 CPU s with 3/4, 7 with 1/2)


def _next_probe(lo: float, top: float, first: bool, rtol: float) -> float:
    """The next radius to probe: just below `top` first (where the attack's point is
    likely minimal, one certified probe closes the bracket), then the geometric middle
    of `[lo, top]` (bisection in log space; `top / 2` while nothing is certified)."""
    if first:
        return top * (1.0 - rtol / 2)
    if lo <= 0:
        return top / 2
    return float(np.sqrt(lo * top))


def _probe_seconds(max_seconds: float, width0: float, lo: float, top: float,
                   left: float, first: bool, missed: bool = False) -> float:
    """The budget of one probe: `PROBE_SHARE` of `max_seconds` in the first bracket
    (`log(top / lo) = width0`), growing as the bracket narrows (in proportion to
    `width0 / log(top / lo)`: a probe near both ends decides more often with more
    leaves), at most half of the time `left` unless it is the last that fits; all
    that is `left` once the first probe (`FIRST_SHARE`) was `missed` (undecided: a
    shorter probe than that would not bound even a few levels of leaves)."""
    if first:
        return min(left, FIRST_SHARE * max_seconds)
    if missed:
        return left
    width = np.log(top / lo) if lo > 0 else width0
    share = PROBE_SHARE * max_seconds * max(1.0, width0 / max(width, 1e-12))
    return left if share >= 0.5 * left else share


def branch_radius(model, twin, x, pred, p, lower, upper, adversarial, *, gap: float = 0.0,
                  rtol: float = 1e-3, guard=True, memory_budget: int | None = None,
                  options: BranchOptions | None = None) -> BranchRadius:
    """Narrows the brackets `[lower, upper]` of the minimal perturbations by branch and
    bound, one input at a time, within `options.max_seconds` each.

    Args:
        model: the Keras classifier; twin: its float64 `Linearized`.
        x: `[B, *input_shape]` inputs; pred: `[B]` their classes.
        p: the norm.
        lower, upper: `[B]` known certified radii and adversarial distances (NaN:
            none; then the search cannot start from above and only probes up to
            twice the lower bound).
        adversarial: `[B, *input_shape]` the points of `upper`.
        gap: the margin the model's rounded output needs (`region.link_gap`).
        rtol: the search stops where `upper - lower <= rtol * upper`.
        guard: the rounding guard of the model's evaluation: a `Rigor` (under "float64"
            the probabilistic bound, as the relaxation's), True (the worst case) or
            False (none).
        memory_budget: bytes of functionals per pull-back of the layer bounds.
        options: a `BranchOptions`.

    Returns:
        `BranchRadius`.

    Example:

    ```python
    res = branch_radius(model, twin, x, pred, 2, lower, upper, adv, rtol=1e-3)
    ```
    """
    options = (options or BranchOptions()).checked()
    budget = int(memory_budget or twin.memory_budget)
    mode = guard_mode(guard)
    passes = cached(twin, ("branch", p, mode, budget, options.batch, options.layer_steps),
                    lambda: LeafPasses(twin, p, mode, budget, options.batch,
                                       options.layer_steps))
    x = np.asarray(x, np.float64)
    lower, upper = np.array(lower, np.float64), np.array(upper, np.float64)
    adversarial = np.array(adversarial, np.float64)
    up0, lo0 = upper.copy(), lower.copy()
    spent = np.zeros((len(x), 4), np.int64)
    for i in range(len(x)):
        lower[i], upper[i], point, used = _bracket(
            passes, model, x[i], int(pred[i]), lower[i], upper[i], gap, rtol, options)
        spent[i] = used
        if point is not None:
            adversarial[i] = point
    improved_upper = np.isfinite(upper) & ~(upper >= up0)
    runner = np.full(len(x), -1, np.int64)
    if improved_upper.any():
        dtype = np.dtype(model.inputs[0].dtype)
        runner[improved_upper] = predict_classes(model, adversarial[improved_upper].astype(dtype))
    return BranchRadius(lower, upper, adversarial, lower > lo0, improved_upper, spent[:, 0],
                        runner, *spent[:, 1:].T)


class _Spent(NamedTuple):
    """The budget one input's probes spent."""

    leaves: int = 0
    passes: int = 0
    attack_steps: int = 0
    probes: int = 0

    def add(self, verdict: BallVerdict, steps: int) -> _Spent:
        return _Spent(self.leaves + verdict.leaves, self.passes + verdict.passes,
                      self.attack_steps + verdict.attack_steps + steps, self.probes + 1)


def _bracket(passes, model, x, pred, lo, hi, gap, rtol, options):
    """One input's probes: `(lower, upper, point or None, _Spent)`."""
    deadline = options.now() + options.max_seconds
    ceiling = hi if np.isfinite(hi) else 2.0 * lo  # lowered by undecided probes
    point, spent, missed, cover = None, _Spent(), False, None
    first = np.isfinite(hi) and hi < NEAR * lo  # then the attack's point is likely minimal
    width0 = np.log(ceiling / lo) if lo > 0 and ceiling > lo else 1.0
    while np.isfinite(ceiling) and ceiling > 0:
        top = min(hi, ceiling) if np.isfinite(hi) else ceiling
        left = deadline - options.now()
        if (np.isfinite(hi) and hi - lo <= rtol * hi) or left <= 0:
            break
        if top - lo <= rtol * top:  # capped by undecided probes: retry below hi, longer
            if not np.isfinite(hi) or ceiling >= hi:
                break
            ceiling = top = hi
        eps = _next_probe(lo, top, first, rtol)
        seconds = _probe_seconds(options.max_seconds, width0, lo, top, left, first, missed)
        # every later probe is above the last certified one: its leaves start the search
        verdict = verify_ball(passes, model, x, pred, eps, gap, options,
                              options.now() + seconds, cover=cover)
        steps = 0
        if verdict.status == "certified":
            lo, cover = eps, verdict.cover
        elif verdict.status == "adversarial":
            pt, dist, steps = _shrink(model, x, verdict.point, pred, passes.p)
            if dist < hi or not np.isfinite(hi):
                hi, point = dist, pt
            ceiling = min(ceiling, dist)
        else:
            ceiling, missed = eps, missed or first
        first = False
        spent = spent.add(verdict, steps)
    return lo, hi, point, spent


def _shrink(model, x, point, pred, p):
    """The adversarial `point` moved closer to `x` by the minimal-norm attack."""
    nb = minimal_norm_attack(model, x[None], p, pred=np.array([pred]), start=point[None],
                             options=AttackOptions(steps=SHRINK_STEPS, restarts=1))
    if np.isfinite(nb.upper[0]):
        return nb.adversarial[0], float(nb.upper[0]), SHRINK_STEPS
    return point, float(lp_norm(point[None] - x[None], p)[0]), SHRINK_STEPS
