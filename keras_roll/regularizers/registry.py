"""The registry of the regularizer family: `register_regularizer`, through which
`keras_roll.wrap(model, regularizer=config)`, `regularizer_loss` and the loading
of saved models find every regularizer config.

Registering a config class is the only step that makes a regularizer known: no
table is kept by hand, and the error for an unknown config lists the
registered ones. docs/design.md, section "Regularizers beside ROLL".

A config class of one's own is registered as `register_regularizer`'s example shows
(docs/guide.md, "A regularizer of your own", trains one).

Example:

```python
registration_of(MMRConfig()).name             # "mmr": its layer, its metric "mmr_loss"
"IBPConfig" in registered_regularizers()      # True: wrap(regularizer=IBPConfig(...))
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["Registration", "register_regularizer", "registered_regularizers",
           "registration_of", "resolve_regularizer_config"]


class Registration(NamedTuple):
    """How the family trains one registered config class.

    Attributes:
        config_class: the frozen config dataclass.
        name: the short name (`log_name` without `_loss`: "mmr", "roll", ...),
            which names the layer `f"{name}_regularizer"` and the wrapped model.
        layer: the layer class `wrap` builds, called `layer(model, config,
            name=...)`; None: `SupervisedRegularizer` (a term that may read
            the step's labels).
        make_term: `(config, model) -> term`, a callable `term(x, y, training)
            -> TermResult` (default: the config's `term` method).
        resolve: `(config, **overrides) -> config`, the config with fields
            replaced and validated (default: `resolve_regularizer_config`).
    """

    config_class: type
    name: str
    layer: type | None
    make_term: Callable[[Any, Any], Callable]
    resolve: Callable[..., Any]


_REGISTRY: dict[str, Registration] = {}


def register_regularizer(config_class: type | None = None, *, layer: type | None = None,
                         make_term: Callable | None = None, resolve: Callable | None = None):
    """Registers a regularizer config class (a decorator; returns the class).

    The class must be a dataclass with the fields `lam` (the weight of the term)
    and `on_eval`, have a string class attribute `log_name` (its metric,
    ending in `_loss`), and a method `term(model)` returning a callable
    `term(x, y, training) -> TermResult` (or pass `make_term`). Subclass
    `keras_roll.regularizers.RegularizerConfig` for the checks of `lam` and
    `on_eval` and for saving. Class names are the keys of saved models, so
    they must be unique.

    Args:
        config_class: the class (when used as `@register_regularizer`).
        layer: the layer class `wrap` builds (default `SupervisedRegularizer`).
        make_term: `(config, model) -> term` (default `config.term(model)`).
        resolve: `(config, **overrides) -> config` (default
            `resolve_regularizer_config`).

    Returns:
        The class (or a decorator, when called with keywords only).

    Raises:
        TypeError: the class lacks one of the parts above (named), or another
            class of the same name is registered.

    Example:

    ```python
    @register_regularizer
    @dataclasses.dataclass(frozen=True)
    class ActivationL1Config(RegularizerConfig):
        lam: float = 1e-3
        on_eval: bool | None = None
        log_name = "activation_l1_loss"

        def term(self, model):
            ...
    ```
    """
    if config_class is None:
        return lambda cls: register_regularizer(cls, layer=layer, make_term=make_term,
                                                resolve=resolve)
    cls = config_class
    what = f"register_regularizer({getattr(cls, '__name__', cls)!r})"
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        raise TypeError(f"{what}: a regularizer config is a class decorated with "
                        f"@dataclasses.dataclass(frozen=True) (below @register_regularizer).")
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = sorted({"lam", "on_eval"} - fields)
    if missing:
        raise TypeError(f"{what}: the config needs the field(s) {missing} (lam: the weight "
                        f"of the term; on_eval: None or False); its fields are "
                        f"{sorted(fields)}.")
    log_name = getattr(cls, "log_name", None)
    if not isinstance(log_name, str) or not log_name.endswith("_loss"):
        raise TypeError(f"{what}: the config needs a class attribute log_name, the name of "
                        f"its metric ending in '_loss' (e.g. 'mmr_loss'); got {log_name!r}.")
    if make_term is None and not callable(getattr(cls, "term", None)):
        raise TypeError(f"{what}: the config needs a method term(model) returning a callable "
                        f"term(x, y, training) -> TermResult.")
    known = _REGISTRY.get(cls.__name__)
    def origin(c):
        return c.__module__, c.__qualname__

    if known is not None and origin(known.config_class) != origin(cls):
        raise TypeError(f"{what}: another regularizer config named {cls.__name__!r} is "
                        f"registered (from {known.config_class.__module__}); saved models "
                        f"name configs by class name, so give this one another name.")
    _REGISTRY[cls.__name__] = Registration(
        config_class=cls, name=log_name.removesuffix("_loss"), layer=layer,
        make_term=make_term or (lambda config, model: config.term(model)),
        resolve=resolve or (lambda config, **overrides: resolve_regularizer_config(
            type(config), config, **overrides)))
    return cls


def registered_regularizers() -> dict[str, Registration]:
    """The registered config classes by class name (a copy).

    Example:

    ```python
    sorted(registered_regularizers())   # ['CrownIBPConfig', 'IBPConfig', ...]
    ```
    """
    return dict(_REGISTRY)


def registration_of(config, what: str = "regularizer") -> Registration:
    """The `Registration` of a config object, or of a config class by name.

    Raises:
        TypeError: not an instance of a registered class (the message lists them).

    Example:

    ```python
    registration_of(MMRConfig()).name     # "mmr"
    ```
    """
    if isinstance(config, str):
        found = _REGISTRY.get(config)
    else:
        found = _REGISTRY.get(type(config).__name__)
        if found is not None and not isinstance(config, found.config_class):
            found = None
    if found is None:
        raise TypeError(f"{what} must be the config of a registered regularizer, one of "
                        f"{sorted(_REGISTRY)} (keras_roll.regularizers.register_regularizer "
                        f"adds one); got {config!r}.")
    return found


def resolve_regularizer_config(cls: type, config=None, **overrides):
    """`config` (default `cls()`) with the fields in `overrides` replaced, validated.

    Raises:
        TypeError: `config` is not a `cls`, or an override names no field
            (the message lists the fields).

    Example:

    ```python
    resolve_regularizer_config(MMRConfig, None, p="inf", k_B=20)
    ```
    """
    if config is None:
        config = cls()
    elif not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__} or None, got {config!r}.")
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"Unknown {cls.__name__} field(s) {unknown}; its fields are {fields}.")
    return dataclasses.replace(config, **overrides) if overrides else config
