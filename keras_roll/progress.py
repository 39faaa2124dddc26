"""Progress bars for long computations (certificates, stability bounds, region counts).

Example:

```python
with progress_bar(len(x), verbose="auto", desc="certify") as bar:
    for chunk in chunks:
        ...
        bar.update(len(chunk))
```
"""

from __future__ import annotations

from tqdm.auto import tqdm

__all__ = ["progress_bar"]


def progress_bar(total: int, verbose, desc: str) -> tqdm:
    """A tqdm bar over `total` examples.

    Args:
        total: number of examples.
        verbose: "auto" (shown only for runs longer than a second, then
            removed), True (always shown and kept) or False (never).
        desc: the label.
    """
    if verbose == "auto":
        return tqdm(total=total, desc=desc, unit="ex", delay=1.0, leave=False)
    return tqdm(total=total, desc=desc, unit="ex", disable=not verbose)
