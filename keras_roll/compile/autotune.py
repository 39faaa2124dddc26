"""`memory_budget="auto"` for the Jacobian streamed along input axes (certificates).

With a twin built with "auto" (`keras_roll.linearize(model)`, the default) and no
budget given, `axis_budget` picks the chunk size of the axis stream
(`keras_roll.compile.streaming.iter_axis_chunks`: `certify`, `stability_bounds`,
`lin.jacobian`) by timing one chunk of the caller's real inputs and reduction
under each candidate budget of `keras_roll.compile.chunking.auto_candidates`,
per example and direction; the fastest is kept for the model, the twin's dtype,
the per-example shape and the reduction (`remembered_budget`). A stream shorter
than `MIN_CHUNKS` chunks is not worth a probe: it keeps the twin's budget, and
the choice is left to the first stream long enough to time.
docs/design.md, "Chunk sizes by measurement".

Example:

```python
budget = axis_budget(lin, x, batch_size=None, reduce=norms, per_neuron=True)
```
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from keras_roll.compile.chunking import (
    auto_candidates,
    choose_budget,
    plan_chunks,
    remembered_budget,
)

__all__ = ["MIN_CHUNKS", "axis_budget", "probed_budget"]

MIN_CHUNKS = 32  # fewer chunks than this (under the smallest candidate): no probe


def axis_budget(lin, x, batch_size=None, reduce=None, per_neuron=False) -> int:
    """The budget of the axis stream of `x` (see the module): the twin's unless it is
    "auto", else the probe's choice.

    Args:
        lin: the `Linearized` model (its dtype is the stream's).
        x: `[B, *input_shape]` checked inputs.
        batch_size: the caller's examples per chunk, or None.
        reduce, per_neuron: the stream's reduction (see `Linearized.iter_axis_chunks`).
    """
    if not getattr(lin, "auto_budget", False) or int(x.shape[0]) == 0:
        return lin.memory_budget
    layout = lin.layout(x.shape[1:])
    per = layout.tangent_bytes(np.dtype(lin.dtype).itemsize)

    def plan_for(budget):
        return plan_chunks(int(x.shape[0]), layout.input_size, per, budget, batch_size)

    name = getattr(reduce, "__qualname__", repr(reduce))
    key = ("axes", lin.dtype, tuple(x.shape[1:]), batch_size, name, bool(per_neuron))
    return remembered_budget(lin.model, key, lambda: probed_budget(
        auto_candidates(plan_for), _chunk_seconds(lin, x, reduce, per_neuron)),
        default=lin.memory_budget)


def probed_budget(plans, seconds, narrow=None) -> int | None:
    """`choose_budget` of `plans` by `seconds`, or None (no probe) when none of them
    cuts the work into `MIN_CHUNKS` chunks: too short a stream to time, or to gain.

    `narrow(plans) -> plans`, if given, keeps the candidates worth timing once the
    work is known to be long enough (a single one left is chosen untimed).
    """
    if max(p.chunks for p in plans.values()) < MIN_CHUNKS:
        return None
    if narrow is not None:
        plans = narrow(plans)
    return choose_budget(plans, seconds, min_chunks=1)


def _chunk_seconds(lin, x, reduce, per_neuron):
    """`seconds(budget, plan)`: one chunk of `plan` on the first examples of `x`, per
    example and direction."""
    shape = tf.constant(x.shape[1:], tf.int32)
    passes = {}

    def seconds(budget, plan):
        b, k = plan.examples_per_chunk, plan.per_chunk
        if b not in passes:
            passes[b] = lin.compiled.primal(tf.cast(x[:b], lin.dtype))
        fwd = passes[b]
        start = time.perf_counter()
        out = lin.compiled.axes_tangent(fwd.trace, tf.constant(0, tf.int32),
                                        tf.constant(k, tf.int32), shape, reduce, per_neuron)
        tf.nest.map_structure(lambda t: t.numpy(), out)
        return (time.perf_counter() - start) / (min(b, int(x.shape[0])) * k)

    return seconds
