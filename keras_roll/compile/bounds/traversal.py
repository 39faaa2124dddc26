"""The traversal the bound passes share: a forward pass that keeps every op's values, and
the backward walk that pulls linear functionals of a value back to the input.

Every bound is a set of linear functionals `Lambda . v` of some value `v` of the
network (the logit margins `f_y - f_j`, or every unit of a layer) pulled back through
the ops in reverse order to the input (docs/design.md, section "Robustness radius"):

* `capture(interpreter, x)`: the interpreter's own primal pass (`propagate` with a
  `PrimalTransform`) that also keeps every op's input and output values, records and
  Keras masks, in the order of `structure_of(program).nodes`;
* `linear_transpose(node, lam, ...)`: `Lambda A` for the frozen-pattern linear map `A`
  of an op, by reverse-mode differentiation of the op's own `tangent` (so every rule's
  tangent is its transpose's definition, and there is nothing to keep in step);
* `pull_back(structure, values, start, lam, relax, visit)`: the reverse walk itself;
  an op the caller relaxes (`relax`) passes on what the caller says, every other op
  its frozen-pattern transpose.

Everything here is TensorFlow: the passes run inside a caller's graph and are
differentiable with respect to the model's weights.

Example:

```python
structure = structure_of(twin.program)
values = capture(twin.interpreter, x)
res = pull_back(structure, values, structure.output_key, rows)
res.lam_input        # [B, C, *input_shape]: the gradients of the C functionals
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import tensorflow as tf

from keras_roll.compile.interpreter import PrimalTransform, propagate
from keras_roll.compile.rules.activations import Activation
from keras_roll.compile.rules.base import NO_RECORD, Tangent
from keras_roll.compile.structure import Node, ProgramStructure

__all__ = ["PullBack", "Values", "capture", "forward_nodes", "frozen_slopes", "linear_transpose",
           "pull_back"]


class Values(NamedTuple):
    """What `capture` keeps of a forward pass, per node (in `ProgramStructure.nodes` order).

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

    def value(self, structure: ProgramStructure, key: int) -> tf.Tensor:
        """The value of `key` (the input, or the output of its producer)."""
        if key == structure.input_key:
            return self.x
        return self.outputs[structure.producer[key]]


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
        interpreter: an `Interpreter` (a twin's: float64 for `robust_radius`).
        x: `[B, *input_shape]` inputs, already in the interpreter's dtype.

    Returns:
        `Values`, in the order of `structure_of(interpreter.program).nodes`.

    Example:

    ```python
    values = capture(lin.at_dtype("float64").interpreter, tf.constant(x, tf.float64))
    ```
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


def forward_nodes(structure: ProgramStructure, initial, fn: Callable) -> dict:
    """A forward walk over the program's ops with values of the caller's kind: the
    input gets `initial`, every op `fn(node, index, input_values) -> value`.

    Returns:
        `{key: value}` for the input and every op's output.

    Example:

    ```python
    growth = forward_nodes(structure, tf.ones_like(x), lambda node, i, ins: magnitude(...))
    ```
    """
    env = {structure.input_key: initial}
    for index, node in enumerate(structure.nodes):
        env[node.output] = fn(node, index, [env[k] for k in node.inputs])
    return env


def _merge(t: tf.Tensor) -> tf.Tensor:
    shape = tf.shape(t)
    return tf.reshape(t, tf.concat([[shape[0] * shape[1]], shape[2:]], 0))


def linear_transpose(node: Node, lam: tf.Tensor, inputs: list, record=NO_RECORD,
                     mask=None) -> list:
    """`Lambda A` for the frozen-pattern linear map `A` of one op, per input.

    Args:
        node: the op's node.
        lam: `[B, C, *output_shape]` functionals of the op's output (`B` may be 1 for
            functionals shared by the batch, while the op has no record or mask).
        inputs: the op's input values (for their shapes).
        record, mask: the op's record and mask (their tangent map depends on them).

    Returns:
        One `[B, C, *input_shape]` tensor per input (zeros where the op does not
        read it).

    Example:

    ```python
    [lam_a] = linear_transpose(node, rows, values.inputs[index])
    ```
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
            (their gradients in a frozen pattern); `B = 1` while functionals shared by
            the batch met no op that makes them per example.
        const: `[B, C]`, the constant terms that `relax` and `visit` added.
    """

    lam_input: tf.Tensor
    const: tf.Tensor


def frozen_slopes(node: Node, lam: tf.Tensor, values: Values, index: int):
    """`pull_back`'s default `relax`: an activation's frozen slopes at `x`,
    `Lambda * slope` (its transpose, without a tape); None for other ops."""
    if not isinstance(node.op, Activation):
        return None
    slope = tf.cast(values.records[index].slope, lam.dtype)
    return lam * slope[:, None], None


def pull_back(structure: ProgramStructure, values: Values, start: int, lam: tf.Tensor,
              relax: Callable = frozen_slopes, visit: Callable | None = None) -> PullBack:
    """Pulls the functionals `lam` of the value `start` back to the model input.

    Args:
        structure: the program's `ProgramStructure`.
        values: a `capture` of the batch.
        start: the key of the value the functionals act on.
        lam: `[B, C, *shape]` functionals (C rows per example; `B = 1` for rows shared
            by the batch).
        relax: `relax(node, lam, values, index) -> (lam_in, const or None)` for an op
            the caller bounds itself (an activation's linear relaxation), or None to
            pull `lam` through the op's frozen-pattern transpose (`linear_transpose`).
            Default: the frozen slopes of `x` (`frozen_slopes`).
        visit: optional `visit(node, index, lam) -> [B, C] or None`, called with the
            functionals of every op's output before it is pulled through (rounding
            terms); what it returns is added to the constant.

    Returns:
        A `PullBack`.

    Example:

    ```python
    grads = pull_back(structure, values, structure.output_key, rows).lam_input
    ```
    """
    env = {start: lam}
    const = tf.zeros(tf.shape(lam)[:2], lam.dtype)
    last = structure.producer.get(start, -1)
    for index in range(last, -1, -1):
        node = structure.nodes[index]
        out_lam = env.pop(node.output, None)
        if out_lam is None:
            continue
        if visit is not None:
            term = visit(node, index, out_lam)
            if term is not None:
                const += term
        relaxed = relax(node, out_lam, values, index)
        if relaxed is not None:
            new, term = relaxed
            if term is not None:
                const += term
            pulled = [new]
        else:
            pulled = linear_transpose(node, out_lam, values.inputs[index],
                                      values.records[index], values.masks[index])
        for key, g in zip(node.inputs, pulled):
            env[key] = env[key] + g if key in env else g
    lam_input = env.get(structure.input_key)
    if lam_input is None:  # the functionals do not depend on the input
        shape = tf.concat([tf.shape(lam)[:2], tf.shape(values.x)[1:]], 0)
        lam_input = tf.zeros(shape, lam.dtype)
    return PullBack(lam_input, const)
