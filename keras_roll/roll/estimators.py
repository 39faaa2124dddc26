"""The directions ROLL differentiates along: estimators of `||grad_x z_j||^2`.

Eq. 9 of Lee et al. (ICLR 2019) needs, for every neuron, the squared norm of
its input gradient, `||g_j||^2 = sum_k (g_j . e_k)^2`. The frozen-pattern twin
gives `g_j . v` for any direction `v` by one tangent pass, so each estimator is
a set of directions and a scale:

* exact (`keras_roll.roll.exact`): every input axis `e_1 .. e_D`, shared by
  the batch (`ExactAxes`), or the same loss in fewer directions: the rows of a
  factor of a first Dense layer's Gram matrix (`FactoredAxes`), or the valid
  steps only behind a leading Masking layer (`PackedAxes`);
* `SampledAxes`: `k` axes per example (or per channel, `strata="channel"`; or
  one set for the batch, `share_axes=True`) drawn without replacement, scaled
  by `D / k` (Eq. 10; per channel `(D / C) / k`); unbiased.
* `RandomProbes`: `k` Gaussian or Rademacher probes per example,
  `E[(g . v)^2] = ||g||^2`, scaled by `1 / k`; unbiased.

An estimator is a `Record`: its tensor fields are `tf.nest` leaves, so the
chunked ROLL loss (`keras_roll.roll.loss`) passes it through its custom gradient
explicitly and rebuilds it there (nothing is captured from outside). Each one
computes, for directions `start .. start + k - 1` (zero past the last one),
the `[B, N]` sum over those directions of every neuron's squared derivative.

**Where the directions live** (`keras_roll.roll.entry`): axes of the model
input, or of the output of a leading Rescaling / Normalization layer
(`wrt=`); the estimators enter the tangent pass at the entry step of their
`RollPlan` (`keras_roll.roll.entry.roll_plan`).

**Padded steps** (`keras_roll.roll.entry.padding_mask`): with a leading
Masking layer, the padded steps of an example have zero gradient by
construction. `SampledAxes` then draws the `k` axes of each example uniformly
among its valid steps x channels (per channel among valid steps with
`strata="channel"`) and scales by `D_valid / min(k, D_valid)` per example,
which keeps the estimate unbiased.

**Seeds under tf.distribute** (`seed_tensor`): in a replica context with more
than one replica, every seed (a fresh random one for `seed=None` too) is
folded with the global replica id, so no two replicas draw the same axes or
probes.

Example:

```python
est = estimator_for(lin, x, RollConfig(samples=3), seed=0)
sq = est.sum_squares(lin, fwd.trace, 0, est.total) * est.scale(lin.dtype)   # [B, N]
```
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from keras_roll.compile.records import Record
from keras_roll.roll.config import EstimatorKind, RollConfig, RollPlan, Strata
from keras_roll.roll.entry import padding_mask, roll_plan
from keras_roll.roll.exact import (
    ActiveFactorAxes,
    ExactAxes,
    FactoredAxes,
    PackedAxes,
    exact_estimator,
    sum_squares_per_unit,
)

__all__ = [
    "Estimator",
    "RandomProbes",
    "SampledAxes",
    "estimator_for",
    "mix_replica",
    "seed_tensor",
    "tangent_dtype_for",
]


def seed_tensor(seed) -> tf.Tensor:
    """A `[2]` int32 seed for stateless ops: int -> [seed, 0]; None -> random.

    In a replica context with more than one replica (`tf.distribute`), the
    seed is then folded with the global replica id (`mix_replica`), so the
    replicas draw independent directions even from one int seed, or when
    their `seed=None` draws coincide (identical graphs on several workers
    under a global seed).

    Example:

    ```python
    seed_tensor(5)                      # [5, 0]
    seed_tensor(tf.constant([5, 17]))   # as given
    ```
    """
    if seed is None:
        return mix_replica(tf.random.uniform([2], 0, 2**31 - 1, dtype=tf.int32))
    if tf.is_tensor(seed) or isinstance(seed, (list, tuple, np.ndarray)):
        s = tf.cast(tf.convert_to_tensor(seed), tf.int32)
        if s.shape.rank == 0:
            return mix_replica(tf.stack([s, tf.zeros([], tf.int32)]))
        return mix_replica(tf.reshape(s, [2]))
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise ValueError(f"seed must be None, an int or a [2] int tensor, got seed={seed!r}.")
    return mix_replica(tf.constant([int(seed) % (2**31 - 1), 0], tf.int32))


def mix_replica(seed: tf.Tensor) -> tf.Tensor:
    """Folds the global replica id into a `[2]` int32 seed when there are replicas.

    Outside `tf.distribute` (or with one replica) the seed is returned as is;
    otherwise `stateless_fold_in(seed, replica_id_in_sync_group)`: distinct
    replica ids give distinct stateless keys, so two replicas never draw the
    same directions, whatever seed they start from.

    Example:

    ```python
    def replica_fn(x):
        return roll_loss(model, x, samples=4, seed=mix_replica(tf.constant([5, 0])))
    ```
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync <= 1:
        return seed
    rid = tf.cast(ctx.replica_id_in_sync_group, tf.int32)
    return tf.cast(tf.random.experimental.stateless_fold_in(seed, rid), tf.int32)


def tangent_dtype_for(config: RollConfig, twin_dtype: str) -> str | None:
    """The dtype of the tangent pass: None when it is the twin's own.

    Example:

    ```python
    tangent_dtype_for(RollConfig(tangent_dtype="bfloat16"), "float32")   # "bfloat16"
    tangent_dtype_for(RollConfig(tangent_dtype="float32"), "float32")    # None
    ```
    """
    name = config.tangent_dtype
    return None if name == twin_dtype else name


@dataclasses.dataclass(frozen=True, eq=False)
class SampledAxes(Record):
    """Input axes drawn without replacement (Eq. 10), uniformly or per channel.

    Attributes:
        axes: `[B, total]` (or `[total]` when shared) int32 flat input axes.
        lead: `[1]` (the batch size) or `[0]` (shared): the leading shape of
            the direction tensors.
        example_shape: `[rank]` int32 per-example input shape.
        depth: D, the flat input size (int or tensor).
        total: axes per example (`samples`, or `samples * channels`).
        samples: the `samples` hyperparameter.
        per_group: axes the draw is uniform over: D, or D / channels.
        shared: one draw for the whole batch.
        dtype: the twin's dtype.
        counts: None, or `[B]` the valid (unpadded) axes of each example's
            draw groups (`padding_mask`): D_valid, or valid steps per channel.
            Axes are then drawn among those only (-1, a zero direction, where
            an example has fewer than `samples`).
        entry: the program step the tangents enter at (`tangent_entry`).
        tangent_dtype: None, or the dtype of the tangent pass (16-bit under
            mixed precision); squares are summed in `dtype`.
    """

    axes: tf.Tensor
    lead: tf.Tensor
    example_shape: tf.Tensor
    depth: int | tf.Tensor
    total: int | tf.Tensor
    samples: int
    per_group: int | tf.Tensor
    shared: bool
    dtype: str
    counts: tf.Tensor | None = None
    entry: int = 0
    tangent_dtype: str | None = None

    def scale(self, dtype):
        """`per_group / samples`: D / k, or (D / C) / k per channel; with padding,
        `[B, 1]`: `D_valid / min(k, D_valid)` per example (0 without valid axes)."""
        if self.counts is None:
            return tf.cast(self.per_group, dtype) / tf.cast(self.samples, dtype)
        counts = tf.cast(self.counts, dtype)
        drawn = tf.minimum(counts, tf.cast(self.samples, dtype))
        return tf.math.divide_no_nan(counts, drawn)[:, None]

    def sum_squares(self, lin, trace, start, k):
        total = self.total
        if isinstance(start, int) and start == 0 and isinstance(k, int) and k == total:
            chunk = self.axes  # a single chunk: every sampled axis
        else:
            cols = start + tf.range(k)  # a static shape for a static k
            chunk = tf.gather(self.axes, tf.minimum(cols, total - 1), axis=-1)
            chunk = tf.where(cols < total, chunk, -1)  # one_hot(-1) = 0
        depth = tf.reduce_prod(self.example_shape) if tf.is_tensor(self.depth) else self.depth
        v = tf.one_hot(chunk, depth, dtype=self.dtype)
        v = tf.reshape(v, tf.concat([self.lead, [k], self.example_shape], 0))
        jvp = lin.tangent_from_trace(trace, v, self.shared, concat=False, axes=chunk,
                                     start=self.entry, dtype=self.tangent_dtype)
        return sum_squares_per_unit(jvp, self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class RandomProbes(Record):
    """Gaussian or Rademacher probes per example, regenerated per chunk from the seed.

    For a fixed seed the probes depend on the chunking (the memory budget);
    the estimate is unbiased either way.

    Attributes:
        seed: `[2]` int32 stateless seed.
        batch: the batch size (scalar int32 tensor).
        example_shape: `[rank]` int32 per-example input shape.
        samples: probes per example.
        kind: "gaussian" or "rademacher".
        dtype: the twin's dtype.
        entry: the program step the tangents enter at (`tangent_entry`).
        tangent_dtype: None, or the dtype of the tangent pass (see `SampledAxes`).
    """

    seed: tf.Tensor
    batch: tf.Tensor
    example_shape: tf.Tensor
    samples: int
    kind: str
    dtype: str
    entry: int = 0
    tangent_dtype: str | None = None

    shared = False

    @property
    def total(self) -> int:
        return self.samples

    def scale(self, dtype):
        """`1 / samples`."""
        return tf.constant(1.0 / self.samples, dtype)

    def sum_squares(self, lin, trace, start, k):
        dtype = self.dtype
        s = tf.random.experimental.stateless_fold_in(self.seed, start)
        dims = tf.stack([self.batch, k, tf.reduce_prod(self.example_shape)])
        if self.kind == "gaussian":
            v = tf.random.stateless_normal(dims, s, dtype=dtype)
        else:
            bits = tf.random.stateless_uniform(dims, s, minval=0, maxval=2, dtype=tf.int32)
            v = tf.cast(2 * bits - 1, dtype)
        live = tf.cast(start + tf.range(k) < self.samples, dtype)
        v = v * live[None, :, None]
        v = tf.reshape(v, tf.concat([tf.stack([self.batch, k]), self.example_shape], 0))
        jvp = lin.tangent_from_trace(trace, v, False, concat=False, start=self.entry,
                                     dtype=self.tangent_dtype)
        return sum_squares_per_unit(jvp, self.dtype)


def estimator_for(lin, x, config: RollConfig | RollPlan, seed, trace=None) -> Estimator:
    """The estimator `config` asks for on the batch `x` (checked, in the twin's dtype).

    Args:
        lin: the `Linearized` model.
        x: `[B, *input_shape]` inputs.
        config: the ROLL hyperparameters (`samples`, `strata`, `estimator`,
            `share_axes`, `wrt`, `tangent_dtype`, `fewest_directions`), or their
            `RollPlan` (the entry step resolved once by the caller).
        seed: None, an int or a `[2]` int tensor (see `seed_tensor`).
        trace: the `Trace` of `x`'s forward pass: with it, sampled axes (not
            shared) avoid the padded steps of a leading Masking layer
            (`padding_mask`).

    Example:

    ```python
    est = estimator_for(lin, x, RollConfig(samples=3), seed=0, trace=fwd.trace)
    ```
    """
    plan = roll_plan(lin, config)
    config, entry = plan.config, plan.entry
    dtype = lin.dtype
    tdtype = tangent_dtype_for(config, dtype)
    static = x.shape[1:]
    if static.is_fully_defined():
        dims = static.as_list()
        example_shape = tf.constant(dims, tf.int32)
        d, channels = int(np.prod(dims)), dims[-1]
    else:
        example_shape = tf.shape(x)[1:]
        d, channels = tf.reduce_prod(example_shape), example_shape[-1]
    samples = config.samples
    if samples is None:
        return exact_estimator(lin, config, entry, example_shape, d, tdtype, trace)
    batch = tf.shape(x)[0]
    seed_t = seed_tensor(seed)
    if config.estimator is not EstimatorKind.AXES:
        return RandomProbes(seed_t, batch, example_shape, samples, config.estimator.value, dtype,
                            entry, tdtype)
    # One set of axes per example ([B, ...]) or, with share_axes, for the batch.
    share = config.share_axes
    keep = None if share or trace is None else padding_mask(lin.program, trace, entry)
    lead = tf.zeros([0], tf.int32) if share else tf.reshape(batch, [1])
    counts = None
    if config.strata is Strata.CHANNEL:
        per_group = d // channels
        u = tf.random.stateless_uniform(
            tf.concat([lead, tf.stack([channels, per_group])], 0), seed_t)
        if keep is not None:  # [B, P] valid positions, the same in every channel
            u = tf.where(keep[:, None, :], u, -1.0)
        pos = tf.math.top_k(u, k=samples).indices  # [(B,) C, k] distinct per channel
        idx = pos * channels + tf.reshape(tf.range(channels), [channels, 1])
        if keep is not None:
            idx = tf.where(tf.gather(keep, pos, batch_dims=1), idx, -1)
            counts = tf.reduce_sum(tf.cast(keep, tf.int32), axis=1)
        total = samples * channels
    else:
        per_group = d
        u = tf.random.stateless_uniform(tf.concat([lead, tf.reshape(d, [1])], 0), seed_t)
        if keep is not None:  # [B, D] valid axes: every channel of the valid positions
            valid = tf.reshape(tf.repeat(keep[:, :, None], channels, axis=2), tf.shape(u))
            u = tf.where(valid, u, -1.0)
        idx = tf.math.top_k(u, k=samples).indices  # k distinct axes
        if keep is not None:
            idx = tf.where(tf.gather(valid, idx, batch_dims=1), idx, -1)
            counts = tf.reduce_sum(tf.cast(valid, tf.int32), axis=1)
        total = samples
    idx = tf.stop_gradient(tf.reshape(idx, tf.concat([lead, [-1]], 0)))
    return SampledAxes(idx, lead, example_shape, d, total, samples, per_group, share, dtype,
                       counts, entry, tdtype)


# Any of the estimators (a `Record` of tensors; see `estimator_for`).
Estimator = (ExactAxes | FactoredAxes | ActiveFactorAxes | PackedAxes | SampledAxes
             | RandomProbes)
