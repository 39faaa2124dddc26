"""Inputs and labels of `robust_radius`, batch by batch.

Arrays are cut into batches; streams (`tf.data.Dataset`, generators, iterators,
`keras.utils.PyDataset`) yield `x`, `(x,)`, `(x, y)` or `(x, y, w)`, batched or not
(single examples are grouped), as `keras_roll.inputs` reads them for `certify`,
with the labels kept. Unlike `certify`, non-finite inputs are not refused here: their
rows get NaN bounds.

Example:

```python
for xb, yb in iter_labelled_batches(ds, None, input_shape=(784,)):
    xb.shape, yb.shape          # (64, 784), (64,)
```
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_roll.inputs import DEFAULT_STREAM_BATCH, is_stream

__all__ = ["check_inputs", "check_labels", "iter_labelled_batches"]


def check_inputs(x, input_shape: tuple) -> np.ndarray:
    """`x` as a numeric numpy array of shape `[B, *input_shape]` (NaN allowed)."""
    if isinstance(x, (list, tuple)) and len(x) == 1:
        x = x[0]
    try:
        arr = x.numpy() if tf.is_tensor(x) else np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"Could not read the input as an array: {e}") from None
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise TypeError(f"Expected a numeric input, got dtype {arr.dtype}; pad it into an "
                        f"array of shape [B, {', '.join(map(str, input_shape))}].")
    shape = tuple(arr.shape)
    if len(shape) != len(input_shape) + 1 or any(
            w is not None and s != w for s, w in zip(shape[1:], input_shape)):
        raise ValueError(f"The model expects inputs of shape (batch, "
                         f"{', '.join(str(w) for w in input_shape)}), got an array of shape "
                         f"{shape}.")
    return arr if np.issubdtype(arr.dtype, np.floating) else arr.astype(np.float32)


def check_labels(y, b: int) -> np.ndarray | None:
    """`[b]` int64 labels from `y` (`[b]` or `[b, 1]` integers), or None."""
    if y is None:
        return None
    arr = y.numpy() if tf.is_tensor(y) else np.asarray(y)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1 or arr.shape[0] != b or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"y must be {b} integer class labels (shape [{b}]), got an array of "
                         f"shape {arr.shape} and dtype {arr.dtype}; pass "
                         f"np.argmax(y_onehot, -1) for one-hot labels.")
    return arr.astype(np.int64)


def _split(element):
    """`(x, y or None)` of one stream element."""
    if isinstance(element, dict):
        raise ValueError(f"A stream element is a dict with keys {sorted(element)}; "
                         f"robust_radius reads models with one input: yield x or (x, y).")
    if isinstance(element, (tuple, list)):
        if not element:
            raise ValueError("A stream element is an empty tuple; yield x or (x, y).")
        return element[0], (element[1] if len(element) > 1 else None)
    return element, None


def _stream(x, input_shape, batch_size):
    size = int(batch_size or DEFAULT_STREAM_BATCH)
    if isinstance(x, keras.utils.PyDataset):
        source = (x[i] for i in range(len(x)))
    else:
        source = iter(x) if isinstance(x, tf.data.Dataset) else x
    xs, ys = [], []
    rank = len(input_shape)
    for element in source:
        xe, ye = _split(element)
        xe = xe.numpy() if tf.is_tensor(xe) else np.asarray(xe)
        if xe.ndim == rank:  # one example
            xs.append(xe[None])
            ys.append(None if ye is None else np.reshape(np.asarray(ye), (1,)))
            if len(xs) == size:
                yield _stack(xs, ys, input_shape)
                xs, ys = [], []
        else:
            if xs:
                yield _stack(xs, ys, input_shape)
                xs, ys = [], []
            yb = None if ye is None else np.asarray(ye.numpy() if tf.is_tensor(ye) else ye)
            xb = check_inputs(xe, input_shape)
            yield xb, check_labels(yb, xb.shape[0])
    if xs:
        yield _stack(xs, ys, input_shape)


def _stack(xs, ys, input_shape):
    xb = check_inputs(np.concatenate(xs), input_shape)
    if any(y is None for y in ys):
        return xb, None
    return xb, check_labels(np.concatenate(ys), xb.shape[0])


def iter_labelled_batches(x, y, input_shape: tuple, batch_size: int | None = None):
    """Yields `(x_batch, y_batch or None)` numpy batches of an array or a stream.

    Args:
        x: `[B, *input_shape]` inputs, or a stream of `x` / `(x, y)` elements.
        y: labels for an array `x` (None: none, or for streams those of the stream).
        input_shape: the model's per-example input shape.
        batch_size: examples per batch (default 256).

    Raises:
        ValueError: bad shapes, or labels given both ways.
    """
    if is_stream(x):
        if y is not None:
            raise ValueError("With a stream of batches, pass the labels inside the stream "
                             "as (x, y) elements, not as y=.")
        yield from _stream(x, input_shape, batch_size)
        return
    arr = check_inputs(x, input_shape)
    labels = check_labels(y, arr.shape[0])
    size = int(batch_size or DEFAULT_STREAM_BATCH)
    for start in range(0, arr.shape[0], size):
        sl = slice(start, start + size)
        yield arr[sl], None if labels is None else labels[sl]
