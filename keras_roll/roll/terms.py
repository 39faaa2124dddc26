"""What the regularizers beside ROLL share: their result type, the labels of a
step, and the checks of their configs.

A regularizer config (`MMRConfig`, `InputGradientConfig`, ...) is a frozen
dataclass with `lam`, `on_eval`, a `log_name`, `to_config()` and
`term(model)`, which returns a callable `term(x, y, training) -> TermResult`;
`keras_roll.roll.supervised.SupervisedRegularizer` adds `lam * mean(term)` to
the training loss. docs/design.md, section "Regularizers beside ROLL".

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

import numpy as np
import tensorflow as tf

from keras_roll.options import INF, parse_norm

__all__ = ["StepLabels", "TermConfig", "TermResult", "check_norm", "check_on_eval",
           "check_positive", "check_weight", "class_indices", "current_labels",
           "labelled_step", "norm_name", "resolve_term_config"]

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


class TermConfig:
    """The base of the frozen config dataclasses of the training terms: their shared
    fields `p`, `lam` and `on_eval` are checked here.

    Example:

    ```python
    InputGradientConfig(p="linf").to_config()["p"]     # "linf"
    ```
    """

    def check_shared(self, norm_of: str) -> None:
        """Validates and normalises the fields every term has: `p` (the norm of
        `norm_of`, as a float), `lam` and `on_eval`; a bad one raises `ValueError`."""
        object.__setattr__(self, "p", check_norm(self.p, norm_of))
        object.__setattr__(self, "lam", check_weight("lam", self.lam))
        object.__setattr__(self, "on_eval", check_on_eval(self.on_eval))

    def to_config(self) -> dict:
        """The fields as JSON-safe values (`p` by name), for `get_config`."""
        config = dataclasses.asdict(self)
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


def resolve_term_config(cls, config, overrides: dict):
    """`config` (default `cls()`) with the fields in `overrides` replaced, validated.

    Raises:
        TypeError: `config` is not a `cls`, or an override names no field
            (the message lists the fields).
    """
    if config is None:
        config = cls()
    elif not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__} or None, got {config!r}.")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"Unknown {cls.__name__} field(s) {unknown}; its fields are {fields}.")
    return dataclasses.replace(config, **overrides) if overrides else config
