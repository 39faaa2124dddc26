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

import math
import numbers

import numpy as np
import tensorflow as tf

from keras_roll.compile.twin import Linearized, linearize

__all__ = [
    "METHODS",
    "as_linearized",
    "check_batch_size",
    "check_bisect_tol",
    "check_directions",
    "check_memory_budget",
    "check_method",
    "check_rigor",
    "check_verbose",
    "for_rigor",
    "parse_norm",
    "parse_norms",
]

INF = math.inf
METHODS = ("analytic", "bisect")
RIGORS = ("float64", "strict", "float32")
_NORM_NAMES = {"inf": INF, "np.inf": INF, "linf": INF, "l_inf": INF, "l1": 1, "l2": 2}


def parse_norm(p):
    """1, 2 or `math.inf` from `p` (1, 2, inf, 1.0, 'l1', 'l2', 'linf', 'inf', 'np.inf')."""
    if isinstance(p, str) and p.strip().lower() in _NORM_NAMES:
        return _NORM_NAMES[p.strip().lower()]
    if isinstance(p, numbers.Real) and not isinstance(p, bool):
        value = float(p)
        if value == 1.0:
            return 1
        if value == 2.0:
            return 2
        if value == INF:
            return INF
    raise ValueError(f"Unsupported norm {p!r}: keras_roll certifies lp balls for p = 1, 2 "
                     f"or np.inf; pass e.g. norms=(1, 2, np.inf).")


def parse_norms(norms) -> tuple:
    """A tuple of distinct norms (see `parse_norm`) in the given order; None gives ()."""
    if norms is None:
        return ()
    if isinstance(norms, (str, numbers.Real)):
        norms = (norms,)
    try:
        items = list(norms)
    except TypeError:
        raise ValueError(f"norms must be a sequence of 1, 2 and np.inf, got {norms!r}.") from None
    out = []
    for p in items:
        q = parse_norm(p)
        if q not in out:
            out.append(q)
    return tuple(out)


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


def check_batch_size(batch_size) -> int | None:
    """None or a positive int."""
    if batch_size is not None and (not isinstance(batch_size, numbers.Integral)
                                   or isinstance(batch_size, bool) or batch_size <= 0):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}.")
    return batch_size


def check_memory_budget(memory_budget) -> int | None:
    """None or a number of bytes >= 1 (returned as an int; 0.5 is refused, not floored)."""
    if memory_budget is not None and (not isinstance(memory_budget, numbers.Real)
                                      or isinstance(memory_budget, bool) or memory_budget < 1):
        raise ValueError(f"memory_budget must be None or a number of bytes >= 1, got "
                         f"{memory_budget!r}; e.g. memory_budget=2**26 for 64 MiB.")
    return None if memory_budget is None else int(memory_budget)


def check_rigor(rigor) -> str:
    """'float64' (the default guard), 'strict' (worst case) or 'float32' (none)."""
    if rigor not in RIGORS:
        raise ValueError(
            f"Unknown rigor={rigor!r}; use 'float64' (the default: neurons and gradients in "
            f"float64, radii shrunk by a probabilistic bound on the rounding of the model's "
            f"own evaluation), 'strict' (the same with a worst-case bound: sound always, "
            f"often 0 on wide float32 networks) or 'float32' (the twin's own dtype, no "
            f"rounding guard).")
    return rigor


def for_rigor(lin: Linearized, rigor: str) -> Linearized:
    """The twin a computation of `rigor` runs on: float64 for 'float64' and 'strict',
    else `lin`."""
    return lin if check_rigor(rigor) == "float32" else lin.at_dtype("float64")


def check_verbose(verbose):
    """'auto', True, False (or a Keras verbosity 0, 1, 2)."""
    if verbose not in ("auto", True, False, 0, 1, 2):
        raise ValueError(f"verbose must be 'auto', True or False, got {verbose!r}.")
    return verbose


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
