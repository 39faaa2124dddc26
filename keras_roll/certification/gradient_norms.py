"""Reductions of the streamed Jacobian: gradient norms, dense slices, axis margins.

The neuron gradients are streamed from the frozen-pattern twin
(`Linearized.iter_axis_chunks`, chunks planned by `keras_roll.compile.chunking`) and
reduced on the fly, so that `[B, N, D]` is never held: to the three norms the
lp margins need (sum of squares, max-abs, sum-abs), to the directional margins
along `+-e_k` (stability bounds), or, for the bisection cross-check only, into
dense per-slice Jacobians. See docs/design.md, section "Data flow of certify".

Example:

```python
cert = keras_roll.certify(model, x)             # lp margins from these norms
sb = keras_roll.stability_bounds(model, x[:1])  # directional margins along +-e_k
```
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.certification.margin_math import directional_margins
from keras_roll.compile.interpreter import ForwardPass
from keras_roll.compile.twin import Linearized
from keras_roll.options import parse_norm

__all__ = ["AxisBounds", "AxisMargins", "GradNorms", "JacobianSlice", "NormSlice",
           "iter_gradient_norms", "iter_jacobian_slices"]

INF = math.inf


class GradNorms(NamedTuple):
    """Per-neuron norms of the input gradients, `[b, N]` float64 each.

    Attributes:
        l2: `||g_j||_2`, the dual norm for l2 balls.
        linf: `max_k |g_jk|`, the dual norm for l1 balls.
        l1: `sum_k |g_jk|`, the dual norm for l_inf balls.
    """

    l2: np.ndarray
    linf: np.ndarray
    l1: np.ndarray

    def dual(self, p) -> np.ndarray:
        """`||g||_q` for the lp ball with `1/p + 1/q = 1`."""
        p = parse_norm(p)
        return {2: self.l2, 1: self.linf, INF: self.l1}[p]


class NormSlice(NamedTuple):
    """The gradient norms of one slice of examples (`iter_gradient_norms`).

    Attributes:
        examples: the slice of the examples.
        forward: their `ForwardPass`.
        norms: their `GradNorms`.
    """

    examples: slice
    forward: ForwardPass
    norms: GradNorms


class JacobianSlice(NamedTuple):
    """The dense Jacobian of one slice of examples (`iter_jacobian_slices`).

    Attributes:
        examples: the slice of the examples.
        forward: their `ForwardPass`.
        jacobian: `[b, N, D]` the input gradients of every neuron.
    """

    examples: slice
    forward: ForwardPass
    jacobian: np.ndarray


class AxisMargins(NamedTuple):
    """Margins along `+e_k` and `-e_k` of a chunk of axes, `[b, k]` each (`AxisBounds`)."""

    up: tf.Tensor
    up_index: tf.Tensor
    down: tf.Tensor
    down_index: tf.Tensor


def _norms_reduce(jvp, start):
    """Reduces one `[b, k, N]` chunk to per-neuron partial norms (inside tf.function)."""
    g = jvp.neurons
    a = tf.abs(g)
    return tf.reduce_sum(g * g, axis=1), tf.reduce_max(a, axis=1), tf.reduce_sum(a, axis=1)


def iter_gradient_norms(lin: Linearized, x, batch_size: int | None = None,
                        memory_budget: int | None = None):
    """Streams the input-gradient norms of every neuron, one example slice at a time.

    The Jacobian is pushed through the frozen-pattern twin in chunks of input
    axes and reduced on the fly (sum of squares, max-abs, sum-abs), so the
    `[B, N, D]` Jacobian is never held in memory.

    Args:
        lin: a `Linearized` model.
        x: `[B, *input_shape]` inputs.
        batch_size: examples per slice (default: as many as `memory_budget` allows).
        memory_budget: bytes of tangents per chunk (default `lin.memory_budget`).

    Yields:
        `NormSlice(examples, forward, norms)`.

    Example:

    ```python
    for sl, fwd, gn in iter_gradient_norms(lin, x):
        dist = neuron_distances(fwd.neurons.below, fwd.neurons.above)
        eps2, _ = margins_from_norms(dist, gn.l2, fwd.neurons.valid)
    ```
    """
    x = lin.check_input(x, keep_float=True)
    d = int(np.prod(x.shape[1:]))
    acc = None
    for sl, fwd, start, k, (sq, mx, sm) in lin.iter_axis_chunks(
            x, batch_size=batch_size, reduce=_norms_reduce, memory_budget=memory_budget,
            per_neuron=True):
        sq, mx, sm = (np.asarray(t.numpy(), np.float64) for t in (sq, mx, sm))
        if start == 0:
            acc = [sq, mx, sm]
        else:
            acc[0] += sq
            np.maximum(acc[1], mx, out=acc[1])
            acc[2] += sm
        if start + k >= d:
            yield NormSlice(sl, fwd, GradNorms(np.sqrt(acc[0]), acc[1], acc[2]))


def iter_jacobian_slices(lin: Linearized, x, batch_size: int | None = None,
                         memory_budget: int | None = None):
    """Yields `JacobianSlice(examples, forward, jacobian [b, N, D])`, dense per slice.

    Example:

    ```python
    for sl, fwd, jac in iter_jacobian_slices(lin, x, batch_size=8):
        jac.shape            # (8, N, D)
    ```
    """
    d = int(np.prod(x.shape[1:]))
    jac = None
    for sl, fwd, start, k, jvp in lin.iter_axis_chunks(
            x, batch_size=batch_size, memory_budget=memory_budget):
        block = jvp.neurons.numpy()  # [b, k, N]
        if start == 0:
            jac = np.zeros((block.shape[0], block.shape[2], d), block.dtype)
        stop = min(start + k, d)
        jac[:, :, start:stop] = np.swapaxes(block[:, : stop - start], 1, 2)
        if stop >= d:
            yield JacobianSlice(sl, fwd, jac)


def _axis_bounds_impl(rates, below, above, valid, err_at_x=None, err_per_radius=None,
                      slack=0.0):
    """Margins along `+e_k` and `-e_k` for a chunk of axes `[b, k, N] -> [b, k]`
    (with rounding bounds: the sound ones, `margin_math.directional_margins`)."""
    rates = tf.cast(rates, below.dtype)
    terms = () if err_at_x is None else (err_at_x, err_per_radius, slack)
    up = directional_margins(rates, below, above, valid, *terms)
    down = directional_margins(-rates, below, above, valid, *terms)
    return AxisMargins(up.eps, up.index, down.eps, down.index)


_AXIS_BOUNDS_XLA = tf.function(_axis_bounds_impl, reduce_retracing=True, autograph=False,
                               jit_compile=True)  # XLA fuses the elementwise passes: ~4x on CPU
_AXIS_BOUNDS_GRAPH = tf.function(_axis_bounds_impl, reduce_retracing=True, autograph=False)
_XLA_ERRORS = (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError,
               tf.errors.NotFoundError, tf.errors.InternalError)


class AxisBounds:
    """Directional margins along `+e_k` and `-e_k` of one chunk of axes.

    Large chunks run under XLA (it fuses the elementwise passes); if XLA fails
    on this device, this reducer falls back to a plain graph for the rest of
    its life. Make one per computation (`stability_bounds` does).

    Args:
        xla_min_elements: chunks smaller than this (`b * k * N`) skip XLA, where
            compiling costs more than it saves.

    Example:

    ```python
    bounds = AxisBounds()
    m = bounds(jvp.neurons, n.below, n.above, n.valid)       # AxisMargins
    ```
    """

    def __init__(self, xla_min_elements: int = 1 << 22):
        self.xla_min_elements = int(xla_min_elements)
        self.use_xla = True

    def __call__(self, rates, below, above, valid, err_at_x=None, err_per_radius=None,
                 slack=0.0):
        args = (rates, below, above, valid)
        if err_at_x is not None:  # one guard, or a list of alternatives
            def cast(t):
                return tf.cast(t, below.dtype)
            args += (tf.nest.map_structure(cast, err_at_x),
                     tf.nest.map_structure(cast, err_per_radius), tf.constant(slack, below.dtype))
        if self.use_xla and int(np.prod(rates.shape)) >= self.xla_min_elements:
            try:
                return _AXIS_BOUNDS_XLA(*args)
            except _XLA_ERRORS:
                self.use_xla = False  # no XLA on this device: plain graph from now on
        return _AXIS_BOUNDS_GRAPH(*args)
