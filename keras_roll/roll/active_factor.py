"""Exact ROLL in fewer directions still: the Gram factor restricted to the active units.

`keras_roll.roll.factored` pushes the `H1` rows of a factor of `W_a^T W_a` from
the output `u` of a first Dense layer. When a ReLU (any activation whose frozen
slopes are 0 or 1) follows that layer directly, every later neuron's gradient
with respect to `u` vanishes off the example's active units `S` (slope 1):
`grad_u z = m * grad_a z` with `a` the ReLU's output and `m` its 0/1 slopes. So

    ||grad_x z||^2 = g_S^T G_SS g_S,   g = grad_a z,   G = W_a^T W_a,

and with the Cholesky factor `L L^T = G_SS` this is `sum_j (L[:, j] . g_S)^2`:
`|S|` directions of `a`, pushed from after the ReLU. Each example gets its own
`|S|` directions, padded with zero directions to the batch's largest `|S|`
(`K`). The ReLU's own neurons (the pre-activations `u`) have the squared
gradient norms `G_jj = ||W_a[:, j]||^2`. The loss is the same function of the
weights (docs/design.md, "Active units of the first layer").

`active_factor` computes the `[B, K, H1]` directions in float64 (with the
relative jitter of `factored.JITTER`, so that a dead or duplicated unit still
factors) and, like `factored.gram_factor`, differentiates them without
differentiating the Cholesky decomposition: the loss depends on an example's
directions `V = L^T E` (`E` the `[K, H1]` one-hot rows of `S`) only through
`V^T V = E^T G_SS E`, and `V = Q^T W_a E^T E` for `Q = W_a E^T L^{-T}`, whose
columns are orthonormal and span the range of `W_a E^T`. With `Q` held
constant the gradient is `dL/dW_a = W_a sum_b E^T L^{-T} dV E^T E`.

Example:

```python
slope = trace.steps[step].ops[op].slope                     # [B, H1], 0 or 1
lower, rows = active_factor(entry.kernel("float32"), slope > 0)
v = spread_directions(lower, rows)                          # [B, K, H1] directions
```
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_roll.roll.entry import entry_readers
from keras_roll.roll.factored import float64_gram

__all__ = ["COMPACT_FRACTION", "active_factor", "first_activation", "spread_directions"]

# Above this fraction of H1 active units (the batch's largest count), the per-example
# factors (B K^3 / 3 flops in float64, and their triangular solves in the gradient)
# and the spreading of their columns cost more than the directions they save: the
# H1 rows of the whole Gram matrix's factor, times the ReLU's slopes, are pushed from
# the same place instead (`exact.ActiveFactorAxes`). On the 784-300x4-10 MLP (batch 64,
# 2 CPU cores) the per-example factors took 0.79-0.90 of the H1 rows' step at K = 150
# and 160 of 300, about as long as the previous H1 path at K = 206 (where the H1 rows
# from the ReLU's output took 0.83 of it), and 2.1 x as long at K = 300.
COMPACT_FRACTION = 0.6


def first_activation(program, index: int) -> tuple[int, int] | None:
    """`(step, op)` of an activation with 0/1 slopes right after step `index`'s linear
    op (fused into it, or the single op of the only step that reads it), else None.

    Example:

    ```python
    first_activation(lin.program, 0)   # (1, 0): Dense, then a ReLU layer
    ```
    """
    step = program.steps[index]
    if len(step.ops) > 1:
        return (index, 1) if _binary(step.ops[1]) else None
    if entry_readers(program, index + 1) != [index + 1]:  # readers of the Dense output
        return None
    after = program.steps[index + 1]
    if len(after.inputs) != 1 or not after.ops or not _binary(after.ops[0]):
        return None
    return index + 1, 0


def _binary(op) -> bool:
    return bool(getattr(op, "binary_slopes", False)) and op.owns_neurons


def active_factor(kernel: tf.Tensor, active: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Per-example factors `L` and the row of `L` of every unit (see the module).

    Example `b`'s directions of the ReLU output are the rows of `L_b^T E_b`:
    direction `j` is `sum_i L_b[i, j] e_{S_b[i]}`, where `S_b` lists the
    example's active units and `L_b L_b^T = G[S_b, S_b]` (plus a jitter of
    2^-36 of `G`'s largest diagonal entry). `K` is the batch's largest
    `|S_b|` (at least 1); rows and columns of `L_b` past `|S_b|` are zero. A
    non-finite kernel gives NaN factors.

    Args:
        kernel: `W_a`, `[D, H1]`, the Dense kernel with the scale of the layers
            before it (`FactoredEntry.kernel`); differentiable.
        active: `[B, H1]` bool, the units on the slope-1 piece.

    Returns:
        `(L, rows)`: `[B, K, K]` lower-triangular factors in `kernel`'s dtype
        (differentiable with respect to `kernel`), and `[B, H1]` int32: the row
        of `L_b` that unit `h` is (`rows[b, h] = i` when `h = S_b[i]`), or `K`
        for an inactive unit. So direction `j` of example `b` is
        `L_b[rows[b, :], j]` with a zero row appended to `L_b`
        (`spread_directions`).

    Example:

    ```python
    lower, rows = active_factor(w, tf.constant([[True, False, True]]))   # [1, 2, 2], [1, 3]
    v = spread_directions(lower, rows)                                  # [1, 2, 3]
    ```
    """
    active = tf.stop_gradient(tf.cast(active, tf.bool))
    units = tf.shape(active)[1]
    count = tf.reduce_sum(tf.cast(active, tf.int32), axis=1)  # [B]
    k = tf.maximum(tf.reduce_max(count), 1)
    # The active units first, in order (a stable sort), then the rest.
    order = tf.argsort(tf.cast(tf.logical_not(active), tf.int32), axis=1, stable=True)
    idx = order[:, :k]  # [B, K]
    valid = tf.range(k)[None, :] < count[:, None]  # [B, K]
    flat = idx[:, :, None] * units + idx[:, None, :]  # [B, K, K] flat entries of G
    rank = tf.argsort(order, axis=1, stable=True)  # the inverse permutation
    rows = tf.where(active, rank, k)  # [B, H1]: the row of L_b of each unit (K: none)
    return _factor(kernel, flat, valid), rows


def spread_directions(columns: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
    """`[B, k, H1]` directions from columns `[B, K, k]` of the factors `L` and the
    `[B, H1]` `rows` of `active_factor`: `v[b, j, h] = columns[b, rows[b, h], j]`,
    0 where `rows[b, h] = K`. One gather of rows (its gradient is a segment sum),
    then a transpose: faster than a batched one-hot matmul or a gather along the
    last axis on CPU."""
    shape = tf.shape(columns)
    batch, k, width = shape[0], shape[1], shape[2]
    padded = tf.reshape(tf.pad(columns, [[0, 0], [0, 1], [0, 0]]), tf.stack([-1, width]))
    picked = tf.gather(padded, rows + (k + 1) * tf.range(batch)[:, None])  # [B, H1, k]
    return tf.transpose(picked, [0, 2, 1])


@tf.custom_gradient
def _factor(kernel, flat, valid):
    """`L_b` of `G[S_b, S_b]` from the flat indices `flat` `[B, K, K]` of its entries."""
    w, finite, gram, jitter = float64_gram(kernel)  # gram: [H1, H1]
    units = tf.shape(gram)[0]
    k = tf.shape(flat)[1]
    pair = valid[:, :, None] & valid[:, None, :]
    sub = tf.gather(tf.reshape(gram, [-1]), flat)  # a flat gather: fast
    eye = tf.eye(k, dtype=tf.float64)
    sub = tf.where(pair, sub, eye) + jitter * eye  # the padding: identity blocks
    valid_rows = tf.cast(valid, tf.float64)[:, :, None]
    lower = tf.linalg.cholesky(sub) * valid_rows
    nan_if_not_finite = tf.where(finite, tf.constant(1.0, tf.float64), np.nan)

    def grad(dlower):
        # W_a sum_b E^T L^{-T} (dV E^T) E, with dV E^T = dL^T.
        c = tf.linalg.matrix_transpose(tf.cast(dlower, tf.float64) * valid_rows)
        solvable = lower + eye * (1.0 - valid_rows)  # the padding's rows: identity
        t = tf.linalg.triangular_solve(solvable, c, lower=True, adjoint=True)  # [B, K, K]
        t *= tf.cast(pair, tf.float64)
        p = tf.math.unsorted_segment_sum(tf.reshape(t, [-1]), tf.reshape(flat, [-1]),
                                         units * units)
        return tf.cast(tf.matmul(w, tf.reshape(p, [units, units])), kernel.dtype), None, None

    return tf.cast(lower * nan_if_not_finite, kernel.dtype), grad
