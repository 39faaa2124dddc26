"""What a call traces: every `tf.function` trace inside a `with traces() as seen:`
block, with its CPU seconds and the ops of its graph (the loops' bodies counted once),
and the CPU seconds of each traced graph's first run.

A trace is TensorFlow building a function's graph from its Python: the first call of a
compiled pass pays it, a warm call does not. `summary` groups the traces by function
name, so a pass traced once per norm, per guard or per batch size shows up as a count
above 1. The CPU time of a trace includes the traces nested in it (a compiled function
called while another one is traced is traced too, and inlined). A graph's first run
(eager) also pays TensorFlow's instantiation of it (Grappler's rewrites, the kernels'
creation): `Trace.first_run` holds that run's CPU seconds, the run itself included
(0 for a graph only inlined into another one).

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
    atomic_function as _atomic,
)
from tensorflow.python.eager.polymorphic_function import (  # noqa: E402
    tracing_compilation as _tracing,
)

__all__ = ["Trace", "summary", "traces"]


class Trace(NamedTuple):
    """One trace: the function's name, its CPU seconds (nested traces included), the
    ops of its graph, and the CPU seconds of the graph's first eager run (0 where it
    did not run eagerly inside the block); `nested` where it was traced while another
    function was (its CPU seconds are inside that one's)."""

    name: str
    cpu: float
    ops: int
    first_run: float = 0.0
    nested: bool = False


@contextlib.contextmanager
def traces():
    """Records every trace made inside the block into the list it yields (`Trace`s);
    each one's `first_run` is filled in when its graph first runs eagerly."""
    seen: list = []
    by_graph: dict = {}  # the traced graph's function name -> its index in `seen`
    original = _tracing._create_concrete_function
    call_flat = _atomic.AtomicFunction.call_flat

    depth = [0]

    def recording(function_type, type_context, func_graph, tracing_options):
        start = time.process_time()
        depth[0] += 1
        try:
            out = original(function_type, type_context, func_graph, tracing_options)
        finally:
            depth[0] -= 1
        name = _name(tracing_options.python_function) or str(tracing_options.name)
        by_graph[out.function_def.signature.name] = len(seen)
        seen.append(Trace(name, time.process_time() - start,
                          len(out.graph.get_operations()), nested=depth[0] > 0))
        return out

    def first_run(self, *args):
        i = by_graph.pop(self.name.decode() if isinstance(self.name, bytes) else self.name,
                         None)
        if i is None or not self._bound_context.executing_eagerly():
            return call_flat(self, *args)
        start = time.process_time()
        out = call_flat(self, *args)
        seen[i] = seen[i]._replace(first_run=time.process_time() - start)
        return out

    _tracing._create_concrete_function = recording
    _atomic.AtomicFunction.call_flat = first_run
    try:
        yield seen
    finally:
        _tracing._create_concrete_function = original
        _atomic.AtomicFunction.call_flat = call_flat


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
    """Lines `count x name: CPU s, ops, first runs CPU s` per traced function, the
    costliest first, after a total line (nested traces counted once, in their outer
    trace)."""
    count, cpu, ops, run = (collections.Counter() for _ in range(4))
    total = sum(t.cpu for t in seen if not t.nested)
    for t in seen:
        count[t.name] += 1
        cpu[t.name] += t.cpu
        ops[t.name] += t.ops
        run[t.name] += t.first_run
    lines = [f"  {count[k]} x {k}: {cpu[k]:.2f} CPU s, {ops[k]} ops, first runs "
             f"{run[k]:.2f} CPU s" for k in sorted(cpu, key=cpu.get, reverse=True)]
    head = (f"{len(seen)} traces of {len(count)} functions: tracing {total:.2f} CPU s, "
            f"first runs {sum(run.values()):.2f} CPU s")
    return "\n".join([head] + lines)


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
