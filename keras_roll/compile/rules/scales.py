"""Scaling layers: BatchNormalization (inference statistics), Rescaling and Normalization.

With the statistics frozen each is `x * scale + offset` per channel (or per
feature), so the twin applies its scale only. BatchNormalization computes
batch statistics in training mode: its op says so (`Op.training_dependent`),
and a convolution or Dense layer whose output only a BatchNormalization reads
folds the scale into its kernel in tangent passes (`Linear.channel_scale`).
The `*_parts` functions give the frozen statistics in a pass's dtype; the
rounding analyses of `keras_roll.rounding.rules` read them too. The table of
rules is in docs/design.md, section "Rules".
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_roll.compile.keras_internals import normalization_statistics
from keras_roll.compile.rules.base import Linear, elementwise
from keras_roll.compile.rules.registry import register_rule

__all__ = ["batch_norm_parts", "normalization_parts", "rescaling_parts"]


def _cast(v, like):
    """A weight (variable or tensor) in the dtype of the tensor `like` (float64 passes)."""
    return tf.cast(v, like.dtype)


def _broadcast_shape(axes, rank, shape):
    """Shape that broadcasts a per-`axes` vector against `[N, *per_example]`."""
    out = [1] * rank
    for a in axes:
        out[a] = shape[a]
    return out


def _work_dtype(dtype):
    """float32 for a 16-bit dtype (statistics are combined before the cast), else `dtype`."""
    dtype = tf.as_dtype(dtype)
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def batch_norm_parts(layer, x):
    """`(inv, mean, beta)` of the inference map `(x - mean) * inv + beta`, shaped for `x`
    (combined in float32 for 16-bit tangents, then cast)."""
    axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
    rank = len(x.shape)
    axes = [a % rank for a in axes]
    shape = _broadcast_shape(axes, rank, x.shape)
    work = _work_dtype(x.dtype)
    inv = tf.math.rsqrt(tf.cast(layer.moving_variance, work) + layer.epsilon)
    if layer.gamma is not None:
        inv *= tf.cast(layer.gamma, work)
    mean = _cast(layer.moving_mean, x)
    beta = _cast(layer.beta, x) if layer.beta is not None else tf.zeros_like(mean)
    return (tf.reshape(tf.cast(inv, x.dtype), shape), tf.reshape(mean, shape),
            tf.reshape(beta, shape))


@register_rule(keras.layers.BatchNormalization)
def _batch_norm_rule(layer):
    """Inference statistics: y = gamma * (x - mean) / sqrt(var + eps) + beta."""

    def linear(xs):
        inv, _, _ = batch_norm_parts(layer, xs[0])
        return xs[0] * inv

    def channel_scale(dtype, rank):
        """`gamma / sqrt(var + eps)` as a `[C]` vector when the layer scales the last
        axis of its `[N, ...]` input of rank `rank`, else None."""
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        if [a % rank for a in axes] != [rank - 1]:
            return None
        work = _work_dtype(dtype)
        inv = tf.math.rsqrt(tf.cast(layer.moving_variance, work) + layer.epsilon)
        if layer.gamma is not None:
            inv *= tf.cast(layer.gamma, work)
        return tf.cast(inv, dtype)

    def local(shape):  # per channel of the last axis: elementwise on any window
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        last = [a % (len(shape) + 1) for a in axes] == [len(shape)]
        return elementwise(shape) if last else None

    return Linear(layer, linear, training_dependent=True,  # batch statistics in training
                  channel_scale=channel_scale, local=local)


def rescaling_parts(layer, x):
    """`(scale, offset)` of a `Rescaling` layer, `x * scale + offset`, in `x`'s dtype,
    cast as Keras casts them (a Python float goes through float32 first, so a
    float64 model's offset of -0.1 is -0.10000000149...: the twin computes the
    function Keras computes)."""
    scale = tf.cast(ops.cast(layer.scale, x.dtype), x.dtype)
    offset = tf.cast(ops.cast(layer.offset, x.dtype), x.dtype)
    if scale.shape.rank and keras.config.image_data_format() == "channels_first":
        scale = tf.reshape(scale, list(scale.shape) + [1] * (3 - scale.shape.rank))
    return scale, offset


@register_rule(keras.layers.Rescaling)
def _rescaling_rule(layer):
    """`x * scale + offset`, in the dtype of the pass."""

    def forward(inputs, mask):
        scale, offset = rescaling_parts(layer, inputs[0])
        return inputs[0] * scale + offset

    def linear(xs):
        return xs[0] * rescaling_parts(layer, xs[0])[0]

    def local(shape):  # a scalar scale, or one per channel of the last axis
        scale = np.shape(keras.ops.convert_to_numpy(layer.scale))
        per_channel = len(scale) == 1 and keras.config.image_data_format() == "channels_last"
        return elementwise(shape) if len(scale) == 0 or per_channel else None

    return Linear(layer, linear, forward=forward, local=local)


def normalization_parts(layer, x):
    """`(mean, std)` of a `Normalization` layer in `x`'s dtype, `std >= epsilon`: it
    computes `(x - mean) / std` (`mean + x * std` with `invert=True`)."""
    get_mean, get_var = normalization_statistics(layer)
    mean = tf.cast(get_mean(), x.dtype)
    std = tf.maximum(tf.sqrt(tf.cast(get_var(), x.dtype)), keras.backend.epsilon())
    return mean, std


@register_rule(keras.layers.Normalization)
def _normalization_rule(layer):
    """`(x - mean) / std` (or `mean + x * std` with invert=True), `std >= epsilon`."""

    def forward(inputs, mask):
        mean, std = normalization_parts(layer, inputs[0])
        return mean + inputs[0] * std if layer.invert else (inputs[0] - mean) / std

    def linear(xs):
        _, std = normalization_parts(layer, xs[0])
        return xs[0] * std if layer.invert else xs[0] / std

    def local(shape):  # statistics per channel of the last axis (or one for all)
        axes = layer.axis if isinstance(layer.axis, (tuple, list)) else (layer.axis,)
        axes = [a % (len(shape) + 1) for a in axes if a is not None]
        return elementwise(shape) if axes in ([], [len(shape)]) else None

    return Linear(layer, linear, forward=forward, local=local)
