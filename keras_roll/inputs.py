"""Inputs of keras_roll: arrays, tensors, `tf.data`, generators, `PyDataset`s, directions.

Every public function takes what Keras users pass to `fit`: an array or tensor
`[B, *input_shape]`, or a stream of batches (a `tf.data.Dataset`, a generator
or iterator, a `keras.utils.PyDataset`) whose elements are `x`, `(x,)`,
`(x, y)` or `(x, y, w)` (only `x` is read), batched or not. Unbatched elements
are grouped into batches of `batch_size` (256 by default). This module reads
them all and checks them against the model's `InputSpec`: bad input gets an
error that echoes the offending shape, dtype or value and says what to pass
instead. Directions (of `Linearized.jvp` and of directional margins) are
checked here too.

Example:

```python
spec = InputSpec((28, 28, 1), "float32", "mnist")
x = check_input(x, spec)                       # a float32 tensor [B, 28, 28, 1]
for xb in input_batches(ds, spec):             # checked tensors, batch by batch
    ...
```
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Union

import keras
import numpy as np
import tensorflow as tf
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from keras_roll.compile.twin import Linearized

__all__ = [
    "DEFAULT_STREAM_BATCH",
    "Array",
    "InputBatches",
    "InputSpec",
    "ModelOrTwin",
    "check_directions",
    "check_input",
    "check_jvp_directions",
    "input_batches",
    "is_stream",
    "iter_input_batches",
    "stream_length",
]

Array = ArrayLike | tf.Tensor
"""Numeric data: a numpy array (or anything `np.asarray` reads) or a tensor."""

ModelOrTwin = Union[keras.Model, "Linearized"]
"""A functional / Sequential Keras model, or its `keras_roll.linearize` twin."""

DEFAULT_STREAM_BATCH = 256  # examples per batch when a stream yields single examples


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


def check_input(x, spec: InputSpec, keep_float: bool = False) -> tf.Tensor:
    """Validates `x` against a model input; returns a tensor of `spec.dtype`.

    Args:
        x: `[B, *input_shape]` array or tensor (or a one-element list of it).
        spec: the model's `InputSpec`.
        keep_float: keep a float32 / float64 input in its own dtype (a float64
            twin then never holds a float64 copy of all of `x`; streaming casts
            each example slice).

    Raises:
        ValueError: ragged input, wrong shape, or (eagerly) NaN / inf values.
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
        raise ValueError(f"Could not read the input as an array: {e}") from None
    if not tf.is_tensor(arr) and arr.dtype == object:
        raise ValueError("The input is ragged or not numeric; pad it into an array of "
                         f"shape [B, {', '.join(map(str, spec.shape))}].")
    in_dtype = tf.as_dtype(arr.dtype)
    if not (in_dtype.is_floating or in_dtype.is_integer or in_dtype.is_bool):
        raise TypeError(f"Expected a numeric input, got dtype {in_dtype.name}.")
    shape = tuple(arr.shape)
    if len(shape) != len(spec.shape) + 1 or any(
        w is not None and s is not None and s != w for s, w in zip(shape[1:], spec.shape)
    ):
        raise ValueError(
            f"Model '{spec.name}' expects inputs of shape (batch, "
            f"{', '.join(str(w) for w in spec.shape)}), got an array of shape {shape}."
        )
    dtype = spec.dtype
    if keep_float and in_dtype in (tf.float32, tf.float64):
        dtype = in_dtype.name
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


def check_directions(directions, x, dtype) -> np.ndarray | None:
    """`[B, K, *input_shape]` numpy directions in `dtype` (shared ones broadcast), or None.

    Args:
        directions: None, `[B, K, *input_shape]` or `[K, *input_shape]` (shared).
        x: the checked `[B, *input_shape]` inputs.
        dtype: the twin's dtype.

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
    if not np.all(np.isfinite(d)):
        raise ValueError("directions contain non-finite values (NaN or inf).")
    return d.astype(dtype, copy=False)


def is_stream(x) -> bool:
    """Whether `x` yields batches (a Dataset, generator, iterator or PyDataset)
    rather than being one array.

    Example:

    ```python
    is_stream(tf.data.Dataset.range(3)), is_stream(np.zeros(3))     # (True, False)
    ```
    """
    if isinstance(x, (tf.data.Dataset, types.GeneratorType, keras.utils.PyDataset)):
        return True
    if isinstance(x, (np.ndarray, list, tuple, dict, str, bytes)) or tf.is_tensor(x):
        return False
    return isinstance(x, collections.abc.Iterator)


def stream_length(x) -> int | None:
    """Number of examples of a stream when cheaply known, else None (progress bars)."""
    if isinstance(x, tf.data.Dataset):
        n = int(x.cardinality())
        spec = _x_spec(x.element_spec)
        if n < 0 or spec is None:
            return None
        if spec.shape.rank is not None and spec.shape.rank >= 1 and spec.shape[0] is not None:
            return n * int(spec.shape[0])  # batched with a fixed batch size (drop_remainder)
        return None
    return None


def _x_spec(spec):
    if isinstance(spec, (tuple, list)):
        return spec[0] if spec else None
    if isinstance(spec, dict):
        return None
    return spec


def _x_of(element):
    """The inputs of one stream element: `x`, `(x,)`, `(x, y)` or `(x, y, w)`."""
    if isinstance(element, (tuple, list)):
        if not element:
            raise ValueError("A stream element is an empty tuple; yield x or (x, y).")
        element = element[0]
    if isinstance(element, dict):
        raise ValueError(f"A stream element is a dict with keys {sorted(element)}; keras_roll "
                         f"models have one input: yield x or (x, y).")
    if tf.is_tensor(element):
        return element.numpy()
    return np.asarray(element)


def iter_input_batches(x, input_shape: tuple, batch_size: int | None = None):
    """Yields the inputs of a stream as numpy batches `[b, *input_shape]`.

    Args:
        x: a `tf.data.Dataset`, a generator / iterator or a `keras.utils.PyDataset`
            of `x`, `(x,)`, `(x, y)` or `(x, y, w)` elements, batched or not.
        input_shape: the model's per-example input shape (None for a variable axis).
        batch_size: examples per batch for streams of single examples
            (default `DEFAULT_STREAM_BATCH`).

    Raises:
        ValueError: an element whose shape fits neither one example nor a batch.

    Example:

    ```python
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    for xb in iter_input_batches(ds, input_shape=(784,)):
        xb.shape            # (64, 784), a numpy array
    ```
    """
    size = int(batch_size or DEFAULT_STREAM_BATCH)
    rank = len(input_shape)
    if isinstance(x, keras.utils.PyDataset):
        source = (x[i] for i in range(len(x)))
    elif isinstance(x, tf.data.Dataset):
        source = iter(x)
    else:
        source = x
    pending: list[np.ndarray] = []
    for element in source:
        arr = _x_of(element)
        if arr.ndim == rank:  # one example
            pending.append(arr)
            if len(pending) == size:
                yield np.stack(pending)
                pending = []
        elif arr.ndim == rank + 1:
            if pending:
                yield np.stack(pending)
                pending = []
            yield arr
        else:
            raise ValueError(
                f"A stream element has inputs of shape {arr.shape}; the model takes examples "
                f"of shape {tuple(input_shape)}, so elements must be one example or a batch "
                f"[b, {', '.join(map(str, input_shape))}].")
    if pending:
        yield np.stack(pending)


@dataclasses.dataclass(frozen=True)
class InputBatches:
    """The checked batches of an input (`input_batches`); iterating gives them.

    Attributes:
        batches: checked tensors `[b, *input_shape]` (float inputs keep their
            float dtype): one for an array, read lazily for a stream.
        total: examples in all, None where a stream does not say.
        stream: whether the input was a stream.
    """

    batches: collections.abc.Iterable
    total: int | None
    stream: bool

    def __iter__(self) -> Iterator[tf.Tensor]:
        return iter(self.batches)


def input_batches(x, spec: InputSpec, batch_size: int | None = None) -> InputBatches:
    """The checked batches of `x`: an array is checked at once, a stream lazily.

    Example:

    ```python
    batches = input_batches(ds, lin.input_spec, batch_size=64)
    for xb in batches:
        ...
    batches.total          # examples, when the stream says
    ```
    """
    if is_stream(x):
        checked = (check_input(xb, spec, keep_float=True)
                   for xb in iter_input_batches(x, spec.shape, batch_size))
        return InputBatches(checked, stream_length(x), True)
    xb = check_input(x, spec, keep_float=True)
    return InputBatches([xb], int(xb.shape[0]), False)
