"""The rule for `keras_roll.layers.ScoRNN`: the SimpleRNN twin with `W` orthogonal.

A scoRNN step is a SimpleRNN step, `h_t = act(x_t K + h_{t-1} W + b)`, whose
recurrent matrix `W = (I + A)^-1 (I - A) D` is a function of the weights only.
Its cell exposes `kernel`, `recurrent_kernel` (`W`, recomputed from the
variables at every read, so that gradients reach `A` and `keras.StatelessScope`
mappings are honoured), `bias` and `units`, so `SimpleRNNOp` linearizes it
unchanged: one neuron per unit and unpadded time step.
"""

from __future__ import annotations

from keras_roll.errors import UnsupportedModelError
from keras_roll.layers.scornn import ScoRNN
from keras_roll.rules.activations import Activation, activation_ops
from keras_roll.rules.recurrent import SimpleRNNOp
from keras_roll.rules.registry import register_rule


@register_rule(ScoRNN)
def _scornn_rule(layer):
    for attr, why in (("stateful", "carries state between batches"),
                      ("return_state", "returns its state as a second output")):
        if getattr(layer, attr):
            raise UnsupportedModelError(
                f"Layer '{layer.name}' (ScoRNN) has {attr}=True, which {why}; "
                f"keras_roll linearizes a model as a function of its input alone. "
                f"Rebuild it with {attr}=False."
            )
    try:
        acts = activation_ops(layer, layer.cell.activation)
    except UnsupportedModelError:
        acts = []
    if len(acts) != 1 or not isinstance(acts[0], Activation):
        name = getattr(layer.cell.activation, "__name__", layer.cell.activation)
        raise UnsupportedModelError(
            f"Layer '{layer.name}' (ScoRNN) needs a ReLU-family activation to be "
            f"piecewise linear; it uses '{name}'. Build it with "
            f"activation=keras.activations.leaky_relu (the default), 'relu' or 'relu6'."
        )
    return SimpleRNNOp(layer, acts[0])
