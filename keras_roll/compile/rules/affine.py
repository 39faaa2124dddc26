"""Affine layers: the twin applies their linear part only (no bias).

Dense and the convolutions are written out so that a fused `activation=` can be
split off; layers that are linear in their input (reshapes, paddings, average
pooling, merges) reuse their own `call`; Dropout-like layers are the identity
at inference, and compute something else in training mode: their ops say so
(`Op.training_dependent`). The scaling layers (BatchNormalization, Rescaling,
Normalization) are in `keras_roll.compile.rules.scales`. The table of rules is
in docs/design.md, section "Rules".
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import ops

from keras_roll.compile.keras_internals import (
    call_layer,
    causal_padding,
    numpy_operation,
    takes_mask,
)
from keras_roll.compile.rules.activations import activation_ops
from keras_roll.compile.rules.base import (
    NO_RECORD,
    Linear,
    Local,
    Op,
    Tangent,
    WeightedSum,
    apply_linear,
    elementwise,
    merge_batch,
    split_batch,
)
from keras_roll.compile.rules.registry import register_rule
from keras_roll.compile.rules.window_products import window_products

# --------------------------------------------------------------------------- helpers


class LayerCall(Op):
    """A layer (or Keras operation) that is linear in its inputs.

    The forward pass calls the layer in inference mode. The tangent pass calls it
    again on the tangents; if `bias_free` is False the layer's value at zero is
    subtracted, which turns any affine layer into its linear part.
    """

    affine = True

    def __init__(self, layer, bias_free=True, name=None):
        super().__init__(layer, name)
        self.bias_free = bias_free
        self.needs_mask = takes_mask(layer)

    def _call(self, inputs, mask=None):
        if isinstance(self.layer, keras.layers.AveragePooling3D) and inputs[0].dtype == tf.float64:
            return _avg_pool3d(self.layer, inputs[0])  # TensorFlow's CPU kernel lacks float64
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
        if tangents[0].axes is not None and len(tangents) == 1:
            axes = self.map_axes(tangents[0])
            if axes is not None:
                out = Tangent(out.value, out.shared, axes=axes)
        return out, None

    def local(self, shape):
        return _layer_local(self.layer, shape)

    @property
    def keeps_axes(self) -> bool:
        """Whether the layer keeps every input axis's flat index (a row-major reshape)."""
        layer = self.layer
        if isinstance(layer, keras.layers.Flatten):
            return getattr(layer, "data_format", "channels_last") == "channels_last"
        return isinstance(layer, keras.layers.Reshape)

    def map_axes(self, t: Tangent):
        """The flat output axes of one-hot input directions `t.axes`, or None.

        Reshapes keep them; a channels-last ZeroPadding moves them by its
        leading pads (a one-hot direction stays one-hot, -1 stays -1), so that
        a convolution after it still gathers kernel taps (`_conv_taps`).
        """
        if self.keeps_axes:
            return t.axes
        layer = self.layer
        pads = _zero_padding(layer)
        if pads is None:
            return None
        rank = len(pads)
        dims = t.value.shape[-rank - 1:]
        if t.value.shape.rank != rank + (2 if t.shared else 3) or None in dims:
            return None
        rest = tf.maximum(t.axes, 0)
        coords = []
        for n in reversed(dims):
            coords.append(rest % n)
            rest = rest // n
        coords = coords[::-1]
        out = tf.zeros_like(t.axes)
        for d, n in enumerate(dims):
            size = n + (sum(pads[d]) if d < rank else 0)
            out = out * size + coords[d] + (pads[d][0] if d < rank else 0)
        return tf.where(t.axes >= 0, out, -1)

_MERGE_OPS = (numpy_operation("Add"), numpy_operation("Subtract"))  # x + y, x - y


def _layer_local(layer, shape) -> Local | None:
    """The `Local` of a linear layer call on channels-last images: merges (elementwise),
    2-D zero padding (a shift) and "valid" 2-D average pooling; else None."""
    L = keras.layers
    if isinstance(layer, (L.Add, L.Subtract, L.Average, *_MERGE_OPS)):
        return elementwise(shape)
    pads = _zero_padding(layer)
    if pads is not None and len(pads) == 2:
        return Local((1, 1), (1, 1), tuple(a for a, _ in pads), lambda xs: xs[0])
    if (isinstance(layer, L.AveragePooling2D) and layer.padding == "valid"
            and layer.data_format == "channels_last"):
        return Local(tuple(layer.pool_size), tuple(layer.strides), (0, 0),
                     lambda xs: call_layer(layer, xs, None))
    return None


def _zero_padding(layer):
    """`((before, after), ...)` per spatial dimension of a channels-last ZeroPadding
    layer, else None."""
    L = keras.layers
    if not isinstance(layer, (L.ZeroPadding1D, L.ZeroPadding2D, L.ZeroPadding3D)):
        return None
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return None
    pads = layer.padding
    if isinstance(layer, L.ZeroPadding1D):
        pads = (pads,)
    return tuple((int(a), int(b)) for a, b in pads)


def _avg_pool3d(layer, x):
    """`AveragePooling3D` in float64: window sums by a ones-kernel conv3d, divided by
    the number of non-padding elements of every window (as Keras counts them)."""
    if layer.data_format == "channels_first":
        x = tf.transpose(x, [0, 2, 3, 4, 1])
    shape = tf.shape(x)
    per_channel = tf.reshape(tf.transpose(x, [0, 4, 1, 2, 3]),
                             tf.concat([[-1], shape[1:4], [1]], 0))
    kernel = tf.ones([*layer.pool_size, 1, 1], x.dtype)
    strides = [1, *layer.strides, 1]
    padding = layer.padding.upper()
    sums = tf.nn.conv3d(per_channel, kernel, strides, padding)
    counts = tf.nn.conv3d(tf.ones_like(per_channel[:1]), kernel, strides, padding)
    out = sums / counts
    out_shape = tf.shape(out)
    out = tf.reshape(out, tf.concat([[shape[0], shape[4]], out_shape[1:4]], 0))
    out = tf.transpose(out, [0, 2, 3, 4, 1])
    if layer.data_format == "channels_first":
        out = tf.transpose(out, [0, 4, 1, 2, 3])
    return out


class Identity(Op):
    """The identity (Dropout and noise layers at inference)."""

    affine = True

    def local(self, shape):
        return elementwise(shape)

    def forward(self, inputs, mask):
        return inputs[0], NO_RECORD

    def tangent(self, tangents, record, mask):
        return tangents[0], None


def _channel_shape(rank: int, data_format: str, channels: int) -> tuple[int, ...]:
    if data_format == "channels_last":
        return (1,) * (rank + 1) + (channels,)
    return (1, channels) + (1,) * rank


def _cast(v, like):
    """A weight (variable or tensor) in the dtype of the tensor `like` (float64 passes)."""
    return tf.cast(v, like.dtype)


def _with_bias(layer, linear, kernels, bias, bias_shape=None, rows=None, one_hot=None,
               channel_last_kernel=False, local=None):
    """ops: `[Linear(x -> linear(x, kernels()) + bias), *activation ops]`.

    `linear(x, ks)` applies the kernels `ks` (a list) to `x`: sums of products,
    described to analyses by the op's `WeightedSum`. `channel_last_kernel`: one
    kernel whose last axis is the output channel of a channels-last output, so
    a per-channel scale after the op folds into it.
    """

    def weights(x):
        return [_cast(k, x) for k in kernels()]

    def bias_value(like):
        b = _cast(bias(), like)
        return tf.reshape(b, bias_shape) if bias_shape else b

    channels_first = getattr(layer, "data_format", None) == "channels_first"

    def forward(inputs, mask):
        out = linear(inputs[0], weights(inputs[0]))
        if bias is None:
            return out
        b = _cast(bias(), out)
        if b.shape.rank == 1 and out.shape.rank >= 2:  # as Keras adds it: fuses on CPU
            return tf.nn.bias_add(out, b, data_format="NC..." if channels_first else "N...C")
        return out + bias_value(out)

    def scaled(xs, scale):  # one kernel whose last axis is the output channel
        ks = weights(xs[0])
        return linear(xs[0], [ks[0] * tf.cast(scale, ks[0].dtype)])

    lin = Linear(layer, lambda xs: linear(xs[0], weights(xs[0])), forward=forward,
                 rows=None if rows is None else (lambda idx: rows(idx)), one_hot=one_hot,
                 scaled=scaled if channel_last_kernel else None,
                 weighted_sum=WeightedSum(linear, kernels,
                                          None if bias is None else bias_value),
                 local=local)
    return [lin, *activation_ops(layer, layer.activation)]


# --------------------------------------------------------------------------- Dense / Conv


@register_rule(keras.layers.Dense)
def _dense_rule(layer):
    return _with_bias(
        layer,
        lambda x, ks: ops.matmul(x, ks[0]),
        lambda: [layer.kernel],
        (lambda: layer.bias) if layer.bias is not None else None,
        rows=lambda idx: tf.gather(layer.kernel, idx),
        channel_last_kernel=True,
    )


def _conv_linear(layer):
    if isinstance(layer, keras.layers.Conv1D) and layer.padding == "causal":

        def linear(x, ks):
            x = ops.pad(x, causal_padding(layer))
            return ops.conv(x, ks[0], strides=list(layer.strides), padding="valid",
                            dilation_rate=layer.dilation_rate, data_format=layer.data_format)

        return linear
    if (isinstance(layer, keras.layers.Conv2D) and layer.data_format == "channels_last"
            and tuple(layer.strides) == (1, 1) and tuple(layer.dilation_rate) == (1, 1)
            and getattr(layer, "groups", 1) == 1 and layer.padding in ("valid", "same")):
        return window_products(layer, _conv_by_convolutions(layer))
    return window_products(layer, lambda x, ks: layer.convolution_op(x, ks[0]))


def _conv_by_convolutions(layer):
    """A stride-1 undilated channels-last 2-D convolution whose input gradient is a
    convolution of the padded output gradient with the flipped kernel (the same sums):
    TensorFlow's CPU `Conv2DBackpropInput` is up to 50 times slower than the forward
    convolution on small images with many channels (ResNet-18's late stages at 32x32)."""
    spans = [k - 1 for k in layer.kernel_size]
    padding = layer.padding.upper()

    @tf.custom_gradient
    def conv(x, kernel):
        def grad(dy):
            # dx[j] = sum_t dy[j + b - t] w[t]: dy padded by k-1-b before, where x was
            # padded by b before and a after ("SAME" at stride 1: b = (k-1)//2, a = k-1-b)
            same = padding == "SAME"
            pads = [[0, 0]] + [[k - k // 2, k // 2] if same else [k, k] for k in spans] + [[0, 0]]
            flipped = tf.transpose(tf.reverse(kernel, [0, 1]), [0, 1, 3, 2])
            dk = tf.compat.v1.nn.conv2d_backprop_filter(x, tf.shape(kernel), dy, [1] * 4, padding)
            return tf.nn.conv2d(tf.pad(dy, pads), flipped, 1, "VALID"), dk

        return tf.nn.conv2d(x, kernel, 1, padding), grad

    return lambda x, ks: conv(x, tf.cast(ks[0], x.dtype))


def _conv_rule(layer):
    bias_shape = _channel_shape(layer.rank, layer.data_format, layer.filters)
    return _with_bias(layer, _conv_linear(layer), lambda: [layer.kernel],
                      (lambda: layer.bias) if layer.use_bias else None, bias_shape,
                      one_hot=_conv_taps(layer),
                      channel_last_kernel=layer.data_format == "channels_last"
                      and getattr(layer, "groups", 1) == 1, local=_conv_local(layer))


def _conv_local(layer):
    """`Linear`'s `local` of a channels-last 2-D convolution ("valid" or "same", any
    stride or dilation, groups=1): its kernel's span and padding; else None."""
    if (layer.rank != 2 or layer.data_format != "channels_last"
            or getattr(layer, "groups", 1) != 1 or layer.padding not in ("valid", "same")):
        return None

    def window_map(xs):
        kernel = tf.cast(layer.kernel, xs[0].dtype)
        return ops.conv(xs[0], kernel, strides=list(layer.strides), padding="valid",
                        dilation_rate=layer.dilation_rate, data_format="channels_last")

    def local(shape):
        geometry = _conv_geometry(layer, shape[:2])
        if geometry is None:
            return None
        spans = tuple((k - 1) * d + 1 for k, d in zip(layer.kernel_size, layer.dilation_rate))
        return Local(spans, tuple(layer.strides), tuple(geometry[0]), window_map)

    return local


def _conv_taps(layer):
    """`one_hot(tangent)` for `Linear`: a convolution of one-hot directions, by gathering
    kernel taps and placing them (channels_last, groups=1), else None.

    Along input axis `(i_1 .. i_r, c)` the convolution's output at position `p`
    is `kernel[t, c, :]` where `p_d * stride_d + t_d * dilation_d = i_d + pad_d`
    for every spatial dimension `d`, zero elsewhere: at most
    `ceil(((k_d - 1) dilation_d + 1) / stride_d)` positions per dimension. So the
    output tangent is a `scatter_nd` of gathered taps (no multiply-adds; its
    gradient is a gather and a scatter into the kernel), equal to the convolution
    of the one-hot tangent (docs/design.md, "The frozen-pattern twin").
    """
    if layer.data_format != "channels_last" or getattr(layer, "groups", 1) != 1:
        return None
    rank = layer.rank

    def one_hot(t, scale=None):
        spatial = t.value.shape[-rank - 1:-1]
        channels = t.value.shape[-1]
        if t.value.shape.rank != rank + (2 if t.shared else 3) or None in spatial \
                or channels is None:
            return None
        geometry = _conv_geometry(layer, spatial)
        if geometry is None:
            return None
        before, sizes = geometry
        axes = tf.reshape(t.axes, [-1])  # [M] flat input axes, -1: a zero direction
        rest = tf.maximum(axes, 0)
        coords = []
        for n in reversed([*spatial, channels]):
            coords.append(rest % n)
            rest = rest // n
        coords = coords[::-1]  # [i_1 .. i_r, c], each [M]
        taps, places, ok = _tap_positions(layer, coords, before, sizes, axes >= 0)
        kernel = tf.cast(layer.kernel, t.value.dtype)
        if scale is not None:
            kernel *= tf.cast(scale, kernel.dtype)
        ok_shape = tf.shape(ok)
        channel = tf.broadcast_to(tf.reshape(coords[-1], [-1] + [1] * rank), ok_shape)
        rows = tf.broadcast_to(tf.reshape(tf.range(tf.shape(axes)[0]), [-1] + [1] * rank),
                               ok_shape)
        gather_idx = tf.stack([tf.broadcast_to(x, ok_shape) for x in taps] + [channel], -1)
        values = tf.gather_nd(kernel, gather_idx)  # [M, c_1 .. c_r, filters]
        values *= tf.cast(ok, values.dtype)[..., None]
        scatter_idx = tf.stack([rows] + [tf.broadcast_to(x, ok_shape) for x in places], -1)
        filters = int(layer.kernel.shape[-1])
        out = tf.scatter_nd(tf.reshape(scatter_idx, [-1, rank + 1]),
                            tf.reshape(values, [-1, filters]),
                            tf.concat([tf.shape(axes)[:1], [*sizes, filters]], 0))
        lead = tf.shape(t.axes)
        return tf.reshape(out, tf.concat([lead, [*sizes, filters]], 0))

    return one_hot


def _conv_geometry(layer, spatial):
    """`(padding before, output size)` per spatial dimension of a convolution of inputs
    of spatial shape `spatial`, or None if some output size is below 1."""
    before, sizes = [], []
    for n, k, s, d in zip(spatial, layer.kernel_size, layer.strides, layer.dilation_rate):
        span = (k - 1) * d + 1
        if layer.padding == "valid":
            out, pad = (n - span) // s + 1, 0
        elif layer.padding == "same":
            out = -(-n // s)
            pad = max((out - 1) * s + span - n, 0) // 2
        else:  # causal (Conv1D): all padding before
            out, pad = (n + (k - 1) * d - span) // s + 1, (k - 1) * d
        if out < 1:
            return None
        before.append(pad)
        sizes.append(out)
    return before, sizes


def _tap_positions(layer, coords, before, sizes, live):
    """`(taps, places, ok)`: for one-hot inputs at `coords` (`[M]` per dimension), the
    kernel tap and output position of every candidate output per spatial dimension
    (`[M, 1 .. n_d .. 1]` each) and whether each combination exists (`[M, n_1 .. n_r]`)."""
    rank = layer.rank
    taps, places = [], []
    ok = tf.reshape(live, [-1] + [1] * rank)  # -> [M, n_1 .. n_r]
    for dim in range(rank):
        k, s, d = layer.kernel_size[dim], layer.strides[dim], layer.dilation_rate[dim]
        m = tf.range(((k - 1) * d) // s + 1)  # candidate output positions
        i = coords[dim][:, None] + before[dim]
        p = i // s - m[None, :]  # [M, n_dim]
        num = i - p * s
        tap = num // d
        fits = (num % d == 0) & (tap < k) & (p >= 0) & (p < sizes[dim])
        view = [-1] + [1] * rank
        view[dim + 1] = int(m.shape[0])
        taps.append(tf.reshape(tf.clip_by_value(tap, 0, k - 1), view))
        places.append(tf.reshape(tf.clip_by_value(p, 0, sizes[dim] - 1), view))
        ok = ok & tf.reshape(fits, view)
    return taps, places, ok


for _cls in (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D):
    register_rule(_cls, _conv_rule)


@register_rule(keras.layers.DepthwiseConv2D)
@register_rule(keras.layers.DepthwiseConv1D)
def _depthwise_rule(layer):
    def linear(x, ks):
        return ops.depthwise_conv(x, ks[0], strides=layer.strides, padding=layer.padding,
                                  dilation_rate=layer.dilation_rate,
                                  data_format=layer.data_format)

    channels = int(layer.kernel.shape[-2]) * layer.depth_multiplier
    bias_shape = _channel_shape(layer.rank, layer.data_format, channels)
    return _with_bias(layer, linear, lambda: [layer.kernel],
                      (lambda: layer.bias) if layer.use_bias else None, bias_shape)


@register_rule(keras.layers.SeparableConv2D)
@register_rule(keras.layers.SeparableConv1D)
def _separable_rule(layer):
    def linear(x, ks):
        return ops.separable_conv(x, ks[0], ks[1],
                                  strides=layer.strides, padding=layer.padding,
                                  dilation_rate=layer.dilation_rate,
                                  data_format=layer.data_format)

    bias_shape = _channel_shape(layer.rank, layer.data_format, layer.filters)
    return _with_bias(layer, linear, lambda: [layer.depthwise_kernel, layer.pointwise_kernel],
                      (lambda: layer.bias) if layer.use_bias else None, bias_shape)


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
for _cls in _MERGE_OPS:  # x + y and x - y on Keras tensors are operations, not layers
    register_rule(_cls, LayerCall)
