"""Exact (float64) dual norms of the gradients of a few chosen neurons.

The default certificate needs exact norms only for the neurons that can decide a
margin (the *candidates* of `keras_roll.certification.guarded_norms`, and the
first neuron within the guard of a zero-radius example). One reverse-mode pass
through the float64 twin's frozen tangent map gives the whole input gradient of
one neuron per example and direction slot, so a few neurons per example cost a
few tangent directions instead of the `D` of the full pass (docs/design.md,
"The default at float32 speed").

Example:

```python
fwd = twin64.compiled.primal(x)
n = exact_norms(twin64, fwd, np.array([[3, 17], [5, -1]]))   # Norms of [2, 2] arrays
```
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import tensorflow as tf

from keras_roll.compile.caches import batch_polymorphic
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.interpreter import Interpreter
from keras_roll.compile.rules.base import flatten_directions
from keras_roll.rounding.tangent_error import Norms

__all__ = ["exact_norms"]

_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(twin):
    fn = _COMPILED.get(twin)
    if fn is None:
        interp = twin.interpreter if twin.dtype == "float64" else \
            Interpreter(twin.program, "float64")
        # rows and live [b, C]: C, the neurons asked for, varies from call to call
        fn = batch_polymorphic(tf.function(functools.partial(_exact_pass, interp),
                                           reduce_retracing=True, autograph=False),
                               free=(1, 2))
        _COMPILED[twin] = fn
    return fn


def _exact_pass(interpreter, trace, rows, live):
    """`[b, C]` float64 (l2, linf, l1) of the gradients of neurons `rows` `[b, C]`, by
    reverse mode through the float64 twin's tangent pass."""
    x = trace.input
    c = tf.shape(rows)[1]
    v = tf.zeros(tf.concat([tf.shape(x)[:1], [c], tf.shape(x)[1:]], 0), tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(v)
        jvp = interpreter.tangent(trace, v, False)
        picked = tf.gather(jvp.neurons, rows[..., None], batch_dims=2)[..., 0]  # [b, C]
        target = tf.reduce_sum(picked * live)
    g = flatten_directions(tape.gradient(target, v))  # [b, C, D]
    a = tf.abs(g)
    return tf.sqrt(tf.reduce_sum(a * a, -1)), tf.reduce_max(a, -1), tf.reduce_sum(a, -1)


def exact_norms(twin, fwd, rows: np.ndarray, memory_budget: int | None = None) -> Norms:
    """Exact (float64) dual norms of the gradients of chosen neurons.

    One reverse-mode pass through the float64 twin's frozen tangent map gives
    the whole gradient of one neuron per example and direction slot, at the
    cost of a few tangent directions, so a few neurons per example cost little
    beside the `D` directions of the full pass.

    Args:
        twin: the float64 `Linearized` that made `fwd`.
        fwd: its `ForwardPass`.
        rows: `[b, C]` int neuron rows per example (-1: none).
        memory_budget: bytes per chunk (default the twin's).

    Returns:
        `Norms` of `[b, C]` arrays (0 where `rows` is -1).

    Example:

    ```python
    n = exact_norms(twin, fwd, np.array([[3, 17], [5, -1]]))
    ```
    """
    fn = _compiled(twin)
    rows = np.asarray(rows, np.int64)
    b, c = rows.shape
    out = [np.zeros((b, c)) for _ in range(3)]
    if not c:
        return Norms(*out)
    shape = tuple(int(s) for s in fwd.trace.input.shape[1:])
    per = 3 * twin.layout(shape).tangent_bytes(8)  # forward, backward, the gradient
    plan = plan_chunks(b, c, per, int(memory_budget or twin.memory_budget))
    for sl in plan.example_slices():
        trace = fwd.trace if (sl.start == 0 and sl.stop == b) else \
            twin.compiled.primal(tf.cast(fwd.trace.input[sl], tf.float64)).trace
        for start in plan.direction_starts():
            cols = slice(start, min(start + plan.per_chunk, c))
            r = rows[sl, cols]
            res = fn(trace, tf.constant(np.maximum(r, 0)),
                            tf.constant((r >= 0).astype(np.float64)))
            for o, t in zip(out, res):
                o[sl, cols] = np.where(r >= 0, t.numpy(), 0.0)
    return Norms(*out)
