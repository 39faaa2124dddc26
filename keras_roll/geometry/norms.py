"""Dual norms and steepest directions: the lp geometry of a linear function.

Over the lp ball of radius `eps`, a linear function `g . u` ranges over `+- eps
||g||_q` (`1/p + 1/q = 1`): `dual_norm` gives `||g||_q`, and `steepest_directions`
the unit-lp direction that attains it. Certified margins divide a distance by
`dual_norm` (docs/design.md, "The maths"), the linear relaxation subtracts `eps`
times it (docs/design.md, "Robustness radius"), and the steepest directions point at
the nearest hyperplane.

Example:

```python
dual_norm(np.array([3.0, -4.0]), 2)                          # 5.0
dual_norm(np.array([3.0, -4.0]), tf.constant(norm_code(2)))  # 5.0, one graph for any p
steepest_directions(np.array([[3.0, -4.0]]), 2, np.ones(1))  # [[0.6, -0.8]]
```
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from keras_roll.options import Norm, parse_norm

__all__ = ["NORM_ORDER", "dual_norm", "norm_code", "steepest_directions"]

NORM_ORDER = (1, 2, math.inf)
"""The norms by their code (`norm_code`): a norm passed to a compiled function as this
index is an input of its graph, so one trace serves every norm."""


def norm_code(p: Norm) -> int:
    """The index of the norm `p` in `NORM_ORDER` (0: l1, 1: l2, 2: l_inf), which
    `dual_norm` takes as a scalar int32 tensor.

    Example:

    ```python
    norm_code("l2"), norm_code(np.inf)     # (1, 2)
    ```
    """
    return NORM_ORDER.index(parse_norm(p))


def dual_norm(g, p: Norm, axis: int | tuple = -1, *, squared: bool = False) -> tf.Tensor:
    """The dual norm `||g||_q` (1/p + 1/q = 1) over `axis`.

    `p=2 -> ||g||_2`, `p=1 -> ||g||_inf = max|g|`, `p=inf -> ||g||_1 = sum|g|`. The
    gradient is finite everywhere, for training through it: the l2 norm's square root is
    taken of positive sums only (0 at 0), and the l1 norm's gradient `sign(g)` is one
    broadcast product (autodiff would tile the incoming gradient first).

    Args:
        g: gradients or functionals (a tensor, or an array: float64 stays float64).
        p: 1, 2 or `np.inf` (or 'l1', 'l2', 'linf'), the norm of the ball; or a
            scalar int32 tensor of its `norm_code`, which selects the norm in the
            graph (one traced graph serves the three norms).
        axis: the input axis, or a tuple of axes, to reduce.
        squared: return `||g||_q^2` (for `p=2` the sum of squares, no square root:
            the regularizers' squared gradient norms).

    Returns:
        A tensor of `g`'s shape without `axis`.

    Example:

    ```python
    dual_norm(np.array([3.0, -4.0]), 2)       # 5.0
    dual_norm(np.array([3.0, -4.0]), np.inf)  # 7.0
    dual_norm(lam, 2, axis=(2, 3))            # [B, C] of [B, C, H, W] functionals
    dual_norm(np.array([3.0, -4.0]), np.inf, squared=True)  # 49.0
    ```
    """
    if tf.is_tensor(p):  # the three norms, one taken (a `tf.switch_case` would do one,
        # but its gradient, alpha-CROWN's, sets off TensorFlow's type-inference warning)
        return tf.gather(tf.stack([dual_norm(g, q, axis, squared=squared)
                                   for q in NORM_ORDER]), p)
    p = parse_norm(p)
    g = g if tf.is_tensor(g) else tf.convert_to_tensor(np.asarray(g))
    if squared:
        if p == 2:
            return tf.reduce_sum(g * g, axis)
        return tf.square(dual_norm(g, p, axis))
    if p == 2:
        sq = tf.reduce_sum(g * g, axis)
        pos = sq > 0
        return tf.where(pos, tf.sqrt(tf.where(pos, sq, tf.ones_like(sq))), tf.zeros_like(sq))
    if p == 1:
        return tf.reduce_max(tf.abs(g), axis)
    return _abs_sum(g, axis)


def _abs_sum(g: tf.Tensor, axis) -> tf.Tensor:
    """`sum |g|` over `axis`, with the gradient `sign(g) dy` as one broadcast product."""

    @tf.custom_gradient
    def abs_sum(g):
        kept = tf.reduce_sum(tf.abs(g), axis, keepdims=True)

        def grad(dy):
            return tf.sign(g) * tf.reshape(dy, tf.shape(kept))

        return tf.squeeze(kept, axis), grad

    return abs_sum(g)


def steepest_directions(g, p: Norm, sign) -> np.ndarray:
    """Unit-lp directions that move `g . u` fastest, `sign` toward a breakpoint.

    The dual-norm maximiser of `g . u` over `||u||_p <= 1`: `g / ||g||_2` (p=2),
    `sign(g)` (p=inf), `sign(g_i) e_i` with `i = argmax |g_i|` (p=1).

    Args:
        g: `[n, D]` gradients (nonzero rows), numpy.
        p: 1, 2 or inf (or their names).
        sign: `[n]` +1 or -1, the direction in which `g . u` should move.

    Returns:
        `[n, D]` numpy directions with `g . u = sign ||g||_q` and `||u||_p = 1`.

    Example:

    ```python
    steepest_directions(np.array([[3.0, -4.0]]), 2, np.array([1.0]))   # [[0.6, -0.8]]
    ```
    """
    p = parse_norm(p)
    g = np.asarray(g)
    if p == 2:
        u = g / np.linalg.norm(g, axis=-1, keepdims=True)
    elif p == math.inf:
        u = np.sign(g)
    else:
        u = np.zeros_like(g)
        i = np.argmax(np.abs(g), axis=-1)
        rows = np.arange(g.shape[0])
        u[rows, i] = np.sign(g[rows, i])
    return u * np.asarray(sign)[:, None]
