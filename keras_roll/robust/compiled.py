"""The robustness passes compiled once for any batch size.

The searches of `keras_roll.robust` call their passes on batches that shrink as
examples finish; `compile_batched` compiles a pass with a batch signature, so that
they never retrace it.

Example:

```python
fn = compile_batched(functools.partial(_terms_fn, twin, guard), twin, "xy")
```
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["BATCH_SPECS", "compile_batched"]

BATCH_SPECS = {
    "x": lambda shape: tf.TensorSpec([None, *shape], tf.float64),  # inputs / directions
    "y": lambda shape: tf.TensorSpec([None], tf.int64),  # classes
    "e": lambda shape: tf.TensorSpec([None], tf.float64),  # radii
    "n": lambda shape: tf.TensorSpec([], tf.int32),  # a norm's code (geometry.norm_code)
    "g": lambda shape: tf.TensorSpec([], tf.int32),  # a guard mode's code
    "b": lambda shape: tf.TensorSpec([None, None], tf.float64),  # flat bounds per example
}


def compile_batched(fn, twin, kinds: str):
    """`fn` compiled once for any batch size: `kinds` names its tensor arguments in order
    (`BATCH_SPECS`: 'x' a float64 batch of inputs, 'y' classes, 'e' radii, 'n' a norm's
    code, 'g' a guard mode's and 'b' flat bounds per example, so that one trace serves
    every norm and guard), so the
    searches, whose batches shrink as examples finish, never retrace it."""
    shape = tuple(twin.input_shape)
    signature = [BATCH_SPECS[k](shape) for k in kinds]
    return tf.function(fn, input_signature=signature, reduce_retracing=True, autograph=False)
