"""Validation of the arguments shared by `certify`, `stability_bounds`,
`lp_margins` and `count_regions`: one validator per argument.

Each validator returns the (normalised) value or raises a `ValueError` that
echoes the bad value and says what to pass instead.

Example:

```python
norms = parse_norms((2.0, "inf"))          # (2, inf)
check_batch_size(batch_size)
lin = as_linearized(model)
```
"""

from __future__ import annotations

import numbers

import numpy as np
import tensorflow as tf

from keras_roll.compile.twin import Linearized, linearize
from keras_roll.options import Rigor

__all__ = [
    "METHODS",
    "as_linearized",
    "check_bisect_tol",
    "check_directions",
    "check_method",
    "for_rigor",
]

METHODS = ("analytic", "bisect")


def check_method(method) -> str:
    """'analytic' or 'bisect'."""
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; use 'analytic' (exact, streamed) or "
                         f"'bisect' (binary search on the real network, a slow cross-check).")
    return method


def check_bisect_tol(bisect_tol) -> float:
    """A relative tolerance in (0, 1)."""
    if not (isinstance(bisect_tol, numbers.Real) and 0 < bisect_tol < 1):
        raise ValueError(f"bisect_tol must be a relative tolerance in (0, 1), got "
                         f"{bisect_tol!r}.")
    return float(bisect_tol)


def for_rigor(lin: Linearized, rigor: Rigor) -> Linearized:
    """The twin a computation of `rigor` runs on: float64 for a guarded rigor, else `lin`."""
    return lin.at_dtype(Rigor.parse(rigor).twin_dtype(lin.dtype))


def as_linearized(model) -> Linearized:
    """`model` itself if it is a `Linearized`, else its (cached) twin (a model made by
    `keras_roll.wrap` is unwrapped)."""
    return model if isinstance(model, Linearized) else linearize(model)


def check_directions(directions, x, dtype) -> np.ndarray | None:
    """`[B, K, *input_shape]` numpy directions in `dtype` (shared ones broadcast), or None.

    Args:
        directions: None, `[B, K, *input_shape]` or `[K, *input_shape]` (shared).
        x: the checked `[B, *input_shape]` inputs.
        dtype: the twin's dtype.
    """
    if directions is None:
        return None
    d = np.asarray(directions.numpy() if tf.is_tensor(directions) else directions)
    if not np.issubdtype(d.dtype, np.number):
        raise ValueError(f"directions must be numeric, got dtype {d.dtype}.")
    ex = tuple(x.shape[1:])
    b = int(x.shape[0])
    if d.ndim == len(ex) + 1 and tuple(d.shape[1:]) == ex:
        d = np.broadcast_to(d[None], (b, *d.shape))  # shared by all examples
    if d.ndim != len(ex) + 2 or d.shape[0] != b or tuple(d.shape[2:]) != ex:
        raise ValueError(
            f"directions must have shape [B, K, *input_shape] = [{b}, K, "
            f"{', '.join(map(str, ex))}] (or [K, {', '.join(map(str, ex))}] shared by all "
            f"examples); got shape {tuple(d.shape)}."
        )
    if not np.all(np.isfinite(d)):
        raise ValueError("directions contain non-finite values (NaN or inf).")
    return d.astype(dtype, copy=False)
