"""Inputs of keras_roll: arrays, tensors, `tf.data`, generators, `PyDataset`s,
labels and directions.

Every public function takes what Keras users pass to `fit`: an array or tensor
`[B, *input_shape]`, or a stream of batches (a `tf.data.Dataset`, a generator
or iterator, a `keras.utils.PyDataset`) whose elements are `x`, `(x,)`,
`(x, y)` or `(x, y, w)`, batched or not. One reader (`read_batches`, `read_all`)
reads them all into typed `Batch`es, checked against the model's `InputSpec`
(`keras_roll.inputs.arrays`) with their labels (`keras_roll.inputs.labels`) and
directions. Bad input gets an error that echoes the offending shape, dtype,
value or rows and says what to pass instead; an input without examples is an
error.

Example:

```python
spec = InputSpec((28, 28, 1), "float32", "mnist")
for batch in read_batches(ds, spec, labels=LabelSpec(10, model="mnist")):
    batch.x, batch.y              # a checked tensor [b, 28, 28, 1], [b] int64 labels
```
"""

import warnings

from keras_roll.inputs.arrays import (
    Array,
    InputSpec,
    ModelOrTwin,
    check_directions,
    check_input,
    check_jvp_directions,
    nonfinite_rows_message,
)
from keras_roll.inputs.labels import LabelSpec, check_labels
from keras_roll.inputs.reader import (
    DEFAULT_STREAM_BATCH,
    Batch,
    InputBatches,
    is_stream,
    read_all,
    read_batches,
    stream_elements,
    stream_length,
)

__all__ = [
    "DEFAULT_STREAM_BATCH",
    "Array",
    "Batch",
    "InputBatches",
    "InputSpec",
    "LabelSpec",
    "ModelOrTwin",
    "check_directions",
    "check_input",
    "check_jvp_directions",
    "check_labels",
    "input_batches",
    "is_stream",
    "nonfinite_rows_message",
    "read_all",
    "read_batches",
    "stream_elements",
    "stream_length",
]


def input_batches(x, spec: InputSpec, batch_size: int | None = None):
    """Deprecated: the checked input tensors of `x`; use `read_batches` (its
    `Batch.x`)."""
    warnings.warn("keras_roll.inputs.input_batches is deprecated; use "
                  "keras_roll.inputs.read_batches, whose batches hold x, y, directions and "
                  "index.", DeprecationWarning, stacklevel=2)
    batches = read_batches(x, spec, batch_size=batch_size)
    return InputBatches((batch.x for batch in batches), batches.total, batches.stream)
