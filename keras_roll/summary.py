"""`Summary`: the object every `summary()` returns, results' and twins' alike.

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
```
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable

__all__ = ["Summary"]


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
