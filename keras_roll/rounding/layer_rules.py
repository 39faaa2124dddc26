"""The rounding rules of the ops and layers keras_roll compiles (`keras_roll.rounding.rules`).

One `RoundingRule` per kind of op: activations (`|s| m + |c|` on the recorded
piece), max pooling (the winner), masking, Dense and the convolutions (their
`WeightedSum`: `|W| m + |b|`, fan-in + 2 roundings), the scaling layers,
merges, average pooling and reshapes (nonnegative coefficients: the layer
applied to magnitudes), subtraction, and the SimpleRNN recursion. Importing
`keras_roll.rounding` registers them. docs/design.md, section "The rounding
bound", states what each bound assumes.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.keras_internals import numpy_operation
from keras_roll.compile.rules.activations import Activation, OutputLink
from keras_roll.compile.rules.affine import Identity
from keras_roll.compile.rules.base import Linear, flatten_examples
from keras_roll.compile.rules.pooling import MaxWindows
from keras_roll.compile.rules.recurrent import MaskingOp, SimpleRNNOp
from keras_roll.compile.rules.scales import (
    batch_norm_parts,
    normalization_parts,
    rescaling_parts,
)
from keras_roll.rounding.rules import DerivedRule, RoundingRule, register_rounding_rule

__all__ = [
    "ActivationRule",
    "BatchNormRule",
    "IdentityRule",
    "MaskingRule",
    "MaxRule",
    "NonnegativeRule",
    "NormalizationRule",
    "RecurrentRule",
    "RescalingRule",
    "SubtractRule",
    "WeightedSumRule",
]

L = keras.layers


class IdentityRule(RoundingRule):
    """The identity (dropout at inference, a folded output link): exact."""

    def keeps_single_terms(self, op):
        return True

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        return bounds[0]

    def roundings(self, op, inputs):
        return 0


class ActivationRule(RoundingRule):
    """`|s| m + |c|` on the recorded piece `f(z) = s z + c` of every unit.

    The certificate keeps every neuron on its piece throughout the ball (the
    bound of later layers may assume it: docs/design.md, "The rounding
    bound"), so a ReLU on its zero piece contributes exactly 0. ReLU, ReLU6 and
    `max_value` caps are a max / min of the input, exact in floating point;
    other slopes take 3 roundings.
    """

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        m = bounds[0]
        slope = tf.cast(record.slope, m.dtype)
        out = tf.abs(slope) * m
        if affine:
            z = tf.cast(record.z, m.dtype)
            out += tf.abs(tf.cast(op.fn(z), m.dtype) - slope * z)
        return out

    def roundings(self, op, inputs):
        return 0 if self.exact(op) else 3

    def keeps_single_terms(self, op):
        return True

    @staticmethod
    def exact(op) -> bool:
        """Whether the activation is a max / min of its input and constants."""
        slopes = op.slopes
        return op.breakpoints[0] == 0.0 and all(isinstance(s, (int, float)) for s in slopes) \
            and slopes[:2] == (0.0, 1.0) and all(s == 0.0 for s in slopes[2:])


class MaxRule(RoundingRule):
    """A max over windows: the recorded winner's bound, the largest among tied
    maxima (the certificate keeps every winner; a max is exact in floating point)."""

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        m = bounds[0]
        chosen = tf.cast(record.one_hot > 0, m.dtype)  # every tied maximum (TieRule.SPLIT)
        return tf.reduce_max(op.windows(m) * chosen, axis=-2)

    def roundings(self, op, inputs):
        return 0

    def keeps_single_terms(self, op):
        return True

    def neuron_tangent_roundings(self, op):
        return 1  # the neuron tangents are differences: winner - element

    def neuron_magnitude(self, op, bounds, record, affine, mask=None, values=None):
        """`|v_winner - v_k| <= max_window m + m_k` (the model compares them exactly)."""
        patches = op.windows(bounds[0])
        return flatten_examples(patches + tf.reduce_max(patches, axis=-2, keepdims=True))


class MaskingRule(RoundingRule):
    """`keras.layers.Masking`: padded steps are zeroed, exactly."""

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        return bounds[0] * tf.cast(record.keep, bounds[0].dtype)

    def roundings(self, op, inputs):
        return 0

    def keeps_single_terms(self, op):
        return True


def _fan_in(layer, weights) -> int | None:
    """Terms of every output's sum for the layers keras_roll registers, else None."""
    if isinstance(layer, L.Dense):
        return int(weights[0].shape[0])
    if isinstance(layer, (L.DepthwiseConv1D, L.DepthwiseConv2D)):
        return int(np.prod(weights[0].shape[:-2]))
    if isinstance(layer, (L.SeparableConv1D, L.SeparableConv2D)):
        # Depthwise then pointwise: the two sums round one after the other.
        return int(np.prod(weights[0].shape[:-2])) + int(weights[1].shape[-2]) + 1
    if isinstance(layer, (L.Conv1D, L.Conv2D, L.Conv3D)):
        return int(np.prod(weights[0].shape[:-1]))
    return None


class WeightedSumRule(RoundingRule):
    """A `Linear` op with a `WeightedSum` (Dense, convolutions): `|W| m + |b|`,
    fan-in + 2 roundings (the products' sum, the bias)."""

    matmul_like = True

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        ws = op.weighted_sum
        m = bounds[0]
        out = ws.apply(m, [tf.abs(tf.cast(w, m.dtype)) for w in ws.weights()])
        if affine and ws.bias is not None:
            out += tf.abs(ws.bias(out))
        return out

    def roundings(self, op, inputs):
        ws = op.weighted_sum
        weights = ws.weights()
        fan_in = _fan_in(op.layer, weights)
        if fan_in is None:  # count the products of the widest output
            x = tf.ones([1, *inputs[0].shape[1:]], tf.float64)
            ones = ws.apply(x, [tf.ones(w.shape, tf.float64) for w in weights])
            fan_in = tf.get_static_value(tf.reduce_max(ones))
            fan_in = int(np.prod(inputs[0].shape[1:])) if fan_in is None else int(fan_in)
        return fan_in + 2

    def tangent_roundings(self, op, inputs, single):
        """On single-term tangents each output is one product: one rounding."""
        return 1 if single else self.roundings(op, inputs)


class BatchNormRule(RoundingRule):
    """Inference BatchNormalization, `(x - mean) inv + beta`: rsqrt, scale, centre,
    shift and the offset Keras folds take 8 roundings at most."""

    def keeps_single_terms(self, op):
        return True

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        inv, mean, beta = batch_norm_parts(op.layer, bounds[0])
        if not affine:
            return bounds[0] * tf.abs(inv)
        return (bounds[0] + tf.abs(mean)) * tf.abs(inv) + tf.abs(beta)

    def roundings(self, op, inputs):
        return 8


class RescalingRule(RoundingRule):
    """`x * scale + offset`: 2 roundings."""

    def keeps_single_terms(self, op):
        return True

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        scale, offset = rescaling_parts(op.layer, bounds[0])
        out = bounds[0] * tf.abs(scale)
        return out + tf.abs(offset) if affine else out

    def roundings(self, op, inputs):
        return 2


class NormalizationRule(RoundingRule):
    """`(x - mean) / std` (or `mean + x * std`): the square root, the centre and the
    division, and the cast of the statistics: 4 roundings."""

    def keeps_single_terms(self, op):
        return True

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        mean, std = normalization_parts(op.layer, bounds[0])
        if op.layer.invert:
            out = bounds[0] * std
            return out + tf.abs(mean) if affine else out
        return (bounds[0] + tf.abs(mean)) / std if affine else bounds[0] / std

    def roundings(self, op, inputs):
        return 4


class NonnegativeRule(RoundingRule):
    """A linear layer with nonnegative coefficients and no bias (merges, average
    pooling, reshapes, paddings): the layer applied to magnitudes is `|A| m`.

    Args:
        count: `fn(layer, inputs) -> int`, the roundings per output element.
        moves_only: whether the layer only moves (copies) elements: reshapes,
            paddings, croppings, concatenations, nearest upsampling.
    """

    def __init__(self, count, moves_only: bool = False):
        self.count = count
        self.moves_only = bool(moves_only)

    def keeps_single_terms(self, op):
        return self.moves_only

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        return op.forward(bounds, mask)[0]

    def roundings(self, op, inputs):
        return int(self.count(op.layer, inputs))


class SubtractRule(RoundingRule):
    """`x - y`: `|x - y| <= |x| + |y|`, one rounding."""

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        return bounds[0] + bounds[1]

    def roundings(self, op, inputs):
        return 1


class RecurrentRule(RoundingRule):
    """A SimpleRNN layer: its recursion run on magnitudes (`SimpleRNNOp.recurrence`),
    `m_z,t = m_t |K| + |b| + m_h,t-1 |U|`, `m_h,t = |s| m_z,t + |c|` at unpadded
    steps, with `f = s z + c` the recorded piece of every unit and step; every
    step's sum takes `F + units + 3` roundings."""

    matmul_like = True

    def magnitudes(self, op, bounds, record, affine, mask=None, values=None):
        dtype = bounds[0].dtype
        bias = offset = None
        if affine:
            if op.cell.bias is not None:
                bias = tf.abs(tf.cast(op.cell.bias, dtype))
            z = tf.cast(record.z, dtype)  # |f(z) - s z| on the recorded piece (0 for ReLU)
            offset = tf.abs(tf.cast(op.act.fn(z), dtype) - tf.cast(record.slope, dtype) * z)
        return self.recursion(op, bounds[0], record, bias, offset)

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        return self.magnitudes(op, bounds, record, affine, mask, values)[0]

    def neuron_magnitude(self, op, bounds, record, affine, mask=None, values=None):
        return self.magnitudes(op, bounds, record, affine, mask, values)[1]

    def roundings(self, op, inputs):
        return int(inputs[0].shape[-1]) + op.cell.units + 3

    def tangent_roundings(self, op, inputs, single):
        return None  # the tangents round inside the recursion too

    @staticmethod
    def recursion(op, m, record, bias, offset):
        """`(output, [B, T * units] neurons)` of `m_z,t = m_t |K| + bias + m_h,t-1 |U|`,
        `m_h,t = |s_t| m_z,t + offset_t` (bias, offset: None for 0)."""
        dtype = m.dtype
        recurrent = tf.abs(tf.cast(op.cell.recurrent_kernel, dtype))
        xw = tf.matmul(m, tf.abs(tf.cast(op.cell.kernel, dtype)))
        if bias is not None:
            xw += bias
        slope = tf.abs(tf.cast(record.slope, dtype))
        offset = tf.zeros_like(slope) if offset is None else offset
        h0 = tf.zeros(tf.stack([tf.shape(m)[0], op.cell.units]), dtype)

        def step(state, elems):
            xw_t, s_t, c_t = elems
            z = xw_t + tf.matmul(state[0], recurrent)
            return (s_t * z + c_t,), (z,)

        tm = op.time_major
        seqs = [tm(op.in_processing_order(xw)), tm(slope), tm(offset)]
        keep = tm(tf.cast(record.mask, tf.bool))
        (hs,), (z,) = op.recurrence(step, seqs, (h0,), (h0,), keep)
        return op.outputs(hs, keep), op.neuron_sequence(z)


# --------------------------------------------------------------------------- registration

_DERIVED = DerivedRule()
_EXACT = NonnegativeRule(lambda layer, inputs: 0, moves_only=True)
_WEIGHTED_SUM = WeightedSumRule()


def _linear_rule(op) -> RoundingRule:
    """A `Linear` op of a layer without a rule of its own: its weighted sum if it has
    one, else the derived rule."""
    return _WEIGHTED_SUM if op.weighted_sum is not None else _DERIVED


def _upsampling_rule(op) -> RoundingRule:
    """Nearest (exact copies) and bilinear (8 roundings) have nonnegative weights;
    bicubic and lanczos do not: their rule is derived."""
    kind = getattr(op.layer, "interpolation", "nearest")
    if kind == "nearest":
        return _EXACT
    return NonnegativeRule(lambda layer, inputs: 8) if kind == "bilinear" else _DERIVED


def _layer_call_rule(rule):
    """`rule` for a bias-free `LayerCall`; the derived rule for one that subtracts its
    value at zero (a layer of unknown coefficients)."""
    return lambda op: rule if getattr(op, "bias_free", True) else _DERIVED


def _register():
    identity = IdentityRule()
    for cls, rule in ((Identity, identity), (OutputLink, identity),
                      (Activation, ActivationRule()), (MaxWindows, MaxRule()),
                      (MaskingOp, MaskingRule()), (SimpleRNNOp, RecurrentRule()),
                      (Linear, _linear_rule)):
        register_rounding_rule(cls, rule)
    pool = NonnegativeRule(lambda layer, inputs: int(np.prod(layer.pool_size)) + 1)
    global_pool = NonnegativeRule(
        lambda layer, inputs: int(np.prod([d for d in inputs[0].shape[1:-1]])) + 2)
    merge = NonnegativeRule(
        lambda layer, inputs: max(len(inputs) - 1, 0) + isinstance(layer, L.Average))
    table = {
        L.BatchNormalization: BatchNormRule(), L.Rescaling: RescalingRule(),
        L.Normalization: NormalizationRule(), L.Subtract: SubtractRule(),
        numpy_operation("Subtract"): SubtractRule(), L.Add: merge, L.Average: merge,
        numpy_operation("Add"): merge,
    }
    for cls in (L.AveragePooling1D, L.AveragePooling2D, L.AveragePooling3D):
        table[cls] = pool
    for cls in (L.GlobalAveragePooling1D, L.GlobalAveragePooling2D, L.GlobalAveragePooling3D):
        table[cls] = global_pool
    for cls in (L.Flatten, L.Reshape, L.Permute, L.RepeatVector, L.Concatenate,
                L.ZeroPadding1D, L.ZeroPadding2D, L.ZeroPadding3D,
                L.Cropping1D, L.Cropping2D, L.Cropping3D):
        table[cls] = _EXACT
    for cls, rule in table.items():
        register_rounding_rule(cls, _layer_call_rule(rule))
    for cls in (L.UpSampling1D, L.UpSampling2D, L.UpSampling3D):
        register_rounding_rule(cls, _upsampling_rule)


_register()
