"""A minimal-norm attack: adversarial points of small l1, l2 or l_inf norm, by gradients.

The upper bounds of `robust_radius` are real adversarial points. The region walk
(`keras_roll.robust.walk`) follows the piecewise-affine map exactly, but it stops at
the first crossing it meets; a gradient attack that keeps shrinking the perturbation
while staying adversarial finds closer points on networks with many small regions
(convolutions). `minimal_norm_attack` is such an attack, after FMN (Pintor et al.,
"Fast Minimum-norm Adversarial Attacks through Adaptive Norm Constraints",
NeurIPS 2021):

* a perturbation `delta` and a norm constraint `eps`; each step descends the
  margin along its normalized gradient and projects onto the lp ball of radius
  `eps` and the input domain; `eps` adapts as in FMN
  (`keras_roll.robust.attack_loop`); for l_inf every other run steps along the
  gradient over its l2 norm (as foolbox's FMN) instead of its sign: the two find
  different local minima;
* known adversarial points (the region walk's, the relaxation's, earlier attacks')
  are starts: one untargeted run from each where it is not the closest, then the
  first restart from the closest so far, so these runs only shrink their norms; the
  other restarts target the other classes from `x`, nearest first by the linear
  estimate: the first `FULL_TARGETS` with `AttackOptions.steps` steps, the later ones
  short scouting runs (`scout_steps`), which catch a nearer class the estimate ranks
  low (often in l1); the runs from `x` of one length (full, scouting) go through
  the loop as one batch (two in l_inf and l1: sign and smooth steps), which on small
  batches costs about what one run does per step;
* then `AttackOptions.polish` runs from the best point so far, toward its class (for
  l_inf alternating sign and smooth steps; the last with a fine schedule);
* then `AttackOptions.refine` first-order steps along the decision boundary from the
  best point (`keras_roll.robust.attack_refine`: toward the point of least norm on the
  boundary's tangent plane, in shares checked in the model), which settle where the
  runs' finite schedules stop short (l1 above all: its minima sit on a few pixels);
* every point found is moved to the first clear flip by the norm's own projection
  onto smaller balls (bisection: scaled for l2, clipped for l_inf,
  soft-thresholded for l1) and checked in the Keras model in its own dtype
  (`clearly_other`, else `adversarial.confirm`'s pushes) and inside the domain;
* finally, probes at fixed radii (projected gradient descent from random points of
  the sphere) bisect between the certified radius (where known) and the best
  distance, with budgets that grow as the bracket narrows
  (`keras_roll.robust.upper_search.shrink_upper`); a probe ends at its first point.

The attack spends its steps where it can still gain: an input whose bracket is
closed (`upper - lower <= tol * upper`, `lower` the certified radius) gets no further
run, and the steps reported are the steps run. The steps run in one compiled graph
for every norm and batch size, on `tf.GradientTape` gradients of the Keras model in
its dtype.

Example:

```python
nb = minimal_norm_attack(model, x, p=np.inf, domain=(0.0, 255.0))
nb.upper, nb.adversarial        # NaN where no adversarial point was found
```
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from keras_roll.robust.adversarial import (
    lp_norm,
    margin_gradients,
    predict_classes,
)
from keras_roll.robust.attack_loop import dual_norms
from keras_roll.robust.attack_options import AttackOptions
from keras_roll.robust.attack_points import (
    ExampleNoise,
    Runner,
    domain_arrays,
    valid_starts,
)
from keras_roll.robust.attack_refine import refine_points
from keras_roll.robust.region import NormBounds
from keras_roll.robust.upper_search import shrink_upper

__all__ = ["AttackOptions", "ball_attack", "minimal_norm_attack", "probe_attack", "run_attack"]

NOISE = 0.5  # restarts start within this share of the best radius around x
FINE = (0.1, 0.2)  # the last polishing run's step size and gamma, as shares of the options'
FULL_TARGETS = 2  # targeted runs with `AttackOptions.steps`; the later ones are scouts
GROUP_ROWS = 512  # rows of the restarts from `x` run through the loop in one batch


def _norm_of(p):
    if p not in (1, 2, np.inf):
        raise ValueError(f"minimal_norm_attack bounds the l1, l2 or l_inf norm (p=1, 2 or "
                         f"np.inf), got p={p!r}.")
    return float(p)


ORDER_ROWS = 256  # rows (input x class) per gradient call of `_class_order`


def _class_order(model, x, pred, p):
    """`[B, L-1]` the other classes, nearest first by the linear estimate of the
    distance to their decision hyperplane at `x` (`margin / ||gradient||_q`): one
    gradient call for `ORDER_ROWS` (input, class) pairs at a time."""
    b, classes = x.shape[0], int(model.outputs[0].shape[-1])
    rows = np.repeat(np.arange(b), classes)
    other = np.tile(np.arange(classes), b)
    dist = np.full(b * classes, np.inf)
    for c0 in range(0, rows.size, ORDER_ROWS):
        r, j = rows[c0:c0 + ORDER_ROWS], other[c0:c0 + ORDER_ROWS]
        m, g = margin_gradients(model, x[r], pred[r], j)
        m = m.astype(np.float32)
        gq = dual_norms(tf.constant(g, tf.float32), p).numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            dist[c0:c0 + r.size] = np.where(gq > 0, np.maximum(m, 0.0) / gq, np.inf)
    dist = dist.reshape(b, classes)
    dist[np.arange(b), pred] = np.nan
    order = np.argsort(np.where(np.isnan(dist), np.inf, dist), axis=1, kind="stable")
    return np.stack([o[o != y] for o, y in zip(order, pred)])


def _restart_from(r, x, best, best_norm, order, rng, p, lo, hi):
    """`(d0, target)` for restart `r`: run 0 is untargeted from the best known point;
    later runs target the next nearest class from `x`, then from noise near `x`."""
    b = x.shape[0]
    shape = (-1,) + (1,) * (x.ndim - 1)
    have = np.isfinite(best_norm)
    target = np.full(b, -1, np.int64)
    if r == 0:  # untargeted, from the best known point
        d0 = np.where(have.reshape(shape), np.nan_to_num(best) - x, 0.0)
    else:  # targeted at the next nearest class, from x (then near x, at random)
        target = order[:, (r - 1) % order.shape[1]]
        d0 = np.zeros_like(x)
        if r > order.shape[1]:
            radius = np.where(have, NOISE * best_norm, 0.0)
            noise = rng(range(b), x.shape)
            noise /= np.maximum(lp_norm(noise, p), 1e-300).reshape(shape)
            d0 = np.clip(x + noise * radius.reshape(shape), lo, hi) - x
    return d0, target


def minimal_norm_attack(model, x, p=2, *, pred=None, start=None, domain=None,
                        options: AttackOptions | None = None, lower=None) -> NormBounds:
    """Adversarial points of small lp norm around every `x` (an FMN-style attack).

    Args:
        model: a Keras classifier, output `[B, L]` (logits or a softmax).
        x: `[B, *input_shape]` inputs.
        p: the norm: 1, 2 or np.inf.
        pred: `[B]` the classes to move away from (default: the model's predictions).
        start: `[B, *input_shape]` known adversarial points to start from (NaN rows,
            or None: start from `x`), or a sequence of such arrays (several starts
            per input: one run from each); the attack then only shrinks their
            distance. Points that do not clearly change the class are ignored.
        domain: None (no bounds), or `(low, high)`: numbers or arrays broadcastable to
            the input shape, in the model's input units; every point stays inside.
        options: an `AttackOptions` (default: 150 steps, 7 runs (four of them short
            scouting runs), 3 polishing runs, 4 rounds of
            refinement, then probes at fixed radii).
        lower: `[B]` radii known to hold no adversarial point (certified), which
            bound the probes' brackets from below (default: none).

    Returns:
        `NormBounds`: `upper` the lp distance (float64, input units) of the best
        point found (NaN where none), `adversarial` the points (in the model's input
        dtype, as float64; NaN rows where none), `runner_up` the class the model
        gives them (-1 where none), `lower` zeros. Every point is classified by the
        Keras model as another class than `pred`, by `FLIP_GAP`.

    Raises:
        ValueError: a bad norm, option, domain, or inputs outside the domain.

    Example:

    ```python
    nb = minimal_norm_attack(model, x_test[:20], p=np.inf, domain=(0.0, 1.0))
    assert (predict_classes(model, nb.adversarial) != predict_classes(model, x_test[:20])).all()
    ```
    """
    return run_attack(model, x, p, pred=pred, start=start, domain=domain, options=options,
                      lower=lower)[0]


def run_attack(model, x, p=2, *, pred=None, start=None, domain=None,
               options: AttackOptions | None = None, lower=None, probes: bool = True,
               tol: float = 1e-3):
    """`minimal_norm_attack`'s `NormBounds` and `[B]` int64 the steps run per input
    (`probes=False`: without the probes, which `probe_attack` runs alone). An input
    whose bracket is closed (`upper - lower <= tol * upper`, `lower` the certified
    radii) gets no further run: the attack spends its steps where it can still gain.

    Example:

    ```python
    nb, steps = run_attack(model, x, np.inf, lower=certified)
    ```
    """
    runner, best, best_norm, starts = _setup(model, x, p, pred, start, domain, options)
    runner.lower, runner.tol = _lower_of(lower, x.shape[0]), float(tol)
    _from_starts(runner, best, best_norm, starts)
    _restarts(runner, best, best_norm)
    _polish(runner, best, best_norm)
    _refine(runner, best, best_norm)
    if probes and runner.options.probe_steps:
        _probes(runner, best, best_norm, lower)
    return _bounds(runner, best, best_norm), runner.taken


def probe_attack(model, x, p, pred, start, lower, options: AttackOptions | None = None,
                 domain=None):
    """The probes alone (`AttackOptions.probe_steps`, `probe_budget`): projected gradient
    descent at radii bisected between `lower [B]` (certified radii) and the distances of
    the adversarial points `start [B, *input_shape]`, by
    `keras_roll.robust.upper_search.shrink_upper`; returns `(NormBounds, [B] steps spent)`
    (`start` where no probe found a closer point).

    Example:

    ```python
    nb, steps = probe_attack(model, x, 2, pred, rr.adversarial[2], rr.lower[2])
    ```
    """
    runner, best, best_norm, _ = _setup(model, x, p, pred, start, domain, options)
    _probes(runner, best, best_norm, lower)
    return _bounds(runner, best, best_norm), runner.taken


def ball_attack(model, x: np.ndarray, starts: np.ndarray, pred: int, eps: float, p,
                steps: int, options: AttackOptions | None = None) -> np.ndarray:
    """Projected gradient descent inside the lp ball of radius `eps` around one input
    `x`, untargeted, from the points `x + starts` (`[n, *input_shape]`): the loop of the
    probes at a fixed radius. Returns `[n, *input_shape]` the adversarial points found
    (checked in the model as `minimal_norm_attack`'s), NaN rows where none.

    Example:

    ```python
    pts = ball_attack(model, x, starts, pred=3, eps=0.1, p=np.inf, steps=40)
    ```
    """
    n = len(starts)
    xs = np.repeat(np.asarray(x, np.float64)[None], n, 0)
    p = _norm_of(p)
    runner = Runner(model, xs, np.full(n, pred, np.int64), p, *domain_arrays(None, xs),
                     (options or AttackOptions()).checked())
    pts, _ = runner.run(np.arange(n), np.asarray(starts, np.float64), np.full(n, eps),
                        np.full(n, -1, np.int64), steps, True)
    return pts


def _setup(model, x, p, pred, start, domain, options):
    """`(runner, best, best_norm, starts)`: the checked arguments, the closest known
    point per row and every known start (`valid_starts`)."""
    p = _norm_of(p)
    options = (options or AttackOptions()).checked()
    x = np.asarray(x, np.float64)
    lo, hi = domain_arrays(domain, x)
    if pred is None:
        pred = predict_classes(model, x) if x.shape[0] else np.zeros(0, np.int64)
    pred = np.asarray(pred, np.int64)
    starts = valid_starts(model, x, start, pred, p, lo, hi)
    best, best_norm = np.full(x.shape, np.nan), np.full(x.shape[0], np.inf)
    for idx, pts, dist in starts:
        _keep(best, best_norm, idx, pts, dist)
    return Runner(model, x, pred, p, lo, hi, options), best, best_norm, starts


def _lower_of(lower, b) -> np.ndarray:
    """`[B]` certified radii (0 where unknown)."""
    return np.zeros(b) if lower is None else np.nan_to_num(np.asarray(lower, np.float64))


def _bounds(runner, best, best_norm) -> NormBounds:
    b = best_norm.shape[0]
    ok = np.isfinite(best_norm)
    runner_up = np.full(b, -1, np.int64)
    if ok.any():
        runner_up[ok] = predict_classes(runner.model, best[ok].astype(runner.dtype))
    best[~ok] = np.nan
    return NormBounds(np.zeros(b), np.where(ok, best_norm, np.nan), best, runner_up)


def _keep(best, best_norm, idx, pts, dist):
    """Keeps the points of rows `idx` that are closer than the best (in place)."""
    better = np.isfinite(dist) & (dist < best_norm[idx])
    best[idx[better]], best_norm[idx[better]] = pts[better], dist[better]


def _groups(restarts, p, rows):
    """The restarts in the order they run, in groups run as one batch: run 0 alone (it
    starts from the best known point), then the later ones (from `x`) together, split
    by their length (full runs, scouts: a batch runs as long as its longest row), by
    their step (for l_inf and l1, sign or smooth: a scalar of the loop) and to at most
    `GROUP_ROWS` rows (`rows` inputs each)."""
    parts = []
    for later in (list(range(1, min(restarts, FULL_TARGETS + 1))),
                  list(range(FULL_TARGETS + 1, restarts))):
        parts += [later] if p == 2 else [later[0::2], later[1::2]]
    parts = [g for g in parts if g]
    size = max(1, GROUP_ROWS // max(rows, 1))
    return [[0]] + [g[i:i + size] for g in parts for i in range(0, len(g), size)]


def _restarts(runner, best, best_norm) -> None:
    """The FMN runs (in place); the runs from `x` go through the loop together (one
    batch of their rows: the loop's cost per step hardly grows with the rows)."""
    x, options = runner.x, runner.options
    b = x.shape[0]
    if not b:
        return
    rng = ExampleNoise(x, options.seed)
    order = _class_order(runner.model, x.astype(runner.dtype), runner.pred, runner.p) \
        if options.restarts > 1 else None
    began = time.monotonic()
    for group in _groups(options.restarts, runner.p, b):
        if group[0] and options.max_seconds is not None \
                and time.monotonic() - began > options.max_seconds:
            break
        rows = runner.open_rows(best_norm)
        if not rows.size:
            break
        d0, eps0, target, steps = [], [], [], []
        for r in group:
            d, t = _restart_from(r, x, best, best_norm, order, rng, runner.p, runner.lo,
                                 runner.hi)
            d0.append(d[rows])
            target.append(t[rows])
            eps0.append(np.where(np.isfinite(best_norm[rows]) & (r == 0), best_norm[rows], 0.0))
            full = r <= FULL_TARGETS
            steps.append(np.full(rows.size, options.steps if full
                                 else min(options.steps, options.scout_steps)))
        smooth = group[0] % 2 == 1  # l_inf, l1: every other run steps along the smooth direction
        pts, dist = runner.run(np.tile(rows, len(group)), np.concatenate(d0),
                               np.concatenate(eps0), np.concatenate(target),
                               np.concatenate(steps), False, smooth)
        for k in range(len(group)):  # in the order of the runs
            part = slice(k * rows.size, (k + 1) * rows.size)
            _keep(best, best_norm, rows, pts[part], dist[part])


def _from_starts(runner, best, best_norm, starts) -> None:
    """An untargeted run from each known start where it is not the closest (in place;
    the restarts begin at the closest)."""
    if len(starts) < 2:
        return
    width = int(np.prod(best.shape[1:]))
    others = []
    for idx, pts, dist in starts:
        keep = (dist > 0) & np.any((pts != best[idx]).reshape(idx.size, width), axis=1)
        others.append((idx[keep], pts[keep], dist[keep]))
    steps = runner.options.steps
    for k, (idx, pts, dist) in enumerate(others):
        keep = np.isin(idx, runner.open_rows(best_norm))
        idx, pts, dist = idx[keep], pts[keep], dist[keep]
        if idx.size:
            found, d = runner.run(idx, pts - runner.x[idx], dist, np.full(idx.size, -1),
                                  steps, False, k % 2 == 1)
            _keep(best, best_norm, idx, found, d)


def _hopped(runner, rng, idx, best, best_norm, last):
    """`(d0, eps0)` of a polishing run: the best points, plus (`AttackOptions.hop`, not
    on the `last` run) uniform noise of `hop` times their distance in the norm."""
    d0, hop = best[idx] - runner.x[idx], 0.0 if last else runner.options.hop
    if hop:
        noise = rng(idx, d0.shape)
        scale = hop * best_norm[idx] / np.maximum(lp_norm(noise, runner.p), 1e-300)
        d0 = d0 + noise * scale.reshape((-1,) + (1,) * (d0.ndim - 1))
    return d0, best_norm[idx] * (1.0 + hop)


def _polish(runner, best, best_norm) -> None:
    """`AttackOptions.polish` runs from the best points so far (in place), each only
    shrinking their norm toward the best point's class (for l_inf alternately by sign
    and by smooth steps: they end in different local minima; all but the last from
    noise around the best point, `AttackOptions.hop`; the last run with a fine
    schedule, `FINE`)."""
    steps = runner.options.steps
    rng = ExampleNoise(runner.x, runner.options.seed + 2)
    for k in range(runner.options.polish):
        idx = runner.open_rows(best_norm)
        idx = idx[np.isfinite(best_norm[idx])]
        if not idx.size:
            break
        last = k == runner.options.polish - 1
        target = predict_classes(runner.model, best[idx].astype(runner.dtype))
        d0, eps0 = _hopped(runner, rng, idx, best, best_norm, last)
        pts, dist = runner.run(idx, d0, eps0, target, steps, False, k % 2 == 1,
                               scale=FINE if last else (1.0, 1.0))
        _keep(best, best_norm, idx, pts, dist)


def _refine(runner, best, best_norm) -> None:
    """`AttackOptions.refine` first-order steps along the boundary from the best points
    (in place; `keras_roll.robust.attack_refine`): they only keep closer points."""
    idx = runner.open_rows(best_norm)
    idx = idx[np.isfinite(best_norm[idx])]
    if idx.size and runner.options.refine:
        pts, dist = refine_points(runner.model, runner.x[idx], best[idx], runner.pred[idx],
                                  runner.p, runner.lo, runner.hi, runner.options.refine)
        _keep(best, best_norm, idx, pts, dist)


def _probes(runner, best, best_norm, lower) -> None:
    """The search at fixed radii below the best points (in place); a probe ends at its
    first point (the steps it ran are counted in `runner.taken`)."""
    x = runner.x
    shape = (-1,) + (1,) * (x.ndim - 1)

    rng = ExampleNoise(x, runner.options.seed + 1)

    def probe(idx, eps, steps):
        # from a random point of the sphere of radius eps, toward the best point's class
        noise = rng(idx, x[idx].shape)
        d0 = noise * (eps / np.maximum(lp_norm(noise, runner.p), 1e-300)).reshape(shape)
        target = predict_classes(runner.model, best[idx].astype(runner.dtype))
        before = runner.taken[idx]
        pts, dist = runner.run(idx, d0, eps, target, steps, True)
        _keep(best, best_norm, idx, pts, dist)
        return dist, runner.taken[idx] - before

    options = runner.options
    shrink_upper(probe, _lower_of(lower, x.shape[0]), best_norm, steps=options.probe_steps,
                 max_steps=options.probe_budget)


