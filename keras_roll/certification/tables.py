"""The paper-style tables of the results' `summary()`, and `Summary`, the object
every `summary()` returns.

Example:

```python
print(format_table("Certified margins", [("l2 ball", cert.margins[2], None)], (50, 100)))
cert.summary()            # a Summary: shows the table in a notebook or a REPL
print(cert.summary())     # the same table, once
```
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable

import numpy as np

from keras_roll.options import Rigor
from keras_roll.rounding.noise import FAILURE_PROBABILITY, KAPPA, LAMBDA, SAMPLES

__all__ = ["Summary", "format_table", "percentiles_of", "rigor_line"]

INF = math.inf


class Summary:
    """The table a result's `summary()` returns (in the manner of statsmodels'
    `Summary`): its `str` is the table, and it shows itself once in a notebook
    (`_repr_html_`) or a REPL (`__repr__`), so `cert.summary()` and
    `print(cert.summary())` both show the table once.

    Attributes:
        lines: the lines of the table and the notes below it.

    Example:

    ```python
    s = keras_roll.certify(model, x).summary()
    print(s)                  # the table
    s.as_text().splitlines()  # its lines
    ```
    """

    def __init__(self, lines: Iterable[str]):
        self.lines = tuple(str(line) for line in lines)

    @classmethod
    def emit(cls, lines: Iterable[str], print_fn: Callable[[str], object] | None = None
             ) -> Summary:
        """A `Summary` of `lines`, also passed as one text to `print_fn` if given (a
        logger's function, say)."""
        summary = cls(lines)
        if print_fn is not None:
            print_fn(summary.as_text())
        return summary

    def as_text(self) -> str:
        """The table as plain text."""
        return "\n".join(self.lines)

    def as_html(self) -> str:
        """The table as a preformatted HTML block."""
        return f"<pre>{html.escape(self.as_text())}</pre>"

    def __str__(self) -> str:
        return self.as_text()

    def __repr__(self) -> str:
        return self.as_text()

    def _repr_html_(self) -> str:
        return self.as_html()


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
