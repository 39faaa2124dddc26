"""Inputs that arrive batch by batch: `tf.data.Dataset`s, Python generators, `PyDataset`s.

`certify`, `stability_bounds`, `count_regions`, `lp_margins` and
`MarginMonitor` take what Keras users pass to `fit`: arrays, or a stream of
batches. A stream element may be `x`, `(x,)`, `(x, y)` or `(x, y, w)` (only
`x` is read), batched or not; unbatched elements are grouped into batches of
`batch_size` (256 by default). Results are computed batch by batch and
concatenated.

Example:

```python
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
for xb in iter_input_batches(ds, input_shape=(784,)):
    xb.shape            # (64, 784), a numpy array
```
"""

from __future__ import annotations

import collections.abc
import types

import keras
import numpy as np
import tensorflow as tf

__all__ = ["DEFAULT_STREAM_BATCH", "is_stream", "iter_input_batches", "stream_length"]

DEFAULT_STREAM_BATCH = 256  # examples per batch when a stream yields single examples


def is_stream(x) -> bool:
    """Whether `x` yields batches (a Dataset, generator, iterator or PyDataset)
    rather than being one array."""
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
