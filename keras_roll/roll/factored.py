"""Exact ROLL in fewer directions: through a factor of a first Dense layer's Gram matrix.

When the first layer after the tangents' entry (the input, or the `wrt=` layer,
possibly after more elementwise Rescaling / Normalization and Flatten layers)
is a Dense layer with `H1 < D` outputs, every neuron's input gradient factors
through it: with `u = a * x W + b` (`a` the elementwise scale of the layers
before it),

    ||grad_x z||^2 = g^T (W_a^T W_a) g,   g = grad_u z,   W_a = diag(a) W,

and for any `R` with `R^T R = W_a^T W_a` this is `sum_i (R_i . g)^2`: the
squares of the derivatives of `z` along the `H1` rows of `R`, pushed from `u`
(after the layer's linear op) instead of the `D` input axes. The loss is the
same function of the weights (docs/design.md, "The factored exact path").

`gram_factor` computes `R` as the transposed Cholesky factor of `W_a^T W_a`
in float64 (with a relative jitter of 2^-36 on the diagonal, so that a
rank-deficient kernel still factors), and differentiates it without
differentiating the Cholesky decomposition: the loss depends on `R` only
through `R^T R`, so with `Q = W_a R^{-1}` (orthonormal columns spanning the
range of `W_a`) the gradient is `dL/dW_a = Q dL/dR`, exactly the gradient of
`R = Q^T W_a` for a constant `Q`.

Example:

```python
entry = factored_entry(lin.program, tangent_entry(lin.program, "normalize"))
if entry is not None:
    r = gram_factor(entry.kernel(lin.dtype))      # [H1, H1], R^T R = W_a^T W_a
```
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.rules.base import NO_RECORD, Linear, Tangent
from keras_roll.roll.entry import AFFINE_ENTRY_LAYERS, affine_problem, entry_readers

__all__ = ["FactoredEntry", "JITTER", "JITTER_FLOOR", "factored_entry", "float64_gram",
           "gram_factor"]

JITTER = 2.0**-36  # relative to the largest diagonal entry of W_a^T W_a
JITTER_FLOOR = 2.0**-900  # the jitter's scale for a zero kernel (its factor rounds to 0)
_RESHAPES = (keras.layers.Flatten, keras.layers.Reshape)


@dataclasses.dataclass(frozen=True)
class FactoredEntry:
    """Where the factored exact path starts: a first Dense layer with fewer outputs.

    Attributes:
        chain: the steps between the entry and the Dense layer (elementwise
            Rescaling / Normalization, Flatten / Reshape) with their
            per-example input shapes, in order.
        step: the Dense layer's program step.
        index: its index; the tangents enter after its first op (the linear
            part).
        units: H1, its outputs (the number of directions).
        depth: D, its inputs (the number of input axes it replaces).
    """

    chain: tuple
    step: object
    index: int
    units: int
    depth: int

    def kernel(self, dtype: str) -> tf.Tensor:
        """`W_a = diag(a) W`, `[D, H1]` in `dtype`: the Dense kernel with the
        elementwise scale `a` of the chain's steps folded into its rows."""
        w = tf.cast(self.step.layer.kernel, dtype)
        if not self.chain:
            return w
        ones = Tangent(tf.ones([1, *self.chain[0].input_shape], dtype), shared=True)
        for step in self.chain:
            for op in step.ops:
                ones, _ = op.tangent([ones], NO_RECORD, None)
        scale = tf.reshape(tf.cast(ones.value, dtype), [-1, 1])
        return scale * w


def _is_reshape(step) -> bool:
    return isinstance(step.layer, _RESHAPES) and all(
        getattr(op, "keeps_axes", False) for op in step.ops)


def factored_entry(program, entry: int) -> FactoredEntry | None:
    """The `FactoredEntry` of ROLL's tangents entering at step `entry`, or None.

    It exists when, from the entry on, each step is the only reader of the
    value before it, the steps are elementwise affine (Rescaling,
    Normalization) or reshapes (Flatten, Reshape), and then comes a Dense
    layer on flat inputs with `H1 < D` units. Otherwise exact ROLL keeps its
    `D` input axes.

    Example:

    ```python
    factored_entry(lin.program, 0)    # FactoredEntry(..., units=300, depth=784) for the MLP
    ```
    """
    shape = tuple(program.input_shape)
    if any(d is None for d in shape):
        return None
    chain, index = [], entry
    while index < len(program.steps):
        readers = entry_readers(program, index)
        if readers != [index] or len(program.steps[index].inputs) != 1:
            return None
        step = program.steps[index]
        if isinstance(step.layer, keras.layers.Dense):
            return _dense_entry(step, index, chain, int(np.prod(shape)))
        elementwise = isinstance(step.layer, AFFINE_ENTRY_LAYERS) and \
            affine_problem(step, shape) is None
        if not (elementwise or _is_reshape(step)) or not step.ops:
            return None
        chain.append(_ChainStep(step, shape))
        shape = tuple(int(d) for d in step.layer.compute_output_shape((None, *shape))[1:])
        index += 1
    return None


@dataclasses.dataclass(frozen=True)
class _ChainStep:
    step: object
    input_shape: tuple

    @property
    def ops(self):
        return self.step.ops


def _dense_entry(step, index, chain, depth) -> FactoredEntry | None:
    kernel = getattr(step.layer, "kernel", None)
    if kernel is None or len(kernel.shape) != 2 or int(kernel.shape[0]) != depth:
        return None  # a Dense layer on non-flat inputs acts per position
    units = int(kernel.shape[1])
    if units >= depth or not step.ops or not isinstance(step.ops[0], Linear):
        return None
    return FactoredEntry(tuple(chain), step, index, units, depth)


def float64_gram(w) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """`(w64, finite, gram, jitter)`: `w` in float64 (zeros if any entry is not
    finite), whether it was finite, `w64^T w64` and the jitter to add to its
    diagonal before a Cholesky factorisation (`JITTER` times the largest diagonal
    entry, at least `JITTER * JITTER_FLOOR`)."""
    w64 = tf.cast(w, tf.float64)
    finite = tf.reduce_all(tf.math.is_finite(w64))
    w64 = tf.where(finite, w64, tf.zeros_like(w64))
    gram = tf.matmul(w64, w64, transpose_a=True)
    largest = tf.maximum(tf.reduce_max(tf.linalg.diag_part(gram)), JITTER_FLOOR)
    return w64, finite, gram, JITTER * largest


@tf.custom_gradient
def gram_factor(w):
    """`R` `[H1, H1]` with `R^T R = W^T W` (up to a jitter of 2^-36 of its largest
    diagonal entry), in `w`'s dtype: the transposed float64 Cholesky factor.

    Non-finite kernels give a NaN factor (the loss is then NaN, as it would be
    along the input axes). The gradient is `W L^{-T} dR` (see the module
    docstring), computed in float64.

    Example:

    ```python
    r = gram_factor(tf.random.normal([784, 300]))
    tf.matmul(r, r, transpose_a=True)     # ~ W^T W
    ```
    """
    w64, finite, gram, jitter = float64_gram(w)
    gram += jitter * tf.eye(tf.shape(gram)[0], dtype=tf.float64)
    lower = tf.linalg.cholesky(gram)
    r = tf.where(finite, tf.transpose(lower), tf.constant(np.nan, tf.float64))

    def grad(dr):
        q_t = tf.linalg.triangular_solve(lower, tf.transpose(w64), lower=True)  # L^-1 W^T
        return tf.cast(tf.matmul(q_t, tf.cast(dr, tf.float64), transpose_a=True), w.dtype)

    return tf.cast(r, w.dtype), grad
