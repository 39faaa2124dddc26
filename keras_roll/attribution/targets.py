"""What the attribution functions attribute: targets and baselines.

A *target* is a weighted sum of the model's (flattened) logits per example,
`sum_c w_c logit_c`, as a `[B, L]` weight matrix:

* `y=None`: the predicted class (argmax of the logits; for one sigmoid logit,
  class 1 where the logit is positive);
* an integer, or `[B]` integer labels: that class's logit (for one sigmoid
  logit, labels 0 / 1: class 0 is the negated logit, the log-odds of class 0);
* `[B, L]` one-hot or multi-hot targets (or any weights): the sum of the hot
  logits, as captum's and xplique's multi-label targets.

Labels are checked by `keras_roll.inputs.check_labels`, as everywhere; inputs
(arrays or streams, whose labels are the targets unless `y` is given) are read
by `keras_roll.inputs.read_all`. Baselines may be a scalar, one example, or one
per example.

Example:

```python
x, y = read_examples(ds, None, engine.spec)              # the stream's labels
t = resolve_targets(y, len(x), num_logits=10, output_link="softmax", logits=None)
t.weights.shape, t.labels                                  # (B, 10), [B] classes
```
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.inputs import InputSpec, LabelSpec, check_labels, read_all

__all__ = ["Targets", "check_baseline", "read_examples", "resolve_targets"]


class Targets(NamedTuple):
    """The attributed function of every example: `sum_c weights[i, c] logits[i, c]`.

    Attributes:
        weights: `[B, L]` float64 weights over the flattened logits.
        labels: `[B]` int64, the class of a one-class target, -1 for a target of
            several classes.
    """

    weights: np.ndarray
    labels: np.ndarray


def resolve_targets(y, n: int, num_logits: int, output_link: str | None,
                    logits=None, model: str = "") -> Targets:
    """Validates `y` (see the module docstring) and returns the `Targets`.

    Args:
        y: None, an int, `[B]` integer labels, or `[B, L]` one-hot / multi-hot targets.
        n: the number of examples B.
        num_logits: L.
        output_link: "sigmoid" for a model whose single logit feeds a sigmoid.
        logits: `[B, L]` logits at the inputs, for `y=None`.
        model: the model's name, for the error messages.

    Raises:
        ValueError: naming `y`, for wrong shapes, values or classes out of range
            (`keras_roll.inputs.check_labels`).

    Example:

    ```python
    resolve_targets(np.array([2, 0]), 2, 3, "softmax").weights    # one-hot rows
    ```
    """
    binary = num_logits == 1 and output_link == "sigmoid"
    if y is None:
        if logits is None:
            raise ValueError("y is required here: pass integer class labels of shape [B].")
        flat = np.asarray(logits).reshape(n, -1)
        y = (flat[:, 0] > 0).astype(np.int64) if binary else np.argmax(flat, axis=1)
    spec = LabelSpec(num_logits, hot=True, sigmoid=output_link == "sigmoid", model=model)
    labels = check_labels(y, n, spec)
    if labels.ndim == 2:  # one-hot / multi-hot weights
        single = (np.count_nonzero(labels, axis=1) == 1) & (labels.max(axis=1) == 1.0)
        return Targets(labels, np.where(single, np.argmax(labels, axis=1), -1).astype(np.int64))
    weights = np.zeros((n, num_logits))
    if binary:
        weights[:, 0] = np.where(labels == 1, 1.0, -1.0)
    else:
        weights[np.arange(n), labels] = 1.0
    return Targets(weights, labels)


def read_examples(x, y, spec: InputSpec) -> tuple[np.ndarray, object]:
    """`(x, y)`: every example of `x` (an array or a stream, read by
    `keras_roll.inputs.read_all`) as a checked, private numpy copy in `spec.dtype`,
    and the labels (`y` if given, else a stream's, else None), not yet checked.

    Raises:
        ValueError: for bad or non-finite inputs (naming the rows) and an input
            without examples.

    Example:

    ```python
    x, y = read_examples(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), None, spec)
    ```
    """
    batch = read_all(x, spec, y=y)
    return np.array(batch.x), batch.y


def check_baseline(baseline, x: np.ndarray, check) -> np.ndarray:
    """The baselines `[B, *input_shape]` of `x`: zeros for None, a scalar broadcast
    to every entry, one example broadcast to every example, or one per example.

    `check(arr, name)` validates the result (finite values, the model dtype).
    """
    if baseline is None:
        return np.zeros_like(x)
    try:
        arr = np.asarray(baseline.numpy() if tf.is_tensor(baseline) else baseline)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"baseline could not be read as an array: {e}") from None
    if arr.ndim == 0 or arr.shape == x.shape[1:]:
        arr = np.broadcast_to(arr, x.shape)
    elif arr.shape != x.shape:
        raise ValueError(f"baseline must be a number, shaped like one example "
                         f"{x.shape[1:]} or like x {x.shape}, got shape {arr.shape}.")
    return check(arr, "baseline")


def check_scalar(value, name: str, low: float = 0.0, low_open: bool = True) -> float:
    """A finite real number above `low` (or at least `low` with `low_open=False`)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and np.isfinite(value)
    if ok:
        ok = value > low if low_open else value >= low
    if not ok:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")
    return float(value)
