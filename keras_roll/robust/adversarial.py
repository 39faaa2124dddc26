"""Adversarial points checked where it matters: in the Keras model, in its own dtype.

An upper bound on the minimal adversarial perturbation is only as good as the point
behind it. The methods of `keras_roll.robust` compute crossings of decision
boundaries in the float64 twin; `confirm` turns each crossing into a point of the
model's input dtype just beyond it (pushed a little further, in steps, until the
prediction of the Keras model really differs, by a gap no other evaluation of the
point rounds away: `FLIP_GAP`), and measures its distance from `x` in float64.

Example:

```python
pred = predict_classes(model, x)
pt, dist = confirm(model, x, u, t, pred, p=2)       # NaN rows where no push worked
```
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_roll.compile.caches import compiled_call

__all__ = ["FLIP_GAP", "PUSHES", "START_GAP", "clearly_other", "confirm", "lp_norm",
           "margin_gradients",
           "model_outputs", "predict_classes"]

# Relative pushes beyond a computed crossing, tried in turn (the crossing itself
# may round to either side in the model's evaluation).
PUSHES = tuple(2.0**-k for k in (22, 20, 18, 16, 14, 12, 10, 8, 5, 2))
# A point counts as adversarial when the new class wins by this share of the largest
# output: then no other evaluation of it (another batch size, another kernel) rounds
# back to the old class. Two float32 evaluations of a softmax output in batches of
# different sizes were seen to differ by 5e-7 of the output (2^-21), both classes
# moving toward a tie: 2^-20 was too thin, 2^-16 leaves a factor of 30.
FLIP_GAP = 2.0**-16
# The gap a known point (an attack's start) must clear: a point moved to the first
# clear flip by FLIP_GAP sits on the edge of that check, and another evaluation (another
# batch size, 2^-21 of the output away) rejects it about half of the time; half the gap
# accepts every point some evaluation found clear, and still no evaluation rounds back.
START_GAP = 0.5 * FLIP_GAP
PREDICT_BATCH = 1024
PUSH_BYTES = 2**24  # candidate points per model call in `confirm` (bytes of inputs)


def model_outputs(model, x: np.ndarray) -> np.ndarray:
    """`[B, L]` float64: the Keras model's outputs, computed in its input dtype, in batches."""
    x = np.asarray(x)
    dtype = model.inputs[0].dtype if getattr(model, "inputs", None) else "float32"
    fn = compiled_call(model)
    out = []
    for i in range(0, x.shape[0], PREDICT_BATCH):
        y = fn(tf.constant(x[i:i + PREDICT_BATCH].astype(dtype)))
        out.append(np.asarray(y, np.float64).reshape(y.shape[0], -1))
    return np.concatenate(out) if out else np.zeros((0, 0))


def margin_gradients(model, x: np.ndarray, pred: np.ndarray, other: np.ndarray) -> tuple:
    """`(margins [B], gradients [B, *input_shape])`, float64 arrays: the Keras model's
    `f_pred - f_other` at `x` (computed in the model's input dtype) and its gradient
    with respect to the input, from one `tf.GradientTape`."""
    xt = tf.constant(np.asarray(x).astype(model.inputs[0].dtype))
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out = tf.reshape(model(xt, training=False), [xt.shape[0], -1])
        m = tf.gather(out, pred, batch_dims=1) - tf.gather(out, other, batch_dims=1)
    return np.asarray(m, np.float64), np.asarray(tape.gradient(m, xt), np.float64)


def predict_classes(model, x: np.ndarray) -> np.ndarray:
    """`[B]` int64: the class the Keras model predicts (argmax of its output)."""
    out = model_outputs(model, x)
    return np.argmax(out, axis=-1) if out.size else np.zeros(len(out), np.int64)


def clearly_other(out: np.ndarray, pred: np.ndarray, gap: float = FLIP_GAP) -> np.ndarray:
    """`[B]` bool: the output's argmax is not `pred`, and it wins over `pred` by
    `gap` (default `FLIP_GAP`) of the largest absolute output."""
    rows = np.arange(out.shape[0])
    top = np.argmax(out, axis=-1)
    wins = out[rows, top] - out[rows, pred]
    return (top != pred) & (wins > gap * np.max(np.abs(out), axis=-1, initial=0.0))


def lp_norm(v: np.ndarray, p) -> np.ndarray:
    """`[B]` lp norms of the flattened rows of `v` (float64)."""
    v = np.asarray(v, np.float64)
    v = v.reshape(v.shape[0], int(np.prod(v.shape[1:])))
    if p == 2:
        return np.sqrt(np.sum(v * v, axis=1))
    if p == 1:
        return np.sum(np.abs(v), axis=1)
    return np.max(np.abs(v), axis=1, initial=0.0)


def confirm(model, base: np.ndarray, direction: np.ndarray, t: np.ndarray,
            pred: np.ndarray, p, origin: np.ndarray | None = None):
    """Points `base + t' direction` just beyond `t` whose prediction differs from `pred`.

    Args:
        model: the Keras model.
        base: `[b, *input_shape]` float64 points.
        direction: `[b, *input_shape]` directions (any scale).
        t: `[b]` the computed crossing along each direction (NaN / inf: skipped).
        pred: `[b]` the class at `origin`.
        p: the norm distances are measured in.
        origin: `[b, *input_shape]` the points distances are measured from
            (default `base`).

    Returns:
        `(points, distances)`: `[b, *input_shape]` points in the model's input
        dtype (NaN rows where no push changed the prediction) and `[b]` float64
        distances `||point - origin||_p` (NaN there).
    """
    base = np.asarray(base, np.float64)
    origin = base if origin is None else np.asarray(origin, np.float64)
    b = base.shape[0]
    dtype = model.inputs[0].dtype if getattr(model, "inputs", None) else "float32"
    points = np.full(base.shape, np.nan, np.dtype(dtype))
    dist = np.full(b, np.nan)
    todo = np.flatnonzero(np.isfinite(t))
    scale = 1e-6 * (1.0 + np.max(np.abs(base.reshape(b, -1)), axis=1, initial=0.0))
    shape = (-1,) + (1,) * (base.ndim - 1)
    row_bytes = max(1, int(np.prod(base.shape[1:])) * np.dtype(dtype).itemsize)
    k = 0
    while todo.size and k < len(PUSHES):
        # The first push alone (most points flip there), then as many of the others
        # per model call as PUSH_BYTES allows: the first push that flips is kept.
        m = 1 if k == 0 else max(1, min(len(PUSHES) - k,
                                        PUSH_BYTES // (row_bytes * todo.size)))
        unit = direction[todo] / np.maximum(lp_norm(direction[todo], np.inf),
                                            1e-300).reshape(shape)
        cand = np.stack([(base[todo] + (t[todo] * (1.0 + rho)).reshape(shape) * direction[todo]
                          + (rho * scale[todo]).reshape(shape) * unit).astype(dtype)
                         for rho in PUSHES[k:k + m]])  # [m, n, *input_shape]
        out = model_outputs(model, cand.reshape(-1, *base.shape[1:]))
        flipped = clearly_other(out, np.tile(pred[todo], m)).reshape(m, todo.size)
        first = np.argmax(flipped, axis=0)
        hit = flipped[first, np.arange(todo.size)]
        done = todo[hit]
        points[done] = cand[first[hit], np.flatnonzero(hit)]
        dist[done] = lp_norm(points[done].astype(np.float64) - origin[done], p)
        todo = todo[~hit]
        k += m
    return points, dist
