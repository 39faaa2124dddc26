"""The backward pass beside the interpreter: linear functionals of a network pulled back to
its input, one op at a time.

Every bound of `keras_roll.robust` is a set of linear functionals `Lambda . v` of some
tensor `v` of the network (the logit margins `f_y - f_j`, or every unit of a layer)
pulled back through the ops in reverse order to the input. This module holds the
pieces they share (docs/design.md, section "Robustness radius"):

* `op_graph(program)`: the program's ops in execution order as `Node`s with value
  keys (a layer call with several ops gets intermediate keys; a folded softmax is
  an alias);
* `capture(interpreter, x)`: a forward pass (the interpreter's own primal pass) that
  also keeps every op's input and output values, records and Keras masks;
* `linear_transpose(node, lam, ...)`: `Lambda A` for the linear part `A` of an op,
  by reverse-mode differentiation of the op's own frozen-pattern `tangent` (so
  every rule's tangent is its transpose's definition, and there is nothing to keep
  in step);
* `pull_back(graph, values, start, lam, activation)`: the walk itself; what an
  activation does to `Lambda` (its frozen slope, or a linear relaxation) and the
  terms it adds are the caller's.

Example:

```python
graph = op_graph(twin.program)
values = capture(twin.interpreter, x)
res = pull_back(graph, values, graph.output_key, rows, frozen_slopes)
res.lam_input        # [B, C, *input_shape]: the gradients of the C functionals
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import tensorflow as tf

from keras_roll.compile.graph import Program
from keras_roll.compile.interpreter import PrimalTransform, propagate
from keras_roll.compile.rules.activations import Activation
from keras_roll.compile.rules.base import NO_RECORD, Op, Tangent

__all__ = [
    "BATCH_SPECS",
    "Node",
    "OpGraph",
    "PullBack",
    "Values",
    "capture",
    "compile_batched",
    "linear_transpose",
    "op_graph",
    "pull_back",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One op of the program with the keys of the values it reads and writes.

    Attributes:
        op: the op (`keras_roll.compile.rules.base.Op`).
        inputs: keys of its input values.
        output: key of its output value.
        step: index of its program step; `position`: its index in the step.
        name: the layer name its neurons are reported under.
        layer: the Keras layer.
    """

    op: Op
    inputs: tuple
    output: int
    step: int
    position: int
    name: str
    layer: object

    @property
    def is_activation(self) -> bool:
        return isinstance(self.op, Activation)


class OpGraph(NamedTuple):
    """The ops of a program in execution order.

    Attributes:
        nodes: the `Node`s.
        input_key: the key of the model input.
        output_key: the key of the model output (the logits, before a folded link).
        producer: `{key: index of the node that writes it}`.
    """

    nodes: tuple
    input_key: int
    output_key: int
    producer: dict


def op_graph(program: Program) -> OpGraph:
    """The `OpGraph` of a compiled program (see the module docstring).

    Example:

    ```python
    graph = op_graph(keras_roll.linearize(model).program)
    [n.name for n in graph.nodes if n.is_activation]     # ['relu_1', ...]
    ```
    """
    alias: dict[int, int] = {}
    nodes: list[Node] = []
    fresh = [0]

    def resolve(key):
        while key in alias:
            key = alias[key]
        return key

    for index, step in enumerate(program.steps):
        ins = tuple(resolve(k) for k in step.inputs)
        if not step.ops:  # a folded output link: its value is its input
            alias[step.output] = ins[0]
            continue
        for position, op in enumerate(step.ops):
            if position == len(step.ops) - 1:
                out = step.output
            else:
                fresh[0] -= 1
                out = fresh[0]
            nodes.append(Node(op, ins, out, index, position, step.name, step.layer))
            ins = (out,)
    producer = {n.output: i for i, n in enumerate(nodes)}
    return OpGraph(tuple(nodes), program.input_key, resolve(program.output_key), producer)


class Values(NamedTuple):
    """What `capture` keeps of a forward pass, per node (in `OpGraph` order).

    Attributes:
        x: the model input.
        inputs: per node, the list of its input values.
        outputs: per node, its output value.
        records: per node, the op's record (`NO_RECORD` without a pattern).
        masks: per node, the Keras mask of its step's first input (or None).
    """

    x: tf.Tensor
    inputs: tuple
    outputs: tuple
    records: tuple
    masks: tuple

    def value(self, graph: OpGraph, key: int) -> tf.Tensor:
        """The value of `key` (the input, or the output of its producer)."""
        if key == graph.input_key:
            return self.x
        return self.outputs[graph.producer[key]]


class _Capture(PrimalTransform):
    """The interpreter's primal pass, keeping every op's inputs and output."""

    def __init__(self, program, x, dtype):
        super().__init__(program, x, dtype)
        self.op_inputs: list = []
        self.op_outputs: list = []

    def apply(self, op, inputs, in_masks, record):
        out = super().apply(op, inputs, in_masks, record)
        self.op_inputs.append(list(inputs))
        self.op_outputs.append(out)
        return out


def capture(interpreter, x: tf.Tensor) -> Values:
    """Runs the forward pass of `interpreter` on `x`, keeping what the bounds read.

    Args:
        interpreter: an `Interpreter` (the twin's, usually float64).
        x: `[B, *input_shape]` inputs, already in the interpreter's dtype.

    Returns:
        `Values`, in the order of `op_graph(interpreter.program).nodes`.
    """
    transform = _Capture(interpreter.program, x, interpreter.dtype)
    propagate(interpreter.program, transform, x)
    records, masks = [], []
    for step in transform.steps:
        for rec in step.ops:
            records.append(rec)
            masks.append(step.mask)
    return Values(x, tuple(transform.op_inputs), tuple(transform.op_outputs),
                  tuple(records), tuple(masks))


def _merge(t: tf.Tensor) -> tf.Tensor:
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([[shape[0] * shape[1]], shape[2:]], 0))


def linear_transpose(node: Node, lam: tf.Tensor, inputs: list, record=NO_RECORD,
                     mask=None) -> list:
    """`Lambda A` for the frozen-pattern linear map `A` of one op, per input.

    Args:
        node: the op's node.
        lam: `[B, C, *output_shape]` functionals of the op's output.
        inputs: the op's input values (for their shapes).
        record, mask: the op's record and mask (their tangent map depends on them).

    Returns:
        One `[B, C, *input_shape]` tensor per input (zeros where the op does not
        read it).
    """
    batch, rows = tf.shape(lam)[0], tf.shape(lam)[1]
    shared = record is NO_RECORD and mask is None
    zeros = []
    for v in inputs:
        lead = tf.stack([batch * rows]) if shared else tf.stack([batch, rows])
        zeros.append(tf.zeros(tf.concat([lead, tf.shape(v)[1:]], 0), lam.dtype))
    with tf.GradientTape() as tape:
        tape.watch(zeros)
        tangents = [Tangent(z, shared=shared) for z in zeros]
        out = node.op.tangent(tangents, record, mask)[0]
        out = out.value if shared else out.per_example(batch)
    grads = tape.gradient(out, zeros, output_gradients=_merge(lam) if shared else lam)
    result = []
    for z, g in zip(zeros, grads):
        g = tf.zeros_like(z) if g is None else g
        if shared:
            g = tf.reshape(g, tf.concat([tf.stack([batch, rows]), tf.shape(z)[1:]], 0))
        result.append(g)
    return result


class PullBack(NamedTuple):
    """The result of `pull_back`.

    Attributes:
        lam_input: `[B, C, *input_shape]`, the functionals pulled back to the input
            (their gradients in a frozen pattern).
        const: `[B, C]`, the constant terms the activations and `visit` added.
    """

    lam_input: tf.Tensor
    const: tf.Tensor


def frozen_slopes(node: Node, lam: tf.Tensor, values: Values, index: int):
    """The `activation` argument of `pull_back` for the pattern of `x`: `Lambda * slope`."""
    slope = tf.cast(values.records[index].slope, lam.dtype)
    return lam * slope[:, None], None


def pull_back(graph: OpGraph, values: Values, start: int, lam: tf.Tensor,
              activation: Callable = frozen_slopes,
              visit: Callable | None = None) -> PullBack:
    """Pulls the functionals `lam` of the value `start` back to the model input.

    Args:
        graph: the `OpGraph`.
        values: a `capture` of the batch.
        start: the key of the value the functionals act on.
        lam: `[B, C, *shape]` functionals (C rows per example).
        activation: `activation(node, lam, values, index) -> (lam_in, const or None)`
            for activation ops (default: the frozen slopes of `x`).
        visit: optional `visit(node, index, lam) -> [B, C] or None`, called with the
            functionals of every op's output before it is pulled through (rounding
            terms); what it returns is added to the constant.

    Returns:
        A `PullBack`.
    """
    env = {start: lam}
    const = tf.zeros(tf.shape(lam)[:2], lam.dtype)
    last = graph.producer.get(start, -1)
    for index in range(last, -1, -1):
        node = graph.nodes[index]
        out_lam = env.pop(node.output, None)
        if out_lam is None:
            continue
        if visit is not None:
            term = visit(node, index, out_lam)
            if term is not None:
                const += term
        if node.is_activation:
            new, term = activation(node, out_lam, values, index)
            if term is not None:
                const += term
            pulled = [new]
        else:
            pulled = linear_transpose(node, out_lam, values.inputs[index],
                                      values.records[index], values.masks[index])
        for key, g in zip(node.inputs, pulled):
            env[key] = env[key] + g if key in env else g
    lam_input = env.get(graph.input_key)
    if lam_input is None:  # the functionals do not depend on the input
        shape = tf.concat([tf.shape(lam)[:2], tf.shape(values.x)[1:]], 0)
        lam_input = tf.zeros(shape, lam.dtype)
    return PullBack(lam_input, const)


BATCH_SPECS = {
    "x": lambda shape: tf.TensorSpec([None, *shape], tf.float64),  # inputs / directions
    "y": lambda shape: tf.TensorSpec([None], tf.int64),  # classes
    "e": lambda shape: tf.TensorSpec([None], tf.float64),  # radii
}


def compile_batched(fn, twin, kinds: str):
    """`fn` compiled once for any batch size: `kinds` names its tensor arguments in order
    (`BATCH_SPECS`: 'x' a float64 batch of inputs, 'y' classes, 'e' radii), so the
    searches, whose batches shrink as examples finish, never retrace it."""
    shape = tuple(twin.input_shape)
    signature = [BATCH_SPECS[k](shape) for k in kinds]
    return tf.function(fn, input_signature=signature, reduce_retracing=True, autograph=False)
