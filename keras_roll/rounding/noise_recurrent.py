"""The noise pass through a SimpleRNN layer: noise at every step, inside the recursion.

A SimpleRNN layer rounds at every time step (processing order) twice: its sum
`z_t = x_t K + h_t-1 U + b` (`n` roundings) and its activation `h_t = f(z_t)`
on the recorded piece (`f`'s roundings); padded steps carry the state. Both
the bounds of the noise pass (the actual magnitudes `m0`, the gradient bounds
`p`, the twin's rigorous errors `w0`, `w1`) and its noise tangents are runs of
the layer's own loop, `SimpleRNNOp.recurrence`, with their own step functions
(docs/design.md, section "The rounding bound"). `keras_roll.rounding.noise`
calls `recurrent_noise` for every `SimpleRNNOp`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import tensorflow as tf

from keras_roll.compile.rules.base import Tangent, flatten_examples
from keras_roll.rounding import rules
from keras_roll.rounding.precision import gamma, underflow_unit, unit_roundoff

__all__ = ["recurrent_noise"]

_U64 = unit_roundoff("float64")
_ETA64 = underflow_unit("float64")


class _Steps(NamedTuple):
    """Per-step quantities of one SimpleRNN layer, time-major `[T, B, units]`."""

    m0: tf.Tensor  # actual magnitudes of the step's sum at x
    m1: tf.Tensor  # their growth per unit radius (bound on the sum's ||grad||_1)
    pz: tf.Tensor  # bound on ||grad z_t||_1
    w0: tf.Tensor  # the twin's rigorous error of z_t at x
    w1: tf.Tensor  # ... and of its gradient
    act_mag: tf.Tensor  # magnitudes of the activation's output on its piece
    slope: tf.Tensor  # |slope| of the recorded piece


def _bounds(transform, op, edge, record):
    """`(_Steps, (p, w0, w1) of the layer output)`: the bounds of every step, one
    run of the recurrence carrying `(h, p_h, w0_h, w1_h)`."""
    dt = transform.dtype
    cell = op.cell
    abs_k = tf.abs(tf.cast(cell.kernel, dt))
    abs_u = tf.abs(tf.cast(cell.recurrent_kernel, dt))
    abs_b = tf.abs(tf.cast(cell.bias, dt)) if cell.bias is not None else tf.zeros([], dt)
    z = tf.cast(record.z, dt)  # [B, T, units], processing order
    s = tf.cast(record.slope, dt)
    act_mag = tf.abs(s) * tf.abs(z) + tf.abs(tf.cast(op.act.fn(z), dt) - s * z)
    dtype = transform.precision.dtype_of(op)
    shift = underflow_unit(dtype) / unit_roundoff(dtype)
    n, n_act = rules.roundings(op, [edge.value]), rules.roundings(op.act, [edge.value])
    g64, g64_act = gamma(n, _U64), gamma(n_act, _U64)
    tm, order = op.time_major, op.in_processing_order

    def inputs_times_k(t):
        return tm(tf.matmul(order(t), abs_k))

    zero = tf.zeros_like(edge.value)
    pr = edge.pr if edge.pr is not None else zero
    w0 = edge.w0 if edge.w0 is not None else zero
    w1 = edge.w1 if edge.w1 is not None else zero
    batch, steps, units = tf.shape(z)[0], tf.shape(z)[1], cell.units
    l1 = transform.known_l1(steps * units, tf.shape(z))
    if l1 is None:  # no known gradient norms: the growth compounds through |U|
        l1 = tf.fill(tf.shape(z), tf.constant(math.inf, dt))

    def step(state, elems):
        h, ph, w0h, w1h = state
        xm, xp, xw0, xw1, hv, s_t, am, l1_t = elems
        m0 = xm + tf.matmul(tf.abs(h) + shift, abs_u)
        m1 = xp + tf.matmul(ph, abs_u)
        w0z = xw0 + tf.matmul(w0h + _ETA64, abs_u) + g64 * m0 + n * _ETA64
        w1z = xw1 + tf.matmul(w1h, abs_u) + g64 * m1
        pz = tf.minimum(m1, l1_t + w1z)  # a bound on ||grad z_t||_1
        new = (hv, s_t * pz, s_t * w0z + g64_act * am + n_act * _ETA64,
               s_t * w1z + g64_act * s_t * pz)
        return new, (m0, m1, pz, w0z, w1z)

    seqs = [inputs_times_k(tf.abs(edge.value) + shift) + abs_b, inputs_times_k(pr),
            inputs_times_k(w0 + _ETA64), inputs_times_k(w1), tm(tf.cast(op.act.fn(z), dt)),
            tm(tf.abs(s)), tm(act_mag), tm(l1)]
    zeros = tf.zeros(tf.stack([batch, units]), dt)
    keep = tm(tf.cast(record.mask, tf.bool))
    states, extras = op.recurrence(step, seqs, (zeros,) * 4, (zeros,) * 5, keep)
    per_step = _Steps(*extras, act_mag=tm(act_mag), slope=tm(tf.abs(s)))
    outputs = tuple(op.outputs(states[i], keep) for i in (1, 2, 3))
    return per_step, outputs


def _noise_tangents(transform, op, edge, record, steps: _Steps, n, n_act):
    """`(output noise Tangent, [B, k, T * units] neuron noise)`: the noise injected at
    every step's sum (and activation, if it rounds) pushed through the recurrence."""
    tdt = transform.tangent_dtype
    batch, t_len, units = tf.shape(record.z)[0], tf.shape(record.z)[1], op.cell.units
    k = transform.samples.count
    tm = op.time_major

    def noise(n_round, m0, m1, matmul_like):  # [T, B, k, units]
        scales = transform.scales(op, n_round, tm(m0), tm(m1), matmul_like)
        return tf.transpose(transform.sampled(scales, tf.stack([t_len, units])), [2, 0, 1, 3])

    inject_z = noise(n, steps.m0, steps.m1, True)
    inject_h = noise(n_act, steps.act_mag, steps.slope * steps.pz, False) if n_act else None
    if edge.noise is None:
        tw = tf.zeros(tf.stack([t_len, batch, k, units]), tdt)
    else:
        tw = tf.matmul(edge.noise.per_example(batch), tf.cast(op.cell.kernel, tdt))
        tw = tf.transpose(op.in_processing_order(tw, axis=2), [2, 0, 1, 3])
    recurrent = tf.cast(op.cell.recurrent_kernel, tdt)
    slope = tm(tf.cast(record.slope, tdt))[:, :, None]

    def step(state, elems):
        dz = elems[0] + tf.matmul(state[0], recurrent) + elems[1]
        new = elems[2] * dz
        if inject_h is not None:
            new += elems[3]
        return (new,), (dz,)

    seqs = [tw, inject_z, slope] + ([inject_h] if inject_h is not None else [])
    dh0 = tf.zeros(tf.stack([batch, k, units]), tdt)
    keep = tm(tf.cast(record.mask, tf.bool))
    (dhs,), (dzs,) = op.recurrence(step, seqs, (dh0,), (dh0,), keep)
    return Tangent(op.outputs(dhs, keep)), op.neuron_sequence(dzs)


def recurrent_noise(transform, op, inputs, mask, record):
    """The noise pass's rule for a `SimpleRNNOp` (see the module docstring)."""
    (edge,) = inputs
    out = tf.cast(op.forward([edge.value], mask)[0], transform.dtype)
    steps, (pr_out, w0_out, w1_out) = _bounds(transform, op, edge, record)
    transform.flag_overflow(op.time_major(steps.m0), transform.precision.dtype_of(op))
    n, n_act = rules.roundings(op, [edge.value]), rules.roundings(op.act, [edge.value])
    noise = neuron_t = None
    if transform.samples.count:
        noise, neuron_t = _noise_tangents(transform, op, edge, record, steps, n, n_act)
    transform.collect(neuron_t, flatten_examples(op.time_major(steps.w0)),
                      flatten_examples(op.time_major(steps.w1)), record.z)
    tracks = transform.tracks
    return type(edge)(out, pr_out if 1 in tracks else None, w0_out if 0 in transform.exact
                      else None, w1_out if 1 in tracks else None, noise)
