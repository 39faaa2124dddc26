"""The one input reader: arrays, tensors, `tf.data`, generators and `PyDataset`s,
with their labels and directions, as typed, checked batches.

Every public function that reads inputs reads them here (`read_batches`, or
`read_all` for functions that need every example at once). A stream's elements
are `x`, `(x,)`, `(x, y)` or `(x, y, w)` (the weights are not read), batched or
not; single examples are grouped into batches of `batch_size`
(`DEFAULT_STREAM_BATCH` by default). Labels come from `y=` (which, for a
stream, replaces the stream's own) or from the stream; they are checked by
`keras_roll.inputs.labels.check_labels` when a `LabelSpec` is given. An input
without any example is an error.

Example:

```python
for batch in read_batches(ds, lin.input_spec, labels=LabelSpec(10)):
    batch.x, batch.y, batch.index        # checked [b, 784] tensor, [b] labels, slice
```
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
from collections.abc import Iterator
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll.inputs.arrays import InputSpec, check_directions, check_input
from keras_roll.inputs.labels import LabelSpec, check_labels

__all__ = [
    "DEFAULT_STREAM_BATCH",
    "Batch",
    "InputBatches",
    "is_stream",
    "read_all",
    "read_batches",
    "stream_elements",
    "stream_length",
]

DEFAULT_STREAM_BATCH = 256  # examples per batch when a stream yields single examples


class Batch(NamedTuple):
    """One checked batch of an input.

    Attributes:
        x: `[b, *input_shape]` checked tensor (float inputs keep their float dtype
            unless read with `keep_float=False`).
        y: the batch's labels: checked (`check_labels`) when read with a
            `LabelSpec`, else as given (numpy); None without labels.
        directions: `[b, K, *input_shape]` numpy directions, or None.
        index: the positions of the batch's examples in the whole input.
    """

    x: tf.Tensor
    y: np.ndarray | None
    directions: np.ndarray | None
    index: slice


@dataclasses.dataclass(frozen=True)
class InputBatches:
    """The batches of an input (`read_batches`); iterating gives `Batch`es.

    Attributes:
        batches: the `Batch`es: computed already for an array, read lazily for a
            stream.
        total: examples in all, None where a stream does not say.
        stream: whether the input was a stream.
    """

    batches: collections.abc.Iterable
    total: int | None
    stream: bool

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)


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
    """Number of examples of a stream when cheaply known, else None (progress bars).

    Example:

    ```python
    stream_length(tf.data.Dataset.from_tensor_slices(x).batch(8, drop_remainder=True))
    ```
    """
    if isinstance(x, tf.data.Dataset):
        n = int(x.cardinality())
        spec = x.element_spec
        if isinstance(spec, (tuple, list)):
            spec = spec[0] if spec else None
        if n < 0 or spec is None or isinstance(spec, dict):
            return None
        if spec.shape.rank is not None and spec.shape.rank >= 1 and spec.shape[0] is not None:
            return n * int(spec.shape[0])  # batched with a fixed batch size (drop_remainder)
    return None


def _numpy(value) -> np.ndarray:
    return np.asarray(value.numpy() if tf.is_tensor(value) else value)


def stream_elements(x) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    """`(x, y or None)` numpy pairs of every element of a stream, as it yields them.

    Raises:
        ValueError: for dict or empty-tuple elements.

    Example:

    ```python
    for xe, ye in stream_elements(tf.data.Dataset.from_tensor_slices((x, y))):
        ...
    ```
    """
    if isinstance(x, keras.utils.PyDataset):
        source = (x[i] for i in range(len(x)))
    else:
        source = iter(x)
    for element in source:
        y = None
        if isinstance(element, (tuple, list)):
            if not element:
                raise ValueError("A stream element is an empty tuple; yield x or (x, y).")
            element, y = element[0], (element[1] if len(element) > 1 else None)
        if isinstance(element, dict):
            raise ValueError(f"A stream element is a dict with keys {sorted(element)}; "
                             f"keras_roll models have one input: yield x or (x, y).")
        yield _numpy(element), None if y is None else _numpy(y)


def _raw_batches(x, input_shape: tuple, batch_size: int | None):
    """`(x, y or None)` numpy batches of a stream, single examples grouped."""
    size = int(batch_size or DEFAULT_STREAM_BATCH)
    rank = len(input_shape)
    xs, ys = [], []
    for xe, ye in stream_elements(x):
        if xe.ndim == rank:  # one example
            xs.append(xe[None])
            ys.append(None if ye is None else ye[None])
            if len(xs) == size:
                yield _stack(xs, ys)
                xs, ys = [], []
        elif xe.ndim == rank + 1:
            if xs:
                yield _stack(xs, ys)
                xs, ys = [], []
            yield xe, ye
        else:
            raise ValueError(
                f"A stream element has inputs of shape {xe.shape}; the model takes examples "
                f"of shape {tuple(input_shape)}, so elements must be one example or a batch "
                f"[b, {', '.join(map(str, input_shape))}].")
    if xs:
        yield _stack(xs, ys)


def _stack(xs, ys):
    if any(y is None for y in ys):
        return np.concatenate(xs), (None if all(y is None for y in ys) else ys)
    return np.concatenate(xs), np.concatenate(ys)


@dataclasses.dataclass
class _Reading:
    """The settings of one read and its position."""

    spec: InputSpec
    labels: LabelSpec | None
    y: np.ndarray | None  # labels given as y= (they replace a stream's)
    directions: object
    keep_float: bool
    finite: bool
    seen: int = 0
    labelled: bool | None = None  # whether the stream's elements carry labels

    def batch(self, xb, yb) -> Batch:
        """The checked `Batch` of raw `(x, y)` at the current position."""
        x = check_input(xb, self.spec, self.keep_float, offset=self.seen,
                        allow_nonfinite=not self.finite)
        b = int(x.shape[0])
        index = slice(self.seen, self.seen + b)
        if self.y is not None and not self.y.ndim:  # one class for every example
            yb = np.full(b, self.y)
        elif self.y is not None:
            yb = self.y[index]
            if yb.shape[0] != b:
                raise ValueError(f"y has {self.y.shape[0]} labels but the input has more "
                                 f"examples; pass one label per example.")
        elif isinstance(yb, list) or self.labelled not in (None, yb is not None):
            raise ValueError("Some stream elements have labels and some do not; yield x or "
                             "(x, y) throughout.")
        self.labelled = yb is not None
        if self.labels is not None:
            yb = check_labels(yb, b, self.labels, offset=self.seen)
        dirs = check_directions(self.directions, x, self.spec.dtype, self.seen)
        self.seen += b
        return Batch(x, yb, dirs, index)

    def stream(self, x, batch_size):
        for xb, yb in _raw_batches(x, self.spec.shape, batch_size):
            if xb.shape[0]:  # an empty batch of a stream adds nothing
                yield self.batch(xb, yb)
        if not self.seen:
            raise ValueError(_EMPTY)
        if self.y is not None and self.y.ndim and self.y.shape[0] != self.seen:
            raise ValueError(f"y has {self.y.shape[0]} labels but the input stream yielded "
                             f"{self.seen} examples; pass one label per example.")


_EMPTY = ("The input has no examples (an empty array or stream): there is nothing to "
          "compute. Pass at least one example.")


def read_batches(x, spec: InputSpec, *, y=None, labels: LabelSpec | None = None,
                 directions=None, batch_size: int | None = None, split: bool = False,
                 keep_float: bool = True, finite: bool = True) -> InputBatches:
    """The checked `Batch`es of `x`: an array at once, a stream lazily.

    Args:
        x: `[B, *input_shape]` array or tensor, or a stream (`tf.data.Dataset`,
            generator, iterator, `keras.utils.PyDataset`) of `x`, `(x,)`, `(x, y)`
            or `(x, y, w)` elements, batched or not.
        spec: the model's `InputSpec`.
        y: labels, one per example (they replace a stream's labels); None: the
            stream's, if any.
        labels: check the labels with this `LabelSpec` (else they pass as given).
        directions: None, `[B, K, *input_shape]` per-example directions (arrays
            only) or `[K, *input_shape]` directions shared by every example.
        batch_size: examples per batch for streams of single examples, and for
            arrays with `split=True` (default `DEFAULT_STREAM_BATCH`).
        split: cut an array into batches (else it is one batch).
        keep_float: keep float32 / float64 inputs in their dtype (else
            `spec.dtype`).
        finite: refuse NaN / inf inputs, naming the rows (else let them through).

    Raises:
        ValueError: no example; bad shapes, values, labels or directions (a
            stream's batches raise when they are read).

    Example:

    ```python
    batches = read_batches(ds, lin.input_spec, batch_size=64)
    for batch in batches:
        ...
    batches.total          # examples, when the stream says
    ```
    """
    y_all = None if y is None else _numpy(y)
    if is_stream(x):
        if directions is not None and np.ndim(directions) != len(spec.shape) + 1:
            raise ValueError(f"With a stream of batches, directions must be shared by all "
                             f"examples: shape [K, *input_shape], got shape "
                             f"{np.shape(directions)}.")
        reading = _Reading(spec, labels, y_all, directions, keep_float, finite)
        return InputBatches(reading.stream(x, batch_size), stream_length(x), True)
    xt = check_input(x, spec, keep_float, allow_nonfinite=not finite)
    n = int(xt.shape[0])
    if not n:
        raise ValueError(_EMPTY)
    if labels is not None:
        y_all = check_labels(y_all, n, labels)
    dirs = check_directions(directions, xt, spec.dtype)
    size = int(batch_size or DEFAULT_STREAM_BATCH) if split else n
    if size >= n:  # one batch: no copy
        return InputBatches([Batch(xt, y_all, dirs, slice(0, n))], n, False)
    batches = []
    for start in range(0, n, size):
        index = slice(start, min(start + size, n))
        batches.append(Batch(
            xt[index], y_all[index] if y_all is not None and y_all.ndim else y_all,
            None if dirs is None else dirs[index], index))
    return InputBatches(batches, n, False)


def read_all(x, spec: InputSpec, *, y=None, labels: LabelSpec | None = None,
             batch_size: int | None = None, keep_float: bool = False,
             finite: bool = True) -> Batch:
    """Every example of `x` as one checked `Batch` (a stream is read whole).

    The arguments are those of `read_batches`; by default the inputs are cast to
    `spec.dtype`.

    Example:

    ```python
    batch = read_all(ds, engine.spec)          # the stream's inputs and labels
    x, y = batch.x.numpy(), batch.y
    ```
    """
    batches = list(read_batches(x, spec, y=y, labels=labels, batch_size=batch_size,
                                keep_float=keep_float, finite=finite))
    if len(batches) == 1:
        return batches[0]
    xs = tf.concat([tf.cast(b.x, batches[0].x.dtype) for b in batches], axis=0)
    ys = None
    if batches[0].y is not None:
        try:
            ys = np.concatenate([b.y for b in batches])
        except ValueError as e:
            raise ValueError(f"The labels of the stream's batches do not fit together: "
                             f"{e}") from None
    return Batch(xs, ys, None, slice(0, int(xs.shape[0])))
