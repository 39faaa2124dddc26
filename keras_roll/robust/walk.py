"""Method 2, across regions: an upper bound by walking to the decision boundary.

From `x`, the walk moves region by region along straight segments. In the current
region the logits are affine; the segment is aimed at the nearest decision
hyperplane of that affine map (its dual-norm projection), and followed until the
first of: the region's boundary (the directional margin of `keras_roll.certification`,
exact), or a margin `f_y - f_j` reaching zero (its rate along the segment is exact
too). At a region boundary the segment is re-aimed from the new region; at a
decision crossing the point, pushed a little beyond, is checked in the Keras model
in its own dtype (`keras_roll.robust.adversarial.confirm`). The first point whose
prediction differs ends the walk.

The point is then improved along straight lines from `x`: the first crossing on the
segment from `x` to it (closer or equal), then, a few times, the segment from `x`
toward the nearest hyperplane of the affine map where that crossing happened (the
projection of `x`, as minimal-perturbation attacks re-aim: Croce & Hein, ICML 2020).
Every point kept is a real adversarial example; its distance is the upper bound
(docs/design.md, section "Robustness radius").

Example:

```python
nb = walk_bounds(model, twin, x, pred, p=2, max_regions=100)
nb.upper, nb.adversarial              # NaN where the budget ran out
```
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from keras_roll.certification import directional_margins
from keras_roll.compile.bounds import margin_rows
from keras_roll.compile.caches import cached
from keras_roll.geometry import dual_norm, steepest_directions, to_numpy
from keras_roll.robust.adversarial import confirm, lp_norm, predict_classes
from keras_roll.robust.compiled import BATCH_SPECS
from keras_roll.robust.region import NormBounds, decision_terms

__all__ = ["walk_bounds"]

STEP_BEYOND = 1e-7  # relative step past a region boundary (float64 points)
STUCK = 1e-3  # a segment that ends before this fraction of its length jumps instead
OVERSHOOT = 0.02  # how far beyond its target a jump goes (DeepFool's overshoot)
REFINEMENTS = 3  # re-aimed straight lines from x after the walk


def _probe(twin, x, d, pred):
    """Exit of the region along `d` and the margins and their rates (one forward + JVP)."""
    fwd = twin.primal(x)
    jvp = twin.tangent_from_trace(fwd.trace, d[:, None], shared=False)
    n = fwd.neurons
    t_exit, _ = directional_margins(jvp.neurons, n.below, n.above, n.valid)
    logits = tf.reshape(fwd.logits, [-1, int(np.prod(fwd.logits.shape[1:]))])
    rows, others = margin_rows(pred, int(logits.shape[-1]), logits.dtype)
    margins = tf.reduce_sum(rows * logits[:, None], -1)
    rates = tf.reduce_sum(rows * jvp.logits, -1)  # [b, L-1]
    return t_exit[:, 0], margins, rates, others


def _aim(terms, origin, cur, p):
    """Targets: the projection of `origin` (else of `cur`) onto the nearest decision
    hyperplane of the affine map of `terms` (taken at `cur`)."""
    b = cur.shape[0]
    g = terms.gradients
    gq = to_numpy(dual_norm(g, p))
    shift = np.einsum("bjd,bd->bj", g, (origin - cur).reshape(b, -1))
    m_origin = terms.margins + shift
    with np.errstate(divide="ignore", invalid="ignore"):
        from_origin = np.where((gq > 0) & (m_origin > 0), m_origin / gq, np.inf)
        from_cur = np.where(gq > 0, np.maximum(terms.margins, 0.0) / gq, np.inf)
    use_origin = np.isfinite(np.min(from_origin, axis=1))
    dist = np.where(use_origin[:, None], from_origin, from_cur)
    j = np.argmin(dist, axis=1)
    rows = np.arange(b)
    gj = g[rows, j]
    live = np.any(gj != 0, axis=1) & np.isfinite(dist[rows, j])
    u = np.zeros_like(gj)
    if live.any():
        u[live] = steepest_directions(gj[live], p, -np.ones(int(live.sum())))
    base = np.where(use_origin[:, None], origin.reshape(b, -1), cur.reshape(b, -1))
    target = base + np.where(live, dist[rows, j], 0.0)[:, None] * u
    return target.reshape(cur.shape), live


def _walk(model, twin, x, pred, p, max_regions, budget):
    """The re-aimed region walk; `(points, distances)` (NaN where the budget ran out).

    Each segment aims at the nearest decision hyperplane of the current affine map
    from the current point. A segment that leaves its region almost at once (two
    regions whose maps aim back at each other across their boundary) jumps to its
    target instead, `OVERSHOOT` beyond it.
    """
    b = x.shape[0]
    cur = x.copy()
    points = np.full(x.shape, np.nan)
    dist = np.full(b, np.nan)
    active = np.arange(b)
    shape = (-1,) + (1,) * (x.ndim - 1)
    for _ in range(max_regions):
        if not active.size:
            break
        terms = decision_terms(twin, cur[active], pred[active], guard=False,
                               memory_budget=budget)
        target, live = _aim(terms, cur[active], cur[active], p)
        d = target - cur[active]
        # one region: the line loop's probe (the graph `_line_search` runs) from t = 0;
        # its crossing `s` is finite where it lies inside the region
        _, s, _, t_exit = _line_loop(twin)(
            tf.constant(cur[active], tf.float64), tf.constant(d, tf.float64),
            tf.constant(pred[active], tf.int64), tf.zeros(active.size, tf.float64),
            tf.constant(np.inf, tf.float64), tf.ones(active.size, tf.int32))
        s, t_exit = to_numpy(s), to_numpy(t_exit)
        cross = live & np.isfinite(s)
        pts, ds = confirm(model, cur[active], d, np.where(cross, s, np.nan), pred[active], p,
                          origin=x[active])
        found = np.isfinite(ds)
        points[active[found]], dist[active[found]] = pts[found], ds[found]
        # Past the region boundary (or past a crossing the model did not confirm).
        step = np.where(cross, s, np.minimum(t_exit, 1.0))
        step = np.where(step < STUCK, 1.0 + OVERSHOOT, step * (1.0 + STEP_BEYOND) + STEP_BEYOND)
        moved = cur[active] + step.reshape(shape) * d
        keep = ~found & live & np.isfinite(step)
        cur[active[keep]] = moved[keep]
        active = active[keep]
    return points, dist


def _first_crossing(margins, rates):
    """`[b]` the first `s >= 0` where some margin `m + s r` reaches 0 (inf where none;
    tensors or arrays, in the graph or eagerly)."""
    inf = tf.constant(np.inf, margins.dtype)
    s = tf.where(rates < 0, tf.maximum(margins, 0.0) / tf.where(rates < 0, -rates, 1.0), inf)
    return tf.reduce_min(tf.where(margins <= 0, tf.zeros_like(s), s), axis=1)


def _line_fn(twin, x, d, pred, t, t_max, regions):
    """Region after region along `x + t d` in one graph, until each row's first
    decision crossing (or `t_max`, or its `regions [b]` probes): `(t [b], s [b], probes
    [b], t_exit [b])`, the crossing at `x + t d + s d` (`s` NaN where none), `t_exit`
    the exit of the last region probed along `d` from its start (NaN where none was).

    The walk probes one region a call (`regions` 1, `t` 0, `t_max` inf): `s` is then
    the first crossing where it lies inside the region, `t_exit` the region's exit.
    """
    shape = [-1] + [1] * (len(x.shape) - 1)

    def body(k, t, s_hit, live, probes, exits):
        at = tf.reshape(tf.where(live, t, tf.zeros_like(t)), shape)  # finished rows: at x
        t_exit, margins, rates, _ = _probe(twin, x + at * d, d, pred)
        s = _first_crossing(margins, rates)
        cross = live & (s <= t_exit) & (t + s <= t_max)
        t_next = tf.where(live & ~cross, t + t_exit * (1.0 + STEP_BEYOND) + STEP_BEYOND, t)
        probes = probes + tf.cast(live, tf.int32)
        still = live & ~cross & (t_next < t_max) & tf.math.is_finite(t_next) \
            & (probes < regions)
        return (k + 1, t_next, tf.where(cross, s, s_hit), still, probes,
                tf.where(live, t_exit, exits))

    nan = tf.fill(tf.shape(t), tf.constant(np.nan, t.dtype))
    start = (tf.constant(0), t, nan, tf.math.is_finite(t) & (t < t_max) & (regions > 0),
             tf.zeros(tf.shape(t), tf.int32), nan)
    _, t, s, _, probes, exits = tf.while_loop(lambda k, t, s, live, probes, exits:
                                              tf.reduce_any(live), body, start)
    return t, s, probes, exits


def _line_loop(twin):
    """`_line_fn` compiled once per twin for any batch size."""
    return cached(twin, ("line_search",), lambda: tf.function(
        functools.partial(_line_fn, twin), autograph=False, input_signature=[
            BATCH_SPECS["x"](twin.input_shape), BATCH_SPECS["x"](twin.input_shape),
            BATCH_SPECS["y"](()), BATCH_SPECS["e"](()), tf.TensorSpec([], tf.float64),
            tf.TensorSpec([None], tf.int32)]))


def _line_search(model, twin, x, direction, pred, p, max_regions, t_max=1.0):
    """The first confirmed crossing on `x + t direction`, `0 <= t <= t_max`, region by
    region (the regions crossed in one compiled loop, `_line_fn`; a crossing the model
    does not confirm is stepped over); `(points, distances)` (NaN rows where none)."""
    b = x.shape[0]
    fn = _line_loop(twin)
    t = np.zeros(b)
    left = np.full(b, max_regions)
    points = np.full(x.shape, np.nan)
    dist = np.full(b, np.nan)
    active = np.flatnonzero(np.all(np.isfinite(direction.reshape(b, -1)), axis=1))
    shape = (-1,) + (1,) * (x.ndim - 1)
    while active.size:
        d = direction[active]
        tt, s, probes, _ = (to_numpy(v) for v in fn(
            tf.constant(x[active], tf.float64), tf.constant(d, tf.float64),
            tf.constant(pred[active], tf.int64), tf.constant(t[active], tf.float64),
            tf.constant(float(t_max), tf.float64), tf.constant(left[active], tf.int32)))
        t[active], left[active] = tt, left[active] - probes
        cur = x[active] + tt.reshape(shape) * d
        pts, ds = confirm(model, cur, d, s, pred[active], p, origin=x[active])
        found = np.isfinite(ds)
        points[active[found]], dist[active[found]] = pts[found], ds[found]
        # past a crossing the model did not confirm
        t[active] = np.where(np.isfinite(s), tt + s * (1.0 + STEP_BEYOND) + STEP_BEYOND, np.inf)
        active = active[~found & np.isfinite(s) & (t[active] < t_max) & (left[active] > 0)]
    return points, dist


def _keep_better(best, cand):
    pts, ds = cand
    better = np.isfinite(ds) & ~(ds >= best[1])
    best[0][better], best[1][better] = pts[better], ds[better]
    return better


def walk_bounds(model, twin, x: np.ndarray, pred: np.ndarray, p, max_regions: int = 100,
                memory_budget: int | None = None) -> NormBounds:
    """Method 2 for one norm: adversarial points by the region walk, then refined.

    Args:
        model: the Keras model (points are checked in it, in its input dtype).
        twin: its float64 `Linearized`.
        x: `[B, *input_shape]` float64 inputs.
        pred: `[B]` their predicted classes.
        p: the norm (1, 2 or inf).
        max_regions: regions the walk and each refining line may cross per input.
        memory_budget: bytes per chunk of the decision terms.

    Returns:
        `NormBounds` with `lower` 0, `upper` the distance of the best point found
        (NaN where none was found within `max_regions`), `adversarial` the point (in
        the model's input dtype, as float64) and `runner_up` the class it is
        predicted as.
    """
    points, dist = _walk(model, twin, x, pred, p, max_regions, memory_budget)
    best = [points, dist]
    found = np.isfinite(dist)
    if found.any():
        idx = np.flatnonzero(found)
        cand = _line_search(model, twin, x[idx], points[idx] - x[idx], pred[idx], p,
                            max_regions)
        sub = [best[0][idx], best[1][idx]]
        _keep_better(sub, cand)
        best[0][idx], best[1][idx] = sub
    for _ in range(REFINEMENTS):
        idx = np.flatnonzero(np.isfinite(best[1]))
        if not idx.size:
            break
        # The affine map on x's side of the crossing, projected from x.
        near = x[idx] + (1.0 - 1e-6) * (best[0][idx] - x[idx])
        terms = decision_terms(twin, near, pred[idx], guard=False, memory_budget=memory_budget)
        target, live = _aim(terms, x[idx], near, p)
        direction = np.where(live.reshape((-1,) + (1,) * (x.ndim - 1)), target - x[idx], np.nan)
        cand = _line_search(model, twin, x[idx], direction, pred[idx], p, max_regions, 2.0)
        sub = [best[0][idx], best[1][idx]]
        if not _keep_better(sub, cand).any():
            break
        best[0][idx], best[1][idx] = sub
    runner = np.full(x.shape[0], -1, np.int64)
    ok = np.isfinite(best[1])
    if ok.any():
        runner[ok] = predict_classes(model, best[0][ok])
    upper = np.where(ok, lp_norm(np.where(ok.reshape((-1,) + (1,) * (x.ndim - 1)),
                                          best[0] - x, 0.0), p), np.nan)
    return NormBounds(np.zeros(x.shape[0]), upper, best[0], runner)
