"""The rounding errors a guarded rigor subtracts, slice by slice of the gradient norms.

The guard of a `Rigor` (`keras_roll.rounding.guard`) bounds, for one example
slice, the rounding error of every neuron at `x` and its growth per unit of
radius; `margin_math` subtracts them from every distance (docs/design.md,
section "The rounding bound"). `errors_and_norms` streams the gradient norms of
a batch with the guard's errors of the same slices; under the default guard the
norms come from `guarded_norms` (float32 tangents, float64 where it decides).

Example:

```python
for sl, fwd, gn, err in errors_and_norms(twin, x, None, 2**26, Rigor.FLOAT64):
    eps, j = margins_from_norms(dist, gn.l2, valid, *err.terms())
```
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

from keras_roll.certification.gradient_norms import GradNorms
from keras_roll.certification.guarded_norms import guarded_norms
from keras_roll.compile.interpreter import ForwardPass
from keras_roll.options import Rigor
from keras_roll.rounding.guard import RoundingErrors, guard_for

__all__ = ["GuardedSlice", "RoundingErrors", "errors_and_norms", "rounding_errors"]


class GuardedSlice(NamedTuple):
    """The gradient norms of one slice of examples and their rounding errors.

    Attributes:
        examples: the slice of the examples.
        forward: their `ForwardPass`.
        norms: their `GradNorms`.
        errors: their `RoundingErrors`, None under rigor "float32".
    """

    examples: slice
    forward: ForwardPass
    norms: GradNorms
    errors: RoundingErrors | None


def rounding_errors(twin, fwd, rigor: Rigor = Rigor.FLOAT64, l1=None,
                    memory_budget: int | None = None) -> RoundingErrors:
    """The `RoundingErrors` of a float64 forward pass `fwd` of `twin` under `rigor`
    ("float64" or "strict"): `keras_roll.rounding.guard_for(rigor).errors(...)`.

    Example:

    ```python
    twin = keras_roll.linearize(model).at_dtype("float64")
    err = rounding_errors(twin, twin.forward(x))
    ```
    """
    guard = guard_for(rigor)
    if guard.rigor is Rigor.FLOAT32:
        raise ValueError(f"rounding_errors computes rigor 'float64' or 'strict', got {rigor!r}.")
    return guard.errors(twin, fwd, l1=l1, memory_budget=memory_budget)


def errors_and_norms(twin, x, batch_size: int | None, budget: int | None,
                     rigor: Rigor, norms=(1, 2, math.inf)) -> Iterator[GuardedSlice]:
    """`GuardedSlice`s of `x`: the streamed gradient norms, and the rounding errors
    of `rigor`'s guard in the same slices (None under "float32"). Under the
    default guard a norm is exact (float64) where it can decide a margin and a
    rigorous upper bound elsewhere (`keras_roll.certification.guarded_norms`).

    Example:

    ```python
    for sl, fwd, gn, err in errors_and_norms(twin, x, None, 2**26, Rigor.STRICT):
        ...
    ```
    """
    for sl, fwd, gn, err in guarded_norms(twin, x, batch_size, budget, rigor, norms):
        yield GuardedSlice(sl, fwd, gn, err)
