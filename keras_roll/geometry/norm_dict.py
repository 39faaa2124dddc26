"""`NormDict`: results by norm, found under 1, 2, np.inf or their names.

Example:

```python
margins = NormDict({2: eps2, np.inf: eps_inf})
margins["l2"] is margins[2] is margins[2.0]      # True
NORM_LABELS[np.inf]                              # 'linf'
```
"""

from __future__ import annotations

import math

from keras_roll.options import parse_norm

__all__ = ["NORM_LABELS", "NormDict"]

NORM_LABELS = {1: "l1", 2: "l2", math.inf: "linf"}
"""The name of every norm in tables and messages."""


class NormDict(dict):
    """A dict keyed by norm that also finds 'l1', 'l2', 'linf', 'inf', 1.0, np.inf.

    Example:

    ```python
    cert.margins["l2"] is cert.margins[2] is cert.margins[2.0]    # True
    ```
    """

    def _key(self, key):
        try:
            return parse_norm(key)
        except ValueError:
            raise KeyError(f"{key!r}: the norms here are "
                           f"{[NORM_LABELS[p] for p in self]}.") from None

    def __getitem__(self, key):
        k = self._key(key)
        if not dict.__contains__(self, k):
            raise KeyError(f"{key!r} was not certified or bounded; the norms here are "
                           f"{[NORM_LABELS[p] for p in self]} (pass norms= to the call "
                           f"that made it).")
        return dict.__getitem__(self, k)

    def __contains__(self, key):
        try:
            return dict.__contains__(self, parse_norm(key))
        except ValueError:
            return False

    def get(self, key, default=None):
        return self[key] if key in self else default
