"""Exact ROLL on masked sequences in length buckets: each example cropped near its length.

Behind a leading Masking layer read by a recurrent layer that returns its last
state (the paper's Japanese Vowels scoRNN), an example's loss does not depend on
the padded steps after its last valid one: they carry the state, create no
neuron and get no gradient. So the examples of a batch can be sorted by length,
cut into `BUCKETS` groups of consecutive lengths, and each group's loss
computed on its inputs cropped to the group's longest sequence. Exact ROLL
along the valid axes (`keras_roll.roll.exact.PackedAxes`) costs
`sum_b D_valid(b) * T` recurrent steps for `T` steps of padded input; cropped
groups cost `sum_b D_valid(b) * T_group`, so work that grows with the square
of the length shrinks with the group's longest sequence instead of the
batch's. The per-example losses are stitched back in batch order: the same loss
and gradients (docs/design.md, "Padded steps in exact ROLL").

Example:

```python
if buckets_apply(lin.program, config, entry):
    loss = bucketed(x, fwd_keep, lambda xb: per_example_loss(xb))   # [B]
```
"""

from __future__ import annotations

import tensorflow as tf

from keras_roll.compile.rules.recurrent import SimpleRNNOp
from keras_roll.roll.config import RollConfig
from keras_roll.roll.entry import entry_readers, masking_reader

__all__ = ["BUCKETS", "buckets_apply", "bucketed"]

BUCKETS = 4  # groups of consecutive lengths per batch


def buckets_apply(program, config: RollConfig, entry: int) -> bool:
    """Whether the exact loss of `config` may be computed in length buckets.

    True when the model input is `[time, channels]` with a variable time axis,
    the tangents' entry is read by a Masking layer alone, and the Masking
    layer's output by a single SimpleRNN-like layer that returns its last
    state without zeroing it at padded steps (`return_sequences=False`,
    `zero_output_for_mask=False`): then the trailing padded steps of an example
    change neither its neurons nor its output.

    Example:

    ```python
    buckets_apply(lin.program, RollConfig(skip_padded_steps=True), 0)  # scornn_classifier()
    ```
    """
    shape = tuple(program.input_shape)
    if not config.exact or len(shape) != 2 or \
            shape[0] is not None:
        return False
    reader = masking_reader(program, entry)
    if reader is None:
        return False
    masking = program.steps[reader]
    after = entry_readers(program, reader + 1)
    if len(after) != 1:
        return False
    step = program.steps[after[0]]
    if step.inputs != [masking.output] or len(step.ops) != 1 or \
            not isinstance(step.ops[0], SimpleRNNOp):
        return False
    layer = step.layer
    return not (getattr(layer, "return_sequences", True)
                or getattr(layer, "zero_output_for_mask", True))


def bucketed(x, keep, loss_fn, buckets: int = BUCKETS):
    """`[B]` per-example losses, computed by `loss_fn` on length buckets of `x`.

    Args:
        x: `[B, T, C]` inputs.
        keep: `[B, T]` bool, the valid (unpadded) steps (`padding_mask`).
        loss_fn: `fn(x_bucket) -> [b]` the per-example loss of a cropped bucket.
        buckets: the number of groups of consecutive lengths.

    Example:

    ```python
    loss = bucketed(x, keep, lambda xb: loss_from_config(lin, xb, config))
    ```
    """
    steps = tf.shape(keep)[1]
    # an example's length: one past its last valid step (0 without any)
    last = steps - tf.argmax(tf.cast(tf.reverse(keep, [1]), tf.int32), axis=1,
                             output_type=tf.int32)
    length = tf.where(tf.reduce_any(keep, axis=1), last, 0)
    order = tf.argsort(length, stable=True)
    batch = tf.shape(x)[0]
    indices, losses = [], []
    for k in range(buckets):
        idx = order[(k * batch) // buckets:((k + 1) * batch) // buckets]
        longest = tf.reduce_max(tf.concat([[1], tf.gather(length, idx)], 0))
        xb = tf.gather(x, idx)[:, :longest]
        indices.append(idx)
        losses.append(_unless_empty(idx, lambda xb=xb: loss_fn(xb), x.dtype))
    return tf.dynamic_stitch(indices, losses)


def _unless_empty(idx, compute, dtype):
    """`compute()`, or an empty loss for an empty bucket (fewer examples than buckets)."""
    if idx.shape[0] is not None:
        return compute() if idx.shape[0] else tf.zeros([0], dtype)
    return tf.cond(tf.size(idx) > 0, compute, lambda: tf.zeros([0], dtype))
