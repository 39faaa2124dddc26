"""Integrated gradients, exact for piecewise-linear networks.

Integrated gradients (Sundararajan, Taly & Yan, ICML 2017) attribute
`f(x) - f(x0)` to the input coordinates:

    IG(x) = (x - x0) * integral_0^1 grad f(x0 + t (x - x0)) dt.

For a piecewise-linear network the gradient is constant inside each linear
region, so the integral is a finite sum: walk the straight path from the baseline
`x0` to `x` region by region; in each region the directional margin along
`d = x - x0` (the frozen-pattern twin's JVP along `d` with
`keras_roll.certification.margins.directional_margins`) says where the path leaves it. The
result is exact up to round-off, its attributions sum to `f(x) - f(x0)`
(completeness), and the walk reports how many regions the path crosses.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import tensorflow as tf

from keras_roll.certification.margins import directional_margins
from keras_roll.evaluate.gradients import (
    LogitGradients,
    check_count,
    check_inputs,
    check_labels,
    label_classes,
)
from keras_roll.options import check_verbose, fixed_budget, progress_bar

__all__ = ["IntegratedGradients", "integrated_gradients"]

DEFAULT_MAX_REGIONS = 100_000
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAX_SHRINKS = 200  # halvings of the probe step before giving up on one region


@dataclasses.dataclass(repr=False)
class IntegratedGradients:
    """Integrated-gradient attributions of a batch.

    Attributes:
        attributions: `[B, *input_shape]` float64 attributions.
        regions: `[B]` int, linear regions crossed by the path (exact method),
            None for a Riemann sum.
        delta: `[B]` completeness gap `sum(attributions) - (f(x) - f(baseline))`.
        f_x: `[B]` the label logit at `x`.
        f_baseline: `[B]` the label logit at the baseline.
        labels: `[B]` the class whose logit was attributed.
        method: "exact" or "riemann".
        steps: the number of Riemann points, or None.
    """

    attributions: np.ndarray
    regions: np.ndarray | None
    delta: np.ndarray
    f_x: np.ndarray
    f_baseline: np.ndarray
    labels: np.ndarray
    method: str
    steps: int | None = None

    def __repr__(self) -> str:
        n = self.attributions.shape[0]
        extra = (f", median_regions={float(np.median(self.regions)):g}"
                 if self.regions is not None and n else "")
        gap = float(np.max(np.abs(self.delta))) if n else 0.0
        return (f"IntegratedGradients(n={n}, method={self.method!r}{extra}, "
                f"max_abs_delta={gap:.3g})")


def integrated_gradients(model, x, y=None, baseline=None, steps: int | None = None,
                         max_regions: int = DEFAULT_MAX_REGIONS,
                         memory_budget: int | None = None,
                         verbose="auto") -> IntegratedGradients:
    """Integrated gradients of the label logit, exact by default.

    * `steps=None`: the **exact** integral. The straight path from the
      baseline to `x` is walked region by region: at the current point `t` of
      the path, a probe a tiny step further (shrunk until its linear region
      reaches back to `t`, so paths that start on or run along a region
      boundary are handled) fixes the gradient of the next open segment, and
      its directional margins along the path say where that segment ends.
      Regions thinner than about 64 machine epsilons of the path are merged
      into their neighbour. Work in float64 (a float64 model) for
      completeness to ~1e-12; float32 models give ~1e-5.
    * `steps=k`: the usual right Riemann sum over the `k` points
      `x0 + (i / k) (x - x0)`, `i = 1..k`; it converges to the exact integral.

    The logit is the model output before a final softmax / sigmoid.

    Args:
        model: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs.
        y: `[B]` integer labels; None for the predicted class.
        baseline: `[*input_shape]` or `[B, *input_shape]`; None for zeros.
        steps: None (exact) or a positive number of Riemann points.
        max_regions: the most regions one path may cross before the walk stops
            with an error (a safeguard against runaway walks).
        memory_budget: bytes of live tensors per compiled chunk.
        verbose: "auto" (a progress bar for walks longer than a second), True or False.

    Returns:
        An `IntegratedGradients`.

    Raises:
        ValueError: naming the argument, for bad inputs, labels or baselines.
        RuntimeError: when a path crosses more than `max_regions` regions.

    Example:

    ```python
    ig = keras_roll.integrated_gradients(model, x, y)           # exact
    ig.attributions.sum(axis=(1, 2, 3)) - (ig.f_x - ig.f_baseline)   # ~0
    ig.regions                                                  # regions crossed
    approx = keras_roll.integrated_gradients(model, x, y, steps=50)
    ```
    """
    check_verbose(verbose)
    budget = fixed_budget(memory_budget)
    if steps is not None:
        steps = check_count(steps, "steps")
    max_regions = check_count(max_regions, "max_regions")
    engine = LogitGradients.of(model)
    lin = engine.lin
    x = check_inputs(lin, x, "x")
    n = x.shape[0]
    base = _check_baseline(lin, baseline, x)
    _, logits_x = engine.gradients(x, np.zeros(n, np.int32), np.ones(n), budget)
    index, sign = check_labels(y, n, engine.num_logits(x.shape[1:]), lin.output_link,
                               default_logits=logits_x)
    _, logits_b = engine.gradients(base, np.zeros(n, np.int32), np.ones(n), budget)
    rows = np.arange(n)
    f_x = sign * logits_x.astype(np.float64)[rows, index]
    f_b = sign * logits_b.astype(np.float64)[rows, index]
    with progress_bar(n, verbose, "integrated gradients") as bar:
        if steps is None:
            attr, regions = _exact(engine, x, base, index, sign, max_regions, budget, bar)
        else:
            attr, regions = _riemann(engine, x, base, index, sign, steps, budget, bar), None
    delta = attr.reshape(n, int(np.prod(x.shape[1:]))).sum(axis=1) - (f_x - f_b)
    labels = label_classes(index, sign, logits_x.shape[1], lin.output_link)
    return IntegratedGradients(attributions=attr, regions=regions, delta=delta, f_x=f_x,
                               f_baseline=f_b, labels=labels,
                               method="exact" if steps is None else "riemann", steps=steps)


def _check_baseline(lin, baseline, x):
    if baseline is None:
        return np.zeros_like(x)
    try:
        arr = np.asarray(baseline.numpy() if tf.is_tensor(baseline) else baseline)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"baseline could not be read as an array: {e}") from None
    if arr.shape == x.shape[1:]:
        arr = np.broadcast_to(arr, x.shape)
    elif arr.shape != x.shape:
        raise ValueError(f"baseline must be shaped like one example {x.shape[1:]} or like "
                         f"x {x.shape}, got shape {arr.shape}.")
    return check_inputs(lin, arr, "baseline")


def _riemann(engine, x, base, index, sign, steps, budget, bar):
    n = x.shape[0]
    ex_shape = x.shape[1:]
    x64, b64 = x.astype(np.float64), base.astype(np.float64)
    total = np.zeros((n, *ex_shape))
    chunk = engine.chunk_size(ex_shape, budget, total=n * steps)
    flat = n * steps
    for f0 in range(0, flat, chunk):
        f = np.arange(f0, min(flat, f0 + chunk))
        e, i = f // steps, f % steps + 1
        alpha = (i / steps).reshape(-1, *([1] * len(ex_shape)))
        pts = (b64[e] + alpha * (x64[e] - b64[e])).astype(x.dtype)
        grad, _ = engine.gradients(pts, index[e], sign[e], budget)
        np.add.at(total, e, grad.astype(np.float64))
        bar.update(int(np.sum(i == steps)))  # examples whose last point is done
    return (x64 - b64) * total / steps


def _probe_fn(engine: LogitGradients):
    """Compiled probe: margins forward / backward along the path, and the gradient."""
    fn = _PROBES.get(engine)
    if fn is None:
        lin = engine.lin

        def probe(pts, d, index, sign):
            grad, _, neurons = engine.select(pts, index, sign)
            rates = lin.jvp(pts, d).neurons  # [a, 1, N]
            both = tf.concat([rates, -rates], axis=1)
            eps, _ = directional_margins(both, neurons.below, neurons.above, neurons.valid)
            pattern = tf.where(neurons.valid, neurons.piece, -tf.ones_like(neurons.piece))
            return eps, grad, pattern

        fn = _PROBES[engine] = tf.function(probe, reduce_retracing=True, autograph=False)
    return fn


def _exact(engine, x, base, index, sign, max_regions, budget, bar):
    lin = engine.lin
    n = x.shape[0]
    ex_shape = x.shape[1:]
    dtype = np.dtype(lin.dtype)
    eps_f = float(np.finfo(dtype).eps)
    tol = 64 * eps_f  # path-parameter slivers thinner than this are merged
    tau0 = float(np.sqrt(eps_f))  # first probe step beyond the current point
    d = int(np.prod(ex_shape))
    b64 = base.reshape(n, d).astype(np.float64)
    d64 = x.reshape(n, d).astype(np.float64) - b64
    d_model = d64.astype(dtype).reshape(n, 1, *ex_shape)
    attr = np.zeros_like(d64)
    regions = np.zeros(n, np.int64)
    segments = np.zeros(n, np.int64)
    shrinks = np.zeros(n, np.int64)
    t = np.zeros(n)
    s = np.full(n, min(tau0, 0.5))
    chunk = engine.chunk_size(ex_shape, budget, total=n, scale=2.0)  # + the JVP
    active = np.arange(n)
    probe = _probe_fn(engine)
    last = [None] * n  # pattern key of the last segment of every path
    while active.size:
        for c0 in range(0, active.size, chunk):
            act = active[c0:c0 + chunk]
            pts = (b64[act] + s[act, None] * d64[act]).astype(dtype).reshape(-1, *ex_shape)
            eps, grad, pattern = probe(tf.constant(pts), tf.constant(d_model[act]),
                                       tf.constant(index[act]),
                                       tf.constant(sign[act].astype(dtype)))
            eps = eps.numpy().astype(np.float64)
            forward, backward = eps[:, 0], eps[:, 1]
            start = s[act] - backward
            ok = start <= t[act] + tol
            acc = act[ok]
            if acc.size:
                grad = grad.numpy()[ok]
                end = np.minimum(1.0, s[acc] + forward[ok])
                end = np.where(end >= 1.0 - tol, 1.0, end)
                attr[acc] += grad.reshape(acc.size, d) * d64[acc] * (end - t[acc])[:, None]
                # A segment with the pattern of the previous one is the same region (its
                # end was found a little early by round-off): count it once.
                keys = [hash(row.tobytes()) for row in pattern.numpy()[ok]]
                for e, key in zip(acc, keys):
                    if key != last[e]:
                        regions[e] += 1
                        last[e] = key
                t[acc] = end
                shrinks[acc] = 0
                s[acc] = t[acc] + np.minimum(tau0, (1.0 - t[acc]) / 2)
                segments[acc] += 1
                over = acc[(segments[acc] >= max_regions) & (t[acc] < 1.0)]
                if over.size:
                    raise RuntimeError(
                        f"The path from the baseline to example {int(over[0])} crossed "
                        f"{max_regions} linear regions and reached only t={t[over[0]]:.6g} "
                        f"of 1; raise max_regions, or use steps=k for a Riemann sum."
                    )
                finished = int(np.sum(t[acc] >= 1.0))
                if finished:
                    bar.update(finished)
            bad = act[~ok]
            if bad.size:  # the probe's region starts after t: probe closer to t
                shrinks[bad] += 1
                if np.any(shrinks[bad] > _MAX_SHRINKS):
                    e = int(bad[np.argmax(shrinks[bad])])
                    raise RuntimeError(
                        f"Could not find the linear region after t={t[e]:.17g} on the path "
                        f"of example {e} after {_MAX_SHRINKS} halvings of the probe step; "
                        f"use steps=k for a Riemann sum."
                    )
                s[bad] = t[bad] + (start[~ok] - t[bad]) / 2
        active = active[t[active] < 1.0]
    return attr.reshape(n, *ex_shape), regions
