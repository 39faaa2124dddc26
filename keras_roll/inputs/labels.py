"""Labels, checked the same way by every function that reads them.

`check_labels` accepts, for `n` examples of a model with `k` classes:

* an integer: that class for every example;
* `[n]` (or `[n, 1]`) integer class indices in `[0, k)` (integer-valued floats
  too); for a model whose single logit feeds a sigmoid, 0 or 1;
* with `LabelSpec.hot`, `[n, k]` one-hot / multi-hot targets (any finite
  weights, at least one nonzero per row), where a function documents them.

Every refusal names the bad values and their positions, the valid range and
the fix.

Example:

```python
spec = LabelSpec(num_classes=10, model="mnist")
y = check_labels(y, len(x), spec)            # [n] int64 class indices
```
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

__all__ = ["LabelSpec", "check_labels"]

SHOWN = 5  # bad values an error message names


class LabelSpec(NamedTuple):
    """What labels a model and a function take.

    Attributes:
        num_classes: the model's classes `k` (its flattened logits; 1 for a
            single sigmoid logit, whose labels are 0 / 1).
        hot: whether `[n, k]` one-hot / multi-hot targets are accepted.
        sigmoid: the model's single logit feeds a sigmoid: labels 0 / 1.
        model: the model's name, for the error messages.
    """

    num_classes: int
    hot: bool = False
    sigmoid: bool = False
    model: str = ""

    @property
    def binary(self) -> bool:
        """One sigmoid logit: two classes, 0 (the negated logit) and 1."""
        return self.sigmoid and self.num_classes == 1

    def range_text(self) -> str:
        """The valid labels, in words."""
        name = f"model '{self.model}'" if self.model else "the model"
        if self.binary:
            return f"0 or 1 for {name}, whose one output is a sigmoid"
        return (f"in [0, {self.num_classes}) for {name}, which has {self.num_classes} "
                f"classes")


def check_labels(y, n: int, spec: LabelSpec, name: str = "y",
                 offset: int = 0) -> np.ndarray | None:
    """Validates labels; returns `[n]` int64 classes, or `[n, k]` float64 targets.

    Args:
        y: None, an integer, `[n]` / `[n, 1]` class indices, or (with `spec.hot`)
            `[n, k]` one-hot / multi-hot targets; an array or a tensor.
        n: the number of examples.
        spec: the model's `LabelSpec`.
        name: what the error messages call `y`.
        offset: the position of `y[0]` among all labels (for the positions named).

    Returns:
        None for `y=None`; else `[n]` int64 class indices, or `[n, k]` float64
        targets for hot targets.

    Raises:
        ValueError: naming `name`, the bad values and positions, the valid range
            and the fix: for non-numeric labels, a wrong shape, non-integer values,
            classes out of range, or hot rows with NaN or without any class.

    Example:

    ```python
    check_labels([3, 1], 2, LabelSpec(10))                 # array([3, 1])
    check_labels(np.eye(3)[[0, 2]], 2, LabelSpec(3, hot=True))   # [2, 3] targets
    ```
    """
    if y is None:
        return None
    try:
        arr = np.asarray(y.numpy() if tf.is_tensor(y) else y)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"{name} could not be read as an array of labels: {e}") from None
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"{name} must hold integer class labels (numbers {spec.range_text()}), "
                         f"got dtype {arr.dtype}.")
    k = spec.num_classes
    if arr.ndim == 0:
        arr = np.full(n, arr)
    if spec.hot and not spec.binary and arr.shape == (n, k) and k > 1:
        return _hot(arr.astype(np.float64), name, offset)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.shape != (n,):
        raise ValueError(f"{name} must have shape [B] = ({n},), one integer class label per "
                         f"example{_hot_shape(spec, n)}, got shape {arr.shape}"
                         f"{_shape_hint(arr, n, k)}.")
    return _classes(arr, spec, name, offset)


def _hot_shape(spec: LabelSpec, n: int) -> str:
    if spec.hot and not spec.binary and spec.num_classes > 1:
        return f", or [B, L] = ({n}, {spec.num_classes}) one-hot / multi-hot targets"
    return ""


def _shape_hint(arr: np.ndarray, n: int, k: int) -> str:
    if arr.ndim == 2 and arr.shape == (n, k) and k > 1:
        return " (for one-hot rows pass np.argmax(y, axis=-1))"
    if arr.size == n:
        return " (pass y.reshape(-1))"
    return ""


def _positions(bad: np.ndarray, offset: int) -> str:
    pos = np.flatnonzero(bad)
    more = f" (and {pos.size - SHOWN} more)" if pos.size > SHOWN else ""
    return f"{(pos[:SHOWN] + offset).tolist()}{more}"


def _classes(arr: np.ndarray, spec: LabelSpec, name: str, offset: int) -> np.ndarray:
    """`[n]` int64 classes of a numeric `[n]` array, in range."""
    if np.issubdtype(arr.dtype, np.floating):
        odd = ~np.isfinite(arr) | (arr != np.round(arr))
        if odd.any():
            raise ValueError(
                f"{name} must hold integer class labels, got {arr[odd][:SHOWN].tolist()} at "
                f"positions {_positions(odd, offset)}; pass class indices "
                f"{spec.range_text()}.")
    labels = arr.astype(np.int64)
    top = 2 if spec.binary else spec.num_classes
    bad = (labels < 0) | (labels >= top)
    if bad.any():
        raise ValueError(
            f"{name} must be {spec.range_text()}; got {labels[bad][:SHOWN].tolist()} at "
            f"positions {_positions(bad, offset)}. Pass class indices counted from 0 "
            f"(np.argmax(y, axis=-1) for one-hot rows, y - 1 for labels counted from 1).")
    return labels


def _hot(weights: np.ndarray, name: str, offset: int) -> np.ndarray:
    """Checked `[n, k]` one-hot / multi-hot targets."""
    bad = ~np.all(np.isfinite(weights), axis=1)
    if bad.any():
        raise ValueError(f"{name} (one-hot / multi-hot targets) holds NaN or inf in rows "
                         f"{_positions(bad, offset)}; every weight must be finite.")
    empty = ~np.any(weights != 0, axis=1)
    if empty.any():
        raise ValueError(f"{name} has rows without any target class at positions "
                         f"{_positions(empty, offset)}; every example needs at least one "
                         f"class (a 1 in its row).")
    return weights
