"""CROWN's layer bounds of a convolution's units, pulled back through the part of the
network each unit sees (its receptive field) instead of the whole network.

A unit of a convolution depends only on a window of the input (and of every value
between): the window of a `k x k` kernel at stride `s` over a window of `w x w`
positions covers `(w - 1) s + k` input positions, at stride `s` times the window's,
starting `s` times the window's start less the padding before the input. Pulling the
rows `+-e_j` of that unit back through the network restricted to its windows gives
the same functionals as the whole pull-back (they are zero outside the windows, so
the relaxation's offsets, the rounding terms and the dual norm at the input are the
same sums, in another order), at the cost of the windows only (auto_LiRPA's
"patches" mode serves the same purpose). Where a window reaches past the border of
its value (zero padding), its rows there are zero: those positions are constants,
not functions of the input. Where a value is read by several ops (a residual
`Add`'s shortcut and its convolutions), its window is the union of theirs.

Which ops are local is their rules' business: `Op.local` (`keras_roll.compile.rules.
base.Local`) gives the span, stride and padding of an op's positions and its linear
part on windows; ops without it (dense layers, global pooling, "same" average
pooling) keep the dense rows. `conv_windows` finds the windows of a value;
`ConvWindows.bounds` runs the caller's pull-back (CROWN's, `keras_roll.compile.
bounds.crown.relaxation_refiner`) of every unit's `+e_j` and `-e_j` rows on the
windows (over `ConvWindows.windowed`, the program with every linear op replaced by
its map on windows), a chunk of (example, position) pairs at a time within the
memory budget, in one traced loop; with `need`, each (example, position) pulls back
only the rows asked for (the units its interval does not prove inactive), and an
affine value only its `+e_j` rows.

Example:

```python
view = conv_windows(structure, values, key)
if view is not None:
    lo, hi = view.bounds(lines.lines, deltas, eps, budget, b, pull)    # [B, n] each
```
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds.traversal import Values
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.rules.activations import Activation
from keras_roll.compile.rules.base import NO_RECORD, Local, Op, Tangent, apply_linear
from keras_roll.compile.structure import ProgramStructure

__all__ = ["ConvWindows", "conv_windows", "rows_per_pull"]


class _Window(NamedTuple):
    """The positions of a value that the key's position `p` reads, per spatial axis:
    `p * stride + start` to `p * stride + start + size - 1` (may pass the border)."""

    start: tuple
    size: tuple
    stride: tuple


def _input_window(out: _Window, local: Local) -> _Window:
    """The window an op's input needs for the window `out` of its output."""
    return _Window(tuple(a * s - b for a, s, b in zip(out.start, local.strides, local.before)),
                   tuple((n - 1) * s + k for n, s, k in zip(out.size, local.strides, local.span)),
                   tuple(t * s for t, s in zip(out.stride, local.strides)))


def _union(a: _Window | None, b: _Window) -> _Window | None:
    """The smallest window holding `a` and `b` (None if their strides differ)."""
    if a is None:
        return b
    if a.stride != b.stride:
        return None
    start = tuple(min(x, y) for x, y in zip(a.start, b.start))
    end = tuple(max(x + n, y + m) for x, n, y, m in zip(a.start, a.size, b.start, b.size))
    return _Window(start, tuple(e - s for e, s in zip(end, start)), a.stride)


def _plan(structure: ProgramStructure, values, key: int):
    """`(windows {key: _Window}, {index: (Local, window its inputs need)}, path)` of the
    ops value `key` depends on, or None where one of them is not local."""
    plan = {key: _Window((0, 0), (1, 1), (1, 1))}
    needs, path = {}, []
    for index in range(structure.producer.get(key, -1), -1, -1):
        node = structure.nodes[index]
        if node.output not in plan:
            continue
        shape = tuple(values.inputs[index][0].shape[1:])
        if (values.masks[index] is not None or len(shape) != 3 or None in shape
                or any(tuple(v.shape[1:]) != shape for v in values.inputs[index])):
            return None
        local = node.op.local(shape)
        if local is None or len(local.span) != 2:
            return None
        need = _input_window(plan[node.output], local)
        for k in node.inputs:
            plan[k] = _union(plan.get(k), need)
            if plan[k] is None:
                return None
        needs[index] = (local, need)
        path.append(index)
    if structure.input_key not in plan:
        return None
    for index in path:  # a relaxed op passes its rows on unchanged: no crop
        node = structure.nodes[index]
        if isinstance(node.op, Activation) and plan[node.inputs[0]] != needs[index][1]:
            return None
    return plan, needs, path


def _inside(window: _Window, grid, shape) -> np.ndarray:
    """`[P, *size, 1]`: 1 where the window of position `p` of the key's `grid` lies in
    the value's spatial `shape`, 0 on the padding."""
    axes = [((np.arange(g) * t + a)[:, None] + np.arange(n)[None] >= 0)
            & ((np.arange(g) * t + a)[:, None] + np.arange(n)[None] < m)
            for g, a, n, t, m in zip(grid, window.start, window.size, window.stride, shape)]
    inside = axes[0][:, None, :, None] & axes[1][None, :, None, :]
    return inside.reshape(-1, *window.size, 1).astype(np.float64)


def conv_windows(structure: ProgramStructure, values, key: int) -> ConvWindows | None:
    """The windows of the units of value `key` (`[B, H, W, C]`), or None where some op it
    depends on is not local (`Op.local`) or the windows are no smaller than the values.

    Example:

    ```python
    view = conv_windows(structure, values, structure.nodes[index].inputs[0])
    ```
    """
    if values.value(structure, key).shape.rank != 4 or values.x.shape.rank != 4:
        return None
    found = _plan(structure, values, key)
    if found is None:
        return None
    plan = found[0]
    below = [k for k in plan if k != key]
    cut = sum(int(np.prod(plan[k].size)) * int(values.value(structure, k).shape[3])
              for k in below)
    whole = sum(int(np.prod(values.value(structure, k).shape[1:])) for k in below)
    if cut >= whole:
        return None  # the windows are no smaller than the values: nothing saved
    return ConvWindows(structure, values, key, *found)


class _OnWindow(Op):
    """A linear op on windows: each input's window cut to what the op needs (`crops`:
    start and size per spatial axis, per input), zero on the padding (the record: a
    `[m, *size, 1]` mask per input), then its map on windows (`Local.window_map`) or
    its own tangent (elementwise)."""

    def __init__(self, op: Op, local: Local, crops: tuple):
        super().__init__(op.layer, op.name)
        self.op, self.local, self.crops = op, local, crops

    def tangent(self, tangents, record, mask):
        batch = tf.shape(record[0])[0]
        cut = []
        for t, ((a, b), (n, m)), inside in zip(tangents, self.crops, record):
            cut.append(Tangent(t.per_example(batch)[:, :, a:a + n, b:b + m] * inside[:, None]))
        if self.local.window_map is None:
            return self.op.tangent(cut, NO_RECORD, None)
        return apply_linear(self.local.window_map, cut), None


class ConvWindows:
    """The windows of one value's units (`conv_windows`): `bounds` pulls the units'
    rows back through them, a chunk of (example, position) pairs at a time.

    Attributes:
        windowed: the program's structure with every linear op on the way replaced by
            its map on windows: the structure the caller's pull-back walks.
        positions, channels: the value's positions (`H W`) and channels.
        largest, entries: the largest window of a value below (elements) and their
            sum: the memory and the work of one row.
    """

    def __init__(self, structure, values, key, plan: dict, needs: dict, path: list):
        self.structure, self.values, self.key = structure, values, key
        self.plan, self.path = plan, path
        shape = values.value(structure, key).shape
        grid = (int(shape[1]), int(shape[2]))
        self.positions = grid[0] * grid[1]
        self.channels = int(shape[3])
        sizes = {k: int(np.prod(w.size)) * int(values.value(structure, k).shape[3])
                 for k, w in plan.items() if k != key}
        self.largest = max(sizes.values())
        self.entries = sum(sizes.values())  # per row: the windows of the values below
        self.inside = {k: _inside(w, grid, values.value(structure, k).shape[1:3])
                       for k, w in plan.items()}
        nodes, self.crops = list(structure.nodes), {}
        for index in path:
            node = structure.nodes[index]
            if isinstance(node.op, Activation):
                continue  # relaxed: the caller's lines, cut to the window
            local, need = needs[index]
            crops = tuple((tuple(s - t for s, t in zip(need.start, plan[k].start)), need.size)
                          for k in node.inputs)
            self.crops[index] = crops
            nodes[index] = dataclasses.replace(node, op=_OnWindow(node.op, local, crops))
        self.windowed = copy.copy(structure)
        self.windowed.nodes = nodes

    def items_per_chunk(self, budget: int, examples: int, rows: int | None = None) -> int:
        """(Example, position) pairs per pull-back: their `rows` rows' functionals (default
        `2 C`) fit `budget` bytes (3 float64 copies of the largest window, as the dense
        rows')."""
        rows = 2 * self.channels if rows is None else rows
        return plan_chunks(1, examples * self.positions,
                           3 * self.values.x.dtype.size * rows * self.largest,
                           budget, batch_size=1, min_directions=1).per_chunk

    def _patches(self, t: tf.Tensor, key: int) -> tf.Tensor:
        """`[b * P, *window, C]`: the windows of value `key`'s tensor `t` (`[b, H, W, C]`,
        any `b` examples), example by example, positions row-major, zero past the
        border."""
        w = self.plan[key]
        grid = self.values.value(self.structure, self.key).shape[1:3]
        shape = t.shape[1:3]
        lo = [max(0, -a) for a in w.start]
        hi = [max(0, a + (g - 1) * s + n - m)
              for a, g, s, n, m in zip(w.start, grid, w.stride, w.size, shape)]
        t = tf.pad(t, [[0, 0], [lo[0], hi[0]], [lo[1], hi[1]], [0, 0]])
        first = [a + p for a, p in zip(w.start, lo)]
        span = [(g - 1) * s + n for g, s, n in zip(grid, w.stride, w.size)]
        t = t[:, first[0]:first[0] + span[0], first[1]:first[1] + span[1]]
        patches = tf.image.extract_patches(t, sizes=[1, *w.size, 1],
                                           strides=[1, *w.stride, 1],
                                           rates=[1, 1, 1, 1], padding="VALID")
        return tf.reshape(patches, [-1, *w.size, int(t.shape[3])])

    def _cropped(self, lines: dict, deltas: list, items):
        """The `Values` (the windows' shapes; the pull-back reads no value, only lines,
        rounding bounds and records), lines (`{index: tensors}`) and rounding bounds
        of the windows `items` (`[m]`), and the cutter `fn(tensor, key)` of any other
        tensor."""
        s, v = self.structure, self.values
        n, dtype = len(s.nodes), v.x.dtype
        # only the chunk's examples are cut into windows: `items` index (example,
        # position) pairs, and a chunk holds few of the batch's examples
        examples, local = tf.unique(items // self.positions)
        picked = local * self.positions + items % self.positions

        def at(t, key):
            t = tf.broadcast_to(t, tf.shape(v.value(s, key)))
            return tf.gather(self._patches(tf.gather(t, examples), key), picked)

        def at_once(ts, key):  # `at` of each, as one cut (the same elements, fewer ops)
            shape = tf.shape(v.value(s, key))
            t = tf.concat([tf.broadcast_to(t, shape) for t in ts], -1)
            t = tf.gather(self._patches(tf.gather(t, examples), key), picked)
            return tuple(tf.split(t, len(ts), axis=-1))

        def shape_of(key):
            return tf.zeros([1, *self.plan[key].size, int(v.value(s, key).shape[3])], dtype)

        inputs, outputs, records = [None] * n, [None] * n, list(v.records)
        cut_lines, cut_deltas = {}, [None] * len(deltas)
        for i in self.path:
            node = s.nodes[i]
            inputs[i] = [shape_of(k) for k in node.inputs]
            outputs[i] = shape_of(node.output)
            if i in lines:
                cut_lines[i] = at_once(lines[i], node.output)
            if i < len(deltas) and deltas[i] is not None:
                cut_deltas[i] = at(deltas[i], node.output)
            if i in self.crops:
                records[i] = tuple(
                    tf.gather(tf.constant(self.inside[k][:, a:a + h, b:b + w], dtype),
                              items % self.positions)
                    for k, ((a, b), (h, w)) in zip(node.inputs, self.crops[i]))
        cut = Values(shape_of(s.input_key), tuple(inputs), tuple(outputs), tuple(records),
                     v.masks)
        return cut, cut_lines, cut_deltas, at

    def bounds(self, lines: dict, deltas: list, eps, budget: int, examples: int,
               pull: Callable, need: tuple | None = None,
               affine: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
        """`(lower, upper)`, `[B, n]` each: the bounds of the value's units, the rows
        `+-e_j` of a chunk of (example, position) pairs at a time (at most `budget` bytes
        of functionals), in one traced loop; `-inf` / `inf` where a row is not needed.

        Args:
            lines: `{op index: (a_l, c_l, a_u, c_u)}`, the relaxation's lines
                (`RelaxedOps.lines`).
            deltas: per node, the rounding bound of its output or None.
            eps: `[B]` radii or a scalar.
            budget: bytes of functionals per pull-back.
            examples: examples per call at most (the plan's balance).
            pull: `pull(values, lines, deltas, rows, eps, cut) -> [m, R]`, the lower
                bounds of the rows `[m, R, 1, 1, C]` of the value in the windows
                over `self.windowed` (`cut(tensor, key)` cuts any other per-example
                tensor the same way).
            need: optional `(lower, upper)`, `[B, n]` bool each: the units whose `+e_j`
                (`-e_j`) row is pulled back (default all); each (example, position)
                pulls back only its own rows, `rows_per_pull` at a time.
            affine: the value is an affine function of the input
                (`crown.affine_in_input`): the bound of `-e_j` is that of `+e_j`, so only
                the `+e_j` rows are pulled back (of the units in either of `need`) and
                `upper = -lower`.
        """
        c, positions = self.channels, self.positions
        dtype = self.values.x.dtype
        total = tf.shape(self.values.x)[0] * positions
        width = c if affine else 2 * c
        if need is None:
            flags = tf.ones([total, width], tf.bool)
        else:
            lo_need, hi_need = (tf.reshape(t, [total, c]) for t in need)
            flags = lo_need | hi_need if affine else tf.concat([lo_need, hi_need], 1)
        rows = width if need is None else rows_per_pull(width)
        eye = np.eye(c)
        table = tf.constant(np.concatenate([eye, -eye])[:width, None, None, :], dtype)
        counts = tf.reduce_sum(tf.cast(flags, tf.int32), 1)  # [total]
        slots = (counts + rows - 1) // rows  # pull-backs of `rows` rows per pair
        owner = tf.repeat(tf.range(total), slots)  # [S]: each pull-back's pair
        first = tf.cumsum(slots, exclusive=True)
        part = tf.range(tf.size(owner)) - tf.gather(first, owner)  # its place in the pair
        order = tf.argsort(tf.cast(~flags, tf.int32), axis=1, stable=True)  # needed first
        fit = self.items_per_chunk(budget, examples, rows)
        s = tf.size(owner)
        chunks = (s + fit - 1) // fit
        per = (s + chunks - 1) // tf.maximum(chunks, 1)
        radii = tf.cast(eps, dtype)
        if radii.shape.rank:
            radii = tf.repeat(radii, positions)
        big = tf.constant(np.inf, dtype)

        def body(i, out):
            at = (i * per + tf.range(per)) % tf.maximum(s, 1)
            items = tf.gather(owner, at)
            # the pair's needed rows, from its place on (wrapping: repeats are harmless)
            k = (tf.gather(part, at)[:, None] * rows + tf.range(rows)[None]) % tf.maximum(
                tf.gather(counts, items)[:, None], 1)
            row = tf.gather(tf.gather(order, items), k, batch_dims=1)  # [per, rows]
            cut, cut_lines, cut_deltas, cutter = self._cropped(lines, deltas, items)
            r = tf.gather(radii, items) if radii.shape.rank else radii
            low = pull(cut, cut_lines, cut_deltas, tf.gather(table, row), r, cutter)
            where = tf.stack([tf.repeat(items, rows), tf.reshape(row, [-1])], 1)
            return i + 1, tf.tensor_scatter_nd_max(out, where, tf.reshape(low, [-1]))

        _, out = tf.while_loop(lambda i, _: i < chunks, body,
                               (tf.constant(0, tf.int32), tf.fill([total, width], -big)),
                               parallel_iterations=1)
        lower = tf.reshape(out[:, :c], [-1, positions * c])
        upper = -lower if affine else -tf.reshape(out[:, c:], [-1, positions * c])
        return lower, upper


def rows_per_pull(width: int) -> int:
    """Rows per pull-back of one (example, position) pair where only some of its `width`
    rows are needed (`ConvWindows.bounds`' `need`): a quarter of them (at least 8), so
    that a pair with few open units pulls back few rows while the cut of its windows
    is shared by several."""
    return min(width, max(8, width // 4))
