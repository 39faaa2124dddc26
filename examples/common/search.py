"""`--search`: each Table 1 row's lam found by bisection on validation accuracy.

The paper's lam does not suit every data set (on Fashion-MNIST every ROLL model at
lam = 2 lands 4-6 points below vanilla), and a grid wastes trainings on both sides of
the accuracy target. The selection's rule (`selection.select`) keeps, per row, the
ROLL model with the largest validation margin whose validation accuracy, in whole
percent, is at least vanilla's minus the row's drop (0: same accuracy, 1: 1 % less);
larger lam gives larger margins and lower accuracy, so the row wants the largest lam
that still meets its target. `bisect_lam` brackets that lam (growing the start by
`grow` until a model misses the target, shrinking it when the start misses) and then
halves the bracket geometrically, one training per step.

Validation accuracy is a noisy, only roughly decreasing function of lam: the search
returns the largest lam *tried* that meets the target, which the selection then
picks up with every other stored model.

Example:

```python
result = bisect_lam(lambda lam: train(lam)["val_acc"], cutoff=97, start=2.0, steps=4)
result.lam, result.upper, result.tried      # 1.41, 2.0, ((1.0, 0.975), ...)
```
"""

from __future__ import annotations

import math
from typing import NamedTuple

from examples.common.app import log
from examples.common.selection import DROPS

__all__ = ["SearchResult", "bisect_lam", "meets", "search_rows"]


class SearchResult(NamedTuple):
    """The outcome of `bisect_lam`.

    Attributes:
        lam: the largest lam tried whose validation accuracy meets the target (None:
            none did).
        upper: the smallest lam above it that missed the target (None: none missed).
        tried: every `(lam, validation accuracy)` known, by lam.
    """

    lam: float | None
    upper: float | None
    tried: tuple


def meets(val_acc: float, cutoff: int) -> bool:
    """The selection's rule: validation accuracy in whole percent >= `cutoff`."""
    return round(100 * val_acc) >= cutoff


def _tidy(lam: float) -> float:
    """lam to 3 significant digits (short model tags, no near-duplicate trainings)."""
    return float(f"{lam:.3g}")


def bisect_lam(val_acc_of, cutoff: int, start: float, steps: int, grow: float = 4.0,
               known=None) -> SearchResult:
    """The largest lam whose validation accuracy meets `cutoff` (whole percent), by
    bracketing and geometric bisection, at most `steps` new trainings.

    Args:
        val_acc_of: `lam -> validation accuracy` (trains a model; called once per lam).
        cutoff: the target, in whole percent (vanilla's minus the row's drop).
        start: the first lam to try (e.g. the paper's).
        steps: the most new trainings.
        grow: the bracketing factor (lam x grow up, lam / grow down).
        known: `{lam: validation accuracy}` already trained (e.g. by another row);
            updated with the new trainings.

    Returns:
        A `SearchResult`.

    Example:

    ```python
    bisect_lam(lambda lam: 0.98 - 0.01 * lam, cutoff=97, start=2.0, steps=6).lam  # ~1.5
    ```
    """
    if not (start > 0 and math.isfinite(start)):
        raise ValueError(f"start must be a positive lam, got {start!r}.")
    if steps < 1 or grow <= 1:
        raise ValueError(f"steps must be >= 1 and grow > 1, got steps={steps}, grow={grow}.")
    tried = {} if known is None else known
    left = [steps]

    def good(lam):
        if lam not in tried:
            left[0] -= 1
            tried[lam] = float(val_acc_of(lam))
        return meets(tried[lam], cutoff)

    def bracket():
        lo = max((lam for lam, a in tried.items() if meets(a, cutoff)), default=0.0)
        hi = min((lam for lam, a in tried.items() if lam > lo and not meets(a, cutoff)),
                 default=None)
        return lo, hi

    lo, hi = bracket()
    while left[0] > 0:
        if hi is None:  # nothing missed yet: go up
            lam = _tidy(start if lo < start else lo * grow)
        elif lo == 0.0:  # nothing met yet: go down
            lam = _tidy(hi / grow)
        else:
            lam = _tidy(math.sqrt(lo * hi))
        if lam in tried or lam <= lo or (hi is not None and lam >= hi):
            break  # the bracket is as narrow as 3 digits allow
        good(lam)
        lo, hi = bracket()
    return SearchResult(lo if lo > 0 else None, hi, tuple(sorted(tried.items())))


def search_rows(train_roll, vanilla: dict, start: float, steps: int) -> list[dict]:
    """Bisects lam for each row of the table (same accuracy, 1 % less) against
    `vanilla`'s validation accuracy; returns the row of every ROLL model trained or
    reused (the selection then picks each row's model among them).

    Args:
        train_roll: `lam -> row` (trains, or reuses a stored model).
        vanilla: vanilla's row (its `val_acc`).
        start: the first lam to try.
        steps: the most new trainings per table row.

    Example:

    ```python
    rows += search_rows(lambda lam: train_or_load(ModelSpec.roll(lam, 1.0, 100.0), ...),
                        vanilla_row, start=2.0, steps=4)
    ```
    """
    rows, known = {}, {}

    def val_acc_of(lam):
        rows[lam] = train_roll(lam)
        return rows[lam]["val_acc"]

    for drop, _, what in DROPS:
        cutoff = round(100 * vanilla["val_acc"]) - drop
        result = bisect_lam(val_acc_of, cutoff, start, steps, known=known)
        tried = ", ".join(f"{lam:g}: {100 * a:.1f} %" for lam, a in result.tried)
        found = ("no lam tried meets it" if result.lam is None else
                 f"lam {result.lam:g}" + ("" if result.upper is None else
                                          f" (lam {result.upper:g} misses it)"))
        log(f"--search, ROLL at {what} (validation accuracy >= {cutoff} %): {found}; "
            f"tried {tried}")
    return list(rows.values())
