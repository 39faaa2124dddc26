"""The rule for `keras_roll.layers.ScoRNN`: the SimpleRNN twin with `W` orthogonal.

A scoRNN step is a SimpleRNN step, `h_t = act(x_t K + h_{t-1} W + b)`, whose
recurrent matrix `W = (I + A)^-1 (I - A) D` is a function of the weights only.
Its cell exposes `kernel`, `recurrent_kernel` (`W`, recomputed from the
variables at every read, so that gradients reach `A` and `keras.StatelessScope`
mappings are honoured), `bias` and `units`, so `SimpleRNNOp` linearizes it
unchanged: one neuron per unit and unpadded time step.
"""

from __future__ import annotations

from keras_roll.compile.rules.recurrent import simple_rnn_op
from keras_roll.compile.rules.registry import register_rule
from keras_roll.layers.scornn import ScoRNN


@register_rule(ScoRNN)
def _scornn_rule(layer):
    return simple_rnn_op(
        layer, name="ScoRNN",
        hint="Build it with activation=keras.activations.leaky_relu (the default), "
             "'relu' or 'relu6'.")
