"""The steps of `minimal_norm_attack`, as one compiled loop for every norm and batch size.

Each step descends the margin `f_pred - f_other` (plus the gap `FLIP_GAP` asks of a
clear flip: `keras_roll.robust.adversarial.clearly_other`) along its normalized
gradient (less the coordinates held at a bound of the input domain), projects the
perturbation onto the lp ball of radius `eps` and onto the input domain, and keeps
the smallest adversarial perturbation seen. Per row, `eps` either adapts (FMN:
Pintor et al., NeurIPS 2021; shrinks by `1 - gamma` while the point is adversarial,
grows by `1 + gamma` once it is not, and before the first adversarial point is the
linear estimate of the distance to the boundary) or stays fixed (projected gradient
descent at a given radius: the probes of
`keras_roll.robust.upper_search.shrink_upper`). Step size and `gamma` decay along a cosine
over each row's own number of steps; a row stops moving after its steps, and the
loop ends once every row has, or once every fixed row holds a point (a probe needs
one). After the steps, each best point is moved to the first clear flip along the
norm's own shrinking of its perturbation (bisection, `BISECTIONS` halvings, in the
same graph).

The norm (its `keras_roll.geometry.norm_code`, an index into `NORM_ORDER`), the
budgets and the batch size are arguments of the graph, not constants traced into it:
one trace per model serves every call. The norm's operations run under
`tf.switch_case`; called with a Python number for `p`, the same helpers build the
operations of that norm alone (the graph of one norm).

Example:

```python
fn = compiled_loop(model)
delta, norm, t, taken = fn(x, delta0, eps0, pred, target, low, high, steps, step_size,
                           gamma, fixed, smooth, norm_code(2))
```
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import tensorflow as tf

from keras_roll.geometry import NORM_ORDER
from keras_roll.robust.adversarial import FLIP_GAP

__all__ = ["BISECTIONS", "compiled_loop", "dual_norms", "loop_function", "shrunk"]

SMOOTH = 1.0  # l2 length of a smooth l_inf step over the sign step's (at the same eps)
L1_SMOOTH = 0.4  # l2 length of a smooth l1 step over eps (foolbox's FMN: about 1 / 6)
BISECTIONS = 24  # halvings of the segment from x to the best point (2^-24: float32's ulp)


def _by_norm(p, branches):
    """`branches[q]()` for the norm `p`: a Python number builds that norm's operations
    alone; a tensor (its `norm_code`) picks one at run time (`tf.switch_case`)."""
    if isinstance(p, numbers.Number):
        return branches[float(p)]()
    return tf.switch_case(p, [branches[q] for q in NORM_ORDER])


def _flat_norm(v, p):
    v = tf.reshape(v, [tf.shape(v)[0], -1])
    return _by_norm(p, {2.0: lambda: tf.sqrt(tf.reduce_sum(v * v, axis=1)),
                        1.0: lambda: tf.reduce_sum(tf.abs(v), axis=1),
                        np.inf: lambda: tf.reduce_max(tf.abs(v), axis=1)})


def _project_l1(flat, eps):
    """The rows of `flat` projected onto the l1 balls of radii `eps` (Duchi et al. 2008)."""
    e = eps[:, None]
    a = tf.abs(flat)
    mu = tf.sort(a, axis=1, direction="DESCENDING")
    cs = tf.cumsum(mu, axis=1)
    k = tf.cast(tf.range(1, tf.shape(flat)[1] + 1), flat.dtype)[None]
    rho = tf.reduce_sum(tf.cast(mu - (cs - e) / k > 0, tf.int32), axis=1)
    rho = tf.maximum(rho, 1)
    theta = (tf.gather(cs, rho - 1, batch_dims=1) - eps) / tf.cast(rho, flat.dtype)
    shrunk = tf.sign(flat) * tf.nn.relu(a - tf.maximum(theta, 0.0)[:, None])
    inside = tf.reduce_sum(a, axis=1, keepdims=True) <= e
    return tf.where(inside, flat, shrunk)


def _project(v, eps, p):
    """`v` projected onto the lp ball of radius `eps` (rows)."""
    shape = tf.shape(v)
    flat = tf.reshape(v, [shape[0], -1])
    e = eps[:, None]

    def l2():
        n = tf.sqrt(tf.reduce_sum(flat * flat, axis=1, keepdims=True))
        return flat * tf.minimum(1.0, e / tf.maximum(n, 1e-30))

    out = _by_norm(p, {np.inf: lambda: tf.clip_by_value(flat, -e, e), 2.0: l2,
                       1.0: lambda: _project_l1(flat, eps)})
    return tf.reshape(out, shape)


def dual_norms(g, p):
    """`[B]` the dual norms (q with 1/p + 1/q = 1) of the flattened rows of `g` (`p` a
    number, or a tensor index into `NORM_ORDER`)."""
    return _by_norm(p, {q: (lambda d=d: _flat_norm(g, d))
                        for q, d in ((1.0, np.inf), (2.0, 2.0), (np.inf, 1.0))})


def _direction(g, p, smooth):
    """The step direction: for l_inf the sign, or (`smooth`) the gradient over its l2
    norm times `SMOOTH sqrt(n)` (coordinates move in proportion to their gradient, as
    foolbox's FMN steps); for l1 the gradient over its largest entry (the projection
    then keeps the largest entries); for l2 over its l2 norm."""
    unit = [-1] + [1] * (len(g.shape) - 1)

    def linf():
        size = tf.cast(tf.reduce_prod(tf.shape(g)[1:]), g.dtype)
        n = _flat_norm(g, 2.0) / (SMOOTH * tf.sqrt(size))
        return tf.where(smooth, g / tf.reshape(tf.maximum(n, 1e-30), unit), tf.sign(g))

    def l1():
        top = tf.reshape(tf.maximum(_flat_norm(g, np.inf), 1e-30), unit)
        n2 = tf.reshape(tf.maximum(_flat_norm(g, 2.0), 1e-30) / L1_SMOOTH, unit)
        return tf.where(smooth, g / n2, g / top)

    return _by_norm(p, {np.inf: linf, 1.0: l1, 2.0: lambda: g / tf.reshape(
        tf.maximum(_flat_norm(g, 2.0), 1e-30), unit)})


def shrunk(delta, t, p):
    """`delta` moved into the lp ball of radius `t` times its norm (`t` `[B]` in [0, 1]),
    by the norm's own projection: scaled (l2), clipped (l_inf: the coordinates below
    the bound keep their values), soft-thresholded (l1: the small ones drop first).
    Tensors or arrays, in the loop's graph or eagerly (the checks of
    `keras_roll.robust.attack_points`); `p` a number or a `norm_code` tensor."""
    unit = [-1] + [1] * (len(delta.shape) - 1)
    t = tf.reshape(tf.cast(t, delta.dtype), unit)
    top = tf.reshape(_flat_norm(delta, np.inf), unit)
    return _by_norm(p, {2.0: lambda: t * delta,
                        np.inf: lambda: tf.clip_by_value(delta, -t * top, t * top),
                        1.0: lambda: tf.sign(delta) * tf.nn.relu(tf.abs(delta)
                                                                 - (1.0 - t) * top)})


def _free(g, point, lo, hi):
    """`g` without the coordinates a descent step would push out of the domain (those
    at a bound, pointing out): they would be clipped back, and for l1, where a step
    moves the largest entries, they would use the step up."""
    out = ((point <= lo) & (g > 0)) | ((point >= hi) & (g < 0))
    return tf.where(out, tf.zeros_like(g), g)


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


def _next_eps(eps, eps0, norm, loss, gq, adv, best_norm, gam, fixed):
    """FMN's radius update (fixed rows keep `eps0`)."""
    estimate = tf.where(gq > 0, norm + tf.maximum(loss, 0.0) / tf.maximum(gq, 1e-30), norm)
    found = best_norm < float("inf")
    adapted = tf.where(adv, tf.minimum(eps * (1 - gam), best_norm),
                       tf.where(found, eps * (1 + gam), estimate * (1 + gam)))
    return tf.where(fixed, eps0, adapted)


def _bisect(model, classes, x, best, pred, norm):
    """`[B]` the smallest share `t` of `best`'s norm found by `BISECTIONS` halvings with
    `x + shrunk(best, t)` clearly adversarial (1 where none is)."""
    def halve(i, lo, hi):
        mid = 0.5 * (lo + hi)
        out = tf.reshape(model(x + shrunk(best, mid, norm), training=False),
                         [tf.shape(x)[0], classes])
        _, flip = _margins(tf.cast(out, tf.float32), pred, -tf.ones_like(pred), classes)
        return i + 1, tf.where(flip, lo, mid), tf.where(flip, mid, hi)

    ones = tf.ones(tf.shape(pred), tf.float32)
    _, _, hi = tf.while_loop(lambda i, *_: i < BISECTIONS, halve,
                             (tf.constant(0), tf.zeros_like(ones), ones))
    return hi


def loop_function(model, p=None):
    """The loop as a `tf.function` (traced per input signature): `p` None takes the norm
    as the graph's last argument (an index into `NORM_ORDER`); a number builds the graph of
    that norm alone (the argument is then ignored)."""
    classes = int(model.outputs[0].shape[-1])

    def loss_and_grad(x, delta, pred, target):
        with tf.GradientTape() as tape:
            tape.watch(delta)
            out = tf.reshape(model(x + delta, training=False), [tf.shape(x)[0], classes])
            loss, flipped = _margins(tf.cast(out, tf.float32), pred, target, classes)
        return loss, flipped, tf.cast(tape.gradient(loss, delta), x.dtype)

    def keep(delta, norm, adv, best, best_norm, shape):
        better = adv & (norm < best_norm)
        return (tf.where(tf.reshape(better, shape), delta, best),
                tf.where(better, norm, best_norm))

    def run(x, delta, eps0, pred, target, lo, hi, steps, step_size, gamma, fixed, smooth,
            norm):
        norm = norm if p is None else float(p)
        shape = [-1] + [1] * (len(x.shape) - 1)
        total = tf.cast(tf.maximum(steps, 1), tf.float32)

        def moving(k, best_norm):  # fixed rows stop at their first point
            return (k < steps) & ~(fixed & (best_norm < float("inf")))

        def body(k, delta, eps, best, best_norm, taken):
            loss, adv, g = loss_and_grad(x, delta, pred, target)
            g = _free(g, x + delta, lo, hi)
            size, gq = _by_norm(norm, {q: (lambda q=q: (_flat_norm(delta, q), dual_norms(g, q)))
                                       for q in NORM_ORDER})
            size, gq = tf.cast(size, tf.float32), tf.cast(gq, tf.float32)
            live = moving(k, best_norm)
            best, best_norm = keep(delta, size, adv, best, best_norm, shape)
            c = 0.5 * (1.0 + tf.cos(math.pi * tf.cast(k, tf.float32) / total))
            gam = gamma / 50 + (gamma - gamma / 50) * c
            alpha = step_size / 100 + (step_size - step_size / 100) * c
            eps = _next_eps(eps, eps0, size, loss, gq, adv, best_norm, gam, fixed)
            scale = tf.cast(tf.reshape(alpha * eps, shape), x.dtype)
            moved = _by_norm(norm, {q: (lambda q=q: _project(
                delta - scale * _direction(g, q, smooth), tf.cast(eps, x.dtype), q))
                for q in NORM_ORDER})
            moved = tf.clip_by_value(x + moved, lo, hi) - x
            delta = tf.where(tf.reshape(live, shape), moved, delta)
            return k + 1, delta, eps, best, best_norm, taken + tf.cast(live, tf.int32)

        start = (tf.constant(0), delta, eps0, delta, tf.fill(tf.shape(eps0), float("inf")),
                 tf.zeros_like(steps))
        _, delta, _, best, best_norm, taken = tf.while_loop(
            lambda k, *v: tf.reduce_any(moving(k, v[3])), body, start)
        out = tf.reshape(model(x + delta, training=False), [tf.shape(x)[0], classes])
        _, adv = _margins(tf.cast(out, tf.float32), pred, target, classes)  # no gradient
        best, best_norm = keep(delta, tf.cast(_flat_norm(delta, norm), tf.float32), adv, best,
                               best_norm, shape)
        return best, best_norm, _bisect(model, classes, x, best, pred, norm), taken

    return tf.function(run, autograph=False)


def compiled_loop(model, p=None):
    """The loop as one graph for any batch size: `fn(x, delta0, eps0, pred, target, low,
    high, steps, step_size, gamma, fixed, smooth, norm) -> (best delta, its norm, t,
    steps taken)`: the norm is inf where no adversarial point was seen, and `t` the
    share of the best delta's norm where its shrinking first clearly flips (bisected
    in the graph; `shrunk`). `steps` is per row (int32), `step_size` and `gamma`
    scalars (float32), `fixed` per row (bool), `smooth` a scalar bool (`_direction`),
    `norm` a scalar int32 `keras_roll.geometry.norm_code` (`p` a number: that norm's
    graph alone). A `ConcreteFunction` runs as a graph even under
    `tf.config.run_functions_eagerly`: hundreds of steps of small ops, run eagerly,
    cost about a hundred times the compiled loop."""
    dtype = model.inputs[0].dtype
    shape = tuple(model.inputs[0].shape[1:])
    inputs = tf.TensorSpec([None, *shape], dtype)
    per_row = {"f": tf.TensorSpec([None], tf.float32), "i": tf.TensorSpec([None], tf.int64)}
    box = tf.TensorSpec(shape, dtype)
    scalar = tf.TensorSpec([], tf.float32)
    return loop_function(model, p).get_concrete_function(
        inputs, inputs, per_row["f"], per_row["i"], per_row["i"], box, box,
        tf.TensorSpec([None], tf.int32), scalar, scalar, tf.TensorSpec([None], tf.bool),
        tf.TensorSpec([], tf.bool), tf.TensorSpec([], tf.int32))
