"""Affine layers: the twin applies their linear part only (no bias).

Dense and the convolutions are written out so that a fused `activation=` can be
split off; layers that are linear in their input (reshapes, paddings, average
pooling, merges) reuse their own `call`; BatchNormalization (inference
statistics), Rescaling and Normalization apply their scale only; Dropout-like
layers are the identity at inference. BatchNormalization, dropout and noise
layers compute something else in training mode: their ops say so
(`Op.training_dependent`). The table of rules is in docs/design.md, section
"Rules".
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_roll.keras_internals import call_layer, causal_padding, numpy_operation, takes_mask
from keras_roll.rules.activations import activation_ops
from keras_roll.rules.base import (
    NO_RECORD,
    Linear,
    Op,
    Tangent,
    apply_linear,
    merge_batch,
    split_batch,
)
from keras_roll.rules.registry import register_rule

# --------------------------------------------------------------------------- helpers


class LayerCall(Op):
    """A layer (or Keras operation) that is linear in its inputs.

    The forward pass calls the layer in inference mode. The tangent pass calls it
    again on the tangents; if `bias_free` is False the layer's value at zero is
    subtracted, which turns any affine layer into its linear part.
    """

    def __init__(self, layer, bias_free=True, name=None):
        super().__init__(layer, name)
        self.bias_free = bias_free
        self.needs_mask = takes_mask(layer)

    def _call(self, inputs, mask=None):
        return call_layer(self.layer, inputs, mask if self.needs_mask else None)

    def forward(self, inputs, mask):
        return self._call(inputs, mask), NO_RECORD

    def tangent(self, tangents, record, mask):
        if self.needs_mask and mask is not None:
            # The layer's output depends on the sequence mask: repeat it per direction.
            ref = next((t.value for t in tangents if not t.shared), None)
            batch = tf.shape(mask)[0] if ref is None else tf.shape(ref)[0]
            per = [merge_batch(t.per_example(batch)) for t in tangents]
            k = tf.shape(tangents[0].per_example(batch))[1]
            out = self._call(per, tf.repeat(mask, k, axis=0))
            if not self.bias_free:
                out -= self._call([tf.zeros_like(p) for p in per], tf.repeat(mask, k, axis=0))
            return Tangent(split_batch(out, batch)), None

        def fn(xs):
            out = self._call(xs)
            if not self.bias_free:
                out -= self._call([tf.zeros_like(x[:1]) for x in xs])
            return out

        out = apply_linear(fn, tangents)
        if self.keeps_axes and tangents[0].axes is not None:
            # A row-major reshape keeps every input axis's flat index.
            out = Tangent(out.value, out.shared, axes=tangents[0].axes)
        return out, None

    @property
    def keeps_axes(self) -> bool:
        layer = self.layer
        if isinstance(layer, keras.layers.Flatten):
            return getattr(layer, "data_format", "channels_last") == "channels_last"
        return isinstance(layer, keras.layers.Reshape)


class Identity(Op):
    """The identity (Dropout and noise layers at inference)."""

    def forward(self, inputs, mask):
        return inputs[0], NO_RECORD

    def tangent(self, tangents, record, mask):
        return tangents[0], None


def _channel_shape(rank: int, data_format: str, channels: int) -> tuple[int, ...]:
    if data_format == "channels_last":
        return (1,) * (rank + 1) + (channels,)
    return (1, channels) + (1,) * rank


def _with_bias(layer, linear, bias, bias_shape=None, rows=None):
    """ops: `[Linear(x -> linear(x) + bias), *activation ops]`."""

    def forward(inputs, mask):
        out = linear(inputs[0])
        if bias is not None:
            b = bias() if callable(bias) else bias
            out = ops.add(out, ops.reshape(b, bias_shape) if bias_shape else b)
        return out

    lin = Linear(layer, lambda xs: linear(xs[0]), forward=forward, rows=rows)
    return [lin, *activation_ops(layer, layer.activation)]


# --------------------------------------------------------------------------- Dense / Conv


@register_rule(keras.layers.Dense)
def _dense_rule(layer):
    return _with_bias(
        layer,
        lambda x: ops.matmul(x, layer.kernel),
        (lambda: layer.bias) if layer.bias is not None else None,
        rows=lambda idx: tf.gather(layer.kernel, idx),
    )


def _conv_linear(layer):
    if isinstance(layer, keras.layers.Conv1D) and layer.padding == "causal":

        def linear(x):
            x = ops.pad(x, causal_padding(layer))
            return ops.conv(x, layer.kernel, strides=list(layer.strides), padding="valid",
                            dilation_rate=layer.dilation_rate, data_format=layer.data_format)

        return linear
    return lambda x: layer.convolution_op(x, layer.kernel)


def _conv_rule(layer):
    bias_shape = _channel_shape(layer.rank, layer.data_format, layer.filters)
    return _with_bias(layer, _conv_linear(layer),
                      (lambda: layer.bias) if layer.use_bias else None, bias_shape)


for _cls in (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D):
    register_rule(_cls, _conv_rule)


@register_rule(keras.layers.DepthwiseConv2D)
@register_rule(keras.layers.DepthwiseConv1D)
def _depthwise_rule(layer):
    def linear(x):
        return ops.depthwise_conv(x, layer.kernel, strides=layer.strides, padding=layer.padding,
                                  dilation_rate=layer.dilation_rate,
                                  data_format=layer.data_format)

    channels = int(layer.kernel.shape[-2]) * layer.depth_multiplier
    bias_shape = _channel_shape(layer.rank, layer.data_format, channels)
    return _with_bias(layer, linear, (lambda: layer.bias) if layer.use_bias else None,
                      bias_shape)


@register_rule(keras.layers.SeparableConv2D)
@register_rule(keras.layers.SeparableConv1D)
def _separable_rule(layer):
    def linear(x):
        return ops.separable_conv(x, layer.depthwise_kernel, layer.pointwise_kernel,
                                  strides=layer.strides, padding=layer.padding,
                                  dilation_rate=layer.dilation_rate,
                                  data_format=layer.data_format)

    bias_shape = _channel_shape(layer.rank, layer.data_format, layer.filters)
    return _with_bias(layer, linear, (lambda: layer.bias) if layer.use_bias else None,
                      bias_shape)


# --------------------------------------------------------------------------- scales


def _broadcast_shape(axes, rank, shape):
    """Shape that broadcasts a per-`axes` vector against `[N, *per_example]`."""
    out = [1] * rank
    for a in axes:
        out[a] = shape[a]
    return out


@register_rule(keras.layers.BatchNormalization)
def _batch_norm_rule(layer):
    """Inference statistics: y = gamma * (x - mean) / sqrt(var + eps) + beta."""

    def linear(xs):
        x = xs[0]
        inv = tf.math.rsqrt(tf.cast(layer.moving_variance, x.dtype) + layer.epsilon)
        if layer.gamma is not None:
            inv *= tf.cast(layer.gamma, x.dtype)
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        rank = len(x.shape)
        axes = [a % rank for a in axes]
        return x * tf.reshape(inv, _broadcast_shape(axes, rank, x.shape))

    return Linear(layer, linear, training_dependent=True)  # batch statistics in training


@register_rule(keras.layers.Rescaling)
def _rescaling_rule(layer):
    return LayerCall(layer, bias_free=False)


@register_rule(keras.layers.Normalization)
def _normalization_rule(layer):
    def linear(xs):
        x = xs[0]
        std = tf.maximum(tf.sqrt(tf.cast(layer.variance, x.dtype)), keras.backend.epsilon())
        return x * std if layer.invert else x / std

    return Linear(layer, linear)


# --------------------------------------------------------------------------- linear layers

_LINEAR_LAYERS = (
    keras.layers.Flatten, keras.layers.Reshape, keras.layers.Permute,
    keras.layers.RepeatVector,
    keras.layers.ZeroPadding1D, keras.layers.ZeroPadding2D, keras.layers.ZeroPadding3D,
    keras.layers.Cropping1D, keras.layers.Cropping2D, keras.layers.Cropping3D,
    keras.layers.UpSampling1D, keras.layers.UpSampling2D, keras.layers.UpSampling3D,
    keras.layers.AveragePooling1D, keras.layers.AveragePooling2D,
    keras.layers.AveragePooling3D,
    keras.layers.GlobalAveragePooling1D, keras.layers.GlobalAveragePooling2D,
    keras.layers.GlobalAveragePooling3D,
    keras.layers.Add, keras.layers.Subtract, keras.layers.Average,
    keras.layers.Concatenate,
)
for _cls in _LINEAR_LAYERS:
    register_rule(_cls, LayerCall)

_RANDOM_IN_TRAINING = (  # the identity at inference, random in training
    keras.layers.Dropout, keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D,
    keras.layers.SpatialDropout3D, keras.layers.GaussianNoise, keras.layers.GaussianDropout,
    keras.layers.AlphaDropout,
)
for _cls in _RANDOM_IN_TRAINING:
    register_rule(_cls, lambda layer: Identity(layer, training_dependent=True))
for _cls in (keras.layers.ActivityRegularization, keras.layers.Identity):
    register_rule(_cls, Identity)


def _register_ops():
    """`x + y` and `x - y` on Keras tensors create operations, not layers."""
    for cls in (numpy_operation("Add"), numpy_operation("Subtract")):
        register_rule(cls, LayerCall)


_register_ops()
