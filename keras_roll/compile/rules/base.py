"""The op interface that every rule compiles a layer into.

A Keras layer call becomes one or more *ops*. Each op knows how to

* run forward on a batch of inputs, returning its output and a *record* (the
  frozen activation pattern: masks, argmax choices, pre-activations);
* push a batch of *tangents* (directional derivatives of its inputs) through
  the same function with the pattern frozen: the bias-free, masked twin of the
  op (docs/design.md, section "The frozen-pattern twin");
* describe the *neurons* it owns: the hyperplanes that bound the input's linear
  region, each a value `z` with the distance `below = z - lo` and
  `above = hi - z` to the breakpoints around it (Lee et al., ICLR 2019, Prop. 6);
* bound its floating-point rounding: `magnitude` maps componentwise bounds on
  the absolute values of its inputs to a bound on its output (`|A| m + |b|`
  for an affine op), and `roundings` says how many roundings each output
  element takes (its fan-in and a few more), so that `keras_roll.rounding.worst_case` can
  bound how far the model's own evaluation strays from exact arithmetic
  (docs/design.md, section "The rounding bound").

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


def merge_batch(t: tf.Tensor) -> tf.Tensor:
    """`[B, K, *shape]` -> `[B * K, *shape]`."""
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([[shape[0] * shape[1]], shape[2:]], axis=0))


def split_batch(t: tf.Tensor, batch_size) -> tf.Tensor:
    """`[B * K, *shape]` -> `[B, K, *shape]`."""
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([[batch_size, -1], shape[1:]], axis=0))


def flatten_directions(t: tf.Tensor) -> tf.Tensor:
    """`[B, K, *shape]` -> `[B, K, prod(shape)]` (well defined for an empty batch)."""
    shape = tf.shape(t)
    return tf.reshape(t, tf.stack([shape[0], shape[1], tf.reduce_prod(shape[2:])]))


def flatten_examples(t: tf.Tensor) -> tf.Tensor:
    """`[B, *shape]` -> `[B, prod(shape)]` (well defined for an empty batch)."""
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
    """

    needs_mask = False
    owns_neurons = False

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

    # ------------------------------------------------------------ rounding bound

    #: whether the op is a matrix product or a convolution (TensorFloat-32 on GPUs
    #: rounds its operands to 10-bit mantissas; see `keras_roll.rounding.worst_case`).
    matmul_like = False

    def magnitude(self, bounds: list[tf.Tensor], record: Record, affine: bool,
                  mask=None) -> tf.Tensor:
        """A componentwise bound on `|output|` from bounds on `|inputs|`.

        Args:
            bounds: one `[B, *shape]` nonnegative tensor per input, `m >= |input|`.
            record: the op's record from the forward pass.
            affine: True for the op itself (`|A| m + |b|`); False for its linear
                part alone (`|A| m`), which bounds how differences propagate.
            mask: the Keras mask of the step's input (as `tangent` gets it).

        Must be monotone in `bounds` and satisfy, for the affine map `f` of
        the op (with the pattern of `record`), `|f(x)| <= magnitude(|x|)` and
        `|f(x) - f(y)| <= magnitude(|x - y|, affine=False)`.
        """
        raise NotImplementedError(
            f"The op {type(self).__name__} of layer '{self.name}' has no rounding bound "
            f"(`magnitude` / `roundings`), which rigor='float64' needs. Implement them on "
            f"the op (docs/design.md, section 'The rounding bound') or pass rigor='float32'."
        )

    def roundings(self, inputs: list[tf.Tensor]) -> int:
        """Roundings per output element when the model evaluates the op.

        The computed output `y^` of exact inputs satisfies
        `|y^ - y| <= gamma_n * magnitude(|inputs|)` with `n` the value returned
        and `gamma_n = n u / (1 - n u)` (u: the unit roundoff of the layer's
        compute dtype); e.g. the fan-in plus one for a dense layer. Shapes are
        static here.
        """
        raise NotImplementedError(
            f"The op {type(self).__name__} of layer '{self.name}' has no rounding bound; "
            f"implement `magnitude` and `roundings` or pass rigor='float32'."
        )

    def neuron_magnitude(self, bounds: list[tf.Tensor], record: Record, affine: bool,
                         mask=None) -> tf.Tensor:
        """`[B, n]` bounds on `|z_j|` of the op's neurons from bounds on `|inputs|`.

        The default fits ops whose neurons are their input (activations).
        """
        return flatten_examples(bounds[0])

    def magnitudes(self, bounds: list[tf.Tensor], record: Record, affine: bool, mask=None):
        """`(output bound, [B, n] neuron bound or None)`; see `magnitude`."""
        out = self.magnitude(bounds, record, affine, mask)
        neurons = (self.neuron_magnitude(bounds, record, affine, mask)
                   if self.owns_neurons else None)
        return out, neurons

    def absolute_growth(self, errors: list[tf.Tensor], record: Record, mask, eta: float):
        """How absolute errors (underflow: subnormals, flush-to-zero) grow through the op.

        Args:
            errors: one `[B, *shape]` bound per input on its absolute error.
            record, mask: as for `magnitude`.
            eta: the absolute error of one rounding near zero in the op's dtype
                (`keras_roll.rounding.worst_case.underflow_unit`).

        Returns:
            `(output bound, [B, n] neuron bound or None)`: by default
            `|A| (errors + eta) + n eta` (inputs may be flushed to zero, each of
            the `n` roundings may underflow) and the neurons' share of `errors`.
        """
        n = self.roundings(errors)
        out, _ = self.magnitudes([e + eta for e in errors], record, False, mask)
        neurons = (self.neuron_magnitude(errors, record, False, mask)
                   if self.owns_neurons else None)
        return out + n * eta, neurons

    def rounding_growth(self, g_in, gamma, inputs: list[tf.Tensor]):
        """How the relative error bound `g` grows through the op.

        Args:
            g_in: the relative error bound of the inputs (`|error| <= g m`).
            gamma: `gamma(n, matmul_like)`, the relative error of `n` roundings
                in the op's evaluation precision.
            inputs: the op's inputs (static shapes).

        Returns:
            `(g_out, g_neurons)`: the bound of the output and of the neurons
            (a scalar, or a tensor broadcastable to `[B, n]`); errors compose
            as `(1 + g_in)(1 + gamma) - 1` (docs/design.md, "The rounding bound").
        """
        g = gamma(self.roundings(inputs), self.matmul_like)
        return (1.0 + g_in) * (1.0 + g) - 1.0, g_in


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

    Example:

    ```python
    @keras_roll.register_rule(MyScale)
    def _scale_rule(layer):
        return keras_roll.compile.rules.Linear(layer, lambda xs: xs[0] * layer.factor)
    ```
    """

    def __init__(self, layer, linear, forward=None, name=None, rows=None,
                 training_dependent=False, magnitude=None, roundings=None,
                 matmul_like=False, one_hot=None, scaled=None, channel_scale=None):
        super().__init__(layer, name, training_dependent=training_dependent)
        self._linear = linear
        self._forward = forward
        self._rows = rows
        self._one_hot = one_hot
        self._scaled = scaled
        self._channel_scale = channel_scale
        self._magnitude = magnitude
        self._roundings = roundings
        self.matmul_like = bool(matmul_like)

    def magnitude(self, bounds, record, affine, mask=None):
        if self._magnitude is not None:
            return self._magnitude(bounds, affine)
        return dense_abs_magnitude(self, bounds, affine)

    def roundings(self, inputs):
        if self._roundings is not None:
            return int(self._roundings(inputs))
        return dense_abs_roundings(self, inputs)

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


# --------------------------------------------------------------------------- generic bounds

MAX_DENSE_ABS = 2**24  # entries of the dense |A| the generic bound may build


def _dense_abs(op, inputs: list[tf.Tensor]) -> tf.Tensor:
    """`[D_in, D_out]` |A| of a linear op, from the op's linear part on unit vectors.

    The generic rounding bound of ops that say nothing about their coefficients
    (a user's `Linear` rule without `magnitude=`): exact, but it costs one
    evaluation per input element, so it is refused above `MAX_DENSE_ABS` entries.
    """
    shapes = [tuple(int(d) for d in x.shape[1:]) for x in inputs]
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    d_in = sum(sizes)
    if not all(d is not None for s in shapes for d in s):
        raise ValueError(f"Layer '{op.name}': the generic rounding bound needs static "
                         f"shapes, got {shapes}; pass magnitude= to its rule or "
                         f"rigor='float32'.")
    dtype = inputs[0].dtype
    eye = tf.eye(d_in, dtype=dtype)
    parts, start = [], 0
    for shape, size in zip(shapes, sizes):
        parts.append(tf.reshape(eye[:, start:start + size], (d_in, *shape)))
        start += size
    cols = op.tangent([Tangent(p, shared=True) for p in parts], NO_RECORD, None)[0].value
    cols = tf.reshape(cols, (d_in, -1))
    if d_in * int(cols.shape[-1]) > MAX_DENSE_ABS:
        raise ValueError(
            f"Layer '{op.name}' ({type(op.layer).__name__}): its rule gives no rounding "
            f"bound, and the generic one would build a dense [{d_in}, {cols.shape[-1]}] "
            f"matrix. Pass magnitude= and roundings= to its rule (docs/design.md, section "
            f"'The rounding bound') or use rigor='float32'.")
    return tf.abs(cols)


def dense_abs_magnitude(op, bounds: list[tf.Tensor], affine: bool) -> tf.Tensor:
    """`|A| m (+ |b|)` for any linear op through its dense `|A|` (see `_dense_abs`)."""
    absa = _dense_abs(op, bounds)
    flat = tf.concat([flatten_examples(m) for m in bounds], axis=1)
    out = tf.matmul(flat, absa)
    ref = op.forward([m[:1] for m in bounds], None)[0]
    if affine and isinstance(op, Linear):
        out += tf.reshape(tf.abs(op.bias(bounds)), (1, -1))
    return tf.reshape(out, tf.concat([tf.shape(bounds[0])[:1], tf.shape(ref)[1:]], 0))


def dense_abs_roundings(op, inputs: list[tf.Tensor]) -> int:
    """Fan-in of the widest output of a linear op (nonzeros of its `|A|` column), plus 2."""
    absa = _dense_abs(op, inputs)
    fan_in = tf.get_static_value(tf.reduce_max(tf.reduce_sum(tf.cast(absa > 0, tf.int32), 0)))
    if fan_in is None:  # inside a graph: every input element may contribute
        fan_in = int(absa.shape[0])
    return int(fan_in) + 2

