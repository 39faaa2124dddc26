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

import numpy as np
import tensorflow as tf

from keras_roll.evaluate.gradients import (
    LogitGradients,
    check_count,
    check_inputs,
    check_labels,
    label_classes,
)
from keras_roll.evaluate.path_walk import exact_walk
from keras_roll.options import check_verbose, fixed_budget, progress_bar

__all__ = ["IntegratedGradients", "integrated_gradients"]

DEFAULT_MAX_REGIONS = 100_000


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
            attr, regions = exact_walk(engine, x, base, index, sign, max_regions, budget, bar)
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
