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

import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["batch_polymorphic", "cached", "compiled_call"]

_ATTRIBUTE = "_keras_roll_cache"
_NEW_CACHE = threading.Lock()  # held only while an owner's first cache is put on it


class _Cache:
    """One owner's values by key, each built once: a lock per key, so that replica
    threads asking for the same value wait for one `make()` (one trace), while values
    for other keys (a `make()` may ask for them) are built meanwhile."""

    __slots__ = ("guard", "locks", "values")

    def __init__(self):
        self.values: dict = {}
        self.locks: dict = {}
        self.guard = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], Any]):
        try:
            return self.values[key]
        except KeyError:
            pass
        with self.guard:
            lock = self.locks.setdefault(key, threading.RLock())
        with lock:  # an RLock: a make() asking for its own key recurses, as unlocked
            if key not in self.values:
                self.values[key] = make()
            return self.values[key]


def cached(owner, key: Hashable, make: Callable[[], Any]):
    """`owner`'s value for `key`: `make()` the first time, the same object after.

    Thread-safe: threads that ask for the same value at once (the replicas of
    `keras_roll.distribute.Replicas`) get one `make()`, so one compiled function and
    one trace.

    Args:
        owner: a Keras model, a twin, an engine (an object without a `__dict__`
            gets a new value every time).
        key: what the value is for (namespaced by the caller, e.g. `("riemann",)`).
        make: builds the value; it may refer to `owner`.

    Example:

    ```python
    fn = cached(model, ("call",), lambda: tf.function(model))   # the same fn next time
    ```
    """
    try:
        cache = vars(owner).get(_ATTRIBUTE)
        if cache is None:
            with _NEW_CACHE:
                cache = vars(owner).get(_ATTRIBUTE)
                if cache is None:
                    cache = _Cache()
                    object.__setattr__(owner, _ATTRIBUTE, cache)  # not tracked by Keras
    except (TypeError, AttributeError):  # no __dict__: nothing to keep it on
        return make()
    return cache.get(key, make)


def compiled_call(model):
    """`model(x, training=False)` compiled once per model, for any batch size: callers
    that evaluate a Keras model on many small batches (adversarial checks,
    faithfulness curves) would otherwise pay tens of milliseconds of eager Python per
    call of a functional model. Its first trace takes any batch size
    (`batch_polymorphic`): the searches' batches shrink as examples finish."""
    return cached(model, ("call",), lambda: batch_polymorphic(tf.function(
        lambda x: model(x, training=False), reduce_retracing=True, autograph=False)))


def batch_polymorphic(fn, batched: int | None = None, free: tuple = ()):
    """`fn` (a `tf.function`) whose first trace already takes any batch size.

    A `tf.function(..., reduce_retracing=True)` traces its first call for the
    shapes it sees and traces again, with the differing axes relaxed, at the first
    call of another shape: `certify` paid both traces (seconds each on a CNN) when
    its second batch, or the last slice of a data set, had another size. The
    wrapper traces the first call of each signature (the tensors' dtypes and shapes
    past the leading axis, the other arguments' values) with the leading axis of
    every tensor argument relaxed to None, so that later batch sizes reuse that
    graph; `reduce_retracing` relaxes the other axes as before. While functions run
    eagerly (`tf.config.run_functions_eagerly(True)`) nothing is traced ahead: `fn`
    runs its Python, and a graph traced for nothing would cost what the call does.

    Args:
        fn: a `tf.function` whose tensor arguments lead with the batch axis
            (the traces and per-example arrays of the twin's passes).
        batched: how many of the leading positional arguments lead with the batch
            axis (None: all of them); the tensors of the others keep their shapes
            (e.g. an input shape given as a tensor).
        free: positions of arguments whose tensors are traced with every axis free
            (their rank kept), e.g. rows `[B, C]` whose count `C` varies from call
            to call.

    Returns:
        A callable with `fn`'s arguments and results.

    Example:

    ```python
    fn = batch_polymorphic(tf.function(pass_fn, reduce_retracing=True))
    fn(trace_of_4_examples)   # one trace, with batch None
    fn(trace_of_3_examples)   # the same graph
    ```
    """
    lock = threading.Lock()
    traced: set = set()

    def call(*args):
        if tf.config.functions_run_eagerly():  # `fn` runs its Python: nothing to trace
            return fn(*args)
        modes = [_mode(i, batched, free) for i in range(len(args))]
        key = tuple(_signature(v, mode) for a, mode in zip(args, modes)
                    for v in tf.nest.flatten(a))
        if key not in traced:
            with lock:
                if key not in traced:
                    fn.get_concrete_function(*(
                        tf.nest.map_structure(lambda v, m=mode: _spec(v, m), a)
                        for a, mode in zip(args, modes)))
                    traced.add(key)
        return fn(*args)

    call.python_function = fn
    if hasattr(fn, "experimental_get_tracing_count"):
        call.experimental_get_tracing_count = fn.experimental_get_tracing_count
    return call


def _mode(position: int, batched: int | None, free: tuple) -> str:
    """How the tensors of the argument at `position` are traced: "free" (every axis),
    "batch" (the leading axis) or "exact" (their shapes)."""
    if position in free:
        return "free"
    return "batch" if batched is None or position < batched else "exact"


def _signature(value, mode: str = "batch"):
    """What of one argument leaf decides a trace, the free axes left out (`_mode`): a
    tensor's (or array's, which `tf.function` takes as a tensor) dtype and trailing
    shape (its shape; its rank), a variable's dtype and shape, a composite tensor's spec,
    another value itself. Never an object's identity, so that the signatures seen stay
    few however many calls there are."""
    if isinstance(value, (tf.Tensor, np.ndarray)):
        shape = {"batch": tuple(value.shape[1:]), "exact": tuple(value.shape),
                 "free": value.ndim}[mode]
        return type(value), value.dtype, shape if value.ndim else ()
    if isinstance(value, tf.Variable):
        return tf.Variable, value.dtype, tuple(value.shape)
    if isinstance(value, (tf.RaggedTensor, tf.SparseTensor)):  # by spec, batch included
        return type(value), tf.type_spec_from_value(value)
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"batch_polymorphic: an argument of type {type(value).__name__} ({value!r:.80}) "
            f"is neither a tensor, an array nor hashable, and tf.function cannot trace it: "
            f"pass it as a tensor or as an immutable value (a tuple, not a set or a list "
            f"inside an object).") from None
    return type(value), value


def _spec(value, mode: str):
    """A tensor's (or array's) `tf.TensorSpec` with its free axes None (`_mode`); other
    values as given."""
    if not isinstance(value, (tf.Tensor, np.ndarray)) or not value.ndim:
        return value
    shape = {"batch": [None, *value.shape[1:]], "exact": list(value.shape),
             "free": [None] * value.ndim}[mode]
    return tf.TensorSpec(shape, tf.as_dtype(value.dtype))
