"""CROWN's layer bounds of a convolution's units, pulled back through the part of the
network each unit sees (its receptive field) instead of the whole network.

A unit of a convolution with "valid" padding depends only on a window of the input
(and of every value between): the window of a `k x k` kernel at stride `s` over a
window of `w x w` positions covers `(w - 1) s + k` input positions, at stride `s`
times the window's. Pulling the rows `+-e_j` of that unit back through the network
restricted to its windows gives the same functionals as the whole pull-back (they are
zero outside the windows, so the relaxation's offsets, the rounding terms and the dual
norm at the input are the same sums, in another order), at the cost of the windows
only: on the MNIST CNNs of `benchmarks.cnn_models` about a tenth of the work of the
second layer's bounds (auto_LiRPA's "patches" mode serves the same purpose).

`conv_windows` finds the windows of a value (a chain of single-input ops back to the
model input: ReLU-family activations, "valid" 2-D convolutions without dilation,
scalar rescalings and channels-last batch normalizations; None for anything else,
where the caller pulls back dense rows). `ConvWindows.bounds` runs the caller's
pull-back (CROWN's, `keras_roll.compile.bounds.crown.relaxation_refiner`) of every
unit's `+e_j` and `-e_j` rows on the windows, a chunk of (example, position) pairs at
a time within the memory budget, in one traced loop.

Example:

```python
view = conv_windows(structure, values, key)
if view is not None:
    lo, hi = view.bounds(lines.lines, deltas, eps, budget, b, pull)    # [B, n] each
```
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds.traversal import Values
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.rules.activations import Activation
from keras_roll.compile.rules.affine import Identity
from keras_roll.compile.structure import ProgramStructure

__all__ = ["ConvWindows", "conv_windows"]


def _same_window(op) -> bool:
    """Whether `op` maps every position to the same position (elementwise, per channel)."""
    if isinstance(op, (Activation, Identity)):
        return True
    layer = getattr(op, "layer", None)
    if isinstance(layer, keras.layers.Rescaling):
        return np.ndim(layer.scale) == 0
    if isinstance(layer, keras.layers.BatchNormalization):
        axes = [layer.axis] if isinstance(layer.axis, int) else list(layer.axis)
        return axes in ([-1], [3])
    return False


def _input_window(op, size, stride):
    """`(size, stride)` of `op`'s input window under its output's, or None."""
    if _same_window(op):
        return size, stride
    layer = getattr(op, "layer", None)
    if (type(layer) is keras.layers.Conv2D and layer.padding == "valid"
            and tuple(layer.dilation_rate) == (1, 1)
            and layer.data_format == "channels_last" and not isinstance(op, Activation)):
        return (tuple((w - 1) * t + k for w, t, k in zip(size, layer.strides,
                                                          layer.kernel_size)),
                tuple(s * t for s, t in zip(stride, layer.strides)))
    return None


def conv_windows(structure: ProgramStructure, values, key: int) -> ConvWindows | None:
    """The windows of the units of value `key` (`[B, H, W, C]`), or None where some op it
    depends on is not local (see the module docstring) or no window is smaller than
    its value.

    Example:

    ```python
    view = conv_windows(structure, values, structure.nodes[index].inputs[0])
    ```
    """
    if values.value(structure, key).shape.rank != 4 or values.x.shape.rank != 4:
        return None
    plan = {key: ((1, 1), (1, 1))}
    path = []
    for index in range(structure.producer.get(key, -1), -1, -1):
        node = structure.nodes[index]
        if node.output not in plan:
            continue
        if len(node.inputs) != 1 or values.masks[index] is not None:
            return None
        window = _input_window(node.op, *plan[node.output])
        if window is None or plan.get(node.inputs[0], window) != window:
            return None
        plan[node.inputs[0]] = window
        path.append(index)
    if structure.input_key not in plan:
        return None
    grid = tuple(values.value(structure, key).shape[1:3])
    for k, (size, stride) in plan.items():
        shape = values.value(structure, k).shape[1:3]
        if tuple((n - w) // s + 1 for n, w, s in zip(shape, size, stride)) != grid:
            return None
    if plan[structure.input_key][0] == tuple(values.x.shape[1:3]):
        return None  # the windows are the whole input: nothing saved
    return ConvWindows(structure, values, key, plan, path)


class ConvWindows:
    """The windows of one value's units (`conv_windows`): `bounds` pulls the units'
    rows back through them, a chunk of (example, position) pairs at a time."""

    def __init__(self, structure, values, key, plan: dict, path: list):
        self.structure, self.values, self.key = structure, values, key
        self.plan, self.path = plan, path
        shape = values.value(structure, key).shape
        self.positions = int(shape[1]) * int(shape[2])
        self.channels = int(shape[3])
        sizes = {k: int(np.prod(size)) * int(values.value(structure, k).shape[3])
                 for k, (size, _) in plan.items() if k != key}
        self.largest = max(sizes.values())
        self.entries = sum(sizes.values())  # per row: the windows of the values below

    def items_per_chunk(self, budget: int, examples: int) -> int:
        """(Example, position) pairs per pull-back: their `2 C` rows' functionals fit
        `budget` bytes (3 float64 copies of the largest window, as the dense rows')."""
        return plan_chunks(1, examples * self.positions,
                           3 * self.values.x.dtype.size * 2 * self.channels * self.largest,
                           budget, batch_size=1, min_directions=1).per_chunk

    def _patches(self, t: tf.Tensor, key: int) -> tf.Tensor:
        """`[b * P, *window, C]`: the windows of value `key`'s tensor `t` (`[b, H, W, C]`,
        any `b` examples), example by example, positions row-major."""
        ref = self.values.value(self.structure, key)
        size, stride = self.plan[key]
        patches = tf.image.extract_patches(t, sizes=[1, *size, 1], strides=[1, *stride, 1],
                                           rates=[1, 1, 1, 1], padding="VALID")
        return tf.reshape(patches, [-1, *size, int(ref.shape[3])])

    def _cropped(self, lines: dict, deltas: list, items):
        """The `Values`, lines (`{index: tensors}`) and rounding bounds of the windows
        `items` (`[m]`), and the cutter `fn(tensor, key)` of any other tensor."""
        s, v = self.structure, self.values
        n = len(s.nodes)
        # only the chunk's examples are cut into windows: `items` index (example,
        # position) pairs, and a chunk holds few of the batch's examples
        examples, local = tf.unique(items // self.positions)
        picked = local * self.positions + items % self.positions

        def at(t, key):
            t = tf.broadcast_to(t, tf.shape(v.value(s, key)))
            return tf.gather(self._patches(tf.gather(t, examples), key), picked)

        inputs, outputs = [None] * n, [None] * n
        cut_lines, cut_deltas = {}, [None] * len(deltas)
        for i in self.path:
            node = s.nodes[i]
            inputs[i] = [at(v.inputs[i][0], node.inputs[0])]
            outputs[i] = at(v.outputs[i], node.output)
            if i in lines:
                cut_lines[i] = tuple(at(t, node.output) for t in lines[i])
            if i < len(deltas) and deltas[i] is not None:
                cut_deltas[i] = at(deltas[i], node.output)
        cut = Values(at(v.x, s.input_key), tuple(inputs), tuple(outputs), v.records, v.masks)
        return cut, cut_lines, cut_deltas, at

    def bounds(self, lines: dict, deltas: list, eps, budget: int, examples: int,
               pull: Callable) -> tuple[tf.Tensor, tf.Tensor]:
        """`(lower, upper)`, `[B, n]` each: the bounds of every unit of the value, the
        rows `+-e_j` of a chunk of (example, position) pairs at a time (at most `budget`
        bytes of functionals), in one traced loop.

        Args:
            lines: `{op index: (a_l, c_l, a_u, c_u)}`, the relaxation's lines
                (`RelaxedOps.lines`).
            deltas: per node, the rounding bound of its output or None.
            eps: `[B]` radii or a scalar.
            budget: bytes of functionals per pull-back.
            examples: examples per call at most (the plan's balance).
            pull: `pull(values, lines, deltas, rows, eps, cut) -> [m, 2C]`, the lower
                bounds of the shared rows `[1, 2C, 1, 1, C]` of the value in the windows
                (`cut(tensor, key)` cuts any other per-example tensor the same way).
        """
        c, positions = self.channels, self.positions
        dtype = self.values.x.dtype
        eye = np.eye(c)
        rows = tf.constant(np.concatenate([eye, -eye])[None, :, None, None, :], dtype)
        fit = self.items_per_chunk(budget, examples)
        total = tf.shape(self.values.x)[0] * positions
        chunks = (total + fit - 1) // fit
        per = (total + chunks - 1) // tf.maximum(chunks, 1)
        radii = tf.cast(eps, dtype)
        if radii.shape.rank:
            radii = tf.repeat(radii, positions)

        def body(i, out):
            items = (i * per + tf.range(per)) % total
            cut, cut_lines, cut_deltas, at = self._cropped(lines, deltas, items)
            r = tf.gather(radii, items) if radii.shape.rank else radii
            low = pull(cut, cut_lines, cut_deltas, rows, r, at)
            return i + 1, tf.tensor_scatter_nd_update(out, items[:, None], low)

        _, out = tf.while_loop(lambda i, _: i < chunks, body,
                               (tf.constant(0, tf.int32), tf.zeros([total, 2 * c], dtype)),
                               parallel_iterations=1)
        out = tf.reshape(out, [-1, positions, 2, c])
        return (tf.reshape(out[:, :, 0], [-1, positions * c]),
                -tf.reshape(out[:, :, 1], [-1, positions * c]))
