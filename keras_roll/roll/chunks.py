"""ROLL's sums of squared neuron derivatives, streamed in chunks within a memory budget.

An estimator (`keras_roll.roll.estimators`) gives `total` directions; each
chunk of `k` of them is one tangent pass of the batch. `plan_directions_for`
sizes the chunks with `keras_roll.compile.chunking` (the one place chunk sizes
are computed): one direction of the whole batch takes every op's tangent, the
neuron tangents and (per-example directions) the direction itself, or, for the
packed rows of exact ROLL behind a Masking layer (`PackedAxes`), one example's
worth plus its gathered records. `sum_squares` runs the plan: one pass when
it fits, else the chunked custom gradients of
`keras_roll.roll.chunked_gradients`. In a graph with a dynamic batch (or a
data-dependent number of rows) the plan is computed inside the graph.
See docs/design.md, sections "Memory" and "Data flow of a ROLL training step".

Example:

```python
fwd = lin.primal(x)
est = estimator_for(lin, x, RollConfig(), seed=None, trace=fwd.trace)
plan = plan_directions_for(lin, fwd, x, est, roll_budget(lin, RollConfig()))
sq = sum_squares(lin, fwd, x, est, plan.memory_budget)     # [B, N]
```
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_roll.compile.chunking import ChunkPlan, plan_chunks, plan_directions
from keras_roll.compile.interpreter import ForwardPass
from keras_roll.compile.twin import Linearized
from keras_roll.options import fixed_budget
from keras_roll.roll.chunked_gradients import chunked_sum_squares, chunked_weighted_sum
from keras_roll.roll.config import RollConfig

__all__ = ["plan_directions_for", "roll_budget", "sum_squares"]


def roll_budget(lin: Linearized, config: RollConfig) -> int:
    """The bytes of tangents per chunk: `config.memory_budget`, else the twin's."""
    return fixed_budget(config.memory_budget) or lin.memory_budget


def plan_directions_for(lin: Linearized, fwd: ForwardPass, x, estimator,
                        budget: int) -> ChunkPlan | None:
    """The `ChunkPlan` of `estimator`'s directions when every size is static (eager,
    or a graph with a fully static batch and number of directions), else None.

    Example:

    ```python
    plan = plan_directions_for(lin, fwd, x, est, 2**26)
    plan.chunks, plan.per_chunk
    ```
    """
    size = tf.get_static_value(fwd.tangent_size)
    if size is None:
        size = _static_tangent_size(lin, x)
    batch, n_neurons = x.shape[0], fwd.neurons.z.shape[1]
    d = x.shape[1:].num_elements() if x.shape[1:].is_fully_defined() else None
    total = estimator.total
    if not isinstance(total, int):
        total = tf.get_static_value(total)
    if None in (size, batch, n_neurons, d, total):
        return None
    rows, per_item = _bytes_per_item(estimator, int(batch), int(size), int(n_neurons), int(d),
                                     _itemsize(lin, estimator))
    return plan_chunks(rows, int(total), per_item, budget, batch_size=max(rows, 1))


def _bytes_per_item(estimator, batch, tangent_size, n_neurons, d, itemsize):
    """`(examples per direction, bytes per example and direction)`: the batch, or 1 for
    packed rows (which also gather their example's records, about a tangent's size)."""
    per = tangent_size + n_neurons + (0 if estimator.shared else d)
    if getattr(estimator, "packed", False):
        return 1, (per + tangent_size) * itemsize
    return batch, per * itemsize


def _itemsize(lin, estimator) -> int:
    """Bytes of one tangent element: the estimator's tangent dtype, else the twin's."""
    return np.dtype(getattr(estimator, "tangent_dtype", None) or lin.dtype).itemsize


def sum_squares(lin: Linearized, fwd: ForwardPass, x, estimator, memory_budget,
                weights=None, columns: int | None = None, combine: str = "sum"):
    """`[B, N]` sum over directions of the squared neuron derivatives (unscaled).

    With `weights` (`[B, N]`, constant), `[B]`: the weighted sum over neurons of
    those sums, whose chunked form differentiates each chunk in the forward pass
    (`chunked_weighted_sum`). Any other `Record` with the estimators' `total`,
    `shared` and `sum_squares(lin, trace, start, k) -> [B, columns]` (`columns`:
    None for the neurons) streams its columns the same way, summed over the
    chunks or (`combine="max"`) their maximum.

    Raises:
        MemoryError: one direction of the batch does not fit in the budget
            (checked in the graph when the plan is dynamic).
    """
    trace = fwd.trace
    z = fwd.neurons.z
    budget = int(memory_budget or lin.memory_budget)

    def whole(total):
        sq = estimator.sum_squares(lin, trace, 0, total)
        return sq if weights is None else tf.reduce_sum(sq * weights, axis=1)

    def chunked(k, n):
        if weights is None:
            shape = tf.shape(z) if columns is None else tf.stack([tf.shape(z)[0], columns])
            return chunked_sum_squares(lin, estimator, trace, shape, z.dtype, k, n, combine)
        return chunked_weighted_sum(lin, estimator, trace, weights, k, n)

    plan = plan_directions_for(lin, fwd, x, estimator, budget)
    if plan is not None:  # eager, or fully static shapes: plan in Python
        if not plan.fits:
            raise MemoryError(_budget_message(lin, budget, plan.bytes_per_direction))
        if plan.direction_chunks == 1:
            return whole(plan.directions)
        return chunked(plan.per_chunk, plan.direction_chunks)
    k, n = _dynamic_plan(fwd, x, estimator, budget, _itemsize(lin, estimator))
    total_t = tf.cast(estimator.total, tf.int32)
    return tf.cond(n <= 1, lambda: whole(total_t), lambda: chunked(k, n))


def _dynamic_plan(fwd, x, estimator, budget, itemsize):
    """`(per_chunk, chunks)` int32 tensors planned inside the graph, with an assertion
    that one direction of the batch fits."""
    size = tf.cast(fwd.tangent_size, tf.int64)
    per = size + tf.cast(tf.shape(fwd.neurons.z)[1], tf.int64)
    if not estimator.shared:
        per += tf.cast(tf.reduce_prod(tf.shape(x)[1:]), tf.int64)
    if getattr(estimator, "packed", False):
        rows = tf.constant(1, tf.int64)
        per += size
    else:
        rows = tf.maximum(tf.cast(tf.shape(x)[0], tf.int64), 1)
    k, n, fits = plan_directions(estimator.total, rows * per * itemsize, budget)
    check = tf.debugging.assert_equal(
        fits, True, message=(f"keras_roll ROLL: one direction for the whole batch does not fit "
                             f"in memory_budget={budget} bytes; use samples=, a smaller batch or "
                             f"a larger Linearized.memory_budget."))
    with tf.control_dependencies([check]):
        return tf.cast(k, tf.int32), tf.cast(n, tf.int32)


def _static_tangent_size(lin, x):
    """Per-example tangent size as a Python int when `x` has a fully static shape.

    Inside a graph the twin's `tangent_size` is a tensor; the twin's cached
    batch-1 eager probe lets fully static graphs plan their chunks in Python.
    """
    if not x.shape.is_fully_defined():
        return None
    try:
        with tf.init_scope():
            if not tf.executing_eagerly():
                return None
            return lin.tangent_size(x.shape[1:])
    except Exception:  # planning falls back to the dynamic path
        return None


def _budget_message(lin, budget, per):
    return (f"The ROLL tangents of model '{lin.model.name}' need {per} bytes for a single "
            f"input direction of the batch, more than memory_budget={budget} bytes. Use the "
            f"approximate loss (samples=..., e.g. samples=120, strata='channel' for images), "
            f"a smaller batch, or a larger budget (keras_roll.linearize(model, "
            f"memory_budget=...)).")
