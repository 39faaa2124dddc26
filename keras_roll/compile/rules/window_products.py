"""Convolutions with few output positions, computed as products of their windows.

A channels-last 2-D "valid" convolution (any stride, no dilation, one group) whose
output has at most `MAX_POSITIONS` positions is one matrix product: its input windows
(stacked, `[n * positions, kh * kw * c_in]`) times the kernel reshaped to
`[kh * kw * c_in, c_out]`. These are the same sums as the convolution's. ResNet-18's
last stages on 32x32 images have such outputs (2x2 and 1x1). There, TensorFlow's CPU
convolution costs up to 5 times the product. Its input gradient costs more still: a
full convolution of the padded output gradient, or `Conv2DBackpropInput`, up to 8
times the product's transpose. Larger outputs keep the convolution (`fallback`).

Example:

```python
linear = window_products(layer, lambda x, ks: layer.convolution_op(x, ks[0]))
y = linear(x, [layer.kernel])   # [n, oh, ow, c_out], the convolution of x
```
"""

from __future__ import annotations

import keras
import tensorflow as tf

__all__ = ["MAX_POSITIONS", "window_products"]

MAX_POSITIONS = 4  # output positions up to which the windows' product is used


def window_products(layer, fallback):
    """`linear(x, ks)` of a convolution layer: the product of the windows where the
    output of `x` (static spatial shape) has at most `MAX_POSITIONS` positions, else
    `fallback(x, ks)`; `fallback` itself for layers this does not cover."""
    if not (isinstance(layer, keras.layers.Conv2D) and layer.data_format == "channels_last"
            and layer.padding == "valid" and tuple(layer.dilation_rate) == (1, 1)
            and getattr(layer, "groups", 1) == 1):
        return fallback
    (kh, kw), (sh, sw) = layer.kernel_size, layer.strides

    def linear(x, ks):
        shape = x.shape
        if len(shape) != 4 or None in (shape[1], shape[2], shape[3]):
            return fallback(x, ks)
        oh, ow = (shape[1] - kh) // sh + 1, (shape[2] - kw) // sw + 1
        if oh < 1 or ow < 1 or oh * ow > MAX_POSITIONS:
            return fallback(x, ks)
        kernel = tf.cast(ks[0], x.dtype)
        rows = kh * kw * shape[3]
        # `tf.slice`, whose gradient is a `Pad`: `StridedSliceGrad` cost three times as much
        windows = [tf.slice(x, [0, i * sh, j * sw, 0], [-1, kh, kw, -1])
                   for i in range(oh) for j in range(ow)]
        stacked = tf.stack(windows, axis=1)  # [n, positions, kh, kw, c_in]
        out = tf.matmul(tf.reshape(stacked, [-1, rows]), tf.reshape(kernel, [rows, -1]))
        return tf.reshape(out, tf.stack([tf.shape(x)[0], oh, ow, tf.shape(kernel)[-1]]))

    return linear
