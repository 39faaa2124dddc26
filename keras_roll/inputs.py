"""Validation of the inputs and directions given to a linearized model.

Bad input gets an error that echoes the offending shape, dtype or value and
says what to pass instead.

Example:

```python
x = check_input(x, input_shape=(28, 28, 1), dtype="float32", model_name="mnist")
shared = check_jvp_directions(v, x, input_shape=(28, 28, 1))
```
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["check_input", "check_jvp_directions"]


def check_input(x, input_shape: tuple, dtype: str, model_name: str) -> tf.Tensor:
    """Validates `x` against a model input; returns a tensor of `dtype`.

    Args:
        x: `[B, *input_shape]` array or tensor (or a one-element list of it).
        input_shape: the model's per-example input shape (None for a variable axis).
        dtype: the dtype of the returned tensor.
        model_name: for the error messages.

    Raises:
        ValueError: ragged input, wrong shape, or (eagerly) NaN / inf values.
        TypeError: a non-numeric dtype.
    """
    if isinstance(x, (list, tuple)) and len(x) == 1:
        x = x[0]
    try:
        arr = x if tf.is_tensor(x) else np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"Could not read the input as an array: {e}") from None
    if not tf.is_tensor(arr) and arr.dtype == object:
        raise ValueError("The input is ragged or not numeric; pad it into an array of "
                         f"shape [B, {', '.join(map(str, input_shape))}].")
    in_dtype = tf.as_dtype(arr.dtype)
    if not (in_dtype.is_floating or in_dtype.is_integer or in_dtype.is_bool):
        raise TypeError(f"Expected a numeric input, got dtype {in_dtype.name}.")
    shape = tuple(arr.shape)
    if len(shape) != len(input_shape) + 1 or any(
        w is not None and s is not None and s != w for s, w in zip(shape[1:], input_shape)
    ):
        raise ValueError(
            f"Model '{model_name}' expects inputs of shape (batch, "
            f"{', '.join(str(w) for w in input_shape)}), got an array of shape {shape}."
        )
    t = tf.cast(tf.convert_to_tensor(arr), dtype)
    if tf.executing_eagerly() and not bool(tf.reduce_all(tf.math.is_finite(t))):
        bad = int(tf.reduce_sum(tf.cast(~tf.math.is_finite(t), tf.int32)))
        raise ValueError(f"The input contains {bad} non-finite values (NaN or inf); "
                         f"margins and gradients are undefined there. Clean the data first.")
    return t


def check_jvp_directions(v: tf.Tensor, x: tf.Tensor, input_shape: tuple) -> bool:
    """Checks directions for `Linearized.jvp`; returns whether they are shared.

    Args:
        v: `[B, K, *input_shape]` per-example or `[K, *input_shape]` shared directions.
        x: the (checked) `[B, *input_shape]` inputs.
        input_shape: the model's per-example input shape.

    Raises:
        ValueError: a rank, batch size or per-example shape that does not match.
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
