"""Exact ROLL on masked sequences in length buckets: each example cropped near its length.

Behind a leading Masking layer read by a recurrent layer that returns its last
state (the paper's Japanese Vowels scoRNN), an example's loss does not depend on
the padded steps after its last valid one: they carry the state, create no
neuron and get no gradient. So the examples of a batch can be sorted by length,
cut into `BUCKETS` groups of consecutive lengths, and each group's loss
computed on its inputs cropped to the group's longest sequence. Exact ROLL
along the input axes costs about `B * T^2` recurrent steps per feature for a
batch padded to `T` steps (`T` axes per feature, each pushed through the steps
after it); cropped groups cost `sum_g B_g * T_g^2`, so work that grows with the
square of the length shrinks with the group's longest sequence instead of the
batch's (the same holds for the valid axes of `keras_roll.roll.exact.PackedAxes`).
Smaller groups run smaller matrix products, so a batch is cut only where that
work falls below `CROP_GAIN` of the whole batch's (a `tf.cond` in the graph:
a batch without padding runs whole). The per-example losses are stitched back
in batch order: the same loss and gradients (docs/design.md, "Padded steps in
exact ROLL").

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
CROP_GAIN = 0.8  # cut a batch when its groups' work is below this fraction of the whole's


def buckets_apply(program, config: RollConfig, entry: int) -> bool:
    """Whether the exact loss of `config` may be computed in length buckets.

    True for exact ROLL (along every input axis or, `skip_padded_steps`, the
    valid ones) when the model input is `[time, channels]` with a variable time axis,
    the tangents' entry is read by a Masking layer alone, and the Masking
    layer's output by a single SimpleRNN-like layer that returns its last
    state without zeroing it at padded steps (`return_sequences=False`,
    `zero_output_for_mask=False`): then the trailing padded steps of an example
    change neither its neurons nor its output.

    Example:

    ```python
    buckets_apply(lin.program, RollConfig(), 0)       # True for scornn_classifier()
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

    The batch is cut only when the buckets' work, `sum_g B_g * T_g^2`, is below
    `CROP_GAIN` of the whole batch's, `B * T^2`; otherwise `loss_fn(x)`.

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
    groups = []
    for k in range(buckets):
        idx = order[(k * batch) // buckets:((k + 1) * batch) // buckets]
        groups.append((idx, tf.reduce_max(tf.concat([[1], tf.gather(length, idx)], 0))))

    def cut():
        losses = [_unless_empty(idx, lambda idx=idx, longest=longest: loss_fn(
            tf.gather(x, idx)[:, :longest]), x.dtype) for idx, longest in groups]
        return tf.dynamic_stitch([idx for idx, _ in groups], losses)

    def work(n, t):
        return tf.cast(n, tf.float64) * tf.cast(t, tf.float64) ** 2

    cropped = tf.add_n([work(tf.size(idx), longest) for idx, longest in groups])
    gain = cropped < CROP_GAIN * work(batch, steps)
    if tf.executing_eagerly():
        return cut() if bool(gain) else loss_fn(x)
    return tf.cond(gain, cut, lambda: loss_fn(x))


def _unless_empty(idx, compute, dtype):
    """`compute()`, or an empty loss for an empty bucket (fewer examples than buckets)."""
    if idx.shape[0] is not None:
        return compute() if idx.shape[0] else tf.zeros([0], dtype)
    return tf.cond(tf.size(idx) > 0, compute, lambda: tf.zeros([0], dtype))
