"""What the regularizers share: their config base, their result type, the labels
and the kind of the step being traced, the checks of their fields, the dual norm.

A regularizer config (`MMRConfig`, `InputGradientConfig`, ...) is a frozen
dataclass over `RegularizerConfig` with the fields `lam` and `on_eval`, a class
attribute `log_name` and a method `term(model)`, which returns a callable
`term(x, y, training) -> TermResult`; `register_regularizer`
(`keras_roll.regularizers.registry`) makes it a `regularizer=` of `wrap`, whose
layer adds `lam * mean(term)` to the training loss. docs/design.md, section
"Regularizers beside ROLL".

Example:

```python
with labelled_step(y, "sparse_categorical_crossentropy"):
    current_labels().y            # what a term reads while the step is traced
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll.options import INF, parse_norm

__all__ = ["RegularizerConfig", "StepLabels", "TermMean", "TermResult", "check_norm",
           "check_on_eval", "check_positive", "check_weight", "class_indices", "current_labels",
           "evaluating", "in_evaluation", "labelled_step", "norm_name"]

_state = threading.local()


class TermResult(NamedTuple):
    """What a regularizer term computes on a batch.

    Attributes:
        per_example: `[B]` the term of each example, without `lam`.
        outputs: the model's outputs on the batch (computed on the way, so
            the wrapped model needs no second forward pass).
    """

    per_example: tf.Tensor
    outputs: tf.Tensor


class StepLabels(NamedTuple):
    """The labels of the training or evaluation step being traced.

    Attributes:
        y: the step's targets (None when the data has none).
        loss: the loss the model is compiled with (a name, a function or a
            `keras.losses.Loss`; None before `compile`).
    """

    y: Any
    loss: Any


@contextlib.contextmanager
def labelled_step(y, loss):
    """Makes `y` and `loss` the labels of the calls made inside it (in this thread).

    The model `keras_roll.wrap` returns enters it in `train_step` and
    `test_step`; the replica threads of a `MirroredStrategy` each enter their
    own, with their own part of the batch.

    Example:

    ```python
    with labelled_step(y, model.loss):
        outputs = wrapped(x, training=True)
    ```
    """
    previous = getattr(_state, "labels", None)
    _state.labels = StepLabels(y, loss)
    try:
        yield
    finally:
        _state.labels = previous


def current_labels() -> StepLabels | None:
    """The `StepLabels` of the step being traced in this thread, or None outside a step."""
    return getattr(_state, "labels", None)


@contextlib.contextmanager
def evaluating():
    """Marks the calls made inside it (in this thread) as an evaluation step.

    `RollModel.test_step` runs in it; a `RollRegularizer` with `on_eval=None`
    computes the ROLL term when called with `training=False` inside it. It is
    thread-local, so the replica threads of a `MirroredStrategy` each see their
    own flag.

    Example:

    ```python
    with evaluating():
        outputs = wrapped(x, training=False)   # adds lam * ROLL to wrapped.losses
    ```
    """
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def in_evaluation() -> bool:
    """Whether the calls of this thread run inside `evaluating()`."""
    return getattr(_state, "depth", 0) > 0


class TermMean(keras.metrics.Mean):
    """A Mean that reads NaN ("not computed") instead of 0 before any update: every
    regularizer's logged term (`roll_loss`, `mmr_loss`, ...) and the certified
    terms' `certified_accuracy` (NaN when `evaluate` did not compute it).

    Example:

    ```python
    m = TermMean(name="roll_loss")
    m.result()                      # nan: not computed
    m.update_state([1.0, 3.0])
    m.result()                      # 2.0
    ```
    """

    def result(self):
        count = tf.convert_to_tensor(self.count)
        total = tf.convert_to_tensor(self.total)
        nan = tf.constant(float("nan"), count.dtype)
        return tf.where(count > 0, total / tf.maximum(count, 1e-12), nan)


def class_indices(y, num_classes: int, what: str) -> tf.Tensor:
    """`[B]` int32 class indices from `[B]` / `[B, 1]` ints or `[B, L]` one-hot labels.

    Raises:
        ValueError: labels of another shape (the message names `what` needs them).
    """
    y = tf.convert_to_tensor(y)
    rank = y.shape.rank
    if rank == 2 and y.shape[-1] == num_classes and num_classes > 1:
        return tf.argmax(y, axis=-1, output_type=tf.int32)
    if rank == 2 and y.shape[-1] == 1:
        y = y[:, 0]
    if y.shape.rank != 1:
        raise ValueError(f"{what} needs one class per example: int labels of shape [B] or "
                         f"[B, 1], or one-hot labels of shape [B, {num_classes}]; got labels "
                         f"of shape {y.shape}.")
    return tf.cast(y, tf.int32)


def norm_name(p: float) -> str:
    """'l1', 'l2' or 'linf' for a parsed norm (how configs store it in JSON)."""
    return "linf" if p == INF else f"l{int(p)}"


def check_norm(value, what: str) -> float:
    """The norm `p` of a term as a float (1.0, 2.0 or inf); `what` names what it
    measures in the error message."""
    try:
        return float(parse_norm(value))
    except ValueError:
        raise ValueError(f"p must be 1, 2 or inf (also 'l1', 'l2', 'linf'), the norm of "
                         f"{what}; got p={value!r}.") from None


class RegularizerConfig:
    """The base of the frozen config dataclasses of the regularizers: the fields
    every one has, `lam` and `on_eval` (and `p`, where a config has one), are
    checked here, and `to_config()` gives them as JSON-safe values for saving.

    A subclass is a `@dataclasses.dataclass(frozen=True)` with the fields `lam`
    and `on_eval`, a class attribute `log_name` (the metric of its term, e.g.
    `"mmr_loss"`) and `term(model)`; registered with `register_regularizer`,
    it is a `regularizer=` of `keras_roll.wrap`. A subclass that defines
    `__post_init__` calls `check_shared` in it.

    Example:

    ```python
    InputGradientConfig(p="linf").to_config()["p"]     # "linf"
    ```
    """

    def __post_init__(self):
        self.check_shared()

    def check_shared(self, norm_of: str = "the perturbations") -> None:
        """Validates and normalises the fields every regularizer has: `lam`, `on_eval`,
        and `p` (the norm of `norm_of`, as a float) where there is one; a bad one
        raises `ValueError`."""
        if hasattr(self, "p"):
            object.__setattr__(self, "p", check_norm(self.p, norm_of))
        object.__setattr__(self, "lam", check_weight("lam", self.lam))
        object.__setattr__(self, "on_eval", check_on_eval(self.on_eval))

    def to_config(self) -> dict:
        """The fields as JSON-safe values (`p` by name), for `get_config`."""
        config = dataclasses.asdict(self)
        if "p" in config:
            config["p"] = norm_name(self.p)
        return config


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def check_weight(name: str, value) -> float:
    """`value` as a float, checked finite and `>= 0` (a regularization weight)."""
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {name}={value!r}.")
    return float(value)


def check_positive(name: str, value) -> float:
    """`value` as a float, checked finite and `> 0` (a threshold)."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {name}={value!r}.")
    return float(value)


def check_on_eval(value) -> bool | None:
    """`on_eval` checked: None (in `evaluate`, not in `predict`) or False (never)."""
    if value is None or (isinstance(value, (bool, np.bool_)) and not value):
        return None if value is None else False
    raise ValueError(f"on_eval must be None (the term in evaluate, so val_loss is the "
                     f"training objective; not in predict, which has no labels) or False "
                     f"(only in training); got on_eval={value!r}.")
