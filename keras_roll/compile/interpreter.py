"""The program interpreter: one walk over (step, op, record) that every pass plugs into.

A `Program` (`keras_roll.compile.graph`) is a list of steps, each a layer call compiled
into ops. Every computation keras_roll does on it is a walk over the steps in
order, feeding each op the values of its inputs and, after the first pass, the
record that the forward pass left for it. `propagate` writes that walk once,
in the manner of jax_verify's `PropagationGraph.forward_propagation(transform)`;
a `Transform` says what flows along the edges and what each op does:

* `PrimalTransform`: the forward pass in a given dtype. It runs every op,
  keeps the Keras masks, collects the neurons and leaves a `Trace` of records.
* `TangentTransform`: the frozen-pattern tangent pass. It pushes `Tangent`s
  (directional derivatives) through the ops with the records of a `Trace`
  and collects the neuron tangents.
* `UnitCollector`: no values at all; it lists the `(op, record)` of every
  neuron-owning op (names, layout, `Linearized.units`).

A new pass (say a float64 primal pass beside a float32 tangent pass, or an
interval pass) is one more `Transform`. See docs/design.md, sections "Module
map" and "Data flow".

Example:

```python
interp = Interpreter(build_program(model), "float32")
fwd = interp.primal(x)                           # ForwardPass
jvp = interp.tangent(fwd.trace, v, shared=True)  # JVP along shared directions v
```
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.graph import Program, Step
from keras_roll.compile.records import Record
from keras_roll.compile.rules.base import Neurons, Op, Tangent, static_dims
from keras_roll.compile.structure import structure_of

__all__ = [
    "ForwardPass",
    "Interpreter",
    "JVP",
    "PrimalTransform",
    "StepRecord",
    "TangentTransform",
    "Trace",
    "Transform",
    "UnitCollector",
    "propagate",
]


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True, eq=False)
class StepRecord(Record):
    """What the forward pass recorded at one step.

    Attributes:
        ops: one record per op of the step (`NO_RECORD` for ops without pattern).
        mask: the Keras mask of the step's first input, or None.
    """

    ops: tuple
    mask: tf.Tensor | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Trace(Record):
    """The records of a forward pass, read by the passes that follow it.

    Attributes:
        input: `[B, *input_shape]` the model input in the twin's dtype (its
            batch size sizes shared tangents inside graphs).
        steps: one `StepRecord` per program step.
    """

    input: tf.Tensor
    steps: tuple


class ForwardPass(NamedTuple):
    """What the twin records on a batch.

    Attributes:
        logits: `[B, *output_shape]` model output before any folded softmax.
        neurons: the hyperplanes of every unit, `[B, N]` each (see `rules.Neurons`).
        trace: the per-step records (masks, slopes, argmax choices), a `Trace`.
        tangent_size: per-example, per-direction number of tangent elements
            (the outputs of every op; used to size chunks).
    """

    logits: tf.Tensor
    neurons: Neurons
    trace: Trace
    tangent_size: tf.Tensor


class JVP(NamedTuple):
    """Directional derivatives of every neuron and logit.

    Attributes:
        neurons: `[B, K, N]`, derivative of neuron j along direction k (or, from
            `Interpreter.tangent(..., concat=False)`, a list of `[B, K, n_u]`
            blocks, one per neuron-owning op).
        logits: `[B, K, L]`, derivative of the flattened output.
    """

    neurons: Any
    logits: tf.Tensor


# --------------------------------------------------------------------------- the walk


class Transform:
    """What one pass does at every step and op of a program.

    Subclasses override `apply`, and `enter_step` / `leave_step` when they keep
    per-step state (the primal pass tracks Keras masks there).

    Example:

    ```python
    class CountOps(Transform):
        def __init__(self):
            self.count = 0

        def apply(self, op, inputs, context, record):
            self.count += 1

    counter = CountOps()
    propagate(program, counter, None)
    ```
    """

    def enter_step(self, step: Step, inputs: list, record: StepRecord | None):
        """Called before the step's ops; returns a context passed to `apply`."""
        return None

    def apply(self, op: Op, inputs: list, context, record: Record | None):
        """Runs one op on the values of its inputs; returns its output value."""
        raise NotImplementedError

    def leave_step(self, step: Step, inputs: list, output, context):
        """Called after the step's ops with its output value; returns the value to keep."""
        return output


def propagate(program: Program, transform: Transform, initial, trace: Trace | None = None,
              start: int = 0, start_op: int = 0):
    """Walks `program` once, in order, with `transform` at every op.

    Args:
        program: the compiled model.
        transform: the pass.
        initial: the value of the model input (with `start > 0`: of the output
            of step `start - 1`; with `start_op > 0`: of op `start_op - 1` of
            step `start`).
        trace: the records of a forward pass, given to the ops of later passes.
        start: the first step to run. Steps before it are skipped; the caller
            guarantees that no later step reads their values except the output
            of step `start - 1` (ROLL's `wrt=`, `keras_roll.roll.entry.tangent_entry`).
        start_op: the first op of step `start` to run (its earlier ops are
            skipped, e.g. the linear part of a first Dense layer whose output
            ROLL's factored exact path starts from); step `start` must then
            read a single value.

    Returns:
        The value of the model output. A step without ops (a folded softmax)
        passes its first input through.
    """
    env = {program.input_key if start == 0 else program.steps[start - 1].output: initial}
    for index, step in enumerate(program.steps):
        if index < start:
            continue
        skip = start_op if index == start else 0
        inputs = [initial] if skip else [env[k] for k in step.inputs]
        record = None if trace is None else trace.steps[index]
        context = transform.enter_step(step, inputs, record)
        values = inputs
        for position, op in enumerate(step.ops):
            if position < skip:
                continue
            op_record = None if record is None else record.ops[position]
            values = [transform.apply(op, values, context, op_record)]
        env[step.output] = transform.leave_step(step, inputs, values[0], context)
    return env[program.output_key]


# --------------------------------------------------------------------------- passes


class PrimalTransform(Transform):
    """The forward pass in `dtype`: outputs, Keras masks, neurons and the trace.

    Args:
        program: the compiled model.
        x: `[B, *input_shape]` model input, already in `dtype`.
        dtype: the dtype every op output is cast to.
    """

    def __init__(self, program: Program, x, dtype):
        self.dtype = dtype
        self.masks = {program.input_key: None}
        self.batch = tf.maximum(tf.shape(x)[0], 1)
        self.steps: list[StepRecord] = []
        self.neurons: list[Neurons] = []
        self.static_size = 0  # tangent elements of outputs of static shape
        self.dynamic_size = None  # the others, an int64 tensor
        self._records: list = []

    @property
    def tangent_size(self) -> tf.Tensor:
        """Per-example, per-direction tangent elements of every op output (int64)."""
        size = tf.constant(self.static_size, tf.int64)
        return size if self.dynamic_size is None else size + self.dynamic_size

    def enter_step(self, step, inputs, record):
        self._records = []
        return [self.masks[k] for k in step.inputs]

    def apply(self, op, inputs, in_masks, record):
        out, rec = op.forward(inputs, in_masks[0])
        out = tf.cast(out, self.dtype)
        self._records.append(rec)
        if op.owns_neurons:
            self.neurons.append(op.neurons(rec))
        per = static_dims(out, 1)
        if per is not None:
            self.static_size += int(np.prod(per))
        else:
            size = tf.cast(tf.size(out) // self.batch, tf.int64)
            self.dynamic_size = size if self.dynamic_size is None else self.dynamic_size + size
        return out

    def leave_step(self, step, inputs, output, in_masks):
        self.masks[step.output] = output_mask(step.layer, inputs, in_masks)
        self.steps.append(StepRecord(tuple(self._records), in_masks[0]))
        return output


class TangentTransform(Transform):
    """The frozen-pattern tangent pass: `Tangent`s in, neuron tangents collected.

    Args:
        folds: `{id(step): next step}` of linear steps whose output only a
            per-channel scale reads (a convolution or Dense and the
            BatchNormalization after it, `batch_norm_folds`): the scale is
            folded into the kernel (`Linear.tangent_scaled`) and the scale's
            step passes its tangent on, which spares a product over the whole
            tangent and, in a backward pass, its gradient and a reduction.
    """

    def __init__(self, folds: dict | None = None):
        self.neuron_tangents: list[tf.Tensor] = []
        self.folds = folds or {}
        self._folded: set[int] = set()
        self._step = None

    def enter_step(self, step, inputs, record):
        self._step = step
        return record.mask

    def apply(self, op, inputs, mask, record):
        step = self._step
        if id(step) in self._folded:  # its scale is in the previous step's kernel
            return inputs[0]
        after = self.folds.get(id(step))
        if after is not None:
            out = _folded_tangent(op, inputs, after.ops[0])
            if out is not None:
                self._folded.add(id(after))
                return out
        out, neuron_tangent = op.tangent(inputs, record, mask)
        if neuron_tangent is not None:
            self.neuron_tangents.append(neuron_tangent)
        return out


def _folded_tangent(op, inputs: list[Tangent], scale_op):
    """`op`'s tangent with `scale_op`'s per-channel scale in its kernel, or None."""
    t = inputs[0]
    rank = t.value.shape.rank
    if rank is None:
        return None
    scale = scale_op.channel_scale(t.value.dtype, rank if t.shared else rank - 1)
    if scale is None:
        return None
    return op.tangent_scaled(inputs, scale)


def batch_norm_folds(program: Program) -> dict[int, Step]:
    """`{id(step): next step}` for every single-op linear step that can scale its kernel
    (`Linear.can_scale`: Dense, convolutions) whose output is read by one step
    only, a single per-channel scaling op (`Linear.channel_scale`:
    BatchNormalization) of that output alone."""
    structure = structure_of(program)
    folds = {}
    for step in program.steps:
        if len(step.ops) != 1 or not getattr(step.ops[0], "can_scale", False):
            continue
        readers = structure.readers(step.output)
        if step.output == program.output_key or len(readers) != 1:
            continue
        after = program.steps[readers[0]]
        if after.inputs == [step.output] and len(after.ops) == 1 \
                and getattr(after.ops[0], "scales_channels", False):
            folds[id(step)] = after
    return folds


class UnitCollector(Transform):
    """Lists `(op, record)` for every neuron-owning op, in program order."""

    def __init__(self):
        self.units: list[tuple[Op, Record]] = []

    def apply(self, op, inputs, context, record):
        if op.owns_neurons:
            self.units.append((op, record))
        return None


# --------------------------------------------------------------------------- interpreter


class Interpreter:
    """Runs the passes of a `Program` (plain TensorFlow: call them in any graph).

    Args:
        program: the compiled model (`keras_roll.compile.graph.build_program`).
        dtype: the dtype of the primal and tangent passes.
    """

    def __init__(self, program: Program, dtype: str):
        self.program = program
        self.dtype = dtype
        self.folds = batch_norm_folds(program)

    def primal(self, x, dtype: str | None = None, start: int = 0,
               start_op: int = 0) -> ForwardPass:
        """The forward pass on `x` (cast to `dtype`, default the interpreter's).

        With `start` / `start_op` (see `propagate`), `x` is the output of the
        ops before them, e.g. of an affine prefix (`keras_roll.compile.prefix`),
        which must not set Keras masks; the trace then holds only the steps run
        (enough for the logits and neurons, not for a tangent pass).
        """
        dtype = dtype or self.dtype
        x = tf.cast(x, dtype)
        transform = PrimalTransform(self.program, x, dtype)
        if start:
            transform.masks[self.program.steps[start - 1].output] = None
        logits = propagate(self.program, transform, x, start=start, start_op=start_op)
        return ForwardPass(logits, concat_neurons(transform.neurons, x),
                           Trace(x, tuple(transform.steps)), transform.tangent_size)

    def tangent(self, trace: Trace, v, shared: bool, concat: bool = True, axes=None,
                start: int = 0, dtype: str | None = None, start_op: int = 0) -> JVP:
        """Derivatives along directions `v` with the pattern of `trace` frozen.

        Args:
            trace: the `Trace` of a forward pass.
            v: `[K, *input_shape]` directions shared by the batch (`shared=True`)
                or `[B, K, *input_shape]` per example.
            shared: which of the two `v` is.
            concat: False to get `neurons` as a list of per-op blocks.
            axes: for one-hot directions, their flat input axes (`[K]` or
                `[B, K]`, -1 for a zero direction), so that a first affine
                layer can gather weight rows (see `rules.base.Tangent`).
            start: the step the tangents enter at (see `propagate`): `v` is
                then a direction of the output of step `start - 1`.
            start_op: with it, `v` is a direction of the output of op
                `start_op - 1` of step `start` (see `propagate`).
            dtype: the dtype of the pass (default the interpreter's), e.g.
                "float16" for the ROLL tangents of a mixed-precision model: the
                floating records of `trace` are cast to it once, and every op
                casts its weights to its tangents' dtype.
        """
        dtype = dtype or self.dtype
        if dtype != self.dtype:
            trace = cast_records(trace, dtype)
        v = tf.cast(v, dtype)
        batch = tf.shape(trace.input)[0] if shared else tf.shape(v)[0]
        k = tf.shape(v)[0] if shared else tf.shape(v)[1]
        transform = TangentTransform(self.folds)
        out = propagate(self.program, transform, Tangent(v, shared=shared, axes=axes), trace,
                        start, start_op)
        out = out.per_example(batch)
        logits = tf.reshape(out, tf.stack([batch, k, tf.reduce_prod(tf.shape(out)[2:])]))
        blocks = transform.neuron_tangents or [tf.zeros(tf.stack([batch, k, 0]), dtype)]
        return JVP(tf.concat(blocks, axis=-1) if concat else blocks, logits)

    def axes_tangent(self, trace: Trace, start, k: int, example_shape, reduce=None,
                     per_neuron: bool = False, entry: int = 0, dtype: str | None = None):
        """Derivatives along input axes `start .. start + k - 1` (zero past the last).

        With `reduce`, returns `reduce(jvp, start)`; with `per_neuron=True` the
        reduction runs on each op's `[b, k, n]` block separately and the results
        are concatenated along the last axis (no `[b, k, N]` copy: much faster
        for reductions over the direction axis). `entry` is `tangent`'s `start`:
        the axes are then those of the output of step `entry - 1`; `dtype` is
        `tangent`'s.
        """
        d = tf.reduce_prod(example_shape)
        axes = start + tf.range(k)
        eye = tf.one_hot(axes, d, dtype=dtype or self.dtype)
        dirs = tf.reshape(eye, tf.concat([[k], example_shape], 0))
        axes = tf.where(axes < d, axes, -1)
        jvp = self.tangent(trace, dirs, True, concat=not per_neuron, axes=axes, start=entry,
                           dtype=dtype)
        if reduce is None:
            return jvp
        if not per_neuron:
            return reduce(jvp, start)
        parts = [reduce(JVP(block, jvp.logits), start) for block in jvp.neurons]
        return tf.nest.map_structure(lambda *xs: tf.concat(xs, axis=-1), *parts)

    def units(self, trace: Trace) -> list[tuple[Op, Record]]:
        """`(op, record)` of every neuron-owning op of a forward pass."""
        collector = UnitCollector()
        propagate(self.program, collector, None, trace)
        return collector.units


# --------------------------------------------------------------------------- helpers


def output_mask(layer, inputs, in_masks):
    """The Keras mask of a layer's output, as `Layer.__call__` would set it."""
    if not isinstance(layer, keras.layers.Layer) or not layer.supports_masking:
        return None
    if all(m is None for m in in_masks) and not isinstance(layer, keras.layers.Masking):
        return None
    arg = inputs if len(inputs) > 1 else inputs[0]
    prev = in_masks if len(inputs) > 1 else in_masks[0]
    return layer.compute_mask(arg, prev)


def cast_records(trace: Trace, dtype) -> Trace:
    """`trace` with its floating tensors (slopes, one-hot choices, masks) cast to `dtype`."""
    return tf.nest.map_structure(
        lambda t: tf.cast(t, dtype) if tf.is_tensor(t) and t.dtype.is_floating else t, trace)


def concat_neurons(neurons: list[Neurons], x) -> Neurons:
    """The `[B, N]` neurons of all ops side by side (well defined without any)."""
    if not neurons:
        batch = tf.shape(x)[0]
        empty = tf.zeros(tf.stack([batch, 0]), x.dtype)
        return Neurons(empty, empty, empty, tf.zeros(tf.stack([batch, 0]), tf.bool),
                       tf.zeros(tf.stack([batch, 0]), tf.int32))
    return Neurons(*[tf.concat(list(parts), axis=1) for parts in zip(*neurons)])
