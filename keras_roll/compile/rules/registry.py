"""The per-layer rule registry (modelled on tfmot's per-layer quantize registry).

A *rule* is a callable `rule(layer) -> Op | Sequence[Op]` that compiles one call
of a layer into ops (see `keras_roll.compile.rules.base`). Rules are looked up by the
exact class of the layer: a subclass that overrides `call` must not silently
inherit its parent's rule, so it needs a rule of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from keras_roll.compile.rules.base import Op
from keras_roll.errors import UnsupportedModelError

Rule = Callable[[object], "Op | Sequence[Op]"]

_RULES: dict[type, Rule] = {}


def register_rule(layer_class: type, rule: Rule | None = None, *, override: bool = False):
    """Registers how keras_roll linearizes a layer class.

    Can be used as a function or as a decorator.

    Args:
        layer_class: the layer (or Keras operation) class, matched exactly.
        rule: `rule(layer) -> Op | list[Op]`. Build it from
            `keras_roll.compile.rules.Linear` (affine layers), `keras_roll.compile.rules.Activation`
            (piecewise-linear activations) or your own `keras_roll.compile.rules.Op`.
        override: allow replacing an existing rule for `layer_class`.

    Returns:
        The rule (so that the decorator form leaves the function usable).

    Example:

    ```python
    class Double(keras.layers.Layer):
        def call(self, x):
            return 2.0 * x

    @keras_roll.register_rule(Double)
    def _double(layer):
        return keras_roll.compile.rules.Linear(layer, lambda xs: 2.0 * xs[0])
    ```
    """
    if not isinstance(layer_class, type):
        raise TypeError(
            f"register_rule expects a layer class, got {layer_class!r} "
            f"of type {type(layer_class).__name__}."
        )

    def _register(fn):
        if not callable(fn):
            raise TypeError(f"A rule must be callable as rule(layer); got {fn!r}.")
        if layer_class in _RULES and not override and _RULES[layer_class] is not fn:
            raise ValueError(
                f"A rule for {layer_class.__name__} is already registered; pass "
                f"override=True to replace it."
            )
        _RULES[layer_class] = fn
        return fn

    if rule is None:
        return _register
    return _register(rule)


def unregister_rule(layer_class: type) -> None:
    """Removes the rule registered for `layer_class` (no error if absent)."""
    _RULES.pop(layer_class, None)


def get_rule(layer) -> Rule:
    """Returns the rule for `layer`, or raises `UnsupportedModelError`."""
    rule = _RULES.get(type(layer))
    if rule is not None:
        return rule
    name = getattr(layer, "name", "?")
    cls = type(layer).__name__
    parents = [
        base.__name__ for base in type(layer).__mro__[1:] if base in _RULES
    ]
    hint = (
        f" It subclasses {parents[0]}, which is supported, but a subclass may change "
        f"`call`, so it needs its own rule."
        if parents
        else ""
    )
    raise UnsupportedModelError(
        f"Layer '{name}' of class {cls} is not piecewise linear as far as keras_roll "
        f"knows.{hint} If it is affine or piecewise linear in its input, register a "
        f"rule with `keras_roll.register_rule({cls}, rule)`; otherwise replace it "
        f"(e.g. a hidden sigmoid/tanh by ReLU)."
    )


def compile_layer(layer) -> list[Op]:
    """Applies the registered rule to `layer` and returns its ops."""
    ops = get_rule(layer)(layer)
    if isinstance(ops, Op):
        return [ops]
    ops = list(ops)
    if not all(isinstance(op, Op) for op in ops):
        raise TypeError(
            f"The rule for {type(layer).__name__} returned {ops!r}; a rule must "
            f"return an Op or a list of Ops."
        )
    return ops


def registered_classes() -> list[type]:
    """The layer classes that have a rule, in registration order."""
    return list(_RULES)
