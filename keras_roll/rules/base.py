"""The op interface that every rule compiles a layer into.

A Keras layer call becomes one or more *ops*. Each op knows how to

* run forward on a batch of inputs, returning its output and a *record* (the
  frozen activation pattern: masks, argmax choices, pre-activations);
* push a batch of *tangents* (directional derivatives of its inputs) through
  the same function with the pattern frozen: the bias-free, masked twin of the
  op (DESIGN.md section 3);
* describe the *neurons* it owns: the hyperplanes that bound the input's linear
  region, each a value `z` with the distance `below = z - lo` and
  `above = hi - z` to the breakpoints around it (Lee et al., ICLR 2019, Prop. 6).

Tangents are `[B, K, *shape]` tensors (K directions per example) or, before the
first activation pattern is applied, *shared* `[K, *shape]` tensors that are the
same for every example; linear ops then run once for the whole batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import keras
import tensorflow as tf


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


class Op:
    """Base class of the ops a rule compiles a layer into.

    Subclasses override `forward` and `tangent`; ops that own neurons also
    override `neurons` and `neuron_shape`.

    Attributes:
        layer: the Keras layer (or operation) the op came from.
        name: the name under which its neurons are reported.
    """

    needs_mask = False

    def __init__(self, layer, name: str | None = None):
        self.layer = layer
        self.name = name or getattr(layer, "name", type(layer).__name__)

    def forward(self, inputs: list[tf.Tensor], mask) -> tuple[tf.Tensor, dict[str, Any]]:
        """Returns the op's output and its record (a dict of tensors)."""
        raise NotImplementedError

    def tangent(self, tangents: list[Tangent], record: dict, mask) -> tuple[Tangent, Any]:
        """Returns the output tangent and the `[B, K, n]` neuron tangents (or None)."""
        raise NotImplementedError

    def neurons(self, record: dict) -> Neurons | None:
        """Returns the neurons this op owns for the recorded batch, or None."""
        return None

    def neuron_shape(self, record_shapes: dict) -> tuple[int, ...] | None:
        """Per-example shape of the neuron tensor, from the record, or None."""
        return None

    @property
    def owns_neurons(self) -> bool:
        return type(self).neurons is not Op.neurons


class Linear(Op):
    """A linear op without pattern: `y = A x + b`.

    Args:
        layer: the Keras layer.
        linear: `fn(list_of_tensors) -> tensor`, the linear part `A` applied to a
            batch (no bias).
        forward: `fn(list_of_tensors, mask) -> tensor`, the affine map; defaults
            to calling the layer in inference mode.

    Example:

    ```python
    @keras_roll.register_rule(MyScale)
    def _scale_rule(layer):
        return keras_roll.rules.Linear(layer, lambda xs: xs[0] * layer.factor)
    ```
    """

    def __init__(self, layer, linear, forward=None, name=None, rows=None):
        super().__init__(layer, name)
        self._linear = linear
        self._forward = forward
        self._rows = rows

    def forward(self, inputs, mask):
        if self._forward is not None:
            return self._forward(inputs, mask), {}
        return call_layer(self.layer, inputs, mask), {}

    def tangent(self, tangents, record, mask):
        t = tangents[0]
        if self._rows is not None and t.axes is not None and len(tangents) == 1 \
                and t.value.shape.rank == (2 if t.shared else 3):
            # One-hot directions into a layer on flat inputs: gather weight rows.
            idx = t.axes
            rows = self._rows(tf.maximum(idx, 0))
            live = tf.cast(idx >= 0, rows.dtype)[..., None]
            return Tangent(rows * live, shared=t.shared), None
        return apply_linear(self._linear, tangents), None


def call_layer(layer, inputs: list, mask=None):
    """Runs a layer's `call` (or a Keras operation) in inference mode.

    Layers get their inputs as one tensor (or a list for merge layers), `mask`
    if their `call` takes one and `training=False`; operations get `op(*inputs)`.
    `call` is used rather than `__call__`, so no autocasting happens: tangents
    keep the twin's dtype under mixed precision.
    """
    if not isinstance(layer, keras.layers.Layer):
        return layer(*inputs)
    kwargs = {}
    if getattr(layer, "_call_has_training_arg", False):
        kwargs["training"] = False
    if mask is not None and getattr(layer, "_call_has_mask_arg", False):
        kwargs["mask"] = mask
    return layer.call(inputs if len(inputs) > 1 else inputs[0], **kwargs)
