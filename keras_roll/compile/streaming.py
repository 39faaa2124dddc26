"""Streaming the input Jacobian of a linearized model along its input axes.

The Jacobian of every neuron is pushed through the frozen-pattern twin one
chunk of examples and input axes at a time (`keras_roll.compile.chunking` sizes
the chunks from the `NeuronLayout` and the memory budget), and either reduced
inside the compiled function (`reduce=`, e.g. to gradient norms) or copied into
a dense array (`dense_jacobian`). The functions here take the compiled passes
they run (`CompiledPasses.primal` and `.axes_tangent`) and the layout, not the
twin: `Linearized.iter_axis_chunks`, `Linearized.jacobian` and
`Linearized.output_jacobian` check the input and call them.

Example:

```python
x = lin.check_input(x, keep_float=True)
for chunk in iter_axis_chunks(lin.compiled, lin.layout(x.shape[1:]), x, "float32", 2**26):
    chunk.result.neurons    # [b, k, N]: columns start .. start + k - 1 of the Jacobian
```
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.chunking import ChunkPlan, plan_chunks
from keras_roll.compile.interpreter import JVP, ForwardPass
from keras_roll.compile.layout import NeuronLayout

if TYPE_CHECKING:
    from keras_roll.compile.twin import CompiledPasses

__all__ = ["MAX_DENSE_RESULT", "AxisChunk", "axis_plan", "dense_jacobian", "iter_axis_chunks"]

MAX_DENSE_RESULT = 4 * 2**30  # refuse to return dense Jacobians above this size


class AxisChunk(NamedTuple):
    """One chunk of the streamed Jacobian.

    Attributes:
        examples: the slice of examples it covers.
        forward: the `ForwardPass` of those examples.
        start: its first input axis.
        size: input axes per chunk (columns past the last axis are zero).
        result: the `JVP` along axes `start .. start + size - 1`, or what
            `reduce(jvp, start)` made of it.
    """

    examples: slice
    forward: ForwardPass
    start: int
    size: int
    result: Any


def axis_plan(layout: NeuronLayout, examples: int, dtype: str, budget: int,
              batch_size: int | None = None) -> ChunkPlan:
    """The chunks of examples and input axes for streaming the Jacobian.

    Example:

    ```python
    plan = axis_plan(lin.layout((784,)), 100, "float32", 2**26)
    ```
    """
    per = layout.tangent_bytes(np.dtype(dtype).itemsize)
    return plan_chunks(int(examples), layout.input_size, per, budget, batch_size)


def iter_axis_chunks(passes: CompiledPasses, layout: NeuronLayout, x: tf.Tensor, dtype: str,
                     budget: int, batch_size: int | None = None, reduce=None,
                     per_neuron: bool = False) -> Iterator[AxisChunk]:
    """Streams the Jacobian along input axes in chunks (see `Linearized.iter_axis_chunks`).

    Args:
        passes: the twin's compiled passes (`primal` and `axes_tangent` are run).
        layout: the `NeuronLayout` for the per-example shape of `x`.
        x: checked `[B, *input_shape]` inputs; a float32 input stays float32
            until each example slice is cast to `dtype` (a float64 twin never
            holds a float64 copy of all of `x`).
        dtype: the twin's dtype.
        budget: bytes of tangents per chunk.
        batch_size: examples per chunk (default from the budget).
        reduce: optional `reduce(jvp, start)` run inside the compiled function.
        per_neuron: the reduction acts on each neuron separately (see
            `Linearized.iter_axis_chunks`).

    Yields:
        `AxisChunk`s, example slice by example slice, axes in order.
    """
    if int(x.shape[0]) == 0:
        return
    plan = axis_plan(layout, int(x.shape[0]), dtype, budget, batch_size)
    example_shape = tf.constant(x.shape[1:], tf.int32)
    k = plan.per_chunk
    for sl in plan.example_slices():
        fwd = passes.primal(tf.cast(x[sl], dtype))
        for start in plan.direction_starts():
            first = tf.constant(start, tf.int32)
            result = passes.axes_tangent(fwd.trace, first, tf.constant(k, tf.int32),
                                         example_shape, reduce, per_neuron)  # one trace
            yield AxisChunk(sl, fwd, start, k, result)


def dense_jacobian(chunks: Iterable[AxisChunk], examples: int, input_size: int,
                   pick: Callable[[JVP], tf.Tensor]) -> np.ndarray | None:
    """`[B, n, D]` dense Jacobian of the rows that `pick` takes from each chunk's `JVP`.

    Args:
        chunks: the `AxisChunk`s of all `examples` (unreduced).
        examples: B.
        input_size: D, the flattened per-example input size.
        pick: `jvp -> [b, k, n]` tangents (e.g. `lambda jvp: jvp.neurons`).

    Returns:
        The Jacobian, or None when there were no chunks (no examples).

    Raises:
        MemoryError: when the dense result would exceed `MAX_DENSE_RESULT` bytes.
    """
    out = None
    for chunk in chunks:
        block = pick(chunk.result).numpy()  # [b, k, n]
        if out is None:
            n = block.shape[-1]
            nbytes = examples * n * input_size * block.itemsize
            if nbytes > MAX_DENSE_RESULT:
                raise MemoryError(
                    f"The dense Jacobian would take {nbytes / 2**30:.1f} GiB "
                    f"([{examples}, {n}, {input_size}]); use keras_roll.certify or "
                    f"lin.iter_axis_chunks to reduce it on the fly."
                )
            out = np.zeros((examples, n, input_size), block.dtype)
        stop = min(chunk.start + chunk.size, input_size)
        out[chunk.examples, :, chunk.start:stop] = np.swapaxes(
            block[:, : stop - chunk.start], 1, 2)
    return out
