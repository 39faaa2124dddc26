"""The attack's runs and the checks of their points, shared by the attack's stages.

`Runner` runs the compiled loop of `keras_roll.robust.attack_loop` (one graph for
every norm and batch size) on rows of one batch and returns only checked points:
each is moved to the first clear flip along the norm's own shrinking of its
perturbation (bisected in the loop's graph; `bisect_to_flip` where that point does
not hold), checked in the Keras model in its own dtype
(`keras_roll.robust.adversarial.clearly_other`) and inside the domain. It counts the
steps the loop ran per input (`Runner.taken`) and knows which inputs' brackets are
still open (`Runner.open_rows`).
`ExampleNoise` draws the restarts' noise from one generator per example, so an
example gets the same points whatever batch or replica it is attacked in.

Example:

```python
lo, hi = domain_arrays((0.0, 1.0), x)
runner = Runner(model, x, pred, np.inf, lo, hi, AttackOptions())
pts, dist = runner.run(np.arange(len(x)), np.zeros_like(x), np.zeros(len(x)),
                       np.full(len(x), -1), 100, False)
```
"""

from __future__ import annotations

import zlib

import numpy as np
import tensorflow as tf

from keras_roll.compile.caches import cached
from keras_roll.geometry import norm_code
from keras_roll.robust.adversarial import (
    START_GAP,
    clearly_other,
    confirm,
    lp_norm,
    model_outputs,
)
from keras_roll.robust.attack_loop import BISECTIONS, compiled_loop, shrunk

__all__ = ["ExampleNoise", "Runner", "bisect_to_flip", "checked_points", "domain_arrays",
           "in_domain", "pad_rows", "start_list", "valid_starts"]

PROBE_STEP = 0.3  # the probes' first step, as a share of AttackOptions.step_size
# Relative pushes of the graph's bisected share `t`, tried in one model call: the graph
# and the check evaluate the model in batches of other sizes (FLIP_GAP's rounding).
GRAPH_PUSHES = (0.0, 2.0**-20, 2.0**-16, 2.0**-12)


def in_domain(points, lo, hi):
    b = points.shape[0]
    ok = (points >= lo) & (points <= hi)
    return np.all(ok.reshape(b, -1), axis=1)


def bisect_to_flip(model, x, delta, pred, p):
    """The smallest `t` in `(0, 1]` found by bisection with `x + shrunk(delta, t)`
    clearly adversarial (`t = 1` is); returns the points (model dtype)."""
    dtype = np.dtype(model.inputs[0].dtype)
    lo, hi = np.zeros(x.shape[0]), np.ones(x.shape[0])
    for _ in range(BISECTIONS):
        mid = 0.5 * (lo + hi)
        pts = (x + shrunk(delta, mid, p).numpy()).astype(dtype)
        flip = clearly_other(model_outputs(model, pts), pred)
        hi, lo = np.where(flip, mid, hi), np.where(flip, lo, mid)
    return (x + shrunk(delta, hi, p).numpy()).astype(dtype)


def pad_rows(a, n):
    return np.concatenate([a, np.repeat(a[-1:], n - a.shape[0], axis=0)]) if n > a.shape[0] \
        else a


def domain_arrays(domain, x):
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
    outside = ~in_domain(x, lo, hi)
    if outside.any():
        raise ValueError(f"{int(outside.sum())} of {x.shape[0]} inputs lie outside "
                         f"domain={domain!r} (first: row {int(np.argmax(outside))}); pass "
                         f"inputs inside the domain, or a wider domain.")
    return lo, hi


def start_list(start, shape) -> list:
    """`start` as a list of `[B, *input_shape]` float64 arrays: None gives none, one
    array of the input's shape one, a sequence of them (or an array with one more
    leading axis) each."""
    if start is None:
        return []
    if isinstance(start, np.ndarray) and start.shape == shape:
        return [np.asarray(start, np.float64)]
    starts = [np.asarray(s, np.float64) for s in start]
    bad = [s.shape for s in starts if s.shape != shape]
    if bad:
        raise ValueError(f"start must be None, an array of the inputs' shape {shape} or a "
                         f"sequence of such arrays, got one of shape {bad[0]}; pass one "
                         f"row per input (NaN rows where there is no point).")
    return starts


def valid_starts(model, x, start, pred, p, lo, hi):
    """`[(rows, points, distances)]` per known start: its rows that are finite, inside
    the domain and clearly classified as another class than `pred` (by `START_GAP`:
    the points of an earlier check, in an evaluation of another batch size, pass)."""
    b = x.shape[0]
    dtype = np.dtype(model.inputs[0].dtype)
    out = []
    for s in start_list(start, x.shape):
        ok = np.all(np.isfinite(s.reshape(b, -1)), axis=1) & in_domain(s, lo, hi)
        idx = np.flatnonzero(ok)
        if idx.size:
            idx = idx[clearly_other(model_outputs(model, s[idx].astype(dtype)), pred[idx],
                                    START_GAP)]
        pts = s[idx].astype(dtype).astype(np.float64)
        out.append((idx, pts, lp_norm(pts - x[idx], p)))
    return out


class ExampleNoise:
    """Uniform noise in [-1, 1] drawn from one generator per example, seeded by the
    seed and the example's own values: an example gets the same noise whatever batch
    (or replica) it is attacked in."""

    def __init__(self, x: np.ndarray, seed: int):
        self.rngs = [np.random.default_rng([seed, zlib.crc32(np.ascontiguousarray(row))])
                     for row in x]

    def __call__(self, idx, shape) -> np.ndarray:
        return np.stack([self.rngs[i].uniform(-1.0, 1.0, shape[1:]) for i in idx]) \
            if len(idx) else np.zeros(shape)


class Runner:
    """The compiled loop on rows of one batch: `run` returns checked points."""

    def __init__(self, model, x, pred, p, lo, hi, options):
        self.model, self.x, self.pred, self.p = model, x, pred, p
        self.lo, self.hi, self.options = lo, hi, options
        self.dtype = np.dtype(model.inputs[0].dtype)
        self.box = tf.constant(lo.astype(self.dtype)), tf.constant(hi.astype(self.dtype))
        self.taken = np.zeros(x.shape[0], np.int64)  # steps the loop ran per input
        self.lower, self.tol = np.zeros(x.shape[0]), 0.0  # certified radii, bracket tolerance

    def open_rows(self, best_norm):
        """The rows whose bracket is still open: no point yet, or `best_norm - lower >
        tol * best_norm` (the attack has something left to gain there)."""
        closed = np.isfinite(best_norm) & (best_norm - self.lower <= self.tol * best_norm)
        return np.flatnonzero(~closed)

    def run(self, idx, d0, eps0, target, steps, fixed, smooth=False, scale=(1.0, 1.0)):
        """`(points, distances)` of rows `idx` (NaN where none) from `x + d0` (`scale`:
        factors of the options' step size and gamma); adds the steps run to `taken`."""
        fn = cached(self.model, ("minimal_norm_attack",),
                    lambda: compiled_loop(self.model))

        def arg(a, dtype):
            return tf.constant(np.asarray(a).astype(dtype))

        x = self.x[idx]
        d0 = d0.astype(self.dtype).astype(np.float64)
        n = idx.size
        out_d, out_n, out_t, taken = fn(
            arg(x, self.dtype), arg(d0, self.dtype), arg(np.broadcast_to(eps0, n), np.float32),
            arg(self.pred[idx], np.int64), arg(target, np.int64), *self.box,
            arg(np.broadcast_to(steps, n), np.int32),
            tf.constant(self.options.step_size * scale[0] * (PROBE_STEP if fixed else 1.0)),
            tf.constant(float(self.options.gamma * scale[1])),
            arg(np.broadcast_to(fixed, n), bool), tf.constant(smooth),
            tf.constant(norm_code(self.p)))
        np.add.at(self.taken, idx, np.asarray(taken, np.int64))
        out_d = np.asarray(out_d, np.float64)
        found = np.flatnonzero(np.isfinite(np.asarray(out_n)))
        pts = np.full(x.shape, np.nan)
        dist = np.full(n, np.nan)
        if found.size:
            pts[found] = checked_points(self.model, x[found], out_d[found],
                                        self.pred[idx[found]], self.p, self.lo, self.hi,
                                        np.asarray(out_t, np.float64)[found])
            dist[found] = lp_norm(pts[found] - x[found], self.p)
        return pts, dist


def checked_points(model, x, delta, pred, p, lo, hi, t=None):
    """The points `x + delta` moved to the first clear flip along the segment from `x`,
    checked in the model and the domain; NaN rows where none holds. `t` (`[B]`, from
    the loop's bisection in its graph): the first clear flip is taken at `shrunk(delta,
    t)` or a push beyond it (`GRAPH_PUSHES`), checked here in one model call; the rows
    where none of them holds are bisected here."""
    out = np.full(x.shape, np.nan)
    todo = np.arange(x.shape[0])
    if t is not None:
        got = _graph_flips(model, x, delta, pred, p, lo, hi, t)
        ok = np.all(np.isfinite(got.reshape(x.shape[0], -1)), axis=1)
        out[ok], todo = got[ok], todo[~ok]
    if todo.size:
        out[todo] = _bisected_points(model, x[todo], delta[todo], pred[todo], p, lo, hi)
    return out


def _graph_flips(model, x, delta, pred, p, lo, hi, t):
    """The first of `x + shrunk(delta, t (1 + c))`, `c` in `GRAPH_PUSHES`, that is
    clearly adversarial in the model and in the domain (NaN rows where none is)."""
    dtype = np.dtype(model.inputs[0].dtype)
    m, b = len(GRAPH_PUSHES), x.shape[0]
    cand = np.stack([(x + shrunk(delta, np.minimum(t * (1.0 + c), 1.0), p).numpy()).astype(dtype)
                     for c in GRAPH_PUSHES])  # [m, b, *input_shape]
    flat = cand.reshape(m * b, *x.shape[1:])
    ok = clearly_other(model_outputs(model, flat), np.tile(pred, m)) \
        & in_domain(flat.astype(np.float64), np.broadcast_to(lo, x.shape[1:]),
                    np.broadcast_to(hi, x.shape[1:]))
    ok = ok.reshape(m, b)
    first = np.argmax(ok, axis=0)
    out = np.full(x.shape, np.nan)
    hit = np.flatnonzero(ok[first, np.arange(b)])
    out[hit] = cand[first[hit], hit]
    return out


def _bisected_points(model, x, delta, pred, p, lo, hi):
    """`checked_points` by bisection in numpy (one model call per halving)."""
    dtype = np.dtype(model.inputs[0].dtype)
    pts = (x + delta).astype(dtype)
    flip = clearly_other(model_outputs(model, pts), pred)
    if not flip.all():  # rounded back in another batch: push a little further
        bad = np.flatnonzero(~flip)
        pushed, dist = confirm(model, x[bad], delta[bad], np.ones(bad.size), pred[bad], p)
        ok = np.isfinite(dist) & in_domain(np.nan_to_num(pushed.astype(np.float64)), lo, hi)
        pts[bad[ok]] = pushed[ok]
        flip[bad[ok]] = True
    out = np.full(x.shape, np.nan)
    idx = np.flatnonzero(flip)
    if idx.size:
        seg = pts[idx].astype(np.float64) - x[idx]
        final = bisect_to_flip(model, x[idx], seg, pred[idx], p)
        keep = clearly_other(model_outputs(model, final), pred[idx]) \
            & in_domain(final.astype(np.float64), lo, hi)
        out[idx[keep]] = final[keep]
    return out
