"""A first-order refinement of the attack's best points along the decision boundary.

An attack's best point `x + d` sits on the boundary between the input's class and the
point's class `c`, but where the runs stopped, not always at a local minimum of the
norm on that boundary (its schedule ends with finite steps). At `d` the margin
`m = f_pred - f_c` is locally affine, `m(d') ~ m(d) + g . (d' - d)`; its level set
through `d` holds a point of least lp norm in closed form (`linear_target`: for l2
along `g`, for l_inf the corner `-t sign(g)`, for l1 a single coordinate, the one of
largest `|g_i|`). Where that point is closer than `d`, the segment from `d` toward it
stays on the linearized boundary while its norm shrinks (a Frank-Wolfe step); the
step tries shares `2^-k` of it in one model call and keeps the closest point that
clearly changes the class in the Keras model and lies inside the domain, then moves
it to the first clear flip along the norm's own shrinking
(`keras_roll.robust.attack_points.checked_points`). At a local minimum (`d` along the
dual direction of `g`) the target is `d` itself and nothing moves; the refinement only
ever keeps closer points.

Example:

```python
pts, dist = refine_points(model, x, best, pred, np.inf, lo, hi, rounds=4)
```
"""

from __future__ import annotations

import numpy as np

from keras_roll.robust.adversarial import (
    clearly_other,
    lp_norm,
    margin_gradients,
    model_outputs,
)
from keras_roll.robust.attack_points import checked_points, in_domain

__all__ = ["CHUNK_BYTES", "SHARES", "linear_target", "refine_points"]

SHARES = tuple(2.0**-k for k in range(0, 12))  # shares of the step tried per round
CHUNK_BYTES = 2**26  # candidate points (float64) per chunk of rows


def linear_target(g: np.ndarray, level: np.ndarray, p) -> np.ndarray:
    """`[B, n]` the points `d` of least lp norm with `g . d = level` (rows of the
    flattened gradients `g [B, n]`; zero rows where `g` is zero)."""
    level = np.asarray(level, np.float64)[:, None]
    if p == 2:
        return level * g / np.maximum(np.sum(g * g, axis=1, keepdims=True), 1e-300)
    if p == 1:
        top = np.argmax(np.abs(g), axis=1)
        rows = np.arange(g.shape[0])
        out = np.zeros_like(g)
        out[rows, top] = level[:, 0] / np.where(g[rows, top] != 0, g[rows, top], np.inf)
        return out
    return level * np.sign(g) / np.maximum(np.sum(np.abs(g), axis=1, keepdims=True), 1e-300)


def refine_points(model, x, best, pred, p, lo, hi, rounds: int):
    """`(points, distances)`: `best [B, *input_shape]` (adversarial points around `x`,
    clearly of another class than `pred`) moved closer by up to `rounds` first-order
    steps along the boundary; rows where no step gains keep their point. The rows run
    in chunks whose candidates (`len(SHARES)` per row, float64) fit `CHUNK_BYTES`."""
    pts, dist = best.copy(), lp_norm(best - x, p)
    width = int(np.prod(x.shape[1:]))
    size = max(1, CHUNK_BYTES // (8 * len(SHARES) * max(width, 1)))
    for c0 in range(0, x.shape[0] if rounds else 0, size):
        part = slice(c0, c0 + size)
        pts[part], dist[part] = _refine_rows(model, x[part], pts[part], dist[part], pred[part],
                                             p, lo, hi, rounds)
    return pts, dist


def _refine_rows(model, x, pts, dist, pred, p, lo, hi, rounds):
    """`refine_points` on one chunk of rows (`pts`, `dist` updated in place)."""
    b = x.shape[0]
    shares = np.asarray(SHARES)[:, None, None]
    width = int(np.prod(x.shape[1:]))
    dtype = np.dtype(model.inputs[0].dtype)
    for _ in range(rounds):
        target = np.argmax(model_outputs(model, pts.astype(dtype)), axis=1)
        g = margin_gradients(model, pts, pred, target)[1].reshape(b, width)
        d = (pts - x).reshape(b, width)
        aim = linear_target(g, np.sum(g * d, axis=1), p)
        gains = dist - lp_norm(aim, p) > 0
        if not gains.any():
            break
        cand = d[None] + shares * (aim - d)[None]  # [k, B, n]
        flat = (x.reshape(1, b, width) + cand).reshape(-1, *x.shape[1:])
        flat = np.clip(flat, lo, hi).astype(dtype).astype(np.float64)
        ok = clearly_other(model_outputs(model, flat.astype(dtype)), np.tile(pred, len(SHARES)))
        ok = ok & in_domain(flat, np.broadcast_to(lo, x.shape[1:]),
                            np.broadcast_to(hi, x.shape[1:]))
        norms = np.where(ok, lp_norm(flat - np.tile(x, (len(SHARES),) + (1,) * (x.ndim - 1)),
                                     p), np.inf).reshape(len(SHARES), b)
        pick = np.argmin(norms, axis=0)
        rows = np.flatnonzero(gains & (norms[pick, np.arange(b)] < dist))
        if not rows.size:
            break
        chosen = flat.reshape(len(SHARES), b, *x.shape[1:])[pick[rows], rows]
        moved = checked_points(model, x[rows], chosen - x[rows], pred[rows], p, lo, hi)
        new = lp_norm(moved - x[rows], p)
        better = np.isfinite(new) & (new < dist[rows])
        pts[rows[better]], dist[rows[better]] = moved[better], new[better]
    return pts, dist
