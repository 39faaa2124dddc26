"""The op interface that every rule compiles a layer into.

A Keras layer call becomes one or more *ops*. Each op knows how to

* run forward on a batch of inputs, returning its output and a *record* (the
  frozen activation pattern: masks, argmax choices, pre-activations);
* push a batch of *tangents* (directional derivatives of its inputs) through
  the same function with the pattern frozen: the bias-free, masked twin of the
  op (docs/design.md, section "The frozen-pattern twin");
* describe the *neurons* it owns: the hyperplanes that bound the input's linear
  region, each a value `z` with the distance `below = z - lo` and
  `above = hi - z` to the breakpoints around it (Lee et al., ICLR 2019, Prop. 6).

How an op rounds in floating point is not the op's business: the rounding
analyses of `keras_roll.rounding` keep their per-op rules in tables keyed by
op type (`keras_roll.rounding.rules`), and derive a default rule for any other
op from its linear map (docs/design.md, section "The rounding bound").

Records are small typed dataclasses (`keras_roll.compile.records.Record`), so that the
trace of a forward pass passes through `tf.function`, `tf.nest` and custom
gradients; ops without a pattern record `NO_RECORD`.

Tangents are `[B, K, *shape]` tensors (K directions per example) or, before the
first activation pattern is applied, *shared* `[K, *shape]` tensors that are the
same for every example; linear ops then run once for the whole batch.

See docs/design.md, sections "The frozen-pattern twin" and "Rules".
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.keras_internals import call_layer
from keras_roll.compile.records import Record


@dataclasses.dataclass(frozen=True)
class Tangent:
    """Directional derivatives of one tensor.

    Attributes:
        value: `[B, K, *shape]`, or `[K, *shape]` when `shared` is True.
        shared: whether the same tangents hold for every example of the batch.
        axes: for one-hot directions, their input axes (`[B, K]` or `[K]` int32
            indices into the flattened example, -1 for a zero direction), so that
            a first affine layer can gather weight rows instead of multiplying by
            one-hot vectors. `value` holds the same directions densely.
    """

    value: tf.Tensor
    shared: bool = False
    axes: Any = None

    def per_example(self, batch_size) -> tf.Tensor:
        """Returns the `[B, K, *shape]` tensor, broadcasting a shared one."""
        if not self.shared:
            return self.value
        shape = tf.concat([[batch_size], tf.shape(self.value)], axis=0)
        return tf.broadcast_to(self.value[None], shape)

    def masked(self, mask: tf.Tensor) -> Tangent:
        """Multiplies by a per-example `[B, *shape]` mask (frozen slopes)."""
        if self.shared:
            return Tangent(self.value[None] * mask[:, None], shared=False)
        return Tangent(self.value * mask[:, None], shared=False)


def static_dims(t: tf.Tensor, start: int):
    """The static sizes of axes `start ..` of `t` as ints, or None if one is unknown.

    Reshapes built from them need no shape arithmetic in the graph (or eagerly)."""
    dims = t.shape[start:]
    return dims.as_list() if dims.is_fully_defined() else None


def _flat(t: tf.Tensor, lead: int):
    """`t` reshaped to its first `lead` axes and the product of the others, from static
    sizes (at most one unknown leading axis, and no empty trailing axis), else None."""
    rest = static_dims(t, lead)
    if rest is None:
        return None
    n = int(np.prod(rest))
    head = [-1 if d is None else d for d in t.shape[:lead].as_list()]
    if head.count(-1) > 1 or (n == 0 and -1 in head):
        return None
    return tf.reshape(t, [*head, n])


def merge_batch(t: tf.Tensor) -> tf.Tensor:
    """`[B, K, *shape]` -> `[B * K, *shape]`."""
    rest = static_dims(t, 2)
    if rest is not None and int(np.prod(rest)) > 0:
        b, k = t.shape[:2].as_list()
        return tf.reshape(t, [b * k if b is not None and k is not None else -1, *rest])
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([[shape[0] * shape[1]], shape[2:]], axis=0))


def split_batch(t: tf.Tensor, batch_size) -> tf.Tensor:
    """`[B * K, *shape]` -> `[B, K, *shape]`."""
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([[batch_size, -1], shape[1:]], axis=0))


def flatten_directions(t: tf.Tensor) -> tf.Tensor:
    """`[B, K, *shape]` -> `[B, K, prod(shape)]` (well defined for an empty batch)."""
    flat = _flat(t, 2)
    if flat is not None:
        return flat
    shape = tf.shape(t)
    return tf.reshape(t, tf.stack([shape[0], shape[1], tf.reduce_prod(shape[2:])]))


def flatten_examples(t: tf.Tensor) -> tf.Tensor:
    """`[B, *shape]` -> `[B, prod(shape)]` (well defined for an empty batch)."""
    flat = _flat(t, 1)
    if flat is not None:
        return flat
    shape = tf.shape(t)
    return tf.reshape(t, tf.stack([shape[0], tf.reduce_prod(shape[1:])]))


def apply_linear(fn, tangents: list[Tangent]) -> Tangent:
    """Applies a linear, example-independent map to tangents.

    `fn` takes a list of `[N, *shape]` tensors (one per input, same N) and
    returns one `[N, *out_shape]` tensor. Shared tangents stay shared when all
    inputs are shared; otherwise every input is brought to `[B, K, ...]`.
    """
    if all(t.shared for t in tangents):
        return Tangent(fn([t.value for t in tangents]), shared=True)
    ref = next(t.value for t in tangents if not t.shared)
    batch = tf.shape(ref)[0]
    merged = [merge_batch(t.per_example(batch)) for t in tangents]
    return Tangent(split_batch(fn(merged), batch), shared=False)


class Neurons(NamedTuple):
    """The hyperplanes an op contributes, flattened per example.

    Attributes:
        z: `[B, n]` values (pre-activations, or max-unit differences).
        below: `[B, n]` distance `z - lo` to the breakpoint below (may be inf).
        above: `[B, n]` distance `hi - z` to the breakpoint above (may be inf).
        valid: `[B, n]` bool; False for neurons that do not exist for this
            example (padded time steps, the winner of a max window).
        piece: `[B, n]` int32, the linear piece each neuron is on (its pattern).
    """

    z: tf.Tensor
    below: tf.Tensor
    above: tf.Tensor
    valid: tf.Tensor
    piece: tf.Tensor


class Local(NamedTuple):
    """How an op's output positions read its input's, on channels-last images: output
    position `p` (per spatial axis) reads the input positions `p * stride - before`
    to `p * stride - before + span - 1` only; positions outside the input are zeros
    (padding). An op declares it with `Op.local`; CROWN's layer bounds then pull a
    unit's rows back through its receptive field alone
    (`keras_roll.compile.bounds.windows`).

    Attributes:
        span: per spatial axis, the input positions one output position reads.
        strides: per spatial axis, the input step between output positions.
        before: per spatial axis, the zero padding before the input.
        window_map: `fn([N, *window, C] tensors) -> [N, *out, C']`, the op's linear
            part on windows of its inputs that already hold their padding ("valid"
            on the window), or None for an op whose own `tangent` applies to any
            window (elementwise, per channel).

    Example:

    ```python
    Local((3, 3), (2, 2), (1, 1), lambda xs: tf.nn.conv2d(xs[0], k, 2, "VALID"))
    ```
    """

    span: tuple
    strides: tuple
    before: tuple
    window_map: Any = None


def elementwise(shape) -> Local:
    """The `Local` of an op that maps every position to itself (per channel) on inputs
    of per-example shape `shape` (`[*spatial, C]`).

    Example:

    ```python
    elementwise((8, 8, 16)).span        # (1, 1)
    ```
    """
    rank = len(shape) - 1
    return Local((1,) * rank, (1,) * rank, (0,) * rank)


@dataclasses.dataclass(frozen=True, eq=False)
class NoRecord(Record):
    """The record of an op without an activation pattern (it records nothing)."""


NO_RECORD = NoRecord()


class Op:
    """Base class of the ops a rule compiles a layer into.

    Subclasses override `forward` and `tangent`; ops that own neurons set
    `owns_neurons = True` and override `neurons` and `neuron_shape` (checked
    when the subclass is defined).

    Attributes:
        layer: the Keras layer (or operation) the op came from.
        name: the name under which its neurons are reported.
        owns_neurons: whether the op contributes neurons (hyperplanes of the
            linear region): activations, max units, recurrent layers.
        training_dependent: whether the layer computes something else in
            training mode (BatchNormalization, dropout and noise layers); the
            twin always linearizes the inference-mode function.
        affine: whether the op is an affine map of its inputs everywhere, with
            no pattern (`Linear`, reshapes, the identity): a straight path stays
            straight through it (`keras_roll.compile.prefix`).
    """

    needs_mask = False
    owns_neurons = False
    affine = False

    def __init__(self, layer, name: str | None = None, training_dependent: bool = False):
        self.layer = layer
        self.name = name or getattr(layer, "name", type(layer).__name__)
        self.training_dependent = bool(training_dependent)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        overrides = cls.neurons is not Op.neurons
        if overrides != bool(cls.owns_neurons):
            raise TypeError(
                f"Op subclass {cls.__name__} {'overrides' if overrides else 'does not override'}"
                f" `neurons` but has owns_neurons={cls.owns_neurons}; an op that owns "
                f"neurons sets `owns_neurons = True` and implements `neurons` and "
                f"`neuron_shape`, other ops do neither."
            )

    def forward(self, inputs: list[tf.Tensor], mask) -> tuple[tf.Tensor, Record]:
        """Returns the op's output and its record (`NO_RECORD` without a pattern)."""
        raise NotImplementedError

    def tangent(self, tangents: list[Tangent], record: Record, mask) -> tuple[Tangent, Any]:
        """Returns the output tangent and the `[B, K, n]` neuron tangents (or None)."""
        raise NotImplementedError

    def neurons(self, record: Record) -> Neurons | None:
        """Returns the neurons this op owns for the recorded batch, or None."""
        return None

    def neuron_shape(self, record: Record) -> tuple[int, ...] | None:
        """Per-example shape of the neuron tensor, from a record with static shapes."""
        return None

    def local(self, shape) -> Local | None:
        """How the op's output positions read its inputs' (`Local`), for channels-last
        inputs of per-example shape `shape` (`[*spatial, C]`, static), or None where
        an output position may read any input position (the default)."""
        return None


class WeightedSum(NamedTuple):
    """An affine op written as sums of products with its weights.

    The op computes `apply(x, weights()) + bias(y)` (`bias` shaped and cast
    like the output `y`); `apply` is linear in `x` and in each weight, so
    `apply(|x|, [|w| for w in weights()])` is `|A| |x|`. Rounding analyses use
    it (`keras_roll.rounding.rules`).

    Attributes:
        apply: `fn(x, kernels) -> y`, the linear part with the given kernels.
        weights: `fn() -> list` of the kernels (variables or tensors).
        bias: `fn(like) -> tensor` broadcastable to `like` in its dtype, or None.

    Example:

    ```python
    WeightedSum(lambda x, ks: x @ ks[0], lambda: [layer.kernel], lambda y: layer.bias)
    ```
    """

    apply: Any
    weights: Any
    bias: Any = None


class Linear(Op):
    """A linear op without pattern: `y = A x + b`.

    Args:
        layer: the Keras layer.
        linear: `fn(list_of_tensors) -> tensor`, the linear part `A` applied to a
            batch (no bias).
        forward: `fn(list_of_tensors, mask) -> tensor`, the affine map; defaults
            to calling the layer in inference mode.
        rows: `fn(idx) -> rows`, for a layer on flat inputs (Dense): the rows of
            `A` of the input axes `idx`, gathered for one-hot directions.
        one_hot: `fn(tangent, scale) -> tensor or None`: the linear part applied
            to the one-hot directions of a `Tangent` with `axes` (e.g. a
            convolution's kernel taps, gathered and placed), times `scale` (None
            or a per-output-channel vector, see `scaled`), or None where it does
            not apply; must equal `linear` on `tangent.value`.
        scaled: `fn(list_of_tensors, scale) -> tensor`: the linear part followed
            by a per-output-channel (last axis) `scale`, computed by scaling the
            kernel, or None. With it, a BatchNormalization that alone reads the
            op's output folds into it in tangent passes (`tangent_scaled`).
        channel_scale: `fn(dtype, rank) -> [C] tensor or None`: for a per-channel
            scale of the last axis of `[N, ...]` inputs of rank `rank`
            (BatchNormalization in inference), the scale, so that the op can be
            folded into the op before it.
        weighted_sum: a `WeightedSum` when the op is sums of products with its
            weights (Dense, convolutions), so that analyses can apply the same
            sums to other weights (their absolute values, for rounding bounds).
        local: `fn(shape) -> Local or None`, the op's locality on channels-last
            inputs of per-example shape `shape` (`Op.local`), or None (not local).

    Example:

    ```python
    @keras_roll.register_rule(MyScale)
    def _scale_rule(layer):
        return keras_roll.compile.rules.Linear(layer, lambda xs: xs[0] * layer.factor)
    ```
    """

    affine = True

    def __init__(self, layer, linear, forward=None, name=None, rows=None,
                 training_dependent=False, one_hot=None, scaled=None, channel_scale=None,
                 weighted_sum: WeightedSum | None = None, local=None):
        super().__init__(layer, name, training_dependent=training_dependent)
        self._local = local
        self._linear = linear
        self._forward = forward
        self._rows = rows
        self._one_hot = one_hot
        self._scaled = scaled
        self._channel_scale = channel_scale
        self.weighted_sum = weighted_sum

    def bias(self, inputs: list[tf.Tensor]) -> tf.Tensor:
        """The op's value at zero (its bias), batch 1."""
        zeros = [tf.zeros(tf.concat([[1], tf.shape(x)[1:]], 0), x.dtype) for x in inputs]
        return self.forward(zeros, None)[0]

    def forward(self, inputs, mask):
        if self._forward is not None:
            return self._forward(inputs, mask), NO_RECORD
        return call_layer(self.layer, inputs, mask), NO_RECORD

    def tangent(self, tangents, record, mask):
        return self._tangent(tangents, None), None

    def tangent_scaled(self, tangents, scale) -> Tangent | None:
        """The tangent of the op followed by a per-output-channel `scale` (a
        folded BatchNormalization), or None if the op cannot scale its kernel."""
        if self._scaled is None:
            return None
        return self._tangent(tangents, scale)

    def local(self, shape) -> Local | None:
        return None if self._local is None else self._local(tuple(shape))

    @property
    def can_scale(self) -> bool:
        """Whether `tangent_scaled` can fold a per-output-channel scale into the op."""
        return self._scaled is not None

    @property
    def scales_channels(self) -> bool:
        """Whether the op may be a per-channel scale (`channel_scale`)."""
        return self._channel_scale is not None

    def channel_scale(self, dtype, rank: int):
        """The `[C]` scale of a per-channel (last axis) scaling op on `[N, ...]` inputs
        of rank `rank`, else None."""
        return None if self._channel_scale is None else self._channel_scale(dtype, rank)

    def _tangent(self, tangents, scale) -> Tangent:
        t = tangents[0]
        if self._rows is not None and t.axes is not None and len(tangents) == 1 \
                and t.value.shape.rank == (2 if t.shared else 3):
            # One-hot directions into a layer on flat inputs: gather weight rows.
            idx = t.axes
            rows = tf.cast(self._rows(tf.maximum(idx, 0)), t.value.dtype)
            if scale is not None:
                rows *= scale
            live = tf.cast(idx >= 0, rows.dtype)[..., None]
            return Tangent(rows * live, shared=t.shared)
        if self._one_hot is not None and t.axes is not None and len(tangents) == 1:
            out = self._one_hot(t, scale)
            if out is not None:
                return Tangent(out, shared=t.shared)
        if scale is None:
            return apply_linear(self._linear, tangents)
        return apply_linear(lambda xs: self._scaled(xs, scale), tangents)
