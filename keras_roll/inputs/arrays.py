"""Arrays a model takes: the `InputSpec`, the checks of inputs and of directions.

`check_input` validates one array or tensor against the model's `InputSpec`:
bad input gets an error that echoes the offending shape, dtype or rows and says
what to pass instead. Directions (of `Linearized.jvp` and of directional margins)
are checked here too.

Example:

```python
spec = InputSpec((28, 28, 1), "float32", "mnist")
x = check_input(x, spec)                       # a float32 tensor [B, 28, 28, 1]
```
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Union

import keras
import numpy as np
import tensorflow as tf
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from keras_roll.compile.twin import Linearized

__all__ = [
    "Array",
    "InputSpec",
    "ModelOrTwin",
    "check_directions",
    "check_input",
    "check_jvp_directions",
    "nonfinite_rows_message",
    "reshape_hint",
]

Array = ArrayLike | tf.Tensor
"""Numeric data: a numpy array (or anything `np.asarray` reads) or a tensor."""

ModelOrTwin = Union[keras.Model, "Linearized"]
"""A functional / Sequential Keras model, or its `keras_roll.linearize` twin."""

ROWS_SHOWN = 5  # rows an error message names before "(and n more)"


class InputSpec(NamedTuple):
    """What a model takes: per-example shape, the twin's dtype, the model's name.

    Attributes:
        shape: per-example input shape (None for a variable axis).
        dtype: the dtype inputs are cast to ("float32" or "float64").
        name: the model's name, for the error messages.
    """

    shape: tuple
    dtype: str
    name: str


def check_input(x, spec: InputSpec, keep_float: bool = False, *, name: str = "x",
                offset: int = 0, allow_nonfinite: bool = False) -> tf.Tensor:
    """Validates `x` against a model input; returns a tensor of `spec.dtype`.

    Args:
        x: `[B, *input_shape]` array or tensor (or a one-element list of it).
        spec: the model's `InputSpec`.
        keep_float: keep a float32 / float64 input in its own dtype (a float64
            twin then never holds a float64 copy of all of `x`; streaming casts
            each example slice).
        name: what the error messages call `x`.
        offset: the position of `x[0]` in the whole input (for the rows named by
            the non-finite error of a batch of a stream).
        allow_nonfinite: let NaN / inf through (the caller flags those rows).

    Raises:
        ValueError: ragged input, wrong shape, or (eagerly) NaN / inf values,
            naming the first rows that hold them.
        TypeError: a non-numeric dtype.

    Example:

    ```python
    x = check_input(np.zeros((2, 784)), InputSpec((784,), "float32", "mlp"))
    ```
    """
    if isinstance(x, (list, tuple)) and len(x) == 1:
        x = x[0]
    try:
        arr = x if tf.is_tensor(x) else np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"Could not read {name} as an array: {e}") from None
    if not tf.is_tensor(arr) and arr.dtype == object:
        raise ValueError(f"{name} is ragged or not numeric; pad it into an array of "
                         f"shape [B, {', '.join(map(str, spec.shape))}].")
    in_dtype = tf.as_dtype(arr.dtype)
    if not (in_dtype.is_floating or in_dtype.is_integer or in_dtype.is_bool):
        raise TypeError(f"Expected a numeric {name}, got dtype {in_dtype.name}; pass an "
                        f"array of shape [B, {', '.join(map(str, spec.shape))}].")
    shape = tuple(arr.shape)
    if len(shape) != len(spec.shape) + 1 or any(
        w is not None and s is not None and s != w for s, w in zip(shape[1:], spec.shape)
    ):
        raise ValueError(
            f"Model '{spec.name}' expects inputs of shape (batch, "
            f"{', '.join(str(w) for w in spec.shape)}), got {name} of shape {shape}."
            + reshape_hint(shape, spec.shape, name, tf.is_tensor(arr)))
    dtype = spec.dtype
    if keep_float and in_dtype in (tf.float32, tf.float64):
        dtype = in_dtype.name
    t = tf.cast(tf.convert_to_tensor(arr), dtype)
    if (not allow_nonfinite and tf.executing_eagerly()
            and not bool(tf.reduce_all(tf.math.is_finite(t)))):
        flat = tf.reshape(t, [int(t.shape[0]), -1])
        bad = tf.reduce_any(~tf.math.is_finite(flat), axis=1).numpy()
        raise ValueError(nonfinite_rows_message(bad, name, offset)
                         + " Margins and gradients are undefined there.")
    return t


def reshape_hint(shape: tuple, wanted: tuple, name: str = "x", tensor: bool = False) -> str:
    """The way forward when an input's shape is not the model's but its sizes match:
    " Reshape it with x.reshape(-1, 784)." (a batch of images for a flat input, one
    example without its batch axis, ...); "" when no reshape fits.

    Example:

    ```python
    reshape_hint((16, 28, 28), (784,))      # ' Reshape it with x.reshape(-1, 784).'
    reshape_hint((784,), (784,))            # ' It looks like one example ...: x[None] ...'
    reshape_hint((16, 10), (784,))          # ''
    ```
    """
    if any(w is None for w in wanted) or any(s is None for s in shape):
        return ""
    size = int(np.prod(wanted, dtype=np.int64))
    dims = ", ".join(str(w) for w in (-1, *wanted))
    how = f"tf.reshape({name}, ({dims}))" if tensor else f"{name}.reshape({dims})"
    if tuple(shape) == tuple(wanted):
        return (f" It looks like one example without its batch axis: add it with "
                f"{name}[None] ({how}).")
    if len(shape) >= 1 and size and int(np.prod(shape[1:], dtype=np.int64)) == size:
        return f" Each example has {size} values, as the model expects: reshape with {how}."
    return ""


def nonfinite_rows_message(bad: np.ndarray, name: str = "x", offset: int = 0) -> str:
    """"Rows 3, 17, 42 (and 5 more) of x hold non-finite values (NaN or inf); ..."

    Args:
        bad: `[b]` bool, the rows that hold NaN or inf.
        name: what the message calls the array.
        offset: the position of row 0 in the whole input.

    Example:

    ```python
    nonfinite_rows_message(np.array([False, True]), "x")   # "Row 1 of x holds ..."
    ```
    """
    rows = np.flatnonzero(bad) + int(offset)
    shown = ", ".join(str(int(r)) for r in rows[:ROWS_SHOWN])
    more = f" (and {rows.size - ROWS_SHOWN} more)" if rows.size > ROWS_SHOWN else ""
    one = rows.size == 1
    return (f"{'Row' if one else 'Rows'} {shown}{more} of {name} "
            f"{'holds' if one else 'hold'} non-finite values (NaN or inf). Drop or clean "
            f"them first, e.g. {name}[np.isfinite({name}).reshape(len({name}), -1).all(1)].")


def check_jvp_directions(v: tf.Tensor, x: tf.Tensor, input_shape: tuple) -> bool:
    """Checks directions for `Linearized.jvp`; returns whether they are shared.

    Args:
        v: `[B, K, *input_shape]` per-example or `[K, *input_shape]` shared directions.
        x: the (checked) `[B, *input_shape]` inputs.
        input_shape: the model's per-example input shape.

    Raises:
        ValueError: a rank, batch size or per-example shape that does not match.

    Example:

    ```python
    shared = check_jvp_directions(tf.eye(784), x, (784,))     # True
    ```
    """
    ex_rank = len(input_shape)
    if v.shape.rank == ex_rank + 1:
        shared = True
    elif v.shape.rank == ex_rank + 2:
        shared = False
        if v.shape[0] is not None and x.shape[0] is not None and v.shape[0] != x.shape[0]:
            raise ValueError(f"Directions have batch size {v.shape[0]} but x has "
                             f"{x.shape[0]}; pass v as [B, K, *input_shape].")
    else:
        raise ValueError(
            f"Directions must have shape [B, K, *input_shape] or [K, *input_shape] "
            f"with input_shape={input_shape}; got shape {tuple(v.shape)}."
        )
    if tuple(v.shape[-ex_rank:]) != tuple(x.shape[1:]):
        raise ValueError(f"Directions end in shape {tuple(v.shape[-ex_rank:])} but the "
                         f"inputs have per-example shape {tuple(x.shape[1:])}.")
    return shared


def check_directions(directions, x, dtype, offset: int = 0) -> np.ndarray | None:
    """`[B, K, *input_shape]` numpy directions in `dtype` (shared ones broadcast), or None.

    Args:
        directions: None, `[B, K, *input_shape]` or `[K, *input_shape]` (shared).
        x: the checked `[B, *input_shape]` inputs.
        dtype: the twin's dtype.
        offset: the position of `x[0]` in the whole input (for error messages).

    Raises:
        ValueError: a shape that fits neither form, or rows with NaN / inf.

    Example:

    ```python
    d = check_directions(np.eye(784)[:3], x, "float64")      # [B, 3, 784]
    ```
    """
    if directions is None:
        return None
    d = np.asarray(directions.numpy() if tf.is_tensor(directions) else directions)
    if not np.issubdtype(d.dtype, np.number):
        raise ValueError(f"directions must be numeric, got dtype {d.dtype}.")
    ex = tuple(x.shape[1:])
    b = int(x.shape[0])
    if d.ndim == len(ex) + 1 and tuple(d.shape[1:]) == ex:
        d = np.broadcast_to(d[None], (b, *d.shape))  # shared by all examples
    if d.ndim != len(ex) + 2 or d.shape[0] != b or tuple(d.shape[2:]) != ex:
        raise ValueError(
            f"directions must have shape [B, K, *input_shape] = [{b}, K, "
            f"{', '.join(map(str, ex))}] (or [K, {', '.join(map(str, ex))}] shared by all "
            f"examples); got shape {tuple(d.shape)}."
        )
    bad = ~np.isfinite(d.reshape(b, -1)).all(axis=1)
    if bad.any():
        raise ValueError(nonfinite_rows_message(bad, "directions", offset))
    return d.astype(dtype, copy=False)
