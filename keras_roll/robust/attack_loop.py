"""The steps of `minimal_norm_attack`, as one compiled loop per norm and batch shape.

Each step descends the margin `f_pred - f_other` (plus the gap `FLIP_GAP` asks of a
clear flip: `keras_roll.robust.adversarial.clearly_other`) along its normalized
gradient (less the coordinates held at a bound of the input domain), projects the
perturbation onto the lp ball of radius `eps` and onto the input domain, and keeps
the smallest adversarial perturbation seen. Per row, `eps` either adapts (FMN:
Pintor et al., NeurIPS 2021; shrinks by `1 - gamma` while the point is adversarial,
grows by `1 + gamma` once it is not, and before the first adversarial point is the
linear estimate of the distance to the boundary) or stays fixed (projected gradient
descent at a given radius: the probes of
`keras_roll.robust.search.shrink_upper`). Step size and `gamma` decay along a cosine
over each row's own number of steps; a row stops moving after its steps.

Budgets are arguments of the graph (not constants traced into it): one trace per
norm and padded batch size serves every budget.

Example:

```python
fn = compiled_loop(model, p=2.0, rows=8)
delta, norm = fn(x, delta0, eps0, pred, target, low, high, steps, step_size, gamma, fixed,
                 smooth)
```
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from keras_roll.robust.adversarial import FLIP_GAP

__all__ = ["compiled_loop", "dual_norms"]

SMOOTH = 1.0  # l2 length of a smooth l_inf step over the sign step's (at the same eps)
L1_SMOOTH = 0.4  # l2 length of a smooth l1 step over eps (foolbox's FMN: about 1 / 6)


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


def dual_norms(g, p):
    """`[B]` the dual norms (q with 1/p + 1/q = 1) of the flattened rows of `g`."""
    return _flat_norm(g, {1.0: np.inf, 2.0: 2.0, np.inf: 1.0}[float(p)])


def _direction(g, p, smooth):
    """The step direction: for l_inf the sign, or (`smooth`) the gradient over its l2
    norm times `SMOOTH sqrt(n)` (coordinates move in proportion to their gradient, as
    foolbox's FMN steps); for l1 the gradient over its largest entry (the projection
    then keeps the largest entries); for l2 over its l2 norm."""
    unit = [-1] + [1] * (len(g.shape) - 1)
    if p == np.inf:
        size = tf.cast(tf.reduce_prod(tf.shape(g)[1:]), g.dtype)
        n = _flat_norm(g, 2) / (SMOOTH * tf.sqrt(size))
        return tf.where(smooth, g / tf.reshape(tf.maximum(n, 1e-30), unit), tf.sign(g))
    if p == 1:
        top = tf.reshape(tf.maximum(_flat_norm(g, np.inf), 1e-30), unit)
        n2 = tf.reshape(tf.maximum(_flat_norm(g, 2), 1e-30) / L1_SMOOTH, unit)
        return tf.where(smooth, g / n2, g / top)
    return g / tf.reshape(tf.maximum(_flat_norm(g, 2), 1e-30), unit)


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


def _loop_fn(model, p):
    """The loop for one norm (one `tf.function`, traced per batch shape)."""
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

    def run(x, delta, eps0, pred, target, lo, hi, steps, step_size, gamma, fixed, smooth):
        shape = [-1] + [1] * (len(x.shape) - 1)
        total = tf.cast(tf.maximum(steps, 1), tf.float32)

        def body(k, delta, eps, best, best_norm):
            loss, adv, g = loss_and_grad(x, delta, pred, target)
            g = _free(g, x + delta, lo, hi)
            norm = tf.cast(_flat_norm(delta, p), tf.float32)
            best, best_norm = keep(delta, norm, adv, best, best_norm, shape)
            c = 0.5 * (1.0 + tf.cos(math.pi * tf.cast(k, tf.float32) / total))
            gam = gamma / 50 + (gamma - gamma / 50) * c
            alpha = step_size / 100 + (step_size - step_size / 100) * c
            gq = tf.cast(dual_norms(g, p), tf.float32)
            eps = _next_eps(eps, eps0, norm, loss, gq, adv, best_norm, gam, fixed)
            step = tf.cast(tf.reshape(alpha * eps, shape), x.dtype) * _direction(g, p, smooth)
            moved = _project(delta - step, tf.cast(eps, x.dtype), p)
            moved = tf.clip_by_value(x + moved, lo, hi) - x
            delta = tf.where(tf.reshape(k < steps, shape), moved, delta)
            return k + 1, delta, eps, best, best_norm

        start = (tf.constant(0), delta, eps0, delta, tf.fill(tf.shape(eps0), float("inf")))
        _, delta, _, best, best_norm = tf.while_loop(
            lambda k, *_: k < tf.reduce_max(steps), body, start)
        _, adv, _ = loss_and_grad(x, delta, pred, target)
        return keep(delta, tf.cast(_flat_norm(delta, p), tf.float32), adv, best, best_norm,
                    shape)

    return tf.function(run, autograph=False)


def compiled_loop(model, p, rows):
    """The loop as a graph for `rows` inputs: `fn(x, delta0, eps0, pred, target, low,
    high, steps, step_size, gamma, fixed, smooth) -> (best delta, its norm)` (inf where
    no adversarial point was seen). `steps` is per row (int32), `step_size` and `gamma`
    scalars (float32), `fixed` per row (bool), `smooth` a scalar bool (`_direction`).
    A `ConcreteFunction` runs as a graph even under `tf.config.run_functions_eagerly`:
    hundreds of steps of small ops, run eagerly, cost about a hundred times the
    compiled loop."""
    dtype = model.inputs[0].dtype
    shape = tuple(model.inputs[0].shape[1:])
    inputs = tf.TensorSpec([rows, *shape], dtype)
    per_row = {"f": tf.TensorSpec([rows], tf.float32), "i": tf.TensorSpec([rows], tf.int64)}
    box = tf.TensorSpec(shape, dtype)
    scalar = tf.TensorSpec([], tf.float32)
    return _loop_fn(model, float(p)).get_concrete_function(
        inputs, inputs, per_row["f"], per_row["i"], per_row["i"], box, box,
        tf.TensorSpec([rows], tf.int32), scalar, scalar, tf.TensorSpec([rows], tf.bool),
        tf.TensorSpec([], tf.bool))
