"""The graph pass: a Keras functional model -> an ordered program of steps.

It walks the functional graph's nodes by depth in execution order (as Keras's
own `Function._run_through_graph` does; the Keras internals it reads are in
`keras_roll.compile.keras_internals`), inlines nested functional / Sequential models,
gives every layer call its own step (shared layers appear once per call) and
compiles each call into ops through the rule registry. The interpreter
(`keras_roll.compile.interpreter`) runs the resulting `Program`; see docs/design.md,
section "Module map".
"""

from __future__ import annotations

import dataclasses

import keras

from keras_roll.compile.keras_internals import (
    functional_class,
    node_training_argument,
    nodes_by_depth,
    sequential_graph,
)
from keras_roll.compile.rules import compile_layer
from keras_roll.compile.rules.activations import Link, OutputLink
from keras_roll.compile.rules.base import Op
from keras_roll.errors import UnsupportedModelError


@dataclasses.dataclass
class Step:
    """One layer call: its ops, the keys of its input tensors and of its output."""

    layer: object
    ops: list[Op]
    inputs: list[int]
    output: int
    name: str


@dataclasses.dataclass
class Program:
    """The compiled model.

    Attributes:
        steps: the layer calls in execution order.
        input_key / output_key: keys of the model input and output tensors.
        input_shape: per-example input shape (may contain None for time).
        output_link: the `Link` (`Link.SOFTMAX`, `Link.SIGMOID`) when a final link
            was folded, else None.
    """

    steps: list[Step]
    input_key: int
    output_key: int
    input_shape: tuple
    input_dtype: str
    output_link: Link | None


def _functional(model, path: str):
    """The Functional graph behind `model`, or a clear error."""
    Functional = functional_class()
    if isinstance(model, keras.Sequential):
        graph = sequential_graph(model)
        if graph is None:
            raise ValueError(
                f"The Sequential model '{model.name}'{path} has not been built, so it has "
                f"no graph to linearize. Give it an input shape, e.g. start it with "
                f"keras.Input(shape=...), or call it once on data."
            )
        return graph
    if isinstance(model, Functional):
        return model
    if isinstance(model, keras.Model):
        raise UnsupportedModelError(
            f"Model '{model.name}'{path} is a subclassed keras.Model "
            f"({type(model).__name__}); its computation lives in Python code that "
            f"keras_roll cannot read. Rebuild it with the functional API "
            f"(keras.Input(...) -> layers -> keras.Model(inputs, outputs)) or as "
            f"keras.Sequential."
        )
    raise TypeError(
        f"Expected a Keras functional or Sequential model, got {model!r} "
        f"of type {type(model).__name__}."
    )


def build_program(model) -> Program:
    """Walks `model` into a `Program`.

    Raises:
        UnsupportedModelError: for subclassed models, several inputs or outputs,
            unsupported layers, or a softmax / sigmoid anywhere but the output.
        ValueError: for a model that was never built.
    """
    graph = _functional(model, "")
    if len(graph.inputs) != 1 or len(graph.outputs) != 1:
        raise UnsupportedModelError(
            f"Model '{model.name}' has {len(graph.inputs)} inputs and "
            f"{len(graph.outputs)} outputs; keras_roll linearizes models with a single "
            f"input tensor and a single output tensor. Concatenate the inputs (or "
            f"outputs) into one tensor."
        )
    builder = _Builder(model)
    (output_key,) = builder.walk(graph, [builder.input_key], "")
    steps = builder.steps
    link = _fold_output_link(steps, output_key)
    shape = tuple(graph.inputs[0].shape[1:])
    return Program(steps, builder.input_key, output_key, shape, str(graph.inputs[0].dtype),
                   link)


class _Builder:
    """Walks a functional graph, and the models nested in it, into program steps."""

    input_key = 1

    def __init__(self, model: keras.Model):
        self.model = model
        self.steps: list[Step] = []
        self.calls: dict[int, int] = {}  # calls of each layer so far (shared layers)
        self.last_key = self.input_key

    def walk(self, fgraph, in_keys: list[int], path: str) -> list[int]:
        """Adds the steps of `fgraph` fed by `in_keys`; returns its output keys."""
        env = {id(x): k for x, k in zip(fgraph.inputs, in_keys)}
        needed = _needed_tensors(fgraph)
        by_depth = nodes_by_depth(fgraph)
        for depth in sorted(by_depth, reverse=True):
            for node in by_depth[depth]:
                if node.is_input or not node.operation:
                    continue
                if not any(id(x) in needed for x in node.outputs):
                    continue  # e.g. the ops computing a Keras mask: masks are re-derived
                data = _data_inputs(node, node.operation)
                if any(id(x) not in env for x in data):
                    continue  # not reachable from the inputs (as Keras does)
                ins = [env[id(x)] for x in data]
                env[id(node.outputs[0])] = self.add(node, ins, path)
        return [env[id(x)] for x in fgraph.outputs]

    def add(self, node, ins: list[int], path: str) -> int:
        """Adds the step of one layer call (or inlines a nested model); returns its key."""
        layer = node.operation
        if isinstance(layer, keras.Model):
            inner = _functional(layer, f" (inside '{path or self.model.name}')")
            if len(inner.inputs) != len(ins) or len(inner.outputs) != 1:
                raise UnsupportedModelError(
                    f"Nested model '{layer.name}' has {len(inner.inputs)} inputs and "
                    f"{len(inner.outputs)} outputs; keras_roll inlines nested models "
                    f"with one input and one output."
                )
            return self.walk(inner, ins, f"{path}{layer.name}/")[0]
        if len(node.outputs) != 1:
            raise UnsupportedModelError(
                f"Layer '{layer.name}' of class {type(layer).__name__} returns "
                f"{len(node.outputs)} tensors; keras_roll supports layers with one "
                f"output."
            )
        n = self.calls.get(id(layer), 0)
        self.calls[id(layer)] = n + 1
        name = path + (layer.name if n == 0 else f"{layer.name}@{n}")
        ops = compile_layer(layer)
        _refuse_forced_training(node, layer, ops, name)
        for op in ops:
            op.name = name
        self.last_key += 1
        self.steps.append(Step(layer, ops, ins, self.last_key, name))
        return self.last_key


def _refuse_forced_training(node, layer, ops, name) -> None:
    """Refuses a training-dependent layer called with `training=True` in the graph.

    Such a call (e.g. Monte-Carlo dropout, `Dropout(0.5)(h, training=True)`)
    runs in training mode whenever the model is called without an explicit
    `training=` (`model(x)`): it is random or depends on the batch, so the model
    has no fixed linear region to certify, and the twin (which always
    linearizes inference mode) would describe another function.
    """
    forced = node_training_argument(node)
    if forced is None or forced is False:
        return
    if any(op.training_dependent for op in ops):
        raise UnsupportedModelError(
            f"Layer '{name}' ({type(layer).__name__}) is called with training={forced!r} "
            f"inside the model, so model(x) runs it in training mode: it is random "
            f"(dropout, noise) or depends on the batch (BatchNormalization's batch "
            f"statistics), and the model has no fixed linear region to certify or "
            f"linearize. Call it without training= (Keras then follows the model's mode).")


def _fold_output_link(steps: list[Step], output_key: int) -> Link | None:
    """Removes a final softmax / sigmoid; refuses one anywhere else."""
    link = None
    for step in steps:
        for i, op in enumerate(step.ops):
            if not isinstance(op, OutputLink):
                continue
            last = step.output == output_key and i == len(step.ops) - 1
            if not last:
                raise UnsupportedModelError(
                    f"Layer '{step.name}' ({type(step.layer).__name__}) applies the activation "
                    f"'{op.link}' inside the network; keras_roll allows softmax / sigmoid "
                    f"only as the final output, where it is folded into the loss. Use a "
                    f"ReLU-family activation in hidden layers."
                )
            link = op.link
            step.ops = step.ops[:-1]
    return link


def _data_inputs(node, layer) -> list:
    """The tensors a node computes on: positional arguments, not `mask=`.

    Keras masks are re-derived by the twin from the layers' `compute_mask`;
    any other tensor keyword argument (e.g. an RNN's `initial_state`) is refused.
    """
    args = [x for x in keras.tree.flatten(node.arguments.args) if _is_keras_tensor(x)]
    for key, value in node.arguments.kwargs.items():
        tensors = [x for x in keras.tree.flatten(value) if _is_keras_tensor(x)]
        if tensors and key != "mask":
            raise UnsupportedModelError(
                f"Layer '{layer.name}' ({type(layer).__name__}) is called with the tensor "
                f"argument {key}=...; keras_roll supports tensors as positional inputs "
                f"only. Remove the argument or wrap the call in a layer with a rule."
            )
    if not isinstance(layer, keras.layers.Layer):
        flat = keras.tree.flatten(node.arguments.args)
        if len(flat) != len(args):
            raise UnsupportedModelError(
                f"Operation '{layer.name}' ({type(layer).__name__}) is called with "
                f"non-tensor arguments; wrap it in a layer and register a rule with "
                f"keras_roll.register_rule."
            )
    return args


def _is_keras_tensor(x) -> bool:
    return isinstance(x, keras.KerasTensor)


def _needed_tensors(fgraph) -> set[int]:
    """Ids of the tensors the outputs depend on through data (not mask) inputs."""
    needed = {id(x) for x in fgraph.outputs}
    by_depth = nodes_by_depth(fgraph)
    for depth in sorted(by_depth):
        for node in by_depth[depth]:
            if node.is_input or not node.operation:
                continue
            if any(id(x) in needed for x in node.outputs):
                args = keras.tree.flatten(node.arguments.args)
                needed.update(id(x) for x in args if _is_keras_tensor(x))
    return needed
