"""A minimal-norm attack: adversarial points of small l1, l2 or l_inf norm, by gradients.

The upper bounds of `robust_radius` are real adversarial points. The region walk
(`keras_roll.robust.walk`) follows the piecewise-affine map exactly, but it stops at
the first crossing it meets; a gradient attack that keeps shrinking the perturbation
while staying adversarial finds closer points on networks with many small regions
(convolutions). `minimal_norm_attack` is such an attack, after FMN (Pintor et al.,
"Fast Minimum-norm Adversarial Attacks through Adaptive Norm Constraints",
NeurIPS 2021):

* a perturbation `delta` and a norm constraint `eps`; each step descends the
  margin `f_pred - max_{j != pred} f_j` (plus the gap `FLIP_GAP` asks of a clear
  flip: `keras_roll.robust.adversarial.clearly_other`) along its normalized
  gradient, projects `delta` onto the lp ball of radius `eps` and the input domain;
* `eps` shrinks by `1 - gamma` while the point is adversarial, grows by
  `1 + gamma` once it is not (after a first adversarial point), and before the
  first one is the linear estimate of the distance to the boundary
  (`||delta|| + margin / ||grad||_q`); `gamma` and the step size decay along a
  cosine;
* it starts from a known adversarial point (the walk's) where there is one, so it
  only shrinks its norm, else from `x`;
* the best adversarial point is moved along the segment from `x` to it to the
  first point the Keras model still classifies otherwise (bisection), and every
  point returned is checked in the Keras model in its own dtype (`clearly_other`,
  else `adversarial.confirm`'s pushes) and inside the domain.

The steps run in one `tf.function` per batch shape (batches are padded to a power
of two rows), on `tf.GradientTape` gradients of the Keras model in its dtype.

Example:

```python
nb = minimal_norm_attack(model, x, p=np.inf, domain=(0.0, 255.0))
nb.upper, nb.adversarial        # NaN where no adversarial point was found
```
"""

from __future__ import annotations

import math
import numbers
import time
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.caches import cached
from keras_roll.robust.adversarial import (
    FLIP_GAP,
    clearly_other,
    confirm,
    lp_norm,
    model_outputs,
    predict_classes,
)
from keras_roll.robust.region import NormBounds

__all__ = ["AttackOptions", "minimal_norm_attack"]

BISECTIONS = 24  # halvings of the segment from x to the best point (2^-24: float32's ulp)
NOISE = 0.5  # restarts start within this share of the best radius around x


class AttackOptions(NamedTuple):
    """Budgets of `minimal_norm_attack` (and of `robust_radius`'s `"attack"` method).

    Attributes:
        steps: gradient steps per run (default 100).
        restarts: runs per input (default 3). The first is untargeted (the largest
            other output) from the best known adversarial point (or `x`); the others
            target the other classes in turn, nearest first by the linear estimate of
            their distance at `x` (from `x`; once every class was targeted, from random
            points within `NOISE` of the best radius around `x`).
        max_seconds: stops starting new runs once this many seconds have passed
            (None: no limit; the first run always completes).
        seed: seed of the restarts' random starts (the runs are deterministic).
        step_size: the first step's length as a share of `eps` (decays along a cosine
            to 1/100 of it).
        gamma: the first relative change of `eps` per step (decays to `gamma / 50`).

    Example:

    ```python
    rr = keras_roll.robust_radius(model, x, y, attack=AttackOptions(steps=200, restarts=3))
    ```
    """

    steps: int = 100
    restarts: int = 3
    max_seconds: float | None = None
    seed: int = 0
    step_size: float = 1.0
    gamma: float = 0.05

    def checked(self) -> AttackOptions:
        """The options, or a ValueError naming the bad one."""
        for name in ("steps", "restarts", "seed"):
            v = getattr(self, name)
            low = 0 if name == "seed" else 1
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < low:
                raise ValueError(f"AttackOptions.{name} must be an integer >= {low}, got "
                                 f"{v!r}.")
        if self.max_seconds is not None and not (
                isinstance(self.max_seconds, numbers.Real) and self.max_seconds > 0):
            raise ValueError(f"AttackOptions.max_seconds must be a positive number of seconds "
                             f"or None, got {self.max_seconds!r}.")
        for name, high in (("step_size", 10.0), ("gamma", 0.5)):
            v = getattr(self, name)
            if not (isinstance(v, numbers.Real) and 0 < v <= high):
                raise ValueError(f"AttackOptions.{name} must be in (0, {high}], got {v!r}.")
        return self


def _norm_of(p):
    if p not in (1, 2, np.inf):
        raise ValueError(f"minimal_norm_attack bounds the l1, l2 or l_inf norm (p=1, 2 or "
                         f"np.inf), got p={p!r}.")
    return float(p)


def _flat_norm(v, p):
    v = tf.reshape(v, [tf.shape(v)[0], -1])
    if p == 2:
        return tf.sqrt(tf.reduce_sum(v * v, axis=1))
    if p == 1:
        return tf.reduce_sum(tf.abs(v), axis=1)
    return tf.reduce_max(tf.abs(v), axis=1)


def _project(v, eps, p):
    """`v` projected onto the lp ball of radius `eps` (rows; Duchi et al. 2008 for l1)."""
    shape = tf.shape(v)
    flat = tf.reshape(v, [shape[0], -1])
    e = eps[:, None]
    if p == np.inf:
        out = tf.clip_by_value(flat, -e, e)
    elif p == 2:
        n = tf.sqrt(tf.reduce_sum(flat * flat, axis=1, keepdims=True))
        out = flat * tf.minimum(1.0, e / tf.maximum(n, 1e-30))
    else:
        a = tf.abs(flat)
        mu = tf.sort(a, axis=1, direction="DESCENDING")
        cs = tf.cumsum(mu, axis=1)
        k = tf.cast(tf.range(1, tf.shape(flat)[1] + 1), flat.dtype)[None]
        rho = tf.reduce_sum(tf.cast(mu - (cs - e) / k > 0, tf.int32), axis=1)
        rho = tf.maximum(rho, 1)
        theta = (tf.gather(cs, rho - 1, batch_dims=1) - eps) / tf.cast(rho, flat.dtype)
        shrunk = tf.sign(flat) * tf.nn.relu(a - tf.maximum(theta, 0.0)[:, None])
        inside = tf.reduce_sum(a, axis=1, keepdims=True) <= e
        out = tf.where(inside, flat, shrunk)
    return tf.reshape(out, shape)


def _dual(g, p):
    return _flat_norm(g, {1.0: np.inf, 2.0: 2.0, np.inf: 1.0}[p])


def _direction(g, p):
    """The step direction: the sign for l_inf, the gradient over its largest entry for
    l1 (the projection then keeps the largest entries), over its l2 norm for l2."""
    if p == np.inf:
        return tf.sign(g)
    n = _flat_norm(g, np.inf if p == 1 else 2)
    return g / tf.reshape(tf.maximum(n, 1e-30), [-1] + [1] * (len(g.shape) - 1))


def _margins(out, pred, target, classes):
    """`(loss, flipped)`: `f_pred - f_other + FLIP_GAP max |f|` with `f_other` the
    target's output (the largest other output where the target is -1), and whether
    the largest other output wins by the gap (`clearly_other`)."""
    own = tf.one_hot(pred, classes, dtype=out.dtype)
    f_pred = tf.reduce_sum(own * out, axis=1)
    other = tf.reduce_max(out - own * 1e30, axis=1)
    f_target = tf.reduce_sum(tf.one_hot(tf.maximum(target, 0), classes, dtype=out.dtype) * out,
                             axis=1)
    gap = FLIP_GAP * tf.reduce_max(tf.abs(out), axis=1)
    loss = f_pred - tf.where(target >= 0, f_target, other) + gap
    return loss, f_pred - other + gap < 0


def _attack_fn(model, p, steps, step_size, gamma):
    """The FMN loop for one norm and budget (one `tf.function`, traced per batch shape)."""
    classes = int(model.outputs[0].shape[-1])
    inf = float("inf")

    def loss_and_grad(x, delta, pred, target):
        with tf.GradientTape() as tape:
            tape.watch(delta)
            out = tf.reshape(model(x + delta, training=False), [tf.shape(x)[0], classes])
            loss, flipped = _margins(tf.cast(out, tf.float32), pred, target, classes)
        return loss, flipped, tf.cast(tape.gradient(loss, delta), x.dtype)

    def run(x, delta, eps, pred, target, lo, hi):
        shape = [-1] + [1] * (len(x.shape) - 1)

        def body(k, delta, eps, best, best_norm):
            loss, adv, g = loss_and_grad(x, delta, pred, target)
            norm = tf.cast(_flat_norm(delta, p), tf.float32)
            better = adv & (norm < best_norm)
            best = tf.where(tf.reshape(better, shape), delta, best)
            best_norm = tf.where(better, norm, best_norm)
            c = 0.5 * (1.0 + tf.cos(math.pi * tf.cast(k, tf.float32) / steps))
            gam = gamma / 50 + (gamma - gamma / 50) * c
            alpha = step_size / 100 + (step_size - step_size / 100) * c
            gq = tf.cast(_dual(g, p), tf.float32)
            estimate = tf.where(gq > 0, norm + tf.maximum(loss, 0.0) / tf.maximum(gq, 1e-30),
                                norm)
            found = best_norm < inf
            eps = tf.where(adv, tf.minimum(eps * (1 - gam), best_norm),
                           tf.where(found, eps * (1 + gam), estimate * (1 + gam)))
            step = tf.cast(tf.reshape(alpha * eps, shape), x.dtype) * _direction(g, p)
            delta = _project(delta - step, tf.cast(eps, x.dtype), p)
            delta = tf.clip_by_value(x + delta, lo, hi) - x
            return k + 1, delta, eps, best, best_norm

        start = (tf.constant(0), delta, eps, delta, tf.fill(tf.shape(eps), inf))
        _, delta, _, best, best_norm = tf.while_loop(lambda k, *_: k < steps, body, start)
        _, adv, _ = loss_and_grad(x, delta, pred, target)
        norm = tf.cast(_flat_norm(delta, p), tf.float32)
        better = adv & (norm < best_norm)
        return (tf.where(tf.reshape(better, shape), delta, best),
                tf.where(better, norm, best_norm))

    return tf.function(run, autograph=False)


def _class_order(model, x, pred, p):
    """`[B, L-1]` the other classes, nearest first by the linear estimate of the
    distance to their decision hyperplane at `x` (`margin / ||gradient||_q`)."""
    classes = int(model.outputs[0].shape[-1])
    xt = tf.constant(x)
    dist = np.full((x.shape[0], classes), np.inf)
    for j in range(classes):
        with tf.GradientTape() as tape:
            tape.watch(xt)
            out = tf.reshape(model(xt, training=False), [x.shape[0], classes])
            out = tf.cast(out, tf.float32)
            m = tf.gather(out, pred, batch_dims=1) - out[:, j]
        g = tape.gradient(m, xt)
        gq = _dual(tf.cast(g, tf.float32), float(p)).numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            dist[:, j] = np.where(gq > 0, np.maximum(m.numpy(), 0.0) / gq, np.inf)
    dist[np.arange(x.shape[0]), pred] = np.nan
    order = np.argsort(np.where(np.isnan(dist), np.inf, dist), axis=1, kind="stable")
    return np.stack([o[o != y] for o, y in zip(order, pred)])


def _compiled(model, p, options, rows):
    """The loop as a graph for `rows` inputs. A `ConcreteFunction` runs as a graph even
    under `tf.config.run_functions_eagerly`: hundreds of steps of small ops, run
    eagerly, cost about a hundred times the compiled loop."""
    dtype = model.inputs[0].dtype
    shape = tuple(model.inputs[0].shape[1:])
    inputs = tf.TensorSpec([rows, *shape], dtype)
    rows_of = {"f": tf.TensorSpec([rows], tf.float32), "i": tf.TensorSpec([rows], tf.int64)}
    box = tf.TensorSpec(shape, dtype)
    return _attack_fn(model, p, options.steps, options.step_size, options.gamma) \
        .get_concrete_function(inputs, inputs, rows_of["f"], rows_of["i"], rows_of["i"], box,
                               box)


def _in_domain(points, lo, hi):
    b = points.shape[0]
    ok = (points >= lo) & (points <= hi)
    return np.all(ok.reshape(b, -1), axis=1)


def _bisect(model, x, delta, pred):
    """The smallest `t` in `(0, 1]` found by bisection with `x + t delta` clearly
    adversarial (`t = 1` is); returns the points (model dtype)."""
    dtype = np.dtype(model.inputs[0].dtype)
    shape = (-1,) + (1,) * (x.ndim - 1)
    lo, hi = np.zeros(x.shape[0]), np.ones(x.shape[0])
    for _ in range(BISECTIONS):
        mid = 0.5 * (lo + hi)
        pts = (x + mid.reshape(shape) * delta).astype(dtype)
        flip = clearly_other(model_outputs(model, pts), pred)
        hi, lo = np.where(flip, mid, hi), np.where(flip, lo, mid)
    return (x + hi.reshape(shape) * delta).astype(dtype)


def _pad_rows(a, n):
    return np.concatenate([a, np.repeat(a[-1:], n - a.shape[0], axis=0)]) if n > a.shape[0] \
        else a


def _domain_arrays(domain, x):
    if domain is None:
        return np.full(x.shape[1:], -np.inf), np.full(x.shape[1:], np.inf)
    try:
        lo, hi = domain
        lo = np.broadcast_to(np.asarray(lo, np.float64), x.shape[1:])
        hi = np.broadcast_to(np.asarray(hi, np.float64), x.shape[1:])
    except (TypeError, ValueError) as e:
        raise ValueError(f"domain must be None or a pair (low, high) of numbers or arrays "
                         f"broadcastable to the input shape {tuple(x.shape[1:])}, got "
                         f"{domain!r}.") from e
    if np.any(~(lo <= hi)):
        raise ValueError(f"domain=(low, high) needs low <= high everywhere, got {domain!r}.")
    outside = ~_in_domain(x, lo, hi)
    if outside.any():
        raise ValueError(f"{int(outside.sum())} of {x.shape[0]} inputs lie outside "
                         f"domain={domain!r} (first: row {int(np.argmax(outside))}); pass "
                         f"inputs inside the domain, or a wider domain.")
    return lo, hi


def _known_starts(model, x, start, pred, p, lo, hi):
    """`(best, best_norm)`: the rows of `start` that are finite, inside the domain and
    clearly classified as another class than `pred` (NaN / inf elsewhere)."""
    b = x.shape[0]
    dtype = np.dtype(model.inputs[0].dtype)
    best = np.full(x.shape, np.nan)
    best_norm = np.full(b, np.inf)
    if start is not None:
        start = np.asarray(start, np.float64)
        ok = np.all(np.isfinite(start.reshape(b, -1)), axis=1) & _in_domain(start, lo, hi)
        if ok.any():
            idx = np.flatnonzero(ok)
            flip = clearly_other(model_outputs(model, start[idx].astype(dtype)), pred[idx])
            idx = idx[flip]
            best[idx] = start[idx].astype(dtype).astype(np.float64)
            best_norm[idx] = lp_norm(best[idx] - x[idx], p)
    return best, best_norm


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
            noise = rng.uniform(-1.0, 1.0, x.shape)
            noise /= np.maximum(lp_norm(noise, p), 1e-300).reshape(shape)
            d0 = np.clip(x + noise * radius.reshape(shape), lo, hi) - x
    return d0, target


def minimal_norm_attack(model, x, p=2, *, pred=None, start=None, domain=None,
                        options: AttackOptions | None = None) -> NormBounds:
    """Adversarial points of small lp norm around every `x` (an FMN-style attack).

    Args:
        model: a Keras classifier, output `[B, L]` (logits or a softmax).
        x: `[B, *input_shape]` inputs.
        p: the norm: 1, 2 or np.inf.
        pred: `[B]` the classes to move away from (default: the model's predictions).
        start: `[B, *input_shape]` known adversarial points to start from (NaN rows,
            or None: start from `x`); the attack then only shrinks their distance.
        domain: None (no bounds), or `(low, high)`: numbers or arrays broadcastable to
            the input shape, in the model's input units; every point stays inside.
        options: an `AttackOptions` (default: 100 steps, 3 runs).

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
    p = _norm_of(p)
    options = (options or AttackOptions()).checked()
    x = np.asarray(x, np.float64)
    b = x.shape[0]
    if b == 0:
        return NormBounds(np.zeros(0), np.zeros(0), x.copy(), np.zeros(0, np.int64))
    lo, hi = _domain_arrays(domain, x)
    if pred is None:
        pred = predict_classes(model, x)
    pred = np.asarray(pred, np.int64)
    dtype = np.dtype(model.inputs[0].dtype)
    best, best_norm = _known_starts(model, x, start, pred, p, lo, hi)
    rows = 1 << max(0, (b - 1).bit_length())  # padded to a power of two: few traces
    fn = cached(model, ("minimal_norm_attack", p, options.steps, options.step_size,
                        options.gamma, rows), lambda: _compiled(model, p, options, rows))
    xt = tf.constant(_pad_rows(x, rows).astype(dtype))
    lo_t, hi_t = tf.constant(lo.astype(dtype)), tf.constant(hi.astype(dtype))
    pred_t = tf.constant(_pad_rows(pred, rows))
    rng = np.random.default_rng(options.seed)
    order = _class_order(model, x.astype(dtype), pred, p) if options.restarts > 1 else None
    began = time.monotonic()
    for r in range(options.restarts):
        if r and options.max_seconds is not None \
                and time.monotonic() - began > options.max_seconds:
            break
        d0, target = _restart_from(r, x, best, best_norm, order, rng, p, lo, hi)
        d0 = d0.astype(dtype).astype(np.float64)
        eps0 = np.where(np.isfinite(best_norm) & (r == 0), best_norm, 0.0)
        out_d, out_n = fn(xt, tf.constant(_pad_rows(d0, rows).astype(dtype)),
                          tf.constant(_pad_rows(eps0, rows).astype(np.float32)), pred_t,
                          tf.constant(_pad_rows(target, rows)), lo_t, hi_t)
        out_d, out_n = np.asarray(out_d, np.float64)[:b], np.asarray(out_n, np.float64)[:b]
        found = np.isfinite(out_n)
        if not found.any():
            continue
        idx = np.flatnonzero(found)
        pts = _checked(model, x[idx], out_d[idx], pred[idx], p, lo, hi)
        dist = lp_norm(np.nan_to_num(pts) - x[idx], p)
        better = np.isfinite(pts.reshape(idx.size, -1)[:, 0]) & (dist < best_norm[idx])
        best[idx[better]], best_norm[idx[better]] = pts[better], dist[better]
    ok = np.isfinite(best_norm)
    upper = np.where(ok, best_norm, np.nan)
    runner = np.full(b, -1, np.int64)
    if ok.any():
        runner[ok] = predict_classes(model, best[ok].astype(dtype))
    best[~ok] = np.nan
    return NormBounds(np.zeros(b), upper, best, runner)


def _checked(model, x, delta, pred, p, lo, hi):
    """The points `x + delta` moved to the first clear flip along the segment from `x`,
    checked in the model and the domain; NaN rows where none holds."""
    dtype = np.dtype(model.inputs[0].dtype)
    pts = (x + delta).astype(dtype)
    flip = clearly_other(model_outputs(model, pts), pred)
    if not flip.all():  # rounded back in another batch: push a little further
        bad = np.flatnonzero(~flip)
        pushed, dist = confirm(model, x[bad], delta[bad], np.ones(bad.size), pred[bad], p)
        ok = np.isfinite(dist) & _in_domain(np.nan_to_num(pushed.astype(np.float64)), lo, hi)
        pts[bad[ok]] = pushed[ok]
        flip[bad[ok]] = True
    out = np.full(x.shape, np.nan)
    idx = np.flatnonzero(flip)
    if idx.size:
        seg = pts[idx].astype(np.float64) - x[idx]
        final = _bisect(model, x[idx], seg, pred[idx])
        keep = clearly_other(model_outputs(model, final), pred[idx]) \
            & _in_domain(final.astype(np.float64), lo, hi)
        out[idx[keep]] = final[keep]
    return out
