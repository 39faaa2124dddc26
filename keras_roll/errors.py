"""Exceptions raised by keras_roll."""


class UnsupportedModelError(ValueError):
    """The model contains something keras_roll cannot linearize exactly.

    Raised for layers that are not piecewise linear (a hidden `sigmoid`, `tanh`
    or `gelu`, a `Lambda`), for subclassed models whose graph cannot be read, and
    for layer configurations that would make the certificate wrong (a stateful
    RNN, `return_state=True`, ...). The message names the layer, its class and
    the way forward, usually `keras_roll.register_rule`.
    """
