"""The budgets of `keras_roll.robust.minimal_norm_attack`: `AttackOptions`.

Example:

```python
opts = AttackOptions(steps=200, restarts=3).checked()
```
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

__all__ = ["AttackOptions"]


class AttackOptions(NamedTuple):
    """Budgets of `minimal_norm_attack` (and of `robust_radius`'s `"attack"` method).

    Attributes:
        steps: gradient steps per run (default 150).
        restarts: runs per input (default 7). The first is untargeted (the largest
            other output) from the best known adversarial point (or `x`); the others
            target the other classes in turn, nearest first by the linear estimate of
            their distance at `x` (from `x`; once every class was targeted, from random
            points within `keras_roll.robust.attacks.NOISE` (half) of the best radius
            around `x`). The first `keras_roll.robust.attacks.FULL_TARGETS` (2)
            targeted runs take `steps` steps, the later ones `scout_steps`.
        max_seconds: stops starting new runs once this many seconds have passed
            (None: no limit; the first run always completes).
        seed: seed of the restarts' random starts (the runs are deterministic).
        step_size: the first step's length as a share of `eps` (decays along a cosine
            to 1/100 of it).
        gamma: the first relative change of `eps` per step (decays to `gamma / 50`).
        probe_steps: the first probe's steps in the final search at fixed radii
            (`keras_roll.robust.upper_search.shrink_upper`: projected gradient descent at
            radii bisected between the certified radius and the best point's
            distance, with budgets that grow as the bracket narrows); 0: no probes.
        probe_budget: the steps all probes of one input may spend together (default
            400).
        polish: runs after the restarts, each from the best point so far, toward its
            class, with `steps` steps (default 3; 0: none). For l_inf they alternate
            sign and smooth steps, which end in different local minima; the last runs
            with a tenth of the step size and a fifth of `gamma` (`FINE`): it settles
            the point the others reached.
        scout_steps: steps of the targeted runs after the first `FULL_TARGETS` (default
            25, never more than `steps`): short runs toward the classes the linear
            estimate ranks further away (by default the 3rd to the 6th), which find
            the nearest class where the estimate is wrong (often for l1: on CNN-S the
            nearest class in l1 can rank 5th);
            the polishing runs then continue from whichever point is closest. They
            run only when `restarts` exceeds `FULL_TARGETS + 1`; a cheaper schedule
            is `AttackOptions(steps=100, restarts=3, polish=3, probe_budget=1000)`
            (on CNN-S it reaches foolbox's FMN in l_inf less often).
        hop: the polishing runs but the last start from the best point plus uniform
            noise of this share of its distance (in the norm's own measure), with the
            norm constraint `1 + hop` times the distance (default 0: no noise): basin
            hopping, which reaches neighbouring local minima the noiseless runs
            cannot leave (l_inf on CNNs).
        refine: rounds of first-order steps along the decision boundary from the best
            point after the polishing runs (default 4; 0: none;
            `keras_roll.robust.attack_refine`): each costs one gradient and one model
            call on 12 candidates per input, keeps only closer points, and the rounds
            stop once no input gains.

    Example:

    ```python
    rr = keras_roll.robust_radius(model, x, y, attack=AttackOptions(steps=200, restarts=3))
    ```
    """

    steps: int = 150
    restarts: int = 7
    max_seconds: float | None = None
    seed: int = 0
    step_size: float = 1.0
    gamma: float = 0.05
    probe_steps: int = 50
    probe_budget: int = 400
    polish: int = 3
    scout_steps: int = 25
    hop: float = 0.0
    refine: int = 4

    def checked(self) -> AttackOptions:
        """The options, or a ValueError naming the bad one."""
        for name in ("steps", "restarts", "seed", "probe_steps", "probe_budget", "polish",
                     "scout_steps", "refine"):
            v = getattr(self, name)
            low = 1 if name in ("steps", "restarts", "scout_steps") else 0
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < low:
                raise ValueError(f"AttackOptions.{name} must be an integer >= {low}, got "
                                 f"{v!r}.")
        if self.max_seconds is not None and not (
                isinstance(self.max_seconds, numbers.Real) and self.max_seconds > 0):
            raise ValueError(f"AttackOptions.max_seconds must be a positive number of seconds "
                             f"or None, got {self.max_seconds!r}.")
        if not (isinstance(self.hop, numbers.Real) and 0 <= self.hop <= 1):
            raise ValueError(f"AttackOptions.hop must be a share in [0, 1] of the best "
                             f"point's distance, got {self.hop!r}.")
        for name, high in (("step_size", 10.0), ("gamma", 0.5)):
            v = getattr(self, name)
            if not (isinstance(v, numbers.Real) and 0 < v <= high):
                raise ValueError(f"AttackOptions.{name} must be in (0, {high}], got {v!r}.")
        return self
