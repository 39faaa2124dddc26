"""What a call traces: every `tf.function` trace inside a `with traces() as seen:`
block, with its CPU seconds and the ops of its graph (the loops' bodies counted once).

A trace is TensorFlow building a function's graph from its Python: the first call of a
compiled pass pays it, a warm call does not. `summary` groups the traces by function
name, so a pass traced once per norm, per guard or per batch size shows up as a count
above 1. The CPU time of a trace includes the traces nested in it (a compiled function
called while another one is traced is traced too, and inlined).

    python -m benchmarks.traces            # robust_radius on a small MLP, l1 / l2 / l_inf

Example:

```python
with traces() as seen:
    keras_roll.robust_radius(model, x, norms=(1, 2, np.inf), verbose=False)
print(summary(seen))
```
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from typing import NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tensorflow.python.eager.polymorphic_function import (  # noqa: E402
    tracing_compilation as _tracing,
)

__all__ = ["Trace", "summary", "traces"]


class Trace(NamedTuple):
    """One trace: the function's name, its CPU seconds (nested traces included), the
    ops of its graph."""

    name: str
    cpu: float
    ops: int


@contextlib.contextmanager
def traces():
    """Records every trace made inside the block into the list it yields (`Trace`s)."""
    seen: list = []
    original = _tracing._create_concrete_function

    def recording(function_type, type_context, func_graph, tracing_options):
        start = time.process_time()
        out = original(function_type, type_context, func_graph, tracing_options)
        name = _name(tracing_options.python_function) or str(tracing_options.name)
        seen.append(Trace(name, time.process_time() - start,
                          len(out.graph.get_operations())))
        return out

    _tracing._create_concrete_function = recording
    try:
        yield seen
    finally:
        _tracing._create_concrete_function = original


def _name(fn):
    """The qualified name of the Python function under TensorFlow's wrappers and
    `functools.partial`s."""
    for _ in range(8):
        inner = getattr(fn, "__wrapped__", None) or getattr(fn, "func", None)
        if inner is None:
            break
        fn = inner
    return getattr(fn, "__qualname__", None)


def summary(seen: list) -> str:
    """Lines `count x name: CPU s, ops` per traced function, the costliest first, and a
    total line."""
    count, cpu, ops = collections.Counter(), collections.Counter(), collections.Counter()
    for t in seen:
        count[t.name] += 1
        cpu[t.name] += t.cpu
        ops[t.name] += t.ops
    lines = [f"  {count[k]} x {k}: {cpu[k]:.2f} CPU s, {ops[k]} ops"
             for k in sorted(cpu, key=cpu.get, reverse=True)]
    return "\n".join([f"{len(seen)} traces of {len(count)} functions"] + lines)


def main():
    import keras
    import numpy as np

    import keras_roll

    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(24, activation="relu")(inp)
    h = keras.layers.Dense(24, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    x = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    for call in ("first", "warm"):
        with traces() as seen:
            cpu = time.process_time()
            keras_roll.robust_radius(model, x, norms=(1, 2, np.inf), verbose=False)
            cpu = time.process_time() - cpu
        print(f"{call} call: {cpu:.2f} CPU s; {summary(seen)}", flush=True)


if __name__ == "__main__":
    main()
