"""The frozen-pattern twin: forward pass that records neurons and patterns, and
batched tangent (forward-mode) passes with the pattern frozen.

With the activation pattern fixed, a piecewise-linear network is linear in its
input, so the derivative of every neuron along a direction is one forward pass
of a bias-free twin whose activations are multiplications by frozen slopes
(DESIGN.md section 3). Feeding K directions per example in parallel gives K
columns of every neuron's input gradient without back-propagation.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll.graph import Program, build_program
from keras_roll.rules.base import Neurons, Tangent

DEFAULT_MEMORY_BUDGET = 64 * 2**20  # bytes of live tangents per chunk
_TRAINING_DEPENDENT = (
    keras.layers.BatchNormalization, keras.layers.Dropout, keras.layers.SpatialDropout1D,
    keras.layers.SpatialDropout2D, keras.layers.SpatialDropout3D, keras.layers.GaussianNoise,
    keras.layers.GaussianDropout, keras.layers.AlphaDropout,
)
DEFAULT_EXAMPLES = 64  # examples per chunk when streaming directions
MAX_DENSE_RESULT = 4 * 2**30  # refuse to return dense Jacobians above this size


class ForwardPass(NamedTuple):
    """What the twin records on a batch.

    Attributes:
        logits: `[B, *output_shape]` model output before any folded softmax.
        neurons: the hyperplanes of every unit, `[B, N]` each (see `rules.Neurons`).
        trace: per-step records (masks, slopes, argmax choices) for `tangent`.
        tangent_size: per-example, per-direction number of tangent elements
            (used to size chunks).
    """

    logits: tf.Tensor
    neurons: Neurons
    trace: list
    tangent_size: tf.Tensor


class JVP(NamedTuple):
    """Directional derivatives of every neuron and logit.

    Attributes:
        neurons: `[B, K, N]`, derivative of neuron j along direction k.
        logits: `[B, K, L]`, derivative of the flattened output.
    """

    neurons: tf.Tensor
    logits: tf.Tensor


def linearize(model, memory_budget: int = DEFAULT_MEMORY_BUDGET) -> Linearized:
    """Compiles a Keras model into its frozen-pattern twin.

    Args:
        model: a built functional or Sequential Keras model of supported layers.
        memory_budget: bytes of tangents a chunk may hold when directions are
            streamed (`jacobian`, `certify`).

    Returns:
        A `Linearized` model (cached on `model`: linearizing it again is free).

    Raises:
        keras_roll.UnsupportedModelError: names the offending layer and the fix.

    Example:

    ```python
    lin = keras_roll.linearize(model)
    fwd = lin.forward(x)              # logits, pre-activations, patterns
    J = lin.jacobian(x)               # [B, N, D] input gradients of all neurons
    ```
    """
    if isinstance(model, Linearized):
        return model
    # One twin per (model, budget), kept on the model itself: repeated calls such as
    # certify(model, x) reuse its compiled functions instead of tracing them again.
    cache = getattr(model, "_keras_roll_twins", None)
    if cache is None:
        cache = {}
        try:  # bypass Keras attribute tracking: the twin is not part of the model
            object.__setattr__(model, "_keras_roll_twins", cache)
        except AttributeError:
            pass
    key = int(memory_budget)
    if key not in cache:
        cache[key] = Linearized(model, memory_budget=memory_budget)
    return cache[key]


class Linearized:
    """A model compiled into steps of ops, with its frozen-pattern twin.

    Use `keras_roll.linearize(model)` to build one. Weights are read from the
    model's variables at every call, so the twin follows training.
    """

    def __init__(self, model, memory_budget: int = DEFAULT_MEMORY_BUDGET):
        if memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got "
                             f"{memory_budget}.")
        self.model = model
        self.program: Program = build_program(model)
        self.memory_budget = int(memory_budget)
        dtype = keras.backend.standardize_dtype(self.program.input_dtype)
        if dtype not in ("float32", "float64"):
            dtype = "float32"  # integer inputs, or float16 under mixed precision
        self.dtype = dtype
        self._forward_fn = tf.function(self._forward, reduce_retracing=True, autograph=False)
        self._jvp_fn = tf.function(self._jvp, reduce_retracing=True, autograph=False)
        self._axes_fn = tf.function(self._axes_jvp, reduce_retracing=True, autograph=False)
        self._names_cache: dict = {}
        self._sizes_cache: dict = {}
        self._layout_cache: dict = {}

    # ------------------------------------------------------------------ structure

    @property
    def input_shape(self) -> tuple:
        """Per-example input shape (None for a variable time axis)."""
        return self.program.input_shape

    @property
    def inference_equals_training(self) -> bool:
        """True when no layer behaves differently in training (BatchNorm, dropout,
        noise), so the twin's forward pass is also the training-mode forward pass."""
        return not any(isinstance(step.layer, _TRAINING_DEPENDENT) for step in self.program.steps)

    def apply_output_link(self, logits):
        """The model output from the twin's logits (re-applies a folded softmax/sigmoid)."""
        if self.output_link == "softmax":
            return tf.nn.softmax(logits, axis=-1)
        if self.output_link == "sigmoid":
            return tf.sigmoid(logits)
        return logits

    @property
    def output_link(self) -> str | None:
        """'softmax' or 'sigmoid' if a final link was folded into the loss."""
        return self.program.output_link

    @property
    def neuron_names(self) -> list[tuple[str, int | tuple]]:
        """`(layer name, unit index)` for every neuron row, in program order.

        The unit index is an int for 1-D units and a tuple (numpy order) for
        multi-dimensional ones; max-pooling neurons index `(*position, window
        element, channel)`. Needs a fixed input shape; for variable-length
        inputs use `neuron_names_for(x)`.
        """
        if any(d is None for d in self.input_shape):
            raise ValueError(
                f"The model input shape {self.input_shape} has a variable axis, so the "
                f"neurons depend on the input length; use lin.neuron_names_for(x)."
            )
        return self.neuron_names_for(np.zeros((1, *self.input_shape), self.dtype))

    def neuron_names_for(self, x) -> list[tuple[str, int | tuple]]:
        """`neuron_names` for inputs shaped like `x` (a list of N tuples)."""
        shape = tuple(np.shape(x)[1:])
        if shape not in self._names_cache:
            self._names_cache[shape] = [
                (name, idx[0] if len(idx) == 1 else idx)
                for name, _, nshape in self.neuron_layout(shape) for idx in np.ndindex(*nshape)
            ]
        return self._names_cache[shape]

    def neuron_name(self, index: int, example_shape) -> tuple[str, int | tuple]:
        """The `(layer name, unit index)` of neuron row `index`, without building
        the whole list (cheap for models with millions of neurons)."""
        for name, start, nshape in self.neuron_layout(example_shape):
            size = int(np.prod(nshape))
            if start <= index < start + size:
                idx = np.unravel_index(index - start, nshape)
                idx = tuple(int(i) for i in idx)
                return name, idx[0] if len(idx) == 1 else idx
        raise IndexError(f"Neuron index {index} is out of range for inputs of shape "
                         f"{tuple(example_shape)}.")

    def num_neurons(self, example_shape) -> int:
        """N, the number of neuron rows for inputs of per-example shape `example_shape`."""
        return self._sizes(example_shape)[1]

    def neuron_layout(self, example_shape) -> list[tuple[str, int, tuple]]:
        """`(name, first row, per-example neuron shape)` of every neuron-owning op."""
        shape = tuple(int(d) for d in example_shape)
        if shape not in self._layout_cache:
            with tf.init_scope():
                fwd = self._forward_fn(tf.zeros((1, *shape), self.dtype))
            layout, start = [], 0
            for step, entry in zip(self.program.steps, fwd.trace):
                for op, rec in zip(step.ops, entry["ops"]):
                    if op.owns_neurons:
                        nshape = op.neuron_shape({k: tuple(v.shape) for k, v in rec.items()})
                        layout.append((op.name, start, tuple(nshape)))
                        start += int(np.prod(nshape))
            self._layout_cache[shape] = layout
        return self._layout_cache[shape]

    def tangent_size(self, example_shape) -> int:
        """Tangent elements per example and direction (the outputs of every op, as
        `ForwardPass.tangent_size`) for inputs of per-example shape `example_shape`."""
        return self._sizes(example_shape)[0]

    def _sizes(self, example_shape) -> tuple[int, int]:
        """(tangent size, number of neurons), by an eager batch-1 pass cached per shape."""
        shape = tuple(int(d) for d in example_shape)
        if shape not in self._sizes_cache:
            with tf.init_scope():
                fwd = self._forward_fn(tf.zeros((1, *shape), self.dtype))
                self._sizes_cache[shape] = (int(fwd.tangent_size), int(fwd.neurons.z.shape[-1]))
        return self._sizes_cache[shape]

    def summary(self, print_fn=print) -> None:
        """Prints the compiled program: one line per op."""
        print_fn(f"Linearized '{self.model.name}': input {self.input_shape}, "
                 f"dtype {self.dtype}, output link {self.output_link}")
        for step in self.program.steps:
            kinds = ", ".join(type(op).__name__ for op in step.ops) or "(folded)"
            print_fn(f"  {step.name:<30} {type(step.layer).__name__:<24} {kinds}")

    # ------------------------------------------------------------------ internals

    def _forward(self, x):
        prog = self.program
        x = tf.cast(x, self.dtype)
        env = {prog.input_key: x}
        masks = {prog.input_key: None}
        trace = []
        size = tf.constant(0, tf.int64)
        neurons = []
        for i, step in enumerate(prog.steps):
            ins = [env[k] for k in step.inputs]
            in_masks = [masks[k] for k in step.inputs]
            mask = in_masks[0]
            entry = {"ops": []} if i else {"ops": [], "input": x}
            if mask is not None:
                entry["mask"] = mask
            h = ins
            for op in step.ops:
                out, rec = op.forward(h, mask)
                h = [tf.cast(out, self.dtype)]
                entry["ops"].append(rec)
                if op.owns_neurons:
                    neurons.append(op.neurons(rec))
                size += tf.cast(tf.size(h[0]) // tf.maximum(tf.shape(x)[0], 1), tf.int64)
            env[step.output] = ins[0] if not step.ops else h[0]
            masks[step.output] = _output_mask(step.layer, ins, in_masks)
            trace.append(entry)
        logits = env[prog.output_key]
        return ForwardPass(logits, _concat_neurons(neurons, x), trace, size)

    def _tangent(self, trace, v: Tangent):
        prog = self.program
        env = {prog.input_key: v}
        neuron_t = []
        for step, entry in zip(prog.steps, trace):
            ts = [env[k] for k in step.inputs]
            mask = entry.get("mask")
            for op, rec in zip(step.ops, entry["ops"]):
                t, nt = op.tangent(ts, rec, mask)
                if nt is not None:
                    neuron_t.append(nt)
                ts = [t]
            env[step.output] = ts[0]
        return neuron_t, env[prog.output_key]

    def _finish(self, neuron_t, out: Tangent, batch, k, concat=True):
        out = out.per_example(batch)
        logits = tf.reshape(out, tf.stack([batch, k, tf.reduce_prod(tf.shape(out)[2:])]))
        if not neuron_t:
            neuron_t = [tf.zeros(tf.stack([batch, k, 0]), self.dtype)]
        return JVP(tf.concat(neuron_t, axis=-1) if concat else neuron_t, logits)

    def _jvp(self, trace, v, shared: bool, concat=True, axes=None):
        """JVP along `v`; with `concat=False`, `neurons` is a list of per-unit blocks.

        `axes` optionally gives the input axes of one-hot directions `v` (see
        `rules.base.Tangent`), which lets a first Dense layer gather rows.
        """
        v = tf.cast(v, self.dtype)
        batch = tf.shape(trace_batch(trace, self))[0] if shared else tf.shape(v)[0]
        k = tf.shape(v)[0] if shared else tf.shape(v)[1]
        neuron_t, out = self._tangent(trace, Tangent(v, shared=shared, axes=axes))
        return self._finish(neuron_t, out, batch, k, concat)

    def _axes_jvp(self, trace, start, k: int, example_shape, reduce=None, per_neuron=False):
        """JVP along input axes `start .. start + k - 1` (zero past the last axis).

        With `per_neuron=True`, `reduce` is applied to each unit's `[b, k, n]`
        block separately and its results are concatenated along the last axis:
        much faster for reductions over the direction axis (no `[b, k, N]` copy).
        """
        d = tf.reduce_prod(example_shape)
        axes = tf.range(start, start + k)
        eye = tf.one_hot(axes, d, dtype=self.dtype)
        dirs = tf.reshape(eye, tf.concat([[k], example_shape], 0))
        axes = tf.where(axes < d, axes, -1)
        jvp = self._jvp(trace, dirs, True, concat=not per_neuron, axes=axes)
        if reduce is None:
            return jvp
        if not per_neuron:
            return reduce(jvp, start)
        parts = [reduce(JVP(block, jvp.logits), start) for block in jvp.neurons]
        return tf.nest.map_structure(lambda *xs: tf.concat(xs, axis=-1), *parts)

    # ------------------------------------------------------------------ public API

    def forward(self, x) -> ForwardPass:
        """Runs the model, recording every unit's neurons and pattern.

        Args:
            x: `[B, *input_shape]` array or tensor.

        Returns:
            A `ForwardPass` (logits, neurons, per-step trace).
        """
        return self._forward_fn(self.check_input(x))

    def __call__(self, x):
        return self.forward(x).logits

    def units(self, fwd: ForwardPass) -> dict[str, dict[str, tf.Tensor]]:
        """The records of every piecewise-linear unit of a forward pass, by name.

        Activation units (and SimpleRNN layers) give `z` (pre-activations) and
        `slope` (the frozen mask); max-pooling units give `argmax` (`[B, *out,
        C]`, the chosen window element) beside their windows.

        Example:

        ```python
        fwd = lin.forward(x)
        lin.units(fwd)["dense"]["slope"]     # [B, units] 0/1 mask of a ReLU
        ```
        """
        out = {}
        for step, entry in zip(self.program.steps, fwd.trace):
            for op, rec in zip(step.ops, entry["ops"]):
                if not op.owns_neurons:
                    continue
                rec = dict(rec)
                if "one_hot" in rec:
                    rec["argmax"] = tf.argmax(rec["one_hot"], axis=-2, output_type=tf.int32)
                out[op.name] = rec
        return out

    def jvp(self, x, v) -> JVP:
        """Derivatives of all neurons and logits along directions, with the
        activation pattern of `x` frozen (no back-propagation).

        Args:
            x: `[B, *input_shape]` inputs.
            v: `[B, K, *input_shape]` directions per example, or `[K, *input_shape]`
                directions shared by all examples.

        Returns:
            A `JVP` with `neurons [B, K, N]` and `logits [B, K, L]`.
        """
        x = self.check_input(x)
        v = tf.convert_to_tensor(v, self.dtype)
        ex_rank = len(self.input_shape)
        if v.shape.rank == ex_rank + 1:
            shared = True
        elif v.shape.rank == ex_rank + 2:
            shared = False
            if v.shape[0] is not None and x.shape[0] is not None and v.shape[0] != x.shape[0]:
                raise ValueError(f"Directions have batch size {v.shape[0]} but x has "
                                 f"{x.shape[0]}; pass v as [B, K, *input_shape].")
        else:
            raise ValueError(
                f"Directions must have shape [B, K, *input_shape] or [K, *input_shape] "
                f"with input_shape={self.input_shape}; got shape {tuple(v.shape)}."
            )
        if tuple(v.shape[-ex_rank:]) != tuple(x.shape[1:]):
            raise ValueError(f"Directions end in shape {tuple(v.shape[-ex_rank:])} but the "
                             f"inputs have per-example shape {tuple(x.shape[1:])}.")
        fwd = self._forward_fn(x)
        return self._jvp_fn(fwd.trace, v, shared)

    def jacobian(self, x, batch_size: int | None = None) -> np.ndarray:
        """Input gradient of every neuron: `[B, N, D]` (D = flattened input size).

        Directions are streamed in chunks within `memory_budget`; only the
        result itself is dense.
        """
        return self._dense_jacobian(x, "neurons", batch_size)

    def output_jacobian(self, x, batch_size: int | None = None) -> np.ndarray:
        """Input gradient of every (flattened) output logit: `[B, L, D]`."""
        return self._dense_jacobian(x, "logits", batch_size)

    def _dense_jacobian(self, x, which, batch_size):
        x = self.check_input(x)
        b_total = int(x.shape[0])
        d = int(np.prod(x.shape[1:]))
        out = None
        for sl, _fwd, start, k, jvp in self.iter_axis_chunks(x, batch_size=batch_size):
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
        if out is None:  # empty batch
            n = 0 if which == "logits" else 0
            return np.zeros((0, n, d), self.dtype)
        return out

    def iter_axis_chunks(self, x, batch_size: int | None = None, reduce=None,
                         memory_budget: int | None = None, per_neuron: bool = False):
        """Streams the Jacobian along input axes in chunks.

        Yields `(example_slice, forward_pass, start, k, result)` where `result` is
        the `JVP` along axes `start .. start + k - 1` for the examples in
        `example_slice` (columns past the last axis are zero), or
        `reduce(jvp, start)` computed inside the compiled function if given.
        With `per_neuron=True` the reduction must act on each neuron separately
        (e.g. a sum over directions): it then runs on each unit's block without
        first concatenating the `[b, k, N]` tangents, which is several times faster.
        """
        x = self.check_input(x)
        b_total = int(x.shape[0])
        if b_total == 0:
            return
        budget = memory_budget or self.memory_budget
        example_shape = tf.constant(x.shape[1:], tf.int32)
        d = int(np.prod(x.shape[1:]))
        per = sum(self._sizes(x.shape[1:])) * np.dtype(self.dtype).itemsize
        b, k = plan_chunks(b_total, d, per, budget, batch_size)
        i = 0
        while i < b_total:
            xb = x[i : i + b]
            fwd = self._forward_fn(xb)
            sl = slice(i, i + int(xb.shape[0]))
            for start in range(0, d, k):
                first = tf.constant(start, tf.int32)
                yield sl, fwd, start, k, self._axes_fn(fwd.trace, first, k, example_shape,
                                                        reduce, per_neuron)
            i += int(xb.shape[0])

    # ------------------------------------------------------------------ validation

    def check_input(self, x) -> tf.Tensor:
        """Validates `x` against the model input; returns a tensor of `self.dtype`."""
        if isinstance(x, (list, tuple)) and len(x) == 1:
            x = x[0]
        try:
            arr = x if tf.is_tensor(x) else np.asarray(x)
        except Exception as e:  # ragged lists and the like
            raise ValueError(f"Could not read the input as an array: {e}") from None
        if not tf.is_tensor(arr) and arr.dtype == object:
            raise ValueError("The input is ragged or not numeric; pad it into an array of "
                             f"shape [B, {', '.join(map(str, self.input_shape))}].")
        dtype = tf.as_dtype(arr.dtype)
        if not (dtype.is_floating or dtype.is_integer or dtype.is_bool):
            raise TypeError(f"Expected a numeric input, got dtype {dtype.name}.")
        shape = tuple(arr.shape)
        want = self.input_shape
        if len(shape) != len(want) + 1 or any(
            w is not None and s is not None and s != w for s, w in zip(shape[1:], want)
        ):
            raise ValueError(
                f"Model '{self.model.name}' expects inputs of shape (batch, "
                f"{', '.join(str(w) for w in want)}), got an array of shape {shape}."
            )
        t = tf.cast(tf.convert_to_tensor(arr), self.dtype)
        if tf.executing_eagerly() and not bool(tf.reduce_all(tf.math.is_finite(t))):
            bad = int(tf.reduce_sum(tf.cast(~tf.math.is_finite(t), tf.int32)))
            raise ValueError(f"The input contains {bad} non-finite values (NaN or inf); "
                             f"margins and gradients are undefined there. Clean the data first.")
        return t


def trace_batch(trace, lin: Linearized):
    """The `[B, ...]` model input kept in the trace, to read the batch size in graphs."""
    if not trace:
        raise ValueError(f"Model '{lin.model.name}' has no layers to linearize.")
    return trace[0]["input"]


def plan_chunks(b_total: int, d: int, per_direction: int, budget: int,
                batch_size: int | None) -> tuple[int, int]:
    """Chooses (examples, directions) per chunk so that `b * k * per <= budget`.

    Examples default to chunks of `DEFAULT_EXAMPLES` (large enough to keep the
    matmuls efficient); directions fill the rest of the budget, balanced so the
    last chunk is not almost empty.
    """
    b = min(b_total, batch_size or DEFAULT_EXAMPLES)
    k = budget // max(1, b * per_direction)
    if k < min(d, 32) and batch_size is None:
        b = max(1, min(b, budget // max(1, per_direction * min(d, 32))))
        k = budget // max(1, b * per_direction)
    k = int(max(1, min(d, k)))
    if k < d:
        k = math.ceil(d / math.ceil(d / k))
    return int(b), k


def _output_mask(layer, ins, in_masks):
    """The Keras mask of a layer's output, as Layer.__call__ would set it."""
    if not isinstance(layer, keras.layers.Layer) or not layer.supports_masking:
        return None
    if all(m is None for m in in_masks) and not isinstance(layer, keras.layers.Masking):
        return None
    arg = ins if len(ins) > 1 else ins[0]
    prev = in_masks if len(ins) > 1 else in_masks[0]
    return layer.compute_mask(arg, prev)


def _concat_neurons(neurons: list[Neurons], x) -> Neurons:
    if not neurons:
        batch = tf.shape(x)[0]
        empty = tf.zeros(tf.stack([batch, 0]), x.dtype)
        return Neurons(empty, empty, empty, tf.zeros(tf.stack([batch, 0]), tf.bool),
                       tf.zeros(tf.stack([batch, 0]), tf.int32))
    return Neurons(*[tf.concat(list(parts), axis=1) for parts in zip(*neurons)])
