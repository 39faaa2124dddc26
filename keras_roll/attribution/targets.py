"""What the attribution functions attribute, and what they read: targets, baselines,
and inputs given as arrays or streams.

A *target* is a weighted sum of the model's (flattened) logits per example,
`sum_c w_c logit_c`, as a `[B, L]` weight matrix:

* `y=None`: the predicted class (argmax of the logits; for one sigmoid logit,
  class 1 where the logit is positive);
* an integer, or `[B]` integer labels: that class's logit (for one sigmoid
  logit, labels 0 / 1: class 0 is the negated logit, the log-odds of class 0);
* `[B, L]` one-hot or multi-hot targets (or any weights): the sum of the hot
  logits, as captum's and xplique's multi-label targets.

Inputs may be arrays or streams (`tf.data.Dataset`, generators, `PyDataset`s) of
`x`, `(x, y)` or `(x, y, w)` elements; a stream's labels are the targets unless
`y` is given. Baselines may be a scalar, one example, or one per example.

Example:

```python
x, y = read_inputs(ds, y=None, input_shape=(784,))       # the stream's labels
t = resolve_targets(y, len(x), num_logits=10, output_link="softmax", logits=None)
t.weights.shape, t.labels                                  # (B, 10), [B] classes
```
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll.inputs import is_stream

__all__ = ["Targets", "check_baseline", "read_inputs", "resolve_targets"]


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
                    logits=None) -> Targets:
    """Validates `y` (see the module docstring) and returns the `Targets`.

    Args:
        y: None, an int, `[B]` integer labels, or `[B, L]` one-hot / multi-hot targets.
        n: the number of examples B.
        num_logits: L.
        output_link: "sigmoid" for a model whose single logit feeds a sigmoid.
        logits: `[B, L]` logits at the inputs, for `y=None`.

    Raises:
        ValueError: naming `y`, for wrong shapes, values or classes out of range.
    """
    binary = num_logits == 1 and output_link == "sigmoid"
    if y is None:
        if logits is None:
            raise ValueError("y is required here: pass integer class labels of shape [B].")
        flat = np.asarray(logits).reshape(n, -1)
        y = (flat[:, 0] > 0).astype(np.int64) if binary else np.argmax(flat, axis=1)
    arr = np.asarray(y.numpy() if tf.is_tensor(y) else y)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise ValueError(f"y must be integer class labels or [B, L] one-hot / multi-hot "
                         f"targets, got dtype {arr.dtype}.")
    if arr.ndim == 0:
        arr = np.full(n, arr)
    if arr.ndim == 2 and arr.shape == (n, num_logits) and not binary:
        return _hot_targets(arr.astype(np.float64))
    if arr.dtype == bool or arr.shape != (n,):
        raise ValueError(
            f"y must have shape [B] = ({n},) (one integer label per example), or "
            f"[B, L] = ({n}, {num_logits}) one-hot / multi-hot targets, got shape {arr.shape}"
            f"{' (pass y.reshape(-1))' if arr.size == n else ''}.")
    labels = class_labels(arr, num_logits, binary)
    weights = np.zeros((n, num_logits))
    if binary:
        weights[:, 0] = np.where(labels == 1, 1.0, -1.0)
    else:
        weights[np.arange(n), labels] = 1.0
    return Targets(weights, labels)


def class_labels(arr: np.ndarray, num_logits: int, binary: bool) -> np.ndarray:
    """`[B]` int64 class labels from a numeric `[B]` array `y`.

    Raises:
        ValueError: naming `y`, for non-integer values or classes out of range (0 / 1
            for a model with one sigmoid output, else `[0, num_logits)`).
    """
    if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
        raise ValueError(f"y must hold integer class labels, got values such as "
                         f"{arr[(~np.isfinite(arr)) | (arr != np.round(arr))][:3]}.")
    labels = arr.astype(np.int64)
    top = 2 if binary else num_logits
    bad = (labels < 0) | (labels >= top)
    if bad.any():
        what = ("0 or 1 for a model with one sigmoid output" if binary
                else f"in [0, {num_logits}) for a model with {num_logits} logits")
        raise ValueError(f"y must be {what}; got {labels[bad][:5].tolist()} at positions "
                         f"{np.flatnonzero(bad)[:5].tolist()}.")
    return labels


def _hot_targets(weights: np.ndarray) -> Targets:
    if not np.all(np.isfinite(weights)):
        raise ValueError("y (one-hot / multi-hot targets) contains NaN or inf.")
    empty = ~np.any(weights != 0, axis=1)
    if empty.any():
        raise ValueError(f"y has rows without any target class at positions "
                         f"{np.flatnonzero(empty)[:5].tolist()}; every example needs at "
                         f"least one class.")
    single = (np.count_nonzero(weights, axis=1) == 1) & (weights.max(axis=1) == 1.0)
    labels = np.where(single, np.argmax(weights, axis=1), -1).astype(np.int64)
    return Targets(weights, labels)


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


def read_inputs(x, y, input_shape: tuple):
    """`(x, y)` as arrays: a stream is read whole (its labels become `y` unless
    `y` is given; None if it has none); arrays pass through.

    Raises:
        ValueError: for elements that fit neither one example nor a batch, or a
            stream whose elements mix labelled and unlabelled ones.
    """
    if not is_stream(x):
        return x, y
    xs, ys = [], []
    if isinstance(x, keras.utils.PyDataset):
        source = (x[i] for i in range(len(x)))
    else:
        source = iter(x)
    for element in source:
        xb, yb = _split(element)
        xb = np.asarray(xb.numpy() if tf.is_tensor(xb) else xb)
        single = xb.ndim == len(input_shape)
        xs.append(xb[None] if single else xb)
        if yb is not None:
            yb = np.asarray(yb.numpy() if tf.is_tensor(yb) else yb)
            ys.append(yb[None] if single else yb)
    if not xs:
        raise ValueError("The input stream is empty: it yielded no examples.")
    if ys and len(ys) != len(xs):
        raise ValueError("Some stream elements have labels and some do not; yield x or "
                         "(x, y) throughout.")
    for xb in xs:
        if xb.ndim != len(input_shape) + 1:
            raise ValueError(f"A stream element has inputs of shape {xb.shape[1:]}; the model "
                             f"takes examples of shape {tuple(input_shape)}.")
    x_all = np.concatenate(xs)
    y_all = np.concatenate(ys) if ys and y is None else y
    return x_all, y_all


def _split(element):
    if isinstance(element, dict):
        raise ValueError(f"A stream element is a dict with keys {sorted(element)}; keras_roll "
                         f"models have one input: yield x or (x, y).")
    if isinstance(element, (tuple, list)):
        if not element:
            raise ValueError("A stream element is an empty tuple; yield x or (x, y).")
        return element[0], (element[1] if len(element) > 1 else None)
    return element, None


def check_scalar(value, name: str, low: float = 0.0, low_open: bool = True) -> float:
    """A finite real number above `low` (or at least `low` with `low_open=False`)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and np.isfinite(value)
    if ok:
        ok = value > low if low_open else value >= low
    if not ok:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}.")
    return float(value)
