"""The directions ROLL differentiates along: three estimators of `||grad_x z_j||^2`.

Eq. 9 of Lee et al. (ICLR 2019) needs, for every neuron, the squared norm of
its input gradient, `||g_j||^2 = sum_k (g_j . e_k)^2`. The frozen-pattern twin
gives `g_j . v` for any direction `v` by one tangent pass, so each estimator is
a set of directions and a scale:

* `ExactAxes`: every input axis `e_1 .. e_D`, shared by the batch; exact.
* `SampledAxes`: `k` axes per example (or per channel, `strata="channel"`; or
  one set for the batch, `share_axes=True`) drawn without replacement, scaled
  by `D / k` (Eq. 10; per channel `(D / C) / k`); unbiased.
* `RandomProbes`: `k` Gaussian or Rademacher probes per example,
  `E[(g . v)^2] = ||g||^2`, scaled by `1 / k`; unbiased.

An estimator is a `Record`: its tensor fields are `tf.nest` leaves, so the
chunked ROLL loss (`keras_roll.roll`) passes it through its custom gradient
explicitly and rebuilds it there (nothing is captured from outside). Each one
computes, for directions `start .. start + k - 1` (zero past the last one),
the `[B, N]` sum over those directions of every neuron's squared derivative.

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

from keras_roll.records import Record
from keras_roll.roll_config import RollConfig

__all__ = [
    "ExactAxes",
    "RandomProbes",
    "SampledAxes",
    "estimator_for",
    "seed_tensor",
    "sum_squares_per_unit",
]


def seed_tensor(seed) -> tf.Tensor:
    """A `[2]` int32 seed for stateless ops: int -> [seed, 0]; None -> random.

    Example:

    ```python
    seed_tensor(5)                      # [5, 0]
    seed_tensor(tf.constant([5, 17]))   # as given
    ```
    """
    if seed is None:
        return tf.random.uniform([2], 0, 2**31 - 1, dtype=tf.int32)
    if tf.is_tensor(seed) or isinstance(seed, (list, tuple, np.ndarray)):
        s = tf.cast(tf.convert_to_tensor(seed), tf.int32)
        if s.shape.rank == 0:
            return tf.stack([s, tf.zeros([], tf.int32)])
        return tf.reshape(s, [2])
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise ValueError(f"seed must be None, an int or a [2] int tensor, got seed={seed!r}.")
    return tf.constant([int(seed) % (2**31 - 1), 0], tf.int32)


def _sum_squares_over_directions(jvp, start):
    return tf.reduce_sum(tf.square(jvp.neurons), axis=1)


def sum_squares_per_unit(jvp) -> tf.Tensor:
    """`[B, N]` sums over directions, unit by unit (no `[B, k, N]` concat)."""
    return tf.concat([tf.reduce_sum(tf.square(t), axis=1) for t in jvp.neurons], axis=-1)


@dataclasses.dataclass(frozen=True, eq=False)
class ExactAxes(Record):
    """Every input axis, one-hot and shared by the batch (Eq. 9, exact).

    Attributes:
        example_shape: `[rank]` int32 per-example input shape.
        total: D, the number of axes (an int, or a tensor for dynamic shapes).
    """

    example_shape: tf.Tensor
    total: int | tf.Tensor

    shared = True

    def scale(self, dtype):
        """The factor of the sum of squares (None: exact, no scaling)."""
        return None

    def sum_squares(self, lin, trace, start, k):
        return lin.axes_tangent(trace, start, k, self.example_shape,
                                reduce=_sum_squares_over_directions, per_neuron=True)


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

    def scale(self, dtype):
        """`per_group / samples`: D / k, or (D / C) / k per channel."""
        return tf.cast(self.per_group, dtype) / tf.cast(self.samples, dtype)

    def sum_squares(self, lin, trace, start, k):
        total = self.total
        if isinstance(start, int) and start == 0 and isinstance(k, int) and k == total:
            chunk = self.axes  # a single chunk: every sampled axis
        else:
            cols = tf.range(start, start + k)
            chunk = tf.gather(self.axes, tf.minimum(cols, total - 1), axis=-1)
            chunk = tf.where(cols < total, chunk, -1)  # one_hot(-1) = 0
        depth = tf.reduce_prod(self.example_shape) if tf.is_tensor(self.depth) else self.depth
        v = tf.one_hot(chunk, depth, dtype=self.dtype)
        v = tf.reshape(v, tf.concat([self.lead, [k], self.example_shape], 0))
        jvp = lin.tangent_from_trace(trace, v, self.shared, concat=False, axes=chunk)
        return sum_squares_per_unit(jvp)


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
    """

    seed: tf.Tensor
    batch: tf.Tensor
    example_shape: tf.Tensor
    samples: int
    kind: str
    dtype: str

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
        live = tf.cast(tf.range(start, start + k) < self.samples, dtype)
        v = v * live[None, :, None]
        v = tf.reshape(v, tf.concat([tf.stack([self.batch, k]), self.example_shape], 0))
        return sum_squares_per_unit(lin.tangent_from_trace(trace, v, False, concat=False))


def estimator_for(lin, x, config: RollConfig, seed) -> ExactAxes | SampledAxes | RandomProbes:
    """The estimator `config` asks for on the batch `x` (checked, in the twin's dtype).

    Args:
        lin: the `Linearized` model.
        x: `[B, *input_shape]` inputs.
        config: the ROLL hyperparameters (`samples`, `strata`, `estimator`,
            `share_axes`).
        seed: None, an int or a `[2]` int tensor (see `seed_tensor`).
    """
    dtype = lin.dtype
    static = x.shape[1:]
    if static.is_fully_defined():
        dims = static.as_list()
        example_shape = tf.constant(dims, tf.int32)
        d, channels = int(np.prod(dims)), dims[-1]
    else:
        example_shape = tf.shape(x)[1:]
        d, channels = tf.reduce_prod(example_shape), example_shape[-1]
    samples = config.samples
    if samples is None:  # exact: every input axis, shared one-hot directions
        return ExactAxes(example_shape, d)
    batch = tf.shape(x)[0]
    seed_t = seed_tensor(seed)
    if config.estimator != "axes":
        return RandomProbes(seed_t, batch, example_shape, samples, config.estimator, dtype)
    # One set of axes per example ([B, ...]) or, with share_axes, for the batch.
    share = config.share_axes
    lead = tf.zeros([0], tf.int32) if share else tf.reshape(batch, [1])
    if config.strata == "channel":
        per_group = d // channels
        u = tf.random.stateless_uniform(
            tf.concat([lead, tf.stack([channels, per_group])], 0), seed_t)
        pos = tf.math.top_k(u, k=samples).indices  # [(B,) C, k] distinct per channel
        idx = pos * channels + tf.reshape(tf.range(channels), [channels, 1])
        total = samples * channels
    else:
        per_group = d
        u = tf.random.stateless_uniform(tf.concat([lead, tf.reshape(d, [1])], 0), seed_t)
        idx = tf.math.top_k(u, k=samples).indices  # k distinct axes
        total = samples
    idx = tf.stop_gradient(tf.reshape(idx, tf.concat([lead, [-1]], 0)))
    return SampledAxes(idx, lead, example_shape, d, total, samples, per_group, share, dtype)
