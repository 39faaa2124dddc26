"""Recurrent units: SimpleRNN with a ReLU-family activation, and Masking.

With the pattern frozen, `h_t = m_t * (W x_t + U h_{t-1} + b)`, so the tangent
recursion is `dh_t = m_t * (W dx_t + U dh_{t-1})` (docs/design.md, section
"Rules"). Padded steps (Keras masking) carry the state and create no neurons.

`SimpleRNNOp(layer, activation)` reads `layer.cell.kernel`, `recurrent_kernel`,
`bias` and `units` and the layer's `go_backwards`, `return_sequences` and
`zero_output_for_mask`, so any `keras.layers.RNN` whose cell looks like a
SimpleRNN cell can register it as its rule.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from keras_roll.compile.records import Record
from keras_roll.compile.rules.activations import Activation, ActivationRecord, activation_ops
from keras_roll.compile.rules.base import (
    Op,
    Tangent,
    apply_linear,
)
from keras_roll.compile.rules.registry import register_rule
from keras_roll.errors import UnsupportedModelError


class SimpleRNNOp(Op):
    """The whole SimpleRNN layer: one neuron per unit and (unpadded) time step.

    Args:
        layer: a SimpleRNN-like `keras.layers.RNN` (see the module docstring).
        activation: the `Activation` op of its cell's activation.
        name: name under which the neurons are reported.

    Example:

    ```python
    @keras_roll.register_rule(MyRNN)
    def _my_rnn(layer):
        (act,) = keras_roll.compile.rules.activations.activation_ops(layer, layer.cell.activation)
        return SimpleRNNOp(layer, act)
    ```
    """

    owns_neurons = True

    def __init__(self, layer, activation: Activation, name=None):
        super().__init__(layer, name)
        self.cell = layer.cell
        self.act = activation

    # ------------------------------------------------------------ the recurrence

    def time_major(self, t):
        """`[B, T, ...]` -> `[T, B, ...]` (and back: the permutation is its own inverse)."""
        return tf.transpose(t, [1, 0] + list(range(2, len(t.shape))))

    def in_processing_order(self, t, axis: int = 1):
        """`t` with its time axis in the order the layer processes it (reversed for
        `go_backwards`)."""
        return tf.reverse(t, [axis]) if self.layer.go_backwards else t

    def recurrence(self, step, sequences, initial, extras, keep):
        """Runs `step` over the time steps in processing order: the layer's one loop.

        Every pass over the layer (values, tangents, rounding bounds, noise)
        is this loop with its own `step`.

        Args:
            step: `fn(state, elems) -> (new_state, new_extras)`: `state` a tuple
                of `[B, ...]` tensors, `elems` one time step of `sequences`.
            sequences: time-major `[T, B, ...]` tensors in processing order.
            initial: the state before the first step.
            extras: zeros shaped like the per-step extras (e.g. the neurons).
            keep: `[T, B]` bool, False at padded steps, where every state entry
                keeps its value.

        Returns:
            `(states, extras)`: tuples of time-major `[T, B, ...]` tensors, the
            state after every step and the extras of every step.
        """

        def body(carry, elems):
            state = carry[0]
            k_t, xs = elems[0], elems[1:]
            new, more = step(state, xs)
            held = tuple(tf.where(tf.reshape(k_t, [-1] + [1] * (len(n.shape) - 1)), n, o)
                         for n, o in zip(new, state))
            return held, tuple(more)

        states, more = tf.scan(body, (keep, *sequences), initializer=(tuple(initial),
                                                                      tuple(extras)))
        return states, more

    def outputs(self, states, keep):
        """The layer's output from time-major per-step states `[T, B, ..., units]`:
        `[B, ..., T, units]` (`return_sequences`) or `[B, ..., units]`, zero at
        padded steps under `zero_output_for_mask`."""
        if self.layer.zero_output_for_mask:
            k = tf.reshape(keep, tf.concat([tf.shape(keep), tf.ones(len(states.shape) - 2,
                                                                    tf.int32)], 0))
            states = tf.where(k, states, tf.zeros_like(states))
        rank = len(states.shape)
        seq = tf.transpose(states, list(range(1, rank - 1)) + [0, rank - 1])
        return seq if self.layer.return_sequences else seq[..., -1, :]

    def neuron_sequence(self, per_step):
        """`[B, ..., T * units]` neuron rows (processing order) from time-major
        per-step `[T, B, ..., units]` values."""
        rank = len(per_step.shape)
        seq = tf.transpose(per_step, list(range(1, rank - 1)) + [0, rank - 1])
        shape = tf.shape(seq)
        return tf.reshape(seq, tf.concat([shape[:-2], [-1]], 0))

    # ------------------------------------------------------------ passes

    def forward(self, inputs, mask):
        x = inputs[0]
        cell = self.cell
        dtype = x.dtype
        recurrent = tf.cast(cell.recurrent_kernel, dtype)
        xw = tf.matmul(x, tf.cast(cell.kernel, dtype))
        if cell.bias is not None:
            xw += tf.cast(cell.bias, dtype)
        batch, steps = tf.shape(x)[0], tf.shape(x)[1]
        m = tf.ones(tf.stack([batch, steps]), tf.bool) if mask is None else tf.cast(mask, tf.bool)
        keep = self.in_processing_order(m)
        h0 = tf.zeros(tf.stack([batch, cell.units]), dtype)

        def step(state, elems):
            z = elems[0] + tf.matmul(state[0], recurrent)
            return (tf.cast(self.act.fn(z), dtype),), (z,)

        (hs,), (z,) = self.recurrence(step, [self.time_major(self.in_processing_order(xw))],
                                      (h0,), (h0,), self.time_major(keep))
        z = self.time_major(z)
        return self.outputs(hs, self.time_major(keep)), ActivationRecord(z, self.act.slope(z),
                                                                         keep)

    def tangent(self, tangents, record, mask):
        cell = self.cell
        dtype = record.slope.dtype
        batch = tf.shape(record.slope)[0]
        recurrent = tf.cast(cell.recurrent_kernel, dtype)
        kernel = tf.cast(cell.kernel, dtype)
        tw = apply_linear(lambda xs: tf.matmul(xs[0], kernel), tangents).per_example(batch)
        tw = tf.transpose(self.in_processing_order(tw, axis=2), [2, 0, 1, 3])  # [T, B, K, u]
        slope = self.time_major(record.slope)[:, :, None]  # [T, B, 1, units]
        dh0 = tf.zeros(tf.stack([batch, tf.shape(tw)[2], cell.units]), dtype)

        def step(state, elems):
            tw_t, s_t = elems
            dz = tw_t + tf.matmul(state[0], recurrent)
            return (s_t * dz,), (dz,)

        keep = self.time_major(record.mask)
        # The state's tangent starts at zero, so it stays exactly zero until the first
        # step whose input tangent is not: the loop starts there. Exact ROLL's chunks
        # of one-hot directions along later steps (and along padded steps, which the
        # Masking layer zeroes) skip the steps before them: about half the work. The
        # step is found on the input tangents `[(B,) K, T, F]`, not on the wider `tw`.
        v = tangents[0].value
        time = v.shape.rank - 2
        first = first_nonzero_step(self.in_processing_order(v, axis=time), axis=time)
        (dhs,), (dzs,) = self.recurrence(step, [tw[first:], slope[first:]], (dh0,), (dh0,),
                                         keep[first:])
        dhs, dzs = (_zeros_before(t, first) for t in (dhs, dzs))
        return Tangent(self.outputs(dhs, keep)), self.neuron_sequence(dzs)

    def neurons(self, record):
        return self.act.neurons(record)

    def neuron_shape(self, record):
        return self.act.neuron_shape(record)


def simple_rnn_op(layer, hint: str = "Build it with activation='relu' (or leaky_relu).",
                  name: str | None = None) -> SimpleRNNOp:
    """The `SimpleRNNOp` of a SimpleRNN-like layer, after the checks every such rule needs.

    Refuses `stateful=True` and `return_state=True` (the model would not be a
    function of its input alone) and a cell activation that is not
    piecewise linear.

    Args:
        layer: a SimpleRNN-like `keras.layers.RNN` (see the module docstring).
        hint: how to fix a wrong activation, appended to the error.
        name: the class name the errors use (default the layer's class).

    Example:

    ```python
    @keras_roll.register_rule(MyRNN)
    def _my_rnn(layer):
        return simple_rnn_op(layer, hint="Use activation='relu'.")
    ```
    """
    cls = name or type(layer).__name__
    for attr, why in (("stateful", "carries state between batches"),
                      ("return_state", "returns its state as a second output")):
        if getattr(layer, attr):
            raise UnsupportedModelError(
                f"Layer '{layer.name}' ({cls}) has {attr}=True, which {why}; "
                f"keras_roll linearizes a model as a function of its input alone. "
                f"Rebuild it with {attr}=False."
            )
    try:
        acts = activation_ops(layer, layer.cell.activation)
    except UnsupportedModelError:
        acts = []
    if len(acts) != 1 or not isinstance(acts[0], Activation):
        act = getattr(layer.cell.activation, "__name__", layer.cell.activation)
        raise UnsupportedModelError(
            f"Layer '{layer.name}' ({cls}) needs a ReLU-family activation to be "
            f"piecewise linear; it uses '{act}'. {hint}"
        )
    return SimpleRNNOp(layer, acts[0])


def first_nonzero_step(t, axis: int = 0):
    """The first index along the (time) `axis` of `t` where `t` is not all zero
    (the last index when it is zero everywhere: a loop runs at least one step)."""
    others = [a for a in range(t.shape.rank) if a != axis]
    nonzero = tf.reduce_any(tf.not_equal(t, 0), axis=others)
    last = tf.maximum(tf.shape(t, out_type=tf.int64)[axis] - 1, 0)
    return tf.where(tf.reduce_any(nonzero), tf.argmax(nonzero), last)


def _zeros_before(t, first):
    """`t` `[T - first, ...]` with `first` zero steps put back in front."""
    zeros = tf.zeros(tf.concat([[first], tf.shape(t, out_type=tf.int64)[1:]], 0), t.dtype)
    return tf.concat([zeros, t], 0)


@register_rule(keras.layers.SimpleRNN)
def _simple_rnn_rule(layer):
    return simple_rnn_op(layer, name="SimpleRNN")


@dataclasses.dataclass(frozen=True, eq=False)
class MaskingRecord(Record):
    """`keep`: `[B, T, 1]` 1.0 at the steps that are not padding."""

    keep: tf.Tensor


class MaskingOp(Op):
    """`keras.layers.Masking`: zeroes padded steps (their mask is part of the pattern)."""

    def forward(self, inputs, mask):
        x = inputs[0]
        keep = tf.reduce_any(tf.not_equal(x, self.layer.mask_value), axis=-1, keepdims=True)
        keep = tf.cast(keep, x.dtype)
        return x * keep, MaskingRecord(keep)

    def tangent(self, tangents, record, mask):
        return tangents[0].masked(record.keep), None


register_rule(keras.layers.Masking, MaskingOp)
