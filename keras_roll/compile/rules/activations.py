"""Piecewise-linear activations: ReLU (max_value, threshold, negative_slope),
ReLU6, LeakyReLU, PReLU, `Activation` layers and activations fused into other
layers through `activation=`.

A final softmax or sigmoid is a link function: it is folded into the loss and the
twin reports the logits before it (`OutputLink`, whose `link` is a `Link`). The
neurons and breakpoints are those of docs/design.md, section "The maths".
"""

from __future__ import annotations

import dataclasses
import math

import keras
import tensorflow as tf

from keras_roll.compile.records import Record
from keras_roll.compile.rules.base import (
    NO_RECORD,
    Neurons,
    Op,
    Tangent,
    elementwise,
    flatten_directions,
    flatten_examples,
)
from keras_roll.compile.rules.registry import register_rule
from keras_roll.errors import UnsupportedModelError
from keras_roll.options import Choice


@dataclasses.dataclass(frozen=True, eq=False)
class ActivationRecord(Record):
    """What a piecewise-linear activation records on a batch.

    Attributes:
        z: `[B, *shape]` pre-activations.
        slope: `[B, *shape]` the slope of the piece each unit is on (the frozen
            pattern: 0/1 for ReLU).
        mask: optional `[B, T]` Keras sequence mask (False at padded steps,
            which create no neurons).
    """

    z: tf.Tensor
    slope: tf.Tensor
    mask: tf.Tensor | None = None


class Activation(Op):
    """A pointwise piecewise-linear activation with a frozen-slope twin.

    Args:
        layer: the layer the activation belongs to (for naming).
        fn: computes the activation exactly as the layer does.
        breakpoints: increasing breakpoints `b_1 < ... < b_m`.
        slopes: `m + 1` slopes, one per piece; floats or tensors broadcastable
            to the per-example shape (PReLU).
        name: name under which the neurons are reported.

    A neuron exactly on a breakpoint is put on the piece below it, as
    `keras.activations.relu` does (its margin is 0 either way).

    Example:

    ```python
    relu6 = Activation(layer, lambda z: keras.activations.relu(z, max_value=6.0),
                       breakpoints=[0.0, 6.0], slopes=[0.0, 1.0, 0.0])
    ```
    """

    owns_neurons = True

    def __init__(self, layer, fn, breakpoints, slopes, name=None):
        super().__init__(layer, name)
        if len(slopes) != len(breakpoints) + 1:
            raise ValueError(
                f"{len(breakpoints)} breakpoints need {len(breakpoints) + 1} slopes, "
                f"got {len(slopes)}."
            )
        if any(b >= c for b, c in zip(breakpoints, breakpoints[1:])):
            raise ValueError(f"Breakpoints must increase, got {breakpoints}.")
        self.fn = fn
        self.breakpoints = tuple(float(b) for b in breakpoints)
        self.slopes = tuple(slopes)
        self._plain_relu = self.breakpoints == (0.0,) and all(
            isinstance(s, (int, float)) for s in self.slopes) and self.slopes == (0.0, 1.0)
        # every frozen slope is 0 or 1: the tangent's product by it is exact
        self.binary_slopes = all(isinstance(s, (int, float)) and s in (0.0, 1.0)
                                 for s in self.slopes)

    def slope(self, z):
        """The frozen slope of every unit: the slope of the piece `z` is on."""
        slopes = [tf.cast(s, z.dtype) if tf.is_tensor(s) or hasattr(s, "value") else s
                  for s in self.slopes]
        if self._plain_relu:
            return tf.cast(z > 0, z.dtype)
        slope = tf.zeros_like(z) + slopes[0]
        for b, s in zip(self.breakpoints, slopes[1:]):
            slope = tf.where(z > b, tf.zeros_like(z) + s, slope)
        return slope

    def forward(self, inputs, mask):
        z = inputs[0]
        record = ActivationRecord(z, self.slope(z), mask)
        return tf.cast(self.fn(z), z.dtype), record

    def local(self, shape):
        return elementwise(shape)

    def tangent(self, tangents, record, mask):
        t = tangents[0]
        slope = record.slope
        batch = tf.shape(slope)[0]
        pre = t.per_example(batch)
        return Tangent(pre * slope[:, None], shared=False), flatten_directions(pre)

    def neurons(self, record):
        z = record.z
        inf = tf.constant(math.inf, z.dtype)
        below = tf.fill(tf.shape(z), inf)
        above = tf.fill(tf.shape(z), inf)
        piece = tf.zeros(tf.shape(z), tf.int32)
        for b in self.breakpoints:
            below = tf.where(z > b, z - b, below)
            piece += tf.cast(z > b, tf.int32)
        for b in reversed(self.breakpoints):
            above = tf.where(z <= b, b - z, above)
        if record.mask is not None:
            m = tf.cast(record.mask, tf.bool)
            m = tf.reshape(m, tf.concat([tf.shape(m), tf.ones(tf.rank(z) - tf.rank(m),
                                                                 tf.int32)], 0))
            valid = tf.broadcast_to(m, tf.shape(z))
        else:
            valid = tf.ones(tf.shape(z), tf.bool)
        flat = flatten_examples
        return Neurons(flat(z), flat(below), flat(above), flat(valid), flat(piece))

    def neuron_shape(self, record):
        return tuple(int(d) for d in record.z.shape[1:])


class Link(Choice):
    """The link function folded off a model's output: the twin reports the logits
    before it (`Linearized.output_link`; None when the model ends in logits).

    * `SOFTMAX` ("softmax"): one softmax over the classes.
    * `SIGMOID` ("sigmoid"): a sigmoid per logit.

    A `Link` is also its string (`Link.SOFTMAX == "softmax"`); compare with `is`
    inside the library.

    Example:

    ```python
    Link.parse("sigmoid")                     # Link.SIGMOID
    keras_roll.linearize(model).output_link   # Link.SOFTMAX for a softmax classifier
    Link.SOFTMAX.apply(logits)                # the model's probabilities
    ```
    """

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"

    def apply(self, logits):
        """The model output from its logits: the link applied (over the last axis
        for a softmax)."""
        if self is Link.SOFTMAX:
            return tf.nn.softmax(logits, axis=-1)
        return tf.sigmoid(logits)


class OutputLink(Op):
    """A softmax / sigmoid at the model output, folded into the loss.

    The twin reports the logits (its input). The graph pass refuses it anywhere
    but at the very end of the model.

    Args:
        layer: the Keras layer that applies the link.
        link: a `Link` or its string ("softmax", "sigmoid").
        name: the op's name (default: the layer's).

    Example:

    ```python
    @keras_roll.register_rule(MySoftmax)
    def my_softmax_rule(layer):
        return OutputLink(layer, Link.SOFTMAX)    # op.link is Link.SOFTMAX
    ```
    """

    def __init__(self, layer, link: Link | str, name=None):
        super().__init__(layer, name)
        self.link = Link.parse(link, "link")

    def forward(self, inputs, mask):
        return inputs[0], NO_RECORD

    def tangent(self, tangents, record, mask):
        return tangents[0], None


def _relu_like(layer, negative_slope=0.0, max_value=None, threshold=0.0, name=None):
    breakpoints, slopes = [float(threshold)], [float(negative_slope), 1.0]
    if max_value is not None:
        if float(max_value) <= float(threshold):
            raise UnsupportedModelError(
                f"Layer '{layer.name}': ReLU with max_value={max_value} <= "
                f"threshold={threshold} is constant; remove it or fix its arguments."
            )
        breakpoints.append(float(max_value))
        slopes.append(0.0)

    def fn(z):
        return keras.activations.relu(
            z, negative_slope=negative_slope, max_value=max_value, threshold=threshold
        )

    return Activation(layer, fn, breakpoints, slopes, name=name)


_LINKS = {}
_PIECEWISE = {}


def _init_tables():
    acts = keras.activations
    _LINKS.update({acts.softmax: Link.SOFTMAX, acts.sigmoid: Link.SIGMOID,
                   tf.nn.softmax: Link.SOFTMAX, tf.nn.sigmoid: Link.SIGMOID,
                   tf.sigmoid: Link.SIGMOID, keras.ops.softmax: Link.SOFTMAX,
                   keras.ops.sigmoid: Link.SIGMOID})
    _PIECEWISE.update({
        acts.relu: {}, keras.ops.relu: {}, tf.nn.relu: {},
        acts.relu6: {"max_value": 6.0}, keras.ops.relu6: {"max_value": 6.0},
        tf.nn.relu6: {"max_value": 6.0},
        acts.leaky_relu: {"negative_slope": 0.2},
        keras.ops.leaky_relu: {"negative_slope": 0.2},
        tf.nn.leaky_relu: {"negative_slope": 0.2},
    })


_init_tables()


def activation_ops(layer, fn, name=None) -> list[Op]:
    """Ops for an activation function `fn` (from `activation=` or `Activation`).

    Returns `[]` for the identity, `[Activation]` for a piecewise-linear function,
    `[OutputLink]` for softmax / sigmoid (legal only at the model output), and
    raises `UnsupportedModelError` for anything else.
    """
    if fn is None or fn is keras.activations.linear:
        return []
    if fn in _PIECEWISE:
        return [_relu_like(layer, name=name, **_PIECEWISE[fn])]
    if fn in _LINKS:
        return [OutputLink(layer, _LINKS[fn], name=name)]
    fn_name = getattr(fn, "__name__", repr(fn))
    raise UnsupportedModelError(
        f"Layer '{layer.name}' of class {type(layer).__name__} uses the activation "
        f"'{fn_name}', which is not piecewise linear. keras_roll certifies networks "
        f"of affine layers and ReLU-family activations (relu, relu6, leaky_relu, "
        f"ReLU/LeakyReLU/PReLU layers); softmax and sigmoid are allowed only at the "
        f"output. Replace '{fn_name}' by a ReLU-family activation or register a rule "
        f"with keras_roll.register_rule."
    )


@register_rule(keras.layers.ReLU)
def _relu_rule(layer):
    return _relu_like(layer, negative_slope=layer.negative_slope,
                      max_value=layer.max_value, threshold=layer.threshold)


@register_rule(keras.layers.LeakyReLU)
def _leaky_relu_rule(layer):
    return _relu_like(layer, negative_slope=layer.negative_slope)


@register_rule(keras.layers.PReLU)
def _prelu_rule(layer):
    def fn(z):  # PReLU.call in the dtype of `z` (float64 passes)
        return tf.nn.relu(z) - tf.cast(layer.alpha, z.dtype) * tf.nn.relu(-z)

    return Activation(layer, fn, [0.0], [layer.alpha, 1.0])


@register_rule(keras.layers.Activation)
def _activation_rule(layer):
    return activation_ops(layer, layer.activation)


@register_rule(keras.layers.Softmax)
def _softmax_rule(layer):
    return OutputLink(layer, Link.SOFTMAX)
