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
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll import inputs
from keras_roll.api_types import Array, ModelOrTwin
from keras_roll.compile import streaming
from keras_roll.compile.chunking import DEFAULT_EXAMPLES, plan_chunks  # noqa: F401  (re-exported)
from keras_roll.compile.graph import Program, build_program
from keras_roll.compile.interpreter import JVP, ForwardPass, Interpreter, Trace
from keras_roll.compile.layout import NeuronLayout
from keras_roll.compile.streaming import MAX_DENSE_RESULT  # noqa: F401  (re-exported)
from keras_roll.options import fixed_budget

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "JVP",
    "CompiledPasses",
    "ForwardPass",
    "Linearized",
    "linearize",
    "plan_chunks",
]

DEFAULT_MEMORY_BUDGET = 64 * 2**20  # bytes of live tangents per chunk


class CompiledPasses(NamedTuple):
    """The interpreter's passes compiled with `tf.function` (`Linearized.compiled`).

    They take checked tensors (see `Linearized.check_input`) and retrace little
    (`reduce_retracing=True`). Executors that stream many chunks call these.
    """

    primal: tf.types.experimental.PolymorphicFunction
    tangent: tf.types.experimental.PolymorphicFunction
    axes_tangent: tf.types.experimental.PolymorphicFunction


def linearize(model: ModelOrTwin, memory_budget: int | str = DEFAULT_MEMORY_BUDGET) -> Linearized:
    """Compiles a Keras model into its frozen-pattern twin.

    Args:
        model: a built functional or Sequential Keras model of supported layers
            (a model made by `keras_roll.wrap` is unwrapped first).
        memory_budget: bytes of tangents a chunk may hold when directions are
            streamed (`jacobian`, `certify`), at least 1; "auto" (or None)
            for the default.

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
    model = unwrap_model(model)
    memory_budget = twin_budget(memory_budget)
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


def twin_budget(memory_budget) -> int:
    """A twin's memory budget in bytes: `memory_budget`, or the default for "auto" / None."""
    budget = fixed_budget(memory_budget)
    return DEFAULT_MEMORY_BUDGET if budget is None else budget


class Linearized:
    """A model compiled into steps of ops, with its frozen-pattern twin.

    Use `keras_roll.linearize(model)` to build one. Weights are read from the
    model's variables at every call, so the twin follows training.

    Attributes:
        model: the Keras model.
        program: its compiled `Program`.
        interpreter: the `Interpreter` that runs the passes.
        compiled: the passes compiled with `tf.function` (`CompiledPasses`).
        memory_budget: bytes of tangents a streamed chunk may hold.
        dtype: the dtype of the twin ("float32" or "float64").
    """

    def __init__(self, model: keras.Model, memory_budget: int | str = DEFAULT_MEMORY_BUDGET):
        memory_budget = twin_budget(memory_budget)
        model = unwrap_model(model)
        self.model = model
        self.program: Program = build_program(model)
        self.memory_budget = int(memory_budget)
        dtype = keras.backend.standardize_dtype(self.program.input_dtype)
        if dtype not in ("float32", "float64"):
            dtype = "float32"  # integer inputs, or float16 under mixed precision
        self.dtype = dtype
        self.interpreter = Interpreter(self.program, dtype)
        self.compiled = self._compile()
        self._layouts: dict[tuple, NeuronLayout] = {}
        self._siblings: dict[str, Linearized] = {dtype: self}

    def _compile(self) -> CompiledPasses:
        def compiled(fn):
            # A partial, not the bound method: TensorFlow counts retracings per code
            # object, so every twin of a session would share one count and warn about
            # "excessive retracing" of functions that each traced only a few times.
            return tf.function(functools.partial(fn.__func__, self), reduce_retracing=True,
                               autograph=False)

        return CompiledPasses(compiled(self.primal), compiled(self.tangent_from_trace),
                              compiled(self.axes_tangent))

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
            twin.compiled = twin._compile()
            self._siblings[dtype] = twin
        return self._siblings[dtype]

    # ------------------------------------------------------------------ structure

    @property
    def input_shape(self) -> tuple:
        """Per-example input shape (None for a variable time axis)."""
        return self.program.input_shape

    @property
    def inference_equals_training(self) -> bool:
        """True when no layer behaves differently in training (BatchNorm, dropout,
        noise: `Op.training_dependent`), so the twin's forward pass is also the
        training-mode forward pass."""
        return not any(op.training_dependent for step in self.program.steps for op in step.ops)

    @property
    def output_link(self) -> str | None:
        """'softmax' or 'sigmoid' if a final link was folded into the loss."""
        return self.program.output_link

    def apply_output_link(self, logits):
        """The model output from the twin's logits (re-applies a folded softmax/sigmoid)."""
        if self.output_link == "softmax":
            return tf.nn.softmax(logits, axis=-1)
        if self.output_link == "sigmoid":
            return tf.sigmoid(logits)
        return logits

    def summary(self, print_fn=print) -> None:
        """Prints the compiled program: one line per op."""
        print_fn(f"Linearized '{self.model.name}': input {self.input_shape}, "
                 f"dtype {self.dtype}, output link {self.output_link}")
        for step in self.program.steps:
            kinds = ", ".join(type(op).__name__ for op in step.ops) or "(folded)"
            print_fn(f"  {step.name:<30} {type(step.layer).__name__:<24} {kinds}")

    # ------------------------------------------------------------------ neuron layout

    def layout(self, example_shape) -> NeuronLayout:
        """The `NeuronLayout` for inputs of per-example shape `example_shape`.

        Built from one eager batch-1 forward pass per shape, then cached.
        """
        shape = tuple(int(d) for d in example_shape)
        if shape not in self._layouts:
            with tf.init_scope():
                fwd = self.compiled.primal(tf.zeros((1, *shape), self.dtype))
                units = [(op.name, op.neuron_shape(rec))
                         for op, rec in self.interpreter.units(fwd.trace)]
                self._layouts[shape] = NeuronLayout.from_units(shape, units,
                                                               int(fwd.tangent_size))
        return self._layouts[shape]

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
        return self.layout(self.input_shape).names

    def neuron_names_for(self, x) -> list[tuple[str, int | tuple]]:
        """`neuron_names` for inputs shaped like `x` (a list of N tuples)."""
        return self.layout(np.shape(x)[1:]).names

    def neuron_name(self, index: int, example_shape) -> tuple[str, int | tuple]:
        """The `(layer name, unit index)` of neuron row `index`, without building
        the whole list (cheap for models with millions of neurons)."""
        return self.layout(example_shape).name(index)

    def num_neurons(self, example_shape) -> int:
        """N, the number of neuron rows for inputs of per-example shape `example_shape`."""
        return self.layout(example_shape).num_neurons

    def neuron_layout(self, example_shape) -> NeuronLayout:
        """The layout; iterating it gives `(name, first row, per-example shape)` per unit."""
        return self.layout(example_shape)

    def tangent_size(self, example_shape) -> int:
        """Tangent elements per example and direction (the outputs of every op, as
        `ForwardPass.tangent_size`) for inputs of per-example shape `example_shape`."""
        return self.layout(example_shape).tangent_size

    # ------------------------------------------------------------------ passes (any graph)

    def primal(self, x: tf.Tensor) -> ForwardPass:
        """The forward pass on a checked tensor, in the caller's graph (not compiled).

        Use it inside training steps and custom gradients; `forward` is the
        validated, compiled entry point.
        """
        return self.interpreter.primal(x)

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
                (ROLL's `wrt=`, see `keras_roll.roll.estimators.tangent_entry`).
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
        return {op.name: rec.as_dict() for op, rec in self.interpreter.units(fwd.trace)}

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
        return streaming.dense_jacobian(self, x, "neurons", batch_size)

    def output_jacobian(self, x: Array, batch_size: int | None = None) -> np.ndarray:
        """Input gradient of every (flattened) output logit: `[B, L, D]`."""
        return streaming.dense_jacobian(self, x, "logits", batch_size)

    def iter_axis_chunks(self, x: Array, batch_size: int | None = None, reduce=None,
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
        return streaming.iter_axis_chunks(self, x, batch_size=batch_size, reduce=reduce,
                                          memory_budget=memory_budget, per_neuron=per_neuron)

    def check_input(self, x: Array) -> tf.Tensor:
        """Validates `x` against the model input; returns a tensor of `self.dtype`."""
        return inputs.check_input(x, self.input_shape, self.dtype, self.model.name)


def unwrap_model(model):
    """The plain model inside a model made by `keras_roll.wrap` (itself otherwise).

    The core cannot import `keras_roll.roll.regularizer`, so it recognises the
    wrapper by its layer: one that holds an `inner_model` and a `roll_config`.
    """
    if not isinstance(model, keras.Model):
        return model
    for layer in getattr(model, "layers", []):
        inner = getattr(layer, "inner_model", None)
        if isinstance(inner, keras.Model) and hasattr(layer, "roll_config"):
            return inner
    return model
