"""The paper's distance regularizer: a hinge on the certified l2 margin itself,
`lam * mean_x max(0, 1 - eps_2(x) / C)` with `eps_2(x) = min_j |z_j| /
||grad_x z_j||_2` (Prop. 6), differentiated with the activation pattern held fixed
(only the binding neuron gets a gradient). Figure 1 compares it with relaxed ROLL.

Example:

```python
inp = keras.Input((2,))
wrapped = keras.Model(inp, DistanceRegularizer(model, lam=1.0, C=5.0)(inp))
```
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import keras_roll
from keras_roll.roll import neuron_grad_sq

__all__ = ["DistanceRegularizer", "distance_loss", "l2_margin"]


def l2_margin(lin: keras_roll.Linearized, x) -> tf.Tensor:
    """The certified l2 margin `min_j |z_j - b_j| / ||grad_x z_j||_2`, `[B]`, differentiable
    with respect to the weights (the activation pattern of `x` held fixed).

    Neurons with a zero gradient never bind (their ratio is inf).

    Example:

    ```python
    eps = l2_margin(keras_roll.linearize(model), x)   # equals certify(model, x).margins[2]
    ```
    """
    x = lin.check_input(x)
    fwd = lin.primal(x)
    sq = neuron_grad_sq(lin, x, forward=fwd)  # exact, [B, N]
    n = fwd.neurons
    dist = tf.minimum(n.below, n.above)
    usable = n.valid & (sq > 0)
    safe_sq = tf.where(usable, sq, tf.ones_like(sq))  # no 0 / 0 in the gradient
    inf = tf.fill(tf.shape(sq), tf.constant(np.inf, sq.dtype))
    ratio = tf.where(usable, dist / tf.sqrt(safe_sq), inf)
    return tf.reduce_min(ratio, axis=1)


def distance_loss(lin: keras_roll.Linearized, x, C: float) -> tf.Tensor:
    """The distance regularizer `max(0, 1 - eps_2(x) / C)` of every example, `[B]`.

    Example:

    ```python
    reg = distance_loss(keras_roll.linearize(model), x, C=5.0)
    ```
    """
    if not C > 0:
        raise ValueError(f"C must be > 0 (the margin the hinge asks for), got C={C!r}.")
    eps = l2_margin(lin, x)
    return tf.nn.relu(1.0 - eps / tf.cast(C, eps.dtype))


class DistanceRegularizer(keras.layers.Layer):
    """Adds `lam * mean(distance_loss(model, x, C))` to the loss of `model(x)` in training
    and in evaluation (so `val_loss` is the training objective, as for ROLL).

    It holds `model` (sharing its weights) and returns `model(x)` unchanged.

    Example:

    ```python
    inp = keras.Input((2,))
    wrapped = keras.Model(inp, DistanceRegularizer(model, lam=1.0, C=5.0)(inp))
    ```
    """

    def __init__(self, model: keras.Model, lam: float = 1.0, C: float = 5.0, **kwargs):
        super().__init__(**kwargs)
        if not lam >= 0:
            raise ValueError(f"lam must be >= 0, got lam={lam!r}.")
        self.inner_model = model
        self.lam, self.C = float(lam), float(C)
        self.lin = keras_roll.linearize(model)
        self.tracker = keras.metrics.Mean(name="distance_loss")

    @property
    def metrics(self):
        return [self.tracker]

    @tf.autograph.experimental.do_not_convert
    def call(self, inputs, training=None):
        reg = tf.reduce_mean(distance_loss(self.lin, inputs, self.C))
        self.add_loss(self.lam * reg)
        self.tracker.update_state(reg)
        return self.inner_model(inputs, training=training)

    def compute_output_spec(self, inputs, training=None):
        return self.inner_model.compute_output_spec(inputs)
