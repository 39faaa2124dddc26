"""The project's one progress bar, and the `verbose` argument that shows it.

`progress_bar(total, verbose, desc)` is the tqdm bar of every long run (certify,
radii, attributions); `RunOptions.progress` opens it for a run's `verbose`.
`keras_roll.options` re-exports these names.

Example:

```python
with progress_bar(3, True, "work", unit="step") as bar:
    bar.update(1.5)       # fractions of an item add up; the count shows 1
```
"""

from __future__ import annotations

import numbers
import sys
from typing import Literal

from tqdm.auto import tqdm

from keras_roll.options.choices import AUTO

__all__ = ["COUNT_FORMAT", "ETA_FORMAT", "FILE_INTERVAL", "Verbose", "check_verbose",
           "progress_bar"]

Verbose = bool | int | Literal["auto"]
"""Progress bar: "auto" (only for runs over a second), True or False (or 0, 1, 2)."""


def check_verbose(verbose) -> Verbose:
    """'auto', True, False (or a Keras verbosity 0, 1, 2).

    Example:

    ```python
    check_verbose("auto")     # 'auto'
    ```
    """
    if isinstance(verbose, str) and verbose == AUTO:
        return verbose
    if isinstance(verbose, bool) or (isinstance(verbose, numbers.Integral)
                                     and int(verbose) in (0, 1, 2)):
        return verbose
    raise ValueError(f"verbose must be 'auto', True or False (or 0, 1, 2), got {verbose!r}.")


ETA_FORMAT = ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit} "
              "[{elapsed} elapsed, ETA {remaining}, {rate_fmt}]")
"""The bar's line when the total is known: done, elapsed time and the time left."""

COUNT_FORMAT = "{desc}: {n_fmt} {unit} [{elapsed} elapsed, {rate_fmt}]"
"""The bar's line when the total is unknown (a stream of unknown length)."""


class _Bar(tqdm):
    """tqdm that shows a fractional count (a share of an example's work) rounded down,
    so that "16/16" means done."""

    @property
    def format_dict(self):
        values = super().format_dict
        values["n_fmt"] = str(int(values["n"] + 1e-6))  # sums of fractions: 15.9999999 is 16
        return values


FILE_INTERVAL = 1.0
"""Seconds between two redraws of a bar written to a file, a pipe or a notebook (not
a terminal): at most one line a second, so a log holds a readable trace."""


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed stream
        return False


def progress_bar(total: int | None, verbose: Verbose, desc: str, unit: str = "ex",
                 file=None) -> tqdm:
    """The project's progress bar (tqdm) over `total` items (None if unknown).

    With a known total its line ends with the elapsed time and the ETA, the time
    left at the rate so far (`ETA_FORMAT`): "gradient distortion (GA):  40%|###   |
    45120/112800 grad [00:12 elapsed, ETA 00:18, 3760.00grad/s]". Work may be
    reported in fractions of an item (`bar.update(0.25)`); the count shown is
    rounded down.

    On a terminal the bar redraws up to ten times a second. Written anywhere else
    (a file, a pipe, a notebook's output) it redraws at most once a second
    (`FILE_INTERVAL`), and its rate and ETA are the averages since the start, which
    do not jump from line to line.

    Args:
        total: number of items (examples, gradients, ...), or None.
        verbose: "auto" (shown only for runs longer than a second, then
            removed), True / 1 / 2 (always shown and kept) or False / 0 (never).
        desc: the label.
        unit: what an item is ("ex" for examples).
        file: the stream it writes to (default: `sys.stderr`).

    Example:

    ```python
    with progress_bar(len(x), "auto", "certify") as bar:
        for chunk in chunks:
            bar.update(len(chunk))
    ```
    """
    file = sys.stderr if file is None else file
    style = {"desc": desc, "unit": unit, "file": file,
             "bar_format": COUNT_FORMAT if total is None else ETA_FORMAT}
    if not _is_terminal(file):
        style.update(mininterval=FILE_INTERVAL, smoothing=0.0)
    if verbose == AUTO:
        return _Bar(total=total, delay=1.0, leave=False, **style)
    return _Bar(total=total, disable=not verbose, **style)
