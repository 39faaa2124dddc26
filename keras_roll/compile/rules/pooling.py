"""Max units: MaxPooling1D/2D and GlobalMaxPooling1D/2D.

A max unit that picks input i of its window is linear while `v_i - v_k >= 0`
for every other input k of the window: each difference is a neuron with a
single breakpoint at 0 and gradient `g_i - g_k` (docs/design.md, section
"The maths", max units). The twin gathers the tangent of the chosen input.

Ties follow TensorFlow's gradients (docs/design.md, section "Ties at max
pooling"), so that every gradient keras_roll reports is the one the model's own
`tf.GradientTape` gives: `MaxPooling1D/2D` choose the first maximal element of
a window in row-major order (the `MaxPoolGrad` kernel), `GlobalMaxPooling1D/2D`
(a `reduce_max`) share the gradient equally among all maximal elements
(`TieRule.FIRST` and `TieRule.SPLIT`). A tie is a region boundary either way.
"""

from __future__ import annotations

import dataclasses
import enum

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.records import Record
from keras_roll.compile.rules.base import (
    Neurons,
    Op,
    Tangent,
    flatten_directions,
    flatten_examples,
    merge_batch,
    split_batch,
    static_dims,
)
from keras_roll.compile.rules.registry import register_rule
from keras_roll.errors import UnsupportedModelError


class TieRule(enum.Enum):
    """How a max unit's gradient is shared among equal maxima of a window.

    * `FIRST`: all of it to the first maximal element in row-major window order
      (TensorFlow's `MaxPool` gradient: MaxPooling1D/2D).
    * `SPLIT`: equal shares to every maximal element (the gradient of
      `tf.reduce_max`: GlobalMaxPooling1D/2D).
    """

    FIRST = "first"
    SPLIT = "split"


@dataclasses.dataclass(frozen=True, eq=False)
class MaxRecord(Record):
    """What a max unit records on a batch.

    Attributes:
        patches: `[B, *out, w, C]` the contents of every window.
        one_hot: `[B, *out, w, C]` the weight of every element in the max's
            gradient: 1 at the chosen element (the first maximal one), or
            `1 / m` at each of `m` tied maxima under `TieRule.SPLIT`.
        valid: `[B or 1, *out, w, C]` bool: a neuron `v_max - v_k` exists (not
            the sole winner, not a padding position; tied maxima are neurons
            at their breakpoint).
        out: `[B, *out, C]` the maxima.
    """

    patches: tf.Tensor
    one_hot: tf.Tensor
    valid: tf.Tensor
    out: tf.Tensor

    @property
    def argmax(self) -> tf.Tensor:
        """`[B, *out, C]` int32, the chosen window element (the first of tied maxima)."""
        return tf.argmax(self.one_hot, axis=-2, output_type=tf.int32)

    def as_dict(self) -> dict:
        return {**super().as_dict(), "argmax": self.argmax}


class MaxWindows(Op):
    """A max over windows, described by a function that cuts windows out.

    Args:
        layer: the pooling layer.
        windows: `fn(x [N, *spatial, C]) -> [N, *out_spatial, w, C]`, the window
            contents (padding positions arbitrary), each window in row-major order.
        valid_fn: `fn(x) -> [*out_spatial, w, 1]` bool, False at padding positions.
        ties: the `TieRule` of the layer's TensorFlow gradient.

    Example:

    ```python
    def windows(x):  # a global max over the time axis of [N, T, C]
        return x

    op = MaxWindows(layer, windows, lambda x: tf.ones([1, 1, 1], tf.bool))
    ```
    """

    owns_neurons = True
    max_window = True  # its neurons compare window elements: a neuron at 0 is a tie

    def __init__(self, layer, windows, valid_fn, name=None, ties: TieRule = TieRule.FIRST):
        super().__init__(layer, name)
        self.windows = windows
        self.valid_fn = valid_fn
        self.ties = ties

    def forward(self, inputs, mask):
        x = inputs[0]
        patches = self.windows(x)
        valid = self.valid_fn(x)
        neg = tf.fill(tf.shape(patches), tf.constant(-float("inf"), x.dtype))
        masked = tf.where(valid, patches, neg)
        top = tf.reduce_max(masked, axis=-2, keepdims=True)
        is_max = tf.logical_and(valid, masked == top)
        if self.ties is TieRule.SPLIT:
            one_hot = tf.cast(is_max, x.dtype)
            one_hot /= tf.maximum(tf.reduce_sum(one_hot, axis=-2, keepdims=True), 1)
            # The max itself (exact), with the gradient shared by the tied elements.
            out = tf.stop_gradient(top[..., 0, :]) + tf.reduce_sum(
                one_hot * (patches - tf.stop_gradient(patches)), axis=-2)
        else:
            w = tf.shape(patches)[-2]
            rank = len(patches.shape)
            order = tf.reshape(tf.range(w), tf.concat([[w], tf.ones([1], tf.int32)], 0))
            first = tf.reduce_min(tf.where(is_max, order, w), axis=rank - 2)  # [N, *out, C]
            one_hot = tf.one_hot(first, w, axis=-1, dtype=x.dtype)  # [N, *out, C, w]
            one_hot = tf.experimental.numpy.swapaxes(one_hot, -1, -2)  # [N, *out, w, C]
            out = tf.reduce_sum(patches * one_hot, axis=-2)
        return out, MaxRecord(patches, one_hot, valid & (one_hot < 1), out)

    def tangent(self, tangents, record, mask):
        one_hot = record.one_hot
        batch = tf.shape(one_hot)[0]
        t = tangents[0].per_example(batch)
        patches = split_batch(self.windows(merge_batch(t)), batch)  # [B, K, *out, w, C]
        chosen = tf.reduce_sum(patches * one_hot[:, None], axis=-2)
        diff = chosen[..., None, :] - patches
        return Tangent(chosen), flatten_directions(diff)

    def neurons(self, record):
        patches, out = record.patches, record.out
        z = out[..., None, :] - patches
        valid = tf.broadcast_to(record.valid, tf.shape(z))
        inf = tf.fill(tf.shape(z), tf.constant(float("inf"), z.dtype))
        flat = flatten_examples
        return Neurons(flat(z), flat(z), flat(inf), flat(valid),
                       flat(tf.cast(record.one_hot > 0, tf.int32)))

    def neuron_shape(self, record):
        return tuple(int(d) for d in record.patches.shape[1:])


def _check_channels_last(layer):
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        raise UnsupportedModelError(
            f"Layer '{layer.name}' ({type(layer).__name__}) uses "
            f"data_format='{layer.data_format}'; keras_roll supports max pooling in "
            f"channels_last only. Rebuild the model with channels_last."
        )


def _patches_2d(x, size, strides, padding):
    p = tf.image.extract_patches(x, sizes=[1, *size, 1], strides=[1, *strides, 1],
                                 rates=[1, 1, 1, 1], padding=padding.upper())
    w = size[0] * size[1]
    c = x.shape[-1]
    dims = static_dims(p, 1)
    if c is not None and dims is not None and int(np.prod(dims)) > 0:
        return tf.reshape(p, [-1 if p.shape[0] is None else p.shape[0], *dims[:2], w, c])
    shape = tf.shape(p)
    c = tf.shape(x)[-1]
    return tf.reshape(p, tf.stack([shape[0], shape[1], shape[2], w, c]))


@register_rule(keras.layers.MaxPooling2D)
def _max_pool_2d(layer):
    _check_channels_last(layer)
    size, strides, padding = layer.pool_size, layer.strides, layer.padding

    def windows(x):
        return _patches_2d(x, size, strides, padding)

    def valid_fn(x):
        ones = tf.ones(tf.concat([[1], tf.shape(x)[1:3], [1]], 0), x.dtype)
        return windows(ones) > 0

    return MaxWindows(layer, windows, valid_fn)


@register_rule(keras.layers.MaxPooling1D)
def _max_pool_1d(layer):
    _check_channels_last(layer)
    size, strides, padding = (1, layer.pool_size[0]), (1, layer.strides[0]), layer.padding

    def windows(x):
        return _patches_2d(x[:, None], size, strides, padding)[:, 0]

    def valid_fn(x):
        ones = tf.ones(tf.concat([[1], tf.shape(x)[1:2], [1]], 0), x.dtype)
        return windows(ones) > 0

    return MaxWindows(layer, windows, valid_fn)


def _global_max(layer, spatial_rank):
    _check_channels_last(layer)
    if layer.keepdims:
        raise UnsupportedModelError(
            f"Layer '{layer.name}': {type(layer).__name__}(keepdims=True) is not "
            f"supported; use keepdims=False and a Reshape."
        )

    def windows(x):
        shape = tf.shape(x)
        return tf.reshape(x, tf.stack([shape[0], -1, shape[-1]]))

    def valid_fn(x):
        return tf.ones([1, 1, 1], tf.bool)

    return MaxWindows(layer, windows, valid_fn, ties=TieRule.SPLIT)


register_rule(keras.layers.GlobalMaxPooling1D, lambda layer: _global_max(layer, 1))
register_rule(keras.layers.GlobalMaxPooling2D, lambda layer: _global_max(layer, 2))
