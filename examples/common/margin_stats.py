"""The statistics of a trained model in the examples' tables: accuracy, #CLR bounds,
margin percentiles and their Spearman correlation, and what the default rounding
guard certifies for the model as Keras evaluates it.

Example:

```python
row, cert = margin_stats(model, x_test, y_test)
row["l2_p50"], row["acc"], row["spearman"]
```
"""

from __future__ import annotations

import math

import numpy as np

import keras_roll
from keras_roll.summary import percentiles_of

__all__ = ["NORMS", "PERCENTILES", "clr_cell", "exact_twin", "margin_stats", "predictions",
           "spearman"]

PERCENTILES = (25, 50, 75, 100)
NORMS = {"l1": 1, "l2": 2}


def spearman(a, b) -> float:
    """Spearman's rank correlation of `a` and `b` over the pairs where both are finite.

    Ties get their average rank; NaN when fewer than two pairs remain or a side is
    constant.

    Example:

    ```python
    spearman([1, 2, 3], [10, 30, 20])   # 0.5
    ```
    """
    a = np.asarray(a, np.float64).reshape(-1)
    b = np.asarray(b, np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"spearman needs arrays of one shape, got {a.shape} and {b.shape}.")
    keep = np.isfinite(a) & np.isfinite(b)
    if keep.sum() < 2:
        return float("nan")
    ra, rb = _rank(a[keep]), _rank(b[keep])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float(np.dot(ra, ra)) * float(np.dot(rb, rb)))
    return float(np.dot(ra, rb) / denom) if denom > 0 else float("nan")


def _rank(v: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties given their average rank."""
    order = np.argsort(v, kind="mergesort")
    ranks = np.empty(v.size, np.float64)
    ranks[order] = np.arange(v.size, dtype=np.float64)
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse.reshape(-1), weights=ranks)
    return sums[inverse.reshape(-1)] / counts[inverse.reshape(-1)]


def predictions(logits: np.ndarray) -> np.ndarray:
    """Class predictions from logits (one logit: its sign, the sigmoid case)."""
    logits = np.asarray(logits)
    if logits.ndim == 1 or logits.shape[-1] == 1:
        return (logits.reshape(len(logits)) > 0).astype(np.int64)
    return logits.argmax(axis=-1)


def exact_twin(model) -> keras_roll.Linearized:
    """The float64 twin of `model`, which the tables certify with `rigor="float32"`.

    The tables report the margins of the network as a function of real numbers (the
    paper's Prop. 6 evaluated in float64 from the float32 weights, which float64
    represents exactly), beside the smaller radii that the default `rigor="float64"`
    certifies for the model *evaluated in float32* (see docs/guide.md, "Rounding").

    Example:

    ```python
    cert = keras_roll.certify(exact_twin(model), x, rigor="float32")
    ```
    """
    return keras_roll.linearize(model).at_dtype("float64")


def margin_stats(model, x, y, prefix: str = "", regions: bool = True, verbose="auto",
                 guarded: bool = False, twin=None):
    """Accuracy, #CLR bounds and margin percentiles of `model` on `(x, y)`.

    Margins and regions are those of the float64 twin (`exact_twin`). With `guarded`,
    also `{prefix}guarded_l2_p50` and `{prefix}guarded_frac`: the median l2 radius that
    `keras_roll.certify`'s default `rigor="float64"` certifies for the model as Keras
    evaluates it (float32 rounding included), and the fraction of points with a
    radius > 0. `twin`: the model's `exact_twin`, when the caller has one already
    (its compiled passes are then reused).

    Returns:
        `(row, certificate)`: the row has `{prefix}acc`, `{prefix}n`, with `regions`
        `{prefix}clr_lower` / `{prefix}clr_upper` (distinct Jacobians <= #CLR <=
        distinct patterns, Lemma 7), `{prefix}clr` (the two as a cell) and
        `{prefix}on_boundary`, `{prefix}l1_p25` ... `{prefix}l2_p100` and
        `{prefix}spearman` (l1 against l2 margins); the certificate is the twin's.

    Example:

    ```python
    row, cert = margin_stats(model, x_test, y_test, guarded=True)
    row["l2_p50"], row["guarded_frac"]
    ```
    """
    twin = exact_twin(model) if twin is None else twin
    # rigor="float32": compute in the twin's own dtype (float64 here), no rounding guard.
    cert = keras_roll.certify(twin, x, norms=(1, 2), verbose=verbose, rigor="float32")
    y = np.asarray(y).reshape(-1)
    row = {f"{prefix}acc": float(np.mean(predictions(cert.logits) == y)), f"{prefix}n": len(y)}
    if regions:
        rc = keras_roll.count_regions(twin, x, verbose=verbose, rigor="float32")
        row.update({f"{prefix}clr_lower": rc.jacobians, f"{prefix}clr_upper": rc.patterns,
                    f"{prefix}on_boundary": rc.on_boundary})
        row[f"{prefix}clr"] = clr_cell(row, prefix)
    for name, p in NORMS.items():
        for q, v in zip(PERCENTILES, percentiles_of(cert.margins[p], PERCENTILES)):
            row[f"{prefix}{name}_p{q}"] = v
    row[f"{prefix}spearman"] = spearman(cert.margins[1], cert.margins[2])
    if guarded:
        own = keras_roll.certify(model, x, norms=(2,), verbose=verbose).margins[2]
        row[f"{prefix}guarded_l2_p50"] = percentiles_of(own, (50,))[0]
        row[f"{prefix}guarded_frac"] = float(np.mean(own > 0))
    return row, cert


def clr_cell(row, prefix: str = "") -> str:
    """'lower - upper' bounds of #CLR (one number when they agree)."""
    lo, up = row.get(f"{prefix}clr_lower"), row.get(f"{prefix}clr_upper")
    if lo is None or up is None:
        return "-"
    return f"{lo:,}" if lo == up else f"{lo:,} - {up:,}"
