"""Caches kept on the object they serve, so that they go when it goes.

Compiled functions, gradient engines and twins built for a model usually refer back
to it. Kept in a module-level `weakref.WeakKeyDictionary`, they would keep the model
alive for good (the dictionary holds its values strongly, and the values hold the
key): a notebook that trains and attributes many models would keep every one of
them. Kept on the object itself (outside Keras' attribute tracking), they form a
reference cycle with it that the garbage collector frees together.

Example:

```python
fn = cached(twin, ("region", guard), lambda: tf.function(...))   # built once per twin
```
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import tensorflow as tf

__all__ = ["cached", "compiled_call"]

_ATTRIBUTE = "_keras_roll_cache"


def cached(owner, key: Hashable, make: Callable[[], Any]):
    """`owner`'s value for `key`: `make()` the first time, the same object after.

    Args:
        owner: a Keras model, a twin, an engine (an object without a `__dict__`
            gets a new value every time).
        key: what the value is for (namespaced by the caller, e.g. `("riemann",)`).
        make: builds the value; it may refer to `owner`.
    """
    try:
        cache = vars(owner).get(_ATTRIBUTE)
        if cache is None:
            cache = {}
            object.__setattr__(owner, _ATTRIBUTE, cache)  # not a tracked Keras attribute
    except (TypeError, AttributeError):  # no __dict__: nothing to keep it on
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def compiled_call(model):
    """`model(x, training=False)` compiled once per model, for any batch size: callers
    that evaluate a Keras model on many small batches (adversarial checks,
    faithfulness curves) would otherwise pay tens of milliseconds of eager Python per
    call of a functional model."""
    return cached(model, ("call",), lambda: tf.function(
        lambda x: model(x, training=False), reduce_retracing=True, autograph=False))
