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
    flatten_directions,
    flatten_examples,
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

    def _time_major(self, t):
        perm = [1, 0] + list(range(2, len(t.shape)))
        return tf.transpose(t, perm)

    def forward(self, inputs, mask):
        x = inputs[0]
        cell, layer = self.cell, self.layer
        dtype = x.dtype
        kernel = tf.cast(cell.kernel, dtype)
        recurrent = tf.cast(cell.recurrent_kernel, dtype)
        xw = tf.matmul(x, kernel)
        if cell.bias is not None:
            xw += tf.cast(cell.bias, dtype)
        batch = tf.shape(x)[0]
        steps = tf.shape(x)[1]
        if mask is None:
            m = tf.ones(tf.stack([batch, steps]), tf.bool)
        else:
            m = tf.cast(mask, tf.bool)
        if layer.go_backwards:
            xw, m = tf.reverse(xw, [1]), tf.reverse(m, [1])
        h0 = tf.zeros(tf.stack([batch, cell.units]), dtype)

        def step(carry, elems):
            h, _, _ = carry
            xw_t, m_t = elems
            z = xw_t + tf.matmul(h, recurrent)
            new = tf.cast(self.act.fn(z), dtype)
            keep = m_t[:, None]
            out = tf.where(keep, new, tf.zeros_like(new) if layer.zero_output_for_mask else h)
            return tf.where(keep, new, h), z, out

        _, z, outs = tf.scan(step, (self._time_major(xw), self._time_major(m)),
                             initializer=(h0, h0, h0))
        z, outs = self._time_major(z), self._time_major(outs)
        record = ActivationRecord(z, self.act.slope(z), m)
        output = outs if layer.return_sequences else outs[:, -1]
        return output, record

    def tangent(self, tangents, record, mask):
        cell = self.cell
        slope, m = record.slope, record.mask
        dtype = slope.dtype
        batch = tf.shape(slope)[0]
        kernel = tf.cast(cell.kernel, dtype)
        recurrent = tf.cast(cell.recurrent_kernel, dtype)
        tw = apply_linear(lambda xs: tf.matmul(xs[0], kernel), tangents).per_example(batch)
        if self.layer.go_backwards:
            tw = tf.reverse(tw, [2])
        k = tf.shape(tw)[1]
        tw = tf.transpose(tw, [2, 0, 1, 3])  # [T, B, K, units]
        slope_t = self._time_major(slope)[:, :, None]  # [T, B, 1, units]
        keep_t = self._time_major(m)[:, :, None, None]
        dh0 = tf.zeros(tf.stack([batch, k, cell.units]), dtype)

        def step(carry, elems):
            dh, _ = carry
            tw_t, s_t, keep = elems
            dz = tw_t + tf.matmul(dh, recurrent)
            return tf.where(keep, s_t * dz, dh), dz

        dhs, dzs = tf.scan(step, (tw, slope_t, keep_t), initializer=(dh0, dh0))
        if self.layer.zero_output_for_mask:
            outs = tf.where(keep_t, dhs, tf.zeros_like(dhs))
        else:
            outs = dhs
        outs = tf.transpose(outs, [1, 2, 0, 3])
        out = outs if self.layer.return_sequences else outs[:, :, -1]
        neuron_t = flatten_directions(tf.transpose(dzs, [1, 2, 0, 3]))
        return Tangent(out), neuron_t

    def neurons(self, record):
        return self.act.neurons(record)

    def neuron_shape(self, record):
        return self.act.neuron_shape(record)

    # ------------------------------------------------------------ rounding bound

    def magnitudes(self, bounds, record, affine, mask=None):
        """The recursion of the layer on magnitudes: `m_z,t = m_x,t |K| + |b| +
        m_h,t-1 |U|`, `m_h,t = |s| m_z,t + |c|` at unpadded steps, with `f = s z + c`
        the recorded piece of every unit and step (see `Activation.magnitude`)."""
        dtype = bounds[0].dtype
        bias = None
        if affine and self.cell.bias is not None:
            bias = tf.abs(tf.cast(self.cell.bias, dtype))
        offset = None
        if affine:  # |f(z) - s z| on the recorded piece of every unit and step (0 for ReLU)
            z_rec = tf.cast(record.z, dtype)
            offset = tf.abs(tf.cast(self.act.fn(z_rec), dtype)
                            - tf.cast(record.slope, dtype) * z_rec)
        return self._recursion(bounds[0], record, bias, offset)

    def absolute_growth(self, errors, record, mask, eta):
        """The absolute (underflow) error recursion: every step's sums add `n eta`,
        its inputs and state may be flushed (`+ eta`), its activation adds `eta`s."""
        dtype = errors[0].dtype
        recurrent = tf.abs(tf.cast(self.cell.recurrent_kernel, dtype))
        n = self.roundings(errors)
        bias = eta * (n + tf.reduce_sum(recurrent, axis=0))
        slope = tf.abs(tf.cast(record.slope, dtype))
        offset = eta * (slope + self.act.roundings(errors) + 1.0)
        return self._recursion(errors[0] + eta, record, bias, offset)

    def _recursion(self, m, record, bias, offset):
        """Runs `m_z,t = m_t |K| + bias + m_h,t-1 |U|`, `m_h,t = |s_t| m_z,t + offset_t`."""
        cell, layer = self.cell, self.layer
        dtype = m.dtype
        kernel = tf.abs(tf.cast(cell.kernel, dtype))
        recurrent = tf.abs(tf.cast(cell.recurrent_kernel, dtype))
        xw = tf.matmul(m, kernel)
        if bias is not None:
            xw += bias
        keep = tf.cast(record.mask, tf.bool)  # in processing order (see `forward`)
        if layer.go_backwards:
            xw = tf.reverse(xw, [1])
        h0 = tf.zeros(tf.stack([tf.shape(m)[0], cell.units]), dtype)
        slope = tf.abs(tf.cast(record.slope, dtype))
        if offset is None:
            offset = tf.zeros_like(slope)

        def step(carry, elems):
            h, _, _ = carry
            xw_t, k_t, s_t, c_t = elems
            z = xw_t + tf.matmul(h, recurrent)
            new = s_t * z + c_t
            k_t = k_t[:, None]
            out = tf.where(k_t, new, tf.zeros_like(new) if layer.zero_output_for_mask else h)
            return tf.where(k_t, new, h), z, out

        elems = tuple(self._time_major(t) for t in (xw, keep, slope, offset))
        _, z, outs = tf.scan(step, elems, initializer=(h0, h0, h0))
        z, outs = self._time_major(z), self._time_major(outs)
        output = outs if layer.return_sequences else outs[:, -1]
        return output, flatten_examples(z)

    def roundings(self, inputs):
        return int(inputs[0].shape[-1]) + self.cell.units + 3

    def rounding_growth(self, g_in, gamma, inputs):
        """Every step rounds its sums and its activation again: the bound of the
        neurons of step `t` is `(1 + g_in) ((1 + g_sum) (1 + g_act))^t / (1 + g_act) - 1`
        (in processing order, as the neurons are laid out)."""
        g_sum = gamma(self.roundings(inputs), True)
        g_act = gamma(self.act.roundings(inputs), False)
        steps = tf.shape(inputs[0])[1]
        t = tf.cast(tf.range(1, steps + 1), tf.float64)
        growth = tf.constant((1.0 + g_sum) * (1.0 + g_act), tf.float64)
        g_in = tf.cast(g_in, tf.float64)
        g_z = (1.0 + g_in) * tf.pow(growth, t) / (1.0 + g_act) - 1.0  # [T]
        g_neurons = tf.reshape(tf.tile(g_z[:, None], [1, self.cell.units]), [1, -1])
        g_out = (1.0 + g_in) * tf.pow(growth, tf.cast(steps, tf.float64)) - 1.0
        return g_out, g_neurons


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

    def magnitude(self, bounds, record, affine, mask=None):
        return bounds[0] * tf.cast(record.keep, bounds[0].dtype)

    def roundings(self, inputs):
        return 0


register_rule(keras.layers.Masking, MaskingOp)
