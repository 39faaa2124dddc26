"""The frozen-pattern twin: `linearize(model)` and the `Linearized` model it returns.

With the activation pattern fixed, a piecewise-linear network is linear in its
input, so the derivative of every neuron along a direction is one forward pass
of a bias-free twin whose activations are multiplications by frozen slopes
(docs/design.md, section "The frozen-pattern twin"). Feeding K directions per
example in parallel gives K columns of every neuron's input gradient without
back-propagation.

`Linearized` is the facade over the pieces that do the work:

* `keras_roll.compile.graph` compiles the model into a `Program` of steps and ops;
* `keras_roll.compile.interpreter` runs its passes (primal, tangent) in one walk;
* `keras_roll.compile.layout` names the neuron rows (`NeuronLayout`, one probe per
  input shape);
* `keras_roll.compile.streaming` streams Jacobians in chunks planned by
  `keras_roll.compile.chunking`;
* `keras_roll.inputs` validates inputs and directions.

The rounding analyses of certificates are passes of `keras_roll.rounding` over
the same program (`Linearized.program`, `Linearized.interpreter`).

`lin.at_dtype("float64")` is the same twin computing in float64 from the
model's float32 weights (exact in float64): certificates use it by default.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll import inputs
from keras_roll.compile import streaming
from keras_roll.compile.autotune import axis_budget
from keras_roll.compile.caches import batch_polymorphic, cached
from keras_roll.compile.graph import Program, build_program
from keras_roll.compile.interpreter import JVP, ForwardPass, Interpreter, Trace
from keras_roll.compile.layout import NeuronLayout
from keras_roll.compile.queries import NeuronQueries, ProgramQueries
from keras_roll.inputs import Array, InputSpec, ModelOrTwin
from keras_roll.options import fixed_budget

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "JVP",
    "CompiledPasses",
    "ForwardPass",
    "Linearized",
    "linearize",
    "twin_budget",
    "unwrap",
]

DEFAULT_MEMORY_BUDGET = 64 * 2**20  # bytes of live tangents per chunk


class CompiledPasses(NamedTuple):
    """The interpreter's passes compiled with `tf.function` (`Linearized.compiled`).

    They take checked tensors (see `Linearized.check_input`) and retrace little
    (`reduce_retracing=True`); the first traces of the primal and the axes tangent take
    any batch size (`keras_roll.compile.caches.batch_polymorphic`), so the twin's
    one-example layout pass, a batch and a data set's last slice share one graph.
    Executors that stream many chunks call these (`keras_roll.compile.streaming`).
    """

    primal: Callable
    tangent: tf.types.experimental.PolymorphicFunction
    axes_tangent: Callable

    @classmethod
    def of(cls, lin: Linearized) -> CompiledPasses:
        """`lin`'s primal, tangent and axes-tangent passes, compiled."""
        def compiled(method):
            # A partial, not the bound method: TensorFlow counts retracings per code
            # object, so every twin of a session would share one count and warn about
            # "excessive retracing" of functions that each traced only a few times.
            return tf.function(functools.partial(method, lin), reduce_retracing=True,
                               autograph=False)

        kind = type(lin)
        # the axes tangent's trace leads with the batch axis, its chunk's start, size
        # and the example shape do not
        return cls(batch_polymorphic(compiled(kind.primal)), compiled(kind.tangent_from_trace),
                   batch_polymorphic(compiled(kind.axes_tangent), batched=1))


def linearize(model: ModelOrTwin, memory_budget: int | str | None = "auto") -> Linearized:
    """Compiles a Keras model into its frozen-pattern twin.

    Args:
        model: a built functional or Sequential Keras model of supported layers
            (a model made by `keras_roll.wrap` is unwrapped first).
        memory_budget: bytes of tangents a chunk may hold when directions are
            streamed (`jacobian`, `certify`, ROLL), at least 1; or "auto" (the
            default; None too): chunks sized by a short timed probe the first
            time the twin meets a shape (`keras_roll.compile.chunking`), else
            `DEFAULT_MEMORY_BUDGET`.

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
    model = unwrap(model)
    budget = fixed_budget(memory_budget)
    # One twin per (model, budget), kept on the model itself: repeated calls such as
    # certify(model, x) reuse its compiled functions instead of tracing them again.
    key = "auto" if budget is None else budget
    return cached(model, ("twin", key), lambda: Linearized(model, memory_budget=memory_budget))


def twin_budget(memory_budget) -> int:
    """A twin's memory budget in bytes: `memory_budget`, or the default for "auto" / None."""
    budget = fixed_budget(memory_budget)
    return DEFAULT_MEMORY_BUDGET if budget is None else budget


class Linearized(NeuronQueries, ProgramQueries):
    """A model compiled into steps of ops, with its frozen-pattern twin.

    Use `keras_roll.linearize(model)` to build one. Weights are read from the
    model's variables at every call, so the twin follows training. The queries
    about its neurons (`neuron_names`, `num_neurons`, ...) and its program
    (`output_link`, `summary`, ...) come from `keras_roll.compile.queries`.

    Attributes:
        model: the Keras model.
        program: its compiled `Program`.
        interpreter: the `Interpreter` that runs the passes.
        compiled: the passes compiled with `tf.function` (`CompiledPasses`).
        memory_budget: bytes of tangents a streamed chunk may hold (the
            default when the twin is "auto" and nothing is tuned).
        auto_budget: whether the twin was built with "auto": the executors
            that time their chunks may then choose other budgets.
        dtype: the dtype of the twin ("float32" or "float64").
    """

    def __init__(self, model: keras.Model, memory_budget: int | str | None = "auto"):
        self.auto_budget = fixed_budget(memory_budget) is None
        memory_budget = twin_budget(memory_budget)
        model = unwrap(model)
        self.model = model
        self.program: Program = build_program(model)
        self.memory_budget = int(memory_budget)
        dtype = keras.backend.standardize_dtype(self.program.input_dtype)
        if dtype not in ("float32", "float64"):
            dtype = "float32"  # integer inputs, or float16 under mixed precision
        self.dtype = dtype
        self.interpreter = Interpreter(self.program, dtype)
        self.compiled = CompiledPasses.of(self)
        self._layouts: dict[tuple, NeuronLayout] = {}
        self._siblings: dict[str, Linearized] = {dtype: self}

    def at_dtype(self, dtype: str) -> Linearized:
        """This twin computing in `dtype` ("float32" or "float64"), cached.

        The float64 twin reads the same (float32) weights, which float64
        represents exactly, so its neurons and gradients carry only float64
        rounding; certificates use it under `rigor="float64"`. It shares the
        model, the program and the neuron layouts.

        Example:

        ```python
        twin = keras_roll.linearize(model).at_dtype("float64")
        twin.forward(x).neurons.z.dtype          # float64
        ```
        """
        dtype = keras.backend.standardize_dtype(dtype)
        if dtype not in ("float32", "float64"):
            raise ValueError(f"A twin computes in 'float32' or 'float64', got {dtype!r}.")
        if dtype not in self._siblings:
            twin = copy.copy(self)
            twin.dtype = dtype
            twin.interpreter = Interpreter(self.program, dtype)
            twin.compiled = CompiledPasses.of(twin)
            self._siblings[dtype] = twin
        return self._siblings[dtype]

    # ------------------------------------------------------------------ structure

    @property
    def input_shape(self) -> tuple:
        """Per-example input shape (None for a variable time axis)."""
        return self.program.input_shape

    @property
    def input_spec(self) -> InputSpec:
        """What the twin takes: `InputSpec(input_shape, dtype, model name)`."""
        return InputSpec(self.input_shape, self.dtype, self.model.name)

    # ------------------------------------------------------------------ neuron layout

    def layout(self, example_shape) -> NeuronLayout:
        """The `NeuronLayout` for inputs of per-example shape `example_shape`.

        Built from one eager batch-1 forward pass per shape, then cached.
        """
        shape = tuple(int(d) for d in example_shape)
        if shape not in self._layouts:
            with tf.init_scope():
                fwd = self.compiled.primal(tf.zeros((1, *shape), self.dtype))
                units = [(op.name, op.neuron_shape(rec), bool(getattr(op, "max_window", False)))
                         for op, rec in self.interpreter.units(fwd.trace)]
                self._layouts[shape] = NeuronLayout.from_units(shape, units,
                                                               int(fwd.tangent_size))
        return self._layouts[shape]

    # ------------------------------------------------------------------ passes (any graph)
    # Traced inside users' tf.functions: `do_not_convert` spares them autograph's
    # conversion of the interpreter and every rule (seconds on the first trace; the
    # passes have no Python control flow on tensors to convert).

    @tf.autograph.experimental.do_not_convert
    def primal(self, x: tf.Tensor, entry=None) -> ForwardPass:
        """The forward pass on a checked tensor, in the caller's graph (not compiled).

        Use it inside training steps and custom gradients; `forward` is the
        validated, compiled entry point. With `entry` (the twin's `affine_prefix`),
        `x` is the prefix's output and the pass starts after it.
        """
        if entry is None:
            return self.interpreter.primal(x)
        return self.interpreter.primal(x, start=entry.start, start_op=entry.start_op)

    @tf.autograph.experimental.do_not_convert
    def tangent_from_trace(self, trace: Trace, v, shared: bool, concat: bool = True,
                           axes=None, start: int = 0, dtype: str | None = None) -> JVP:
        """Derivatives along `v` with the pattern of `trace` frozen (not compiled).

        Args:
            trace: `ForwardPass.trace` of the examples.
            v: `[K, *input_shape]` shared (`shared=True`) or `[B, K, *input_shape]`
                per-example directions.
            shared: which of the two `v` is.
            concat: False gives `neurons` as a list of per-unit `[B, K, n_u]` blocks.
            axes: for one-hot directions, their flat input axes (`[K]` or `[B, K]`,
                -1 for a zero direction): a first Dense layer then gathers rows.
            start: the program step the tangents enter at (0: the model input);
                `v` is then a direction of the output of step `start - 1`
                (ROLL's `wrt=`, see `keras_roll.roll.entry.tangent_entry`).
            dtype: the dtype of the tangent pass (default the twin's), e.g.
                "float16" for ROLL under mixed precision (`Interpreter.tangent`).

        Example:

        ```python
        fwd = lin.forward(x)
        jvp = lin.tangent_from_trace(fwd.trace, v, shared=False)   # v: [B, K, ...]
        ```
        """
        return self.interpreter.tangent(trace, v, shared, concat=concat, axes=axes, start=start,
                                        dtype=dtype)

    @tf.autograph.experimental.do_not_convert
    def axes_tangent(self, trace: Trace, start, k: int, example_shape, reduce=None,
                     per_neuron: bool = False, entry: int = 0, dtype: str | None = None):
        """Derivatives along input axes `start .. start + k - 1` (not compiled).

        See `Interpreter.axes_tangent`; `reduce(jvp, start)` and `per_neuron`
        reduce the chunk inside the caller's graph; `entry` is the step the
        tangents enter at (`tangent_from_trace`'s `start`); `dtype` the dtype
        of the pass (default the twin's).
        """
        return self.interpreter.axes_tangent(trace, start, k, example_shape, reduce=reduce,
                                             per_neuron=per_neuron, entry=entry, dtype=dtype)

    # ------------------------------------------------------------------ public API

    def forward(self, x: Array) -> ForwardPass:
        """Runs the model, recording every unit's neurons and pattern.

        Args:
            x: `[B, *input_shape]` array or tensor.

        Returns:
            A `ForwardPass` (logits, neurons, per-step trace).
        """
        return self.compiled.primal(self.check_input(x))

    def __call__(self, x: Array) -> tf.Tensor:
        return self.forward(x).logits

    def jvp(self, x: Array, v: Array) -> JVP:
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
        shared = inputs.check_jvp_directions(v, x, self.input_shape)
        fwd = self.compiled.primal(x)
        return self.compiled.tangent(fwd.trace, v, shared)

    def jacobian(self, x: Array, batch_size: int | None = None) -> np.ndarray:
        """Input gradient of every neuron: `[B, N, D]` (D = flattened input size).

        Directions are streamed in chunks within `memory_budget`; only the
        result itself is dense.
        """
        return self._dense_jacobian(x, batch_size, lambda jvp: jvp.neurons)

    def output_jacobian(self, x: Array, batch_size: int | None = None) -> np.ndarray:
        """Input gradient of every (flattened) output logit: `[B, L, D]`."""
        return self._dense_jacobian(x, batch_size, lambda jvp: jvp.logits)

    def _dense_jacobian(self, x, batch_size, pick) -> np.ndarray:
        x = self.check_input(x, keep_float=True)
        d = int(np.prod(x.shape[1:]))
        out = streaming.dense_jacobian(self.iter_axis_chunks(x, batch_size), int(x.shape[0]), d,
                                       pick)
        if out is None:  # no example: [0, N, D] or [0, L, D]
            fwd = self.forward(tf.cast(x, self.dtype))
            empty = JVP(np.zeros((0, 1, int(fwd.neurons.z.shape[-1]))),
                        np.zeros((0, 1, int(np.prod(fwd.logits.shape[1:])))))
            return np.zeros((0, pick(empty).shape[-1], d), self.dtype)
        return out

    def iter_axis_chunks(self, x: Array, batch_size: int | None = None, reduce=None,
                         memory_budget: int | None = None, per_neuron: bool = False):
        """Streams the Jacobian along input axes in chunks.

        Yields `keras_roll.compile.streaming.AxisChunk`s `(examples, forward,
        start, size, result)`: `result` is the `JVP` along axes `start .. start
        + size - 1` for the examples of the slice `examples` (columns past the
        last axis are zero), or `reduce(jvp, start)` computed inside the
        compiled function if given. With `per_neuron=True` the reduction must
        act on each neuron separately (e.g. a sum over directions): it then runs
        on each unit's block without first concatenating the `[b, k, N]`
        tangents, which is several times faster. Without `memory_budget`, an
        "auto" twin sizes the chunks by a timed probe (`keras_roll.compile.autotune`).
        """
        x = self.check_input(x, keep_float=True)
        layout = self.layout(x.shape[1:])
        budget = memory_budget or axis_budget(self, x, batch_size, reduce, per_neuron)
        return streaming.iter_axis_chunks(self.compiled, layout, x, self.dtype, budget,
                                          batch_size, reduce, per_neuron)

    def check_input(self, x: Array, keep_float: bool = False) -> tf.Tensor:
        """Validates `x` against the model input; returns a tensor of `self.dtype`
        (with `keep_float`, a float32 / float64 input keeps its dtype)."""
        return inputs.check_input(x, self.input_spec, keep_float)


def unwrap(model):
    """The plain model inside a model made by `keras_roll.wrap` (itself otherwise).

    Takes the wrapped model or its `RollRegularizer` layer. The compiler cannot
    import `keras_roll.roll`, so it recognises the regularizer by what it holds:
    an `inner_model` and a `roll_config`.

    Example:

    ```python
    plain = keras_roll.unwrap(keras_roll.wrap(model))      # plain is model
    ```
    """
    if _is_regularizer(model):
        return model.inner_model
    for layer in getattr(model, "layers", []) if isinstance(model, keras.Model) else []:
        if _is_regularizer(layer):
            return layer.inner_model
    return model


def _is_regularizer(layer) -> bool:
    return isinstance(getattr(layer, "inner_model", None), keras.Model) and \
        hasattr(layer, "roll_config")
