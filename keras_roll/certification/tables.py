"""The paper-style tables of the results' `summary()`; `Summary`, the object
every `summary()` returns, lives in `keras_roll.summary` (re-exported here).

Example:

```python
print(format_table("Certified margins", [("l2 ball", cert.margins[2], None)], (50, 100)))
cert.summary()            # a Summary: shows the table in a notebook or a REPL
print(cert.summary())     # the same table, once
```
"""

from __future__ import annotations

import math

import numpy as np

from keras_roll.options import Rigor
from keras_roll.rounding.noise import FAILURE_PROBABILITY, KAPPA, LAMBDA, SAMPLES
from keras_roll.summary import Summary

__all__ = ["Summary", "format_table", "percentiles_of", "rigor_line"]

INF = math.inf


def rigor_line(rigor: Rigor, evaluation: str) -> str:
    """The summary line that says what a certificate's rounding guard guarantees.

    Example:

    ```python
    rigor_line(Rigor.FLOAT64, "float32")   # 'Rounding guard: probabilistic, ...'
    ```
    """
    rigor = Rigor.parse(rigor)
    if rigor is Rigor.FLOAT32:
        return (f"Rigor float32: the float32 twin's radii, not guarded against rounding "
                f"(the model evaluates in {evaluation}).")
    if rigor is Rigor.STRICT:
        return (f"Rounding guard: worst case (rigor 'strict'): radii shrunk by a rigorous "
                f"bound on rounding; sound for the model evaluated in {evaluation}.")
    return (f"Rounding guard: probabilistic (rigor 'float64'): radii shrunk by "
            f"{LAMBDA:g} x {KAPPA:g} estimated standard deviations of the rounding of the "
            f"model evaluated in {evaluation} (Higham & Mary's model; {SAMPLES} Gaussian "
            f"probes), or by the worst-case bound where smaller; a neuron of a point fails "
            f"with probability < {FAILURE_PROBABILITY:.1e}. rigor='strict' for the worst "
            f"case alone.")


def percentiles_of(v, qs) -> list[float]:
    """Percentiles `qs` of `v` (inf where interpolating infinities gives NaN)."""
    v = np.asarray(v, np.float64)
    if v.size == 0:
        return [float("nan")] * len(qs)
    with np.errstate(invalid="ignore"):
        out = np.percentile(v, qs)
    out = np.where(np.isnan(out), INF, out)  # inf - inf when interpolating infinities
    return [float(o) for o in out]


def format_table(head: str, rows, qs) -> str:
    """A paper-style table: one row of percentiles (and a count of zeros) per `(label, v, _)`."""
    cols = [f"P{q:g}" for q in qs]
    width = 22 + 12 * len(cols) + 10
    lines = [head, "_" * width,
             f"{'Margin':<22}" + "".join(f"{c:>12}" for c in cols) + f"{'zero':>10}",
             "=" * width]
    for label, v, _ in rows:
        vals = percentiles_of(v, qs)
        zero = int(np.sum(np.asarray(v) == 0))
        lines.append(f"{label:<22}" + "".join(f"{x:>12.4g}" for x in vals) + f"{zero:>10d}")
    lines.append("_" * width)
    return "\n".join(lines)
