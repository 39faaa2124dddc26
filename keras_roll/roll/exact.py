"""Exact ROLL's directions (Eq. 9): input axes, a Gram factor, or valid steps only.

The exact loss needs `||g_j||^2 = sum_k (g_j . e_k)^2` over every input axis.
Three estimators give it exactly, each a `Record` of tensors that the chunked
ROLL loss passes through its custom gradients (see
`keras_roll.roll.estimators`):

* `ExactAxes`: the `D` input axes, one-hot and shared by the batch.
* `FactoredAxes`: when a first Dense layer has `H1 < D` units, the `H1` rows of
  a factor `R` of its Gram matrix, pushed from its output
  (`keras_roll.roll.factored`): the same loss in fewer directions.
* `ActiveFactorAxes`: when a ReLU follows that Dense layer, per example the
  rows of a factor of the Gram matrix of its active units only, pushed from
  the ReLU's output (`keras_roll.roll.active_factor`): the batch's largest
  number of active units instead of `H1` (for a batch with more than
  `COMPACT_FRACTION * H1` of them, the `H1` factor rows times the ReLU's
  slopes, from the same place).
* `PackedAxes`: behind a leading Masking layer, one row per example and valid
  (unpadded) input axis, packed across the batch: padded steps, whose
  gradients are zero by construction, get no direction. Each row carries its
  example's records (gathered from the trace) and its sums of squares are
  added back to its example (docs/design.md, "Padded steps in exact ROLL").

`exact_estimator` picks the one with the fewest directions (`RollConfig.fewest_directions`).

Example:

```python
est = exact_estimator(lin, RollConfig(), entry=0, example_shape=tf.constant([784]), d=784,
                      tangent_dtype=None, trace=lin.primal(x).trace)
sq = est.sum_squares(lin, trace, 0, est.total)     # [B, N]
```
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from keras_roll.compile.records import Record
from keras_roll.roll.active_factor import (
    COMPACT_FRACTION,
    active_factor,
    first_activation,
    spread_directions,
)
from keras_roll.roll.entry import padding_mask
from keras_roll.roll.factored import factored_entry, gram_factor

__all__ = ["ActiveFactorAxes", "ExactAxes", "ExactDirections", "FactoredAxes", "PackedAxes",
           "exact_estimator", "factor_rows", "sum_squares_per_unit"]


def _sum_squares_over_directions(jvp, start):
    return tf.reduce_sum(tf.square(jvp.neurons), axis=1)


def sum_squares_per_unit(jvp, dtype=None) -> tf.Tensor:
    """`[B, N]` sums over directions, unit by unit (no `[B, k, N]` concat).

    `dtype`: the dtype the squares are summed in (16-bit tangents are cast to it
    first, so that squares neither overflow float16 nor lose bfloat16 digits).
    """
    def square(t):
        return tf.square(t if dtype is None or t.dtype == dtype else tf.cast(t, dtype))

    return tf.concat([tf.reduce_sum(square(t), axis=1) for t in jvp.neurons], axis=-1)


def factor_rows(factor, start, k, total) -> tf.Tensor:
    """Rows `start .. start + k - 1` of `factor` `[total, H1]`, zero past `total`: one
    chunk of a Gram factor's directions."""
    rows = start + tf.range(k)
    v = tf.gather(factor, tf.minimum(rows, total - 1))
    return v * tf.cast(rows < total, v.dtype)[:, None]


@dataclasses.dataclass(frozen=True, eq=False)
class ExactDirections(Record):
    """What the exact estimators share: no scaling of the sums of squares, and the
    dtypes they are computed in (keyword arguments, after each estimator's own fields).

    Attributes:
        dtype: the twin's dtype (squares are summed in it).
        tangent_dtype: None, or the dtype of the tangent pass (16-bit under mixed
            precision).

    Example:

    ```python
    est = ExactAxes(tf.constant([784]), 784, dtype="float32")
    assert est.scale("float32") is None and est.tangent_dtype is None
    ```
    """

    dtype: str | None = dataclasses.field(default=None, kw_only=True)
    tangent_dtype: str | None = dataclasses.field(default=None, kw_only=True)

    shared = False  # True: one set of directions for the whole batch

    def scale(self, dtype):
        """The factor of the sum of squares (None: exact, no scaling)."""
        return None


@dataclasses.dataclass(frozen=True, eq=False)
class ExactAxes(ExactDirections):
    """Every input axis, one-hot and shared by the batch (Eq. 9, exact).

    Attributes:
        example_shape: `[rank]` int32 per-example input shape.
        total: D, the number of axes (an int, or a tensor for dynamic shapes).
        entry: the program step the tangents enter at (`tangent_entry`).
        dtype, tangent_dtype: as `ExactDirections`.
    """

    example_shape: tf.Tensor
    total: int | tf.Tensor
    entry: int = 0

    shared = True

    def sum_squares(self, lin, trace, start, k):
        dtype = self.dtype

        def reduce(jvp, start):
            t = jvp.neurons
            return tf.reduce_sum(tf.square(t if t.dtype == dtype else tf.cast(t, dtype)),
                                 axis=1)

        return lin.axes_tangent(trace, start, k, self.example_shape,
                                reduce=_sum_squares_over_directions if self.tangent_dtype is None
                                else reduce, per_neuron=True, entry=self.entry,
                                dtype=self.tangent_dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class FactoredAxes(ExactDirections):
    """Exact ROLL along the rows of a Gram factor, from a first Dense layer's output
    (`keras_roll.roll.factored`: the same loss as `ExactAxes` in `H1 < D` directions).

    Attributes:
        factor: `[H1, H1]` `R` with `R^T R = W_a^T W_a` (`gram_factor`), in the
            twin's dtype; differentiable with respect to the kernel.
        total: H1, the number of directions.
        step: the Dense layer's step; tangents enter after its first op.
        dtype, tangent_dtype: as `ExactDirections`.
    """

    factor: tf.Tensor
    total: int
    step: int

    shared = True

    def sum_squares(self, lin, trace, start, k):
        v = factor_rows(self.factor, start, k, self.total)
        jvp = lin.interpreter.tangent(trace, v, True, concat=False, start=self.step,
                                      start_op=1, dtype=self.tangent_dtype)
        return sum_squares_per_unit(jvp, self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class ActiveFactorAxes(ExactDirections):
    """Exact ROLL from the output of the ReLU after a first Dense layer (`H1 < D` units):
    along per-example factors of the Gram matrix of its active units when the batch's
    largest number of active units `K` is at most `COMPACT_FRACTION * H1`
    (`keras_roll.roll.active_factor`), else along the `H1` rows of a factor `R` of the
    whole Gram matrix times the ReLU's slopes (`keras_roll.roll.factored`). Either way
    the same loss as `ExactAxes`, decided per batch in the graph.

    Attributes:
        factor: `[B, K, K]` `L` (`active_factor`; `[B, 1, 1]` zeros when not
            compact), in the twin's dtype; differentiable with respect to the kernel.
        rows: `[B, H1]` int32, the row of `L` of each unit (`K`: inactive);
            the compact directions are `spread_directions(factor, rows)`.
        gram_factor: `[H1, H1]` `R` (`gram_factor`; zeros when compact), in the
            twin's dtype; differentiable with respect to the kernel.
        slope: `[B, H1]` the ReLU's 0/1 slopes, in the twin's dtype.
        compact: whether the batch uses the active units' factors (a bool tensor).
        norms: `[H1]` squared gradient norms of the ReLU's own neurons,
            `||W_a[:, j]||^2`, in the twin's dtype.
        total: K when compact, else H1 (a scalar int32 tensor).
        step: the ReLU's step; the tangents enter after its op `op`.
        op: the ReLU's op in that step.
        dtype, tangent_dtype: as `ExactDirections`.
    """

    factor: tf.Tensor
    rows: tf.Tensor
    gram_factor: tf.Tensor
    slope: tf.Tensor
    compact: tf.Tensor
    norms: tf.Tensor
    total: tf.Tensor
    step: int
    op: int

    @classmethod
    def from_slope(cls, kernel, slope, step, op, dtype, tangent_dtype=None):
        """The estimator for the kernel `W_a` (`FactoredEntry.kernel`) and the ReLU's
        `[B, H1]` slopes `slope` (its op `op` of step `step`)."""
        units = int(kernel.shape[-1])
        active = slope > 0
        compact = tf.reduce_max(tf.reduce_sum(tf.cast(active, tf.int32), axis=1)) \
            <= int(COMPACT_FRACTION * units)
        batch = tf.shape(slope)[0]

        def per_example():
            lower, rows = active_factor(kernel, active)
            return lower, rows, tf.zeros([units, units], dtype)

        def whole():
            rows = tf.zeros(tf.stack([batch, units]), tf.int32)
            return tf.zeros(tf.stack([batch, 1, 1]), dtype), rows, gram_factor(kernel)

        lower, rows, r = tf.cond(compact, per_example, whole)
        norms = tf.reduce_sum(tf.square(tf.cast(kernel, tf.float64)), axis=0)
        total = tf.where(compact, tf.shape(lower)[1], units)
        return cls(lower, rows, r, tf.cast(slope, dtype), compact, tf.cast(norms, dtype), total,
                   step, op, dtype=dtype, tangent_dtype=tangent_dtype)

    def sum_squares(self, lin, trace, start, k):
        def compact():
            # Columns start .. start + k - 1 of L (zero past K): a slice, whose gradient
            # is a pad (a gather along the last axis would transpose in its gradient).
            size = tf.clip_by_value(self.total - start, 0, k)
            part = tf.slice(self.factor, tf.stack([0, 0, tf.minimum(start, self.total)]),
                            tf.stack([-1, -1, size]))
            part = tf.pad(part, tf.stack([[0, 0], [0, 0], [0, k - size]]))  # [B, K, k]
            return spread_directions(part, self.rows)  # [B, k, H1]

        def whole():
            r = factor_rows(self.gram_factor, start, k, self.total)  # [k, H1]
            return r[None] * self.slope[:, None, :]  # through the ReLU's mask

        v = tf.cond(self.compact, compact, whole)
        jvp = lin.interpreter.tangent(trace, v, False, concat=False, start=self.step,
                                      start_op=self.op + 1, dtype=self.tangent_dtype)
        first = tf.cast(tf.equal(start, 0), self.dtype) * self.norms  # once, in the first chunk
        first = tf.broadcast_to(first, tf.stack([tf.shape(v)[0], tf.shape(self.norms)[0]]))
        return tf.concat([first, sum_squares_per_unit(jvp, self.dtype)], axis=-1)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedAxes(ExactDirections):
    """Exact ROLL along the valid axes only: one row per (example, unpadded input axis).

    Direction `r` is the one-hot axis `axis[r]` of example `example[r]`; a chunk
    of rows is one tangent pass of a batch of rows, each with the records of
    its example (gathered from the trace), and its `[rows, N]` squares are
    summed into their examples. Padded steps (zero gradient behind a leading
    Masking layer) get no row, so the work is `sum_b D_valid(b)` directions
    instead of `B * D`.

    Attributes:
        example: `[R + 1]` int32, the example of every row (one spare row at
            the end, so that a chunk past the last row gathers a valid index).
        axis: `[R + 1]` int32, the flat input axis of every row (-1 spare).
        total: R, the number of rows (a scalar int32 tensor).
        batch: B, the number of examples (a scalar int32 tensor).
        example_shape: `[rank]` int32 per-example input shape.
        depth: D, the flat input size (int or tensor).
        entry: the program step the tangents enter at (`tangent_entry`).
        dtype, tangent_dtype: as `ExactDirections`.
    """

    example: tf.Tensor
    axis: tf.Tensor
    total: tf.Tensor
    batch: tf.Tensor
    example_shape: tf.Tensor
    depth: int | tf.Tensor
    entry: int

    packed = True  # one example per direction: chunks are planned per row

    @classmethod
    def from_mask(cls, keep, example_shape, depth, entry, dtype, tangent_dtype=None):
        """The rows of `keep` `[B, P]` (the valid positions, `padding_mask`): every
        channel of every valid position, example by example."""
        batch = tf.shape(keep)[0]
        channels = example_shape[-1]
        valid = tf.reshape(tf.repeat(keep[:, :, None], channels, axis=2), tf.stack([batch, -1]))
        rows = tf.cast(tf.where(valid), tf.int32)  # [R, 2] (example, axis), row-major
        example = tf.concat([rows[:, 0], [0]], 0)
        axis = tf.concat([rows[:, 1], [-1]], 0)
        return cls(tf.stop_gradient(example), tf.stop_gradient(axis), tf.shape(rows)[0],
                   batch, example_shape, depth, entry, dtype=dtype, tangent_dtype=tangent_dtype)

    def sum_squares(self, lin, trace, start, k):
        rows = tf.minimum(start + tf.range(k), self.total)  # past the end: the spare row
        example = tf.gather(self.example, rows)
        axis = tf.gather(self.axis, rows)
        sub = tf.nest.map_structure(lambda t: tf.gather(t, example), trace)
        v = tf.one_hot(axis, self.depth, dtype=self.dtype)
        v = tf.reshape(v, tf.concat([tf.shape(axis), [1], self.example_shape], 0))
        jvp = lin.tangent_from_trace(sub, v, False, concat=False, axes=axis[:, None],
                                     start=self.entry, dtype=self.tangent_dtype)
        return tf.math.unsorted_segment_sum(sum_squares_per_unit(jvp, self.dtype), example,
                                            self.batch)


def exact_estimator(lin, config, entry: int, example_shape, d, tangent_dtype=None,
                    trace=None) -> ExactAxes | FactoredAxes | ActiveFactorAxes | PackedAxes:
    """The exact estimator with the fewest directions for `config` (see the module).

    Args:
        lin: the `Linearized` model.
        config: the `RollConfig` (`fewest_directions` False: no factor;
            `skip_padded_steps` True: `PackedAxes` behind a leading Masking layer).
        entry: the step the tangents enter at (`tangent_entry`).
        example_shape: `[rank]` int32 per-example input shape.
        d: D, the flat input size (int or tensor).
        tangent_dtype: None, or the dtype of the tangent pass.
        trace: the forward pass's `Trace` (needed for `ActiveFactorAxes` and
            `PackedAxes`).
    """
    if config.fewest_directions:
        factored = factored_entry(lin.program, entry)
        after = None if factored is None or trace is None else \
            first_activation(lin.program, factored.index)
        if after is not None:
            slope = trace.steps[after[0]].ops[after[1]].slope
            return ActiveFactorAxes.from_slope(factored.kernel(lin.dtype), slope, after[0],
                                               after[1], lin.dtype, tangent_dtype)
        if factored is not None:
            factor = gram_factor(factored.kernel(lin.dtype))
            return FactoredAxes(factor, factored.units, factored.index, dtype=lin.dtype,
                                tangent_dtype=tangent_dtype)
    if config.skip_padded_steps:
        keep = None if trace is None else padding_mask(lin.program, trace, entry)
        if keep is not None:
            return PackedAxes.from_mask(keep, example_shape, d, entry, lin.dtype,
                                        tangent_dtype)
    return ExactAxes(example_shape, d, entry, dtype=lin.dtype, tangent_dtype=tangent_dtype)
