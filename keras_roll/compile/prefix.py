"""The affine prefix of a program: the ops before its first piecewise-linear one.

An affine map keeps a straight path straight: along `x(t) = b + t (x - b)` the
output of the prefix is `u(t) = u(b) + t (u(x) - u(b))`. A pass that evaluates a
model at many points of one segment (Riemann-sum integrated gradients) runs the
prefix on the two end points only and enters the program after it
(`Interpreter.primal(u, start=..., start_op=...)`); a gradient with respect to `u`
is taken back to the input once per segment, since the prefix's transpose is
linear. On the 784-300x4-10 MLP the prefix is the first Dense layer's linear part,
about half of a forward pass's multiply-adds; on a CNN, the first convolution
(docs/design.md, "Integrated gradients").

Example:

```python
prefix = affine_prefix(lin.program)        # None when the first op has a pattern
u = prefix.apply(x, lin.dtype)             # the prefix's output at x
fwd = lin.interpreter.primal(u, start=prefix.start, start_op=prefix.start_op)
grad_x = prefix.transpose(grad_u, x)       # the input gradient of a gradient at u
```
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from keras_roll.compile.structure import structure_of

__all__ = ["AffinePrefix", "affine_prefix"]


@dataclasses.dataclass(frozen=True)
class AffinePrefix:
    """The affine ops a program starts with, and where a pass enters after them.

    Attributes:
        ops: the affine ops, in order (each reads the output of the one before).
        start: `propagate`'s `start`: the step of the first op after the prefix.
        start_op: `propagate`'s `start_op`: that op's position in its step.
    """

    ops: tuple
    start: int
    start_op: int

    def apply(self, x, dtype) -> tf.Tensor:
        """The prefix's output on the `[B, *input_shape]` batch `x`, in `dtype`."""
        x = tf.cast(x, dtype)
        for op in self.ops:
            x = tf.cast(op.forward([x], None)[0], dtype)
        return x

    def transpose(self, grad_u, like) -> tf.Tensor:
        """`A^T grad_u`: the gradient with respect to the input of a linear function
        whose gradient with respect to the prefix's output is `grad_u`, in the dtype
        of `grad_u`; `like` is a batch of inputs of the right shape."""
        zeros = tf.zeros(tf.shape(like), grad_u.dtype)
        with tf.GradientTape() as tape:
            tape.watch(zeros)
            out = self.apply(zeros, grad_u.dtype)
        grad = tape.gradient(out, zeros, output_gradients=tf.reshape(grad_u, tf.shape(out)))
        return tf.zeros_like(zeros) if grad is None else grad


def affine_prefix(program) -> AffinePrefix | None:
    """The program's `AffinePrefix`, or None when its first op has a pattern.

    The prefix follows the single chain from the input
    (`ProgramStructure.leading_chain`: each step reads one value, which no other
    step reads), and its ops are affine without Keras masks. It
    ends at the first op that is not (an activation, a max pooling, a merge).
    A program that is affine throughout gives None (nothing to gain).

    Example:

    ```python
    affine_prefix(keras_roll.linearize(mlp).program)   # the first Dense layer's matmul
    ```
    """
    steps = program.steps
    chain = structure_of(program).leading_chain()
    ops = []
    for index in chain:
        for position, op in enumerate(steps[index].ops):
            if not op.affine or op.needs_mask:
                return _entry(ops, index, position)
            ops.append(op)
    return _entry(ops, len(chain), 0) if len(chain) < len(steps) else None


def _entry(ops, start: int, start_op: int) -> AffinePrefix | None:
    return AffinePrefix(tuple(ops), start, start_op) if ops else None
