"""The bisection cross-check: margins by binary search on the real network.

The paper's feasibility search (Lee et al., ICLR 2019): along a ray `x + t d`,
a point is in the region of `x` when every neuron valid at `x` is on the same
linear piece and every max window keeps its winner, so the margin along `d` is
found by doubling then bisection on that test, evaluated with forward passes
of the real network (no gradients). It needs no closed form, so it checks the
analytic margins of `keras_roll.certification.margin_math`; it is slow (many forward passes
per example). See docs/design.md, section "The maths".

Example:

```python
slow = keras_roll.certify(model, x, method="bisect")   # margins by this search
fast = keras_roll.certify(model, x)                    # the closed forms it checks
```
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.certification.margin_math import (
    Margin,
    SliceMargins,
    exact_zeros,
    neuron_arrays,
    neuron_distances,
)
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.twin import Linearized
from keras_roll.geometry import dual_norm, steepest_directions, to_numpy

__all__ = ["BoundaryDirections", "binding_directions", "bisect_region", "bisect_slice"]

INF = math.inf
_DIRECTION = object()  # the tag of a given direction among the rays of bisect_slice


class BoundaryDirections(NamedTuple):
    """Where each ball touches its binding hyperplane (`binding_directions`).

    Attributes:
        u: `[B, *input_shape]` float64 unit lp directions (NaN where none binds).
        t: `[B]` float64 distance along them to the hyperplane.
    """

    u: np.ndarray
    t: np.ndarray


def binding_directions(lin: Linearized, xs: list, index, p):
    """Steepest unit-lp directions toward the binding neurons, and the distance along them.

    For each example with binding neuron `j = index[i] >= 0` (a row of the
    neuron layout), `u = steepest_directions(g_j, p, toward nearest breakpoint)`
    and `t = dist_j / ||g_j||_q`: `x + t u` lies on the neuron's hyperplane. The
    gradient `g_j` is one reverse pass through the twin's forward pass (the
    pattern is piecewise constant there, so it is the frozen-pattern gradient).

    Args:
        lin: the twin the certificate was computed with.
        xs: the inputs, a list of `[b, *input_shape]` batches.
        index: `[B]` binding rows (-1: none).
        p: 1, 2 or inf.

    Returns:
        `BoundaryDirections(u [B, *input_shape], t [B])` float64, NaN where no
        neuron binds.

    Example:

    ```python
    u, t = binding_directions(lin, [x], cert.binding_index[2], 2)
    ```
    """
    index = np.asarray(index, np.int64)
    us, ts = [], []
    offset = 0
    for xb in xs:
        xb = tf.convert_to_tensor(xb)
        b = int(xb.shape[0])
        idx = index[offset:offset + b]
        offset += b
        per = 4 * lin.layout(xb.shape[1:]).tangent_bytes(np.dtype(lin.dtype).itemsize)
        plan = plan_chunks(b, 1, per, lin.memory_budget, max_examples=256)
        for sl in plan.example_slices():
            x64 = tf.cast(xb[sl], lin.dtype)
            rows = tf.constant(np.maximum(idx[sl], 0))
            with tf.GradientTape() as tape:
                tape.watch(x64)
                n = lin.primal(x64).neurons
                z = tf.gather(n.z, rows, batch_dims=1)
            g = np.asarray(tape.gradient(z, x64).numpy(), np.float64).reshape(z.shape[0], -1)
            below = tf.gather(n.below, rows, batch_dims=1).numpy().astype(np.float64)
            above = tf.gather(n.above, rows, batch_dims=1).numpy().astype(np.float64)
            live = (idx[sl] >= 0) & np.any(g != 0, axis=1)
            safe = np.where(live[:, None], g, 1.0)
            sign = np.where(above <= below, 1.0, -1.0)
            u = steepest_directions(safe, p, sign)
            t = neuron_distances(below, above) / to_numpy(dual_norm(safe, p))
            u[~live], t[~live] = np.nan, np.nan
            us.append(u.reshape(x64.shape))
            ts.append(t)
    if not us:
        return BoundaryDirections(np.zeros((0,)), np.zeros((0,)))
    return BoundaryDirections(np.concatenate(us), np.concatenate(ts))


def bisect_slice(lin: Linearized, xb, fwd, jac, norms, dirs_b, tol: float,
                 budget: int) -> SliceMargins:
    """Bisection margins for one slice of examples (`certify(..., method="bisect")`).

    The lp margin of an example is the smallest bisected margin along the
    dual-norm steepest direction of each of its valid, non-constant neurons
    toward its nearest breakpoint; directional margins are bisected along the
    given directions.

    Args:
        lin: a `Linearized` model.
        xb: `[b, *input_shape]` examples.
        fwd: their `ForwardPass`.
        jac: `[b, N, D]` their dense neuron Jacobian.
        norms: the norms to certify.
        dirs_b: `[b, K, *input_shape]` directions, or None.
        tol: relative tolerance of the bisection.
        budget: bytes per forward batch.

    Returns:
        `SliceMargins`: `{p: Margin([b], [b])}`, the directional `Margin([b, K],
        [b, K])` when `dirs_b` is given, and the neurons exactly at a breakpoint.

    Example:

    ```python
    for sl, fwd, jac in iter_jacobian_slices(lin, x):
        res = bisect_slice(lin, x[sl], fwd, jac, (2,), None, 1e-4, lin.memory_budget)
        res.margins[2].eps          # [b]
    ```
    """
    below, above, valid, piece = neuron_arrays(fwd)
    b, n, d = jac.shape
    ex_shape = tuple(xb.shape[1:])
    base, vecs, owner = [], [], []  # example of each direction, the direction, its tag
    jac64 = jac.astype(np.float64)
    dist = neuron_distances(below, above)
    for p in norms:
        for e in range(b):
            sel = np.flatnonzero(valid[e] & np.isfinite(dist[e]) & np.any(jac[e] != 0, axis=1))
            if sel.size == 0:
                continue
            sign = np.where(above[e, sel] <= below[e, sel], 1.0, -1.0)
            vecs.append(steepest_directions(jac64[e, sel], p, sign))
            base.append(np.full(sel.size, e))
            owner.extend((p, e, j) for j in sel)
    if dirs_b is not None:
        k = dirs_b.shape[1]
        vecs.append(dirs_b.reshape(b * k, d).astype(np.float64))
        base.append(np.repeat(np.arange(b), k))
        owner.extend((_DIRECTION, e, j) for e in range(b) for j in range(k))
    out = {p: Margin(np.full(b, INF), np.full(b, -1, np.int64)) for p in norms}
    along = None
    if dirs_b is not None:
        along = Margin(np.full((b, dirs_b.shape[1]), INF),
                       np.full((b, dirs_b.shape[1]), -1, np.int64))
    zeros = exact_zeros(dist, np.abs(jac).max(axis=2), valid)
    result = SliceMargins(out, along, {p: zeros for p in norms})
    if not vecs:
        return result
    base = np.concatenate(base)
    vecs = np.concatenate(vecs).reshape(-1, *ex_shape)
    t, bad = bisect_region(lin, xb, base, vecs, piece, valid, tol, budget)
    for (tag, e, j), tj, bj in zip(owner, t, bad):
        if tag is _DIRECTION:
            along.eps[e, j] = tj
            along.index[e, j] = bj if np.isfinite(tj) else -1
        elif tj < out[tag].eps[e]:
            out[tag].eps[e], out[tag].index[e] = tj, j
    return result


def bisect_region(lin: Linearized, xb, base, dirs, ref_piece, ref_valid, tol: float = 1e-4,
                  memory_budget: int | None = None):
    """Largest `t` with `x + t d` in the (closed) linear region of `x`, by bisection.

    The paper's feasibility search, evaluated on the real network: a point is
    in the region of `x` when every neuron valid at `x` is on the same linear
    piece and every max window keeps its winner (the `piece` arrays agree).
    With ties broken as the twin does (a neuron on a breakpoint counts on the
    piece below it, a tied max window keeps its first maximum) this set is a
    convex region whose closure is the closed region of `x`, so the supremum
    along a ray is the same, with no tolerance to tune. Along a ray the set is
    an interval from 0 to `t*`, so
    doubling from a small step brackets `t*` and bisection narrows it until
    `hi - lo <= tol * hi`. Returns the last feasible `t` (a sound lower bound),
    `inf` past `1e6 * (1 + ||x||) / ||d||`.

    Args:
        lin: a `Linearized` model.
        xb: `[b, *input_shape]` reference points.
        base: `[M]` int, the reference point of every ray.
        dirs: `[M, *input_shape]` directions.
        ref_piece, ref_valid: `[b, N]` pattern and validity at the reference points.
        tol: relative tolerance.
        memory_budget: bytes per forward batch.

    Returns:
        `Margin(t [M] float64, index [M] int64)`: the margin and the first
        neuron whose piece differs just past it (-1 when `t` is inf).

    Example:

    ```python
    fwd = lin.forward(x)
    t, j = bisect_region(lin, x, np.zeros(1, int), d[None], fwd.neurons.piece.numpy(),
                         fwd.neurons.valid.numpy())
    ```
    """
    x0 = np.asarray(xb.numpy() if tf.is_tensor(xb) else xb, np.float64)
    m = int(base.shape[0])
    flat_d = np.asarray(dirs, np.float64).reshape(m, -1)
    flat_x = x0.reshape(x0.shape[0], -1)
    dnorm = np.linalg.norm(flat_d, axis=1)
    scale = 1.0 + np.linalg.norm(flat_x, axis=1)[base]
    eps_f = np.finfo(np.dtype(lin.dtype)).eps
    moving = dnorm > 0
    safe = np.where(moving, dnorm, 1.0)
    t0, t_max = 1e-2 * scale / safe, 1e6 * scale / safe
    floor = 8 * eps_f * (1.0 + np.abs(flat_x).max(axis=1)[base]) / np.where(
        moving, np.abs(flat_d).max(axis=1), 1.0)
    lo = np.zeros(m)
    hi = np.where(moving, t0, INF)
    bad = np.full(m, -1, np.int64)
    budget = int(memory_budget or lin.memory_budget)
    ref_piece, ref_valid = np.asarray(ref_piece), np.asarray(ref_valid, bool)
    n = ref_piece.shape[1]
    # A forward batch of points holds about 8 copies of its neurons and inputs.
    per_point = max(1, 4 * n + 2 * x0[0].size) * np.dtype(lin.dtype).itemsize * 8
    chunk = plan_chunks(m, 1, per_point, budget, max_examples=None).examples_per_chunk

    def inside(rows, t):
        pts = (flat_x[base[rows]] + t[:, None] * flat_d[rows]).astype(lin.dtype)
        pts = pts.reshape(-1, *x0.shape[1:])
        ok = np.empty(rows.size, bool)
        first = np.empty(rows.size, np.int64)
        for i in range(0, rows.size, chunk):
            piece = lin.forward(pts[i:i + chunk]).neurons.piece.numpy()
            r = base[rows[i:i + chunk]]
            same = (piece == ref_piece[r]) | ~ref_valid[r]
            ok[i:i + chunk] = same.all(axis=1)
            first[i:i + chunk] = np.argmin(same, axis=1) if n else -1
        return ok, first

    active = np.flatnonzero(moving)
    while active.size:  # doubling: bracket t* in [lo, hi]
        ok, first = inside(active, hi[active])
        lo[active[ok]] = hi[active[ok]]
        hi[active[ok]] *= 2
        bad[active[~ok]] = first[~ok]
        escaped = active[ok][hi[active[ok]] > t_max[active[ok]]]
        hi[escaped], lo[escaped] = INF, INF
        active = active[ok][hi[active[ok]] <= t_max[active[ok]]]
    active = np.flatnonzero(np.isfinite(hi))
    for _ in range(200):  # bisection
        active = active[(hi[active] - lo[active] > tol * hi[active])
                        & (hi[active] > floor[active])]
        if not active.size:
            break
        mid = 0.5 * (lo[active] + hi[active])
        ok, first = inside(active, mid)
        lo[active[ok]] = mid[ok]
        hi[active[~ok]] = mid[~ok]
        bad[active[~ok]] = first[~ok]
    bad[~np.isfinite(lo)] = -1
    return Margin(lo, bad)
