"""Why a certified radius is zero, and what to do about it.

A radius is 0 when some neuron sits on a breakpoint (a boundary of the linear
region passes through `x`) or, under a rounding guard, close enough to one that
the model's own rounding could move it across. `Certificate.zero_cause` holds
one `ZeroCause` per example and norm; `Certificate.binding` names the neuron
(and so the layer) behind it, and `Certificate.summary()` counts the causes
(one line per cause, all norms in it) and names the remedies. See docs/guide.md,
section "Certificates".

Example:

```python
cert = keras_roll.certify(cnn, x)
cert.zero_cause[2][:3]          # [ZeroCause.MAX_POOL_TIE, ZeroCause.NONE, ...]
cert.binding[2][0]              # ('max_pooling2d', (3, 4, 0, 0))
```
"""

from __future__ import annotations

import enum

import numpy as np

from keras_roll.geometry import NORM_LABELS

__all__ = ["ZeroCause", "explain_zeros", "no_causes", "zero_lines"]


class ZeroCause(str, enum.Enum):
    """Why a radius is zero (`NONE` where it is not).

    * `MAX_POOL_TIE`: two elements of a max-pooling window are exactly equal
      maxima (e.g. a flat background window). A tie is a region boundary: any
      move that separates them changes which one the gradient flows through.
    * `AT_BREAKPOINT`: a neuron is exactly at its breakpoint (e.g. a ReLU's
      pre-activation is exactly 0), with a nonzero gradient.
    * `ROUNDING_GUARD`: a neuron lies within the rounding guard of its
      breakpoint: in exact arithmetic the radius is positive, but the model's
      own floating-point evaluation could put the neuron on either side.

    Example:

    ```python
    ZeroCause.MAX_POOL_TIE.remedy      # 'average pooling ...'
    ```
    """

    NONE = "none"
    MAX_POOL_TIE = "max_pool_tie"
    AT_BREAKPOINT = "at_breakpoint"
    ROUNDING_GUARD = "rounding_guard"

    def __str__(self) -> str:
        return self.value

    @property
    def description(self) -> str:
        """What the cause means, in a few words."""
        return _DESCRIPTIONS[self]

    @property
    def remedy(self) -> str:
        """What gives a positive radius instead."""
        return _REMEDIES[self]


_DESCRIPTIONS = {
    ZeroCause.NONE: "the radius is not zero",
    ZeroCause.MAX_POOL_TIE: "a tie between equal maxima of a max-pooling window",
    ZeroCause.AT_BREAKPOINT: "a neuron exactly at its breakpoint",
    ZeroCause.ROUNDING_GUARD: "a neuron within the rounding guard of its breakpoint",
}
_REMEDIES = {
    ZeroCause.NONE: "",
    ZeroCause.MAX_POOL_TIE: "average pooling has no ties (a tie is a true region boundary)",
    ZeroCause.AT_BREAKPOINT: "none: the input lies on a region boundary",
    ZeroCause.ROUNDING_GUARD: "rigor='float32' for the paper's exact-arithmetic radii, or a "
                              "float64 model (a guard about 1e9 times smaller)",
}


def explain_zeros(eps: np.ndarray, index: np.ndarray, exact: np.ndarray,
                  max_window: np.ndarray, guarded: bool) -> tuple[np.ndarray, np.ndarray]:
    """The `ZeroCause` of every radius of a batch, and the neuron behind it.

    A zero with a neuron exactly at its breakpoint (`exact >= 0`) is a tie or a
    breakpoint, whatever the guard: that neuron becomes the binding one (it
    attains the zero margin too). Any other zero is the guard's.

    Args:
        eps: `[b]` radii.
        index: `[b]` binding neuron rows (-1: none).
        exact: `[b]` the first neuron exactly at its breakpoint (-1: none).
        max_window: `[N]` bool, the rows that compare the elements of a max window.
        guarded: whether a rounding guard shrank the radii.

    Returns:
        `(causes [b] object array of ZeroCause, index [b])`.

    Example:

    ```python
    causes, index = explain_zeros(eps, index, exact, layout.max_window_rows, True)
    ```
    """
    eps, index, exact = np.asarray(eps), np.asarray(index), np.asarray(exact)
    max_window = np.asarray(max_window, bool)
    causes = no_causes(eps.shape)
    zero = eps == 0
    at = zero & (exact >= 0)
    index = np.where(at, exact, index)
    if max_window.size:
        on_max = max_window[np.maximum(index, 0)] & (index >= 0)
    else:
        on_max = np.zeros(eps.shape, bool)
    causes[at & on_max] = ZeroCause.MAX_POOL_TIE
    causes[at & ~on_max] = ZeroCause.AT_BREAKPOINT
    other = zero & ~at
    if guarded:
        causes[other] = ZeroCause.ROUNDING_GUARD
    else:  # no guard and no exact zero found (e.g. a bisection floor): the binding kind
        causes[other & on_max] = ZeroCause.MAX_POOL_TIE
        causes[other & ~on_max] = ZeroCause.AT_BREAKPOINT
    return causes, index


def no_causes(shape) -> np.ndarray:
    """An object array of `ZeroCause.NONE` (`np.full` would store the strings)."""
    causes = np.empty(shape, dtype=object)
    causes.fill(ZeroCause.NONE)
    return causes


def zero_lines(zero_cause: dict, binding: dict) -> list[str]:
    """The summary lines of the zero radii: one per cause, with its count in every norm,
    the layers of the neurons behind it and its remedy.

    Args:
        zero_cause: `{p: [B]}` `ZeroCause`s by norm (`Certificate.zero_cause`).
        binding: `{p: [B]}` binding neurons `(layer, unit)` or None (`Certificate.binding`).

    Example:

    ```python
    zero_lines(cert.zero_cause, cert.binding)
    # ['Zero radii: 4 of 4 (l1, l2, linf) from a tie between equal maxima of a
    #   max-pooling window (in pool: 4); remedy: average pooling ...']
    ```
    """
    causes = {p: np.asarray(c, dtype=object) for p, c in zero_cause.items()}
    if not causes:
        return []
    n = next(iter(causes.values())).size
    lines = []
    for cause in ZeroCause:
        if cause is ZeroCause.NONE:
            continue
        hits = {p: causes[p] == cause for p in causes}
        counts = {NORM_LABELS[p]: int(h.sum()) for p, h in hits.items() if h.any()}
        if not counts:
            continue
        if len(set(counts.values())) == 1:
            count = f"{next(iter(counts.values()))} of {n} ({', '.join(counts)})"
        else:
            count = ", ".join(f"{lab} {c}" for lab, c in counts.items()) + f" of {n}"
        layers = {}  # each example once: the layer of its first norm with this cause
        for p, h in hits.items():
            for i in np.flatnonzero(h):
                if i not in layers and binding[p][i] is not None:
                    layers[i] = binding[p][i][0]
        names, num = np.unique(list(layers.values()), return_counts=True)
        where = ", ".join(f"{name}: {c}" for name, c in
                          sorted(zip(names, num), key=lambda item: -item[1])[:3])
        lines.append(f"Zero radii: {count} from {cause.description}"
                     + (f" (in {where})" if where else "") + f"; remedy: {cause.remedy}.")
    return lines
