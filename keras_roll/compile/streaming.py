"""Streaming the input Jacobian of a linearized model along its input axes.

The Jacobian of every neuron is pushed through the frozen-pattern twin one
chunk of examples and input axes at a time (`keras_roll.compile.chunking` sizes the
chunks from the twin's `NeuronLayout` and memory budget), and either reduced
inside the compiled function (`reduce=`, e.g. to gradient norms) or copied into
a dense array (`dense_jacobian`). `Linearized.iter_axis_chunks`,
`Linearized.jacobian` and `Linearized.output_jacobian` call these.

Example:

```python
for sl, fwd, start, k, jvp in iter_axis_chunks(lin, x):
    jvp.neurons            # [b, k, N]: columns start .. start + k - 1 of the Jacobian
```
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_roll import inputs
from keras_roll.compile.chunking import ChunkPlan, plan_chunks

__all__ = ["MAX_DENSE_RESULT", "axis_plan", "dense_jacobian", "iter_axis_chunks"]

MAX_DENSE_RESULT = 4 * 2**30  # refuse to return dense Jacobians above this size


def axis_plan(lin, x, batch_size: int | None = None,
              memory_budget: int | None = None) -> ChunkPlan:
    """The chunks of examples and input axes for streaming the Jacobian of `x`."""
    layout = lin.layout(x.shape[1:])
    per = layout.tangent_bytes(np.dtype(lin.dtype).itemsize)
    return plan_chunks(int(x.shape[0]), layout.input_size, per,
                       memory_budget or lin.memory_budget, batch_size)


def iter_axis_chunks(lin, x, batch_size: int | None = None, reduce=None,
                     memory_budget: int | None = None, per_neuron: bool = False):
    """Streams the Jacobian along input axes in chunks (see `Linearized.iter_axis_chunks`).

    Yields:
        `(example_slice, forward_pass, start, k, result)`.

    A float32 input stays float32 until each example slice is cast to the
    twin's dtype (a float64 twin never holds a float64 copy of all of `x`).
    """
    x = check_input_keep_float(lin, x)
    if int(x.shape[0]) == 0:
        return
    plan = axis_plan(lin, x, batch_size, memory_budget)
    example_shape = tf.constant(x.shape[1:], tf.int32)
    k = plan.per_chunk
    for sl in plan.example_slices():
        fwd = lin.compiled.primal(tf.cast(x[sl], lin.dtype))
        for start in plan.direction_starts():
            first = tf.constant(start, tf.int32)
            yield sl, fwd, start, k, lin.compiled.axes_tangent(fwd.trace, first, k, example_shape,
                                                                reduce, per_neuron)


def check_input_keep_float(lin, x) -> tf.Tensor:
    """`lin.check_input(x)`, keeping a float32 / float64 input in its own dtype."""
    dtype = x.dtype if tf.is_tensor(x) or isinstance(x, np.ndarray) else None
    if dtype is not None and tf.as_dtype(dtype) in (tf.float32, tf.float64):
        return inputs.check_input(x, lin.input_shape, tf.as_dtype(dtype).name, lin.model.name)
    return lin.check_input(x)


def dense_jacobian(lin, x, which: str, batch_size: int | None = None) -> np.ndarray:
    """`[B, n, D]` Jacobian of the neurons (`which="neurons"`) or logits ("logits")."""
    x = lin.check_input(x)
    b_total = int(x.shape[0])
    d = int(np.prod(x.shape[1:]))
    out = None
    for sl, _fwd, start, k, jvp in iter_axis_chunks(lin, x, batch_size=batch_size):
        block = getattr(jvp, which).numpy()  # [b, k, n]
        if out is None:
            n = block.shape[-1]
            nbytes = b_total * n * d * block.itemsize
            if nbytes > MAX_DENSE_RESULT:
                raise MemoryError(
                    f"The dense Jacobian would take {nbytes / 2**30:.1f} GiB "
                    f"([{b_total}, {n}, {d}]); use keras_roll.certify or "
                    f"lin.iter_axis_chunks to reduce it on the fly."
                )
            out = np.zeros((b_total, n, d), block.dtype)
        stop = min(start + k, d)
        out[sl, :, start:stop] = np.swapaxes(block[:, : stop - start], 1, 2)
    if out is None:  # empty batch: [0, N, D] or [0, L, D]
        layout = lin.layout(x.shape[1:])
        if which == "neurons":
            n = layout.num_neurons
        else:
            n = int(np.prod(lin.forward(x[:0]).logits.shape[1:]))
        return np.zeros((0, n, d), lin.dtype)
    return out
