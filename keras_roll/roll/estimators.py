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
chunked ROLL loss (`keras_roll.roll.loss`) passes it through its custom gradient
explicitly and rebuilds it there (nothing is captured from outside). Each one
computes, for directions `start .. start + k - 1` (zero past the last one),
the `[B, N]` sum over those directions of every neuron's squared derivative.

**Where the directions live** (`wrt=`, `tangent_entry`): by default they are
axes of the model input. With `wrt="<layer>"`, a leading elementwise affine
layer (Rescaling, Normalization, per-channel too), they are axes of that
layer's output: the tangent pass enters the program right after it, so the
loss equals the loss of the model without that layer fed the layer's outputs
(the paper's normalised units).

**Padded steps** (`padding_mask`): with a leading Masking layer, the padded
steps of an example have zero gradient by construction. `SampledAxes` then
draws the `k` axes of each example uniformly among its valid steps x channels
(per channel among valid steps with `strata="channel"`) and scales by
`D_valid / min(k, D_valid)` per example, which keeps the estimate unbiased.

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

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.records import Record
from keras_roll.compile.rules.recurrent import MaskingOp
from keras_roll.roll.config import RollConfig

__all__ = [
    "AFFINE_ENTRY_LAYERS",
    "ExactAxes",
    "RandomProbes",
    "SampledAxes",
    "check_tangent_dtype",
    "estimator_for",
    "mix_replica",
    "padding_mask",
    "seed_tensor",
    "sum_squares_per_unit",
    "tangent_entry",
]

AFFINE_ENTRY_LAYERS = (keras.layers.Rescaling, keras.layers.Normalization)


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


# --------------------------------------------------------------------------- where directions live


def _readers(program, key) -> list[int]:
    return [i for i, step in enumerate(program.steps) if key in step.inputs]


def _entry_key(program, entry: int):
    return program.input_key if entry == 0 else program.steps[entry - 1].output


def _broadcasts_elementwise(value, example_shape) -> bool:
    """Whether an array `value` broadcasts against `[B, *example_shape]` elementwise."""
    shape = np.shape(value)
    full = (None, *example_shape)
    if len(shape) > len(full):
        return False
    for dim, want in zip(shape[::-1], full[::-1]):
        if dim != 1 and (want is None or dim != want):
            return False
    return True


def _affine_problem(step, example_shape) -> str | None:
    """Why `step` is not an elementwise affine map of its input (None if it is)."""
    layer = step.layer
    if not isinstance(layer, AFFINE_ENTRY_LAYERS):
        return (f"a {type(layer).__name__}, not an elementwise affine layer (Rescaling or "
                f"Normalization)")
    if isinstance(layer, keras.layers.Rescaling):
        for attr in ("scale", "offset"):
            value = getattr(layer, attr)
            if not _broadcasts_elementwise(value, example_shape):
                return (f"a Rescaling whose {attr} of shape {np.shape(value)} does not "
                        f"broadcast elementwise against inputs of shape {example_shape}")
    return None


def _leading_chain(program) -> list[tuple[str, int]]:
    """`(name, index)` of the leading elementwise affine steps, in order.

    Step `i` belongs to the chain when it reads only the output of step
    `i - 1` (the model input for the first one), nothing else reads that
    value, and it is a Rescaling or Normalization that acts elementwise.
    """
    chain = []
    key = program.input_key
    for i, step in enumerate(program.steps):
        if step.inputs != [key] or _readers(program, key) != [i]:
            break
        if _affine_problem(step, program.input_shape) is not None:
            break
        chain.append((step.name, i))
        key = step.output
    return chain


def tangent_entry(program, wrt: str | None) -> int:
    """The program step ROLL's tangents enter at for `wrt=` (0: the model input).

    Args:
        program: the model's `keras_roll.compile.graph.Program` (`lin.program`).
        wrt: None, or the name of a leading elementwise affine layer
            (Rescaling / Normalization, scalar or per-channel), possibly after
            other such layers: its step name, or its layer name when that is
            unique.

    Returns:
        The index of the first step after the `wrt` layer (0 for `wrt=None`).

    Raises:
        ValueError: no such layer, a layer that is not elementwise affine, or
            one that does not lead the model (the message lists the valid names).

    Example:

    ```python
    lin = keras_roll.linearize(keras_roll.models.fc())
    tangent_entry(lin.program, "normalize")     # 1: tangents enter at dense_1
    ```
    """
    if wrt is None:
        return 0
    chain = _leading_chain(program)
    valid = [name for name, _ in chain]
    for name, index in chain:
        if name == wrt or (name.split("/")[-1] == wrt
                           and sum(s.layer.name == wrt for s in program.steps) == 1):
            return index + 1
    hint = (f"valid names for this model: {valid}" if valid else
            "this model has none: put a keras.layers.Rescaling or Normalization right after "
            "its Input")
    matches = [s for s in program.steps if s.name == wrt or getattr(s.layer, "name", None) == wrt]
    if not matches:
        names = [s.name for s in program.steps]
        raise ValueError(f"wrt={wrt!r}: the model has no layer of that name (its layers: "
                         f"{names}); wrt names a leading Rescaling / Normalization layer, "
                         f"{hint}.")
    problem = _affine_problem(matches[0], program.input_shape)
    if problem is not None:
        raise ValueError(f"wrt={wrt!r} names {problem}; ROLL's gradients can be taken with "
                         f"respect to the output of a leading elementwise affine layer only, "
                         f"{hint}.")
    raise ValueError(f"wrt={wrt!r} names a {type(matches[0].layer).__name__} that does not lead "
                     f"the model: it must read the model input (possibly after other "
                     f"Rescaling / Normalization layers) and be the only layer that reads it, "
                     f"so that the model is a function of its output; {hint}.")


def padding_mask(program, trace, entry: int = 0):
    """`[B, P]` bool: the unpadded positions (all axes but the channels) of each
    example, when a leading Masking layer reads the tangents' entry, else None.

    The Masking op multiplies the tangents by its `keep` record, so along a
    padded position every neuron has derivative zero. Only a Masking layer
    that is the single reader of the entry value qualifies (otherwise another
    path could give padded steps a gradient).

    Example:

    ```python
    keep = padding_mask(lin.program, lin.primal(x).trace)   # [B, T] for [B, T, C] inputs
    ```
    """
    readers = _readers(program, _entry_key(program, entry))
    if len(readers) != 1:
        return None
    step = program.steps[readers[0]]
    if len(step.ops) != 1 or not isinstance(step.ops[0], MaskingOp):
        return None
    keep = trace.steps[readers[0]].ops[0].keep  # [B, *shape[:-1], 1]
    batch = tf.shape(keep)[0]
    return tf.reshape(keep > 0, tf.stack([batch, -1]))


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


def check_tangent_dtype(tangent_dtype, twin_dtype: str) -> str | None:
    """`tangent_dtype` standardized: None (the twin's dtype) or a float dtype name.

    Example:

    ```python
    check_tangent_dtype("bfloat16", "float32")   # "bfloat16"
    check_tangent_dtype("float32", "float32")    # None: the twin's own dtype
    ```
    """
    if tangent_dtype is None:
        return None
    try:
        name = keras.backend.standardize_dtype(tangent_dtype)
    except (TypeError, ValueError):
        name = None
    if name not in ("float16", "bfloat16", "float32", "float64"):
        raise ValueError(f"tangent_dtype must be None (the twin's dtype), 'float16' or "
                         f"'bfloat16' (16-bit ROLL tangents, e.g. under mixed precision), "
                         f"'float32' or 'float64'; got tangent_dtype={tangent_dtype!r}.")
    return None if name == twin_dtype else name


@dataclasses.dataclass(frozen=True, eq=False)
class ExactAxes(Record):
    """Every input axis, one-hot and shared by the batch (Eq. 9, exact).

    Attributes:
        example_shape: `[rank]` int32 per-example input shape.
        total: D, the number of axes (an int, or a tensor for dynamic shapes).
        entry: the program step the tangents enter at (`tangent_entry`).
        tangent_dtype: None, or the dtype of the tangent pass (see `SampledAxes`).
        dtype: the twin's dtype (squares are summed in it).
    """

    example_shape: tf.Tensor
    total: int | tf.Tensor
    entry: int = 0
    tangent_dtype: str | None = None
    dtype: str | None = None

    shared = True

    def scale(self, dtype):
        """The factor of the sum of squares (None: exact, no scaling)."""
        return None

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


def estimator_for(lin, x, config: RollConfig, seed, trace=None,
                  tangent_dtype: str | None = None) -> ExactAxes | SampledAxes | RandomProbes:
    """The estimator `config` asks for on the batch `x` (checked, in the twin's dtype).

    Args:
        lin: the `Linearized` model.
        x: `[B, *input_shape]` inputs.
        config: the ROLL hyperparameters (`samples`, `strata`, `estimator`,
            `share_axes`, `wrt`).
        seed: None, an int or a `[2]` int tensor (see `seed_tensor`).
        trace: the `Trace` of `x`'s forward pass: with it, sampled axes (not
            shared) avoid the padded steps of a leading Masking layer
            (`padding_mask`).
        tangent_dtype: None (the twin's dtype) or the dtype of the tangent
            pass, e.g. "float16" under mixed precision (`check_tangent_dtype`).

    Example:

    ```python
    est = estimator_for(lin, x, RollConfig(samples=3), seed=0, trace=fwd.trace)
    ```
    """
    dtype = lin.dtype
    tdtype = check_tangent_dtype(tangent_dtype, dtype)
    entry = tangent_entry(lin.program, config.wrt)
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
        return ExactAxes(example_shape, d, entry, tdtype, dtype)
    batch = tf.shape(x)[0]
    seed_t = seed_tensor(seed)
    if config.estimator != "axes":
        return RandomProbes(seed_t, batch, example_shape, samples, config.estimator, dtype,
                            entry, tdtype)
    # One set of axes per example ([B, ...]) or, with share_axes, for the batch.
    share = config.share_axes
    keep = None if share or trace is None else padding_mask(lin.program, trace, entry)
    lead = tf.zeros([0], tf.int32) if share else tf.reshape(batch, [1])
    counts = None
    if config.strata == "channel":
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


# Any of the three estimators (a `Record` of tensors; see `estimator_for`).
Estimator = ExactAxes | SampledAxes | RandomProbes
