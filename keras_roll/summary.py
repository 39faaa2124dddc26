"""`Summary`: the object every `summary()` returns, results' and twins' alike, and
the paper-style tables of percentiles the results print in it (`format_table`).

In the manner of statsmodels' `Summary`: its `str` is the table, and it shows
itself once in a notebook (`_repr_html_`) or a REPL (`__repr__`), so both
`cert.summary()` and `print(cert.summary())` show the table once. It depends on
nothing in the core, so every floor can return one (docs/design.md, "Options and
results").

Example:

```python
s = keras_roll.linearize(model).summary()   # shows itself in a notebook
print(s)                                    # the table, once
Summary.emit(["a table"], print_fn=log.info)  # also handed to a logger
print(format_table("Certified margins", [("l2 ball", cert.margins[2])], (50, 100)))
```
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

__all__ = ["Summary", "format_table", "percentiles_of"]

UNDEFINED = "n/a"
"""What a table prints where a value is undefined (no values to take a percentile of)."""


class Summary:
    """The table a `summary()` returns (in the manner of statsmodels' `Summary`):
    its `str` is the table, and it shows itself once in a notebook
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
        logger's function, say); nothing is printed otherwise."""
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


def percentiles_of(values, qs: Sequence[float]) -> list[float]:
    """Percentiles `qs` of the defined values of `values`: NaN entries are left out
    (a caller that has them counts and names them), infinities are kept (inf where
    interpolating between infinities gives NaN), and NaN where no value is left.

    Example:

    ```python
    percentiles_of([1.0, 3.0, np.nan], (50,))     # [2.0]
    percentiles_of([np.nan], (50,))               # [nan]
    ```
    """
    v = np.asarray(values, np.float64).reshape(-1)
    v = v[~np.isnan(v)]
    if v.size == 0:
        return [math.nan] * len(qs)
    with np.errstate(invalid="ignore"):
        out = np.percentile(v, qs)
    out = np.where(np.isnan(out), math.inf, out)  # inf - inf when interpolating infinities
    return [float(o) for o in out]


def format_table(head: str, rows: Iterable[tuple[str, object]], qs: Sequence[float],
                 count: bool = False, column: str = "Margin") -> str:
    """A paper-style table: one row of percentiles and a count of zeros per
    `(label, values)`; with `count`, a last column with the number of values in the row.
    NaN values are left out of a row (`percentiles_of`); a row with none left prints
    `n/a`, never a number. `column` heads the labels.

    Example:

    ```python
    print(format_table("Certified margins", [("l2 ball", cert.margins[2])], (25, 50)))
    ```
    """
    cols = [f"P{q:g}" for q in qs]
    width = 22 + 12 * len(cols) + 10 + (10 if count else 0)
    lines = [head, "_" * width,
             f"{column:<22}" + "".join(f"{c:>12}" for c in cols) + f"{'zero':>10}"
             + (f"{'n':>10}" if count else ""),
             "=" * width]
    for label, values in rows:
        v = np.asarray(values, np.float64).reshape(-1)
        cells = "".join(f"{UNDEFINED:>12}" if math.isnan(x) else f"{x:>12.4g}"
                        for x in percentiles_of(v, qs))
        defined = v[~np.isnan(v)]
        line = f"{label:<22}" + cells + f"{int(np.sum(defined == 0)):>10d}"
        lines.append(line + (f"{defined.size:>10d}" if count else ""))
    lines.append("_" * width)
    return "\n".join(lines)
