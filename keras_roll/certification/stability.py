"""Per-coordinate stability intervals (the paper's Figure 3): `stability_bounds`.

How far each input coordinate can move on its own before the activation
pattern changes: the directional margins along every axis `+-e_k`. The axes
are streamed through the frozen-pattern twin in chunks and reduced to margins
chunk by chunk (`keras_roll.certification.gradient_norms.AxisBounds`), so only
`[b, k, N]` is ever held; `method="bisect"` searches along the 2 D rays on the
twin's forward pass instead. Each batch gives a `StabilityBounds` of its own
that `StabilityBounds.concat` joins.

Example:

```python
sb = keras_roll.stability_bounds(model, x[:1])
width = sb.upper - sb.lower              # how far each pixel may move alone
```
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from keras_roll.certification.bisection import bisect_region
from keras_roll.certification.certificates import StabilityBounds
from keras_roll.certification.gradient_norms import AxisBounds
from keras_roll.certification.margin_math import neuron_arrays
from keras_roll.certification.runs import nonfinite, warn_nonfinite
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.twin import Linearized, linearize
from keras_roll.inputs import ModelOrTwin, read_batches
from keras_roll.options import Method, RunOptions, check_bisect_tol
from keras_roll.rounding.guard import guard_for

__all__ = ["StabilityBounds", "stability_bounds"]

INF = math.inf


def stability_bounds(model: ModelOrTwin, x, method: Method | str | None = "analytic",
                     bisect_tol: float = 1e-4, options: RunOptions | None = None,
                     **overrides) -> StabilityBounds:
    """Per-coordinate stability intervals `[-eps(x, -e_k), +eps(x, +e_k)]`.

    How far each input coordinate can move on its own before the activation
    pattern changes: the directional margins along every axis (the paper's
    Figure 3). Under `rigor="float64"` (the default) or `"strict"` they are
    computed in float64 and shrunk by the rounding guard of `certify` (the
    probabilistic guard's growth term compounds `|A|` through the layers here:
    no gradient norms are known before the axes are streamed).

    Args:
        model: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs, or a stream of batches (see `certify`).
        method: "analytic", or "bisect" (binary search on the twin's forward pass
            along every `+-e_k`: 2 D rays per example, a slow cross-check).
        bisect_tol: relative tolerance of the bisection.
        options: a `keras_roll.RunOptions`, or None.
        **overrides: its fields: `batch_size` (examples per chunk),
            `memory_budget` (bytes of tangents per chunk), `verbose` and `rigor`
            (see `certify`).

    Returns:
        A `StabilityBounds` with `lower`, `upper` shaped like `x` (NaN, with a
        warning, for examples with non-finite neurons or logits).

    Example:

    ```python
    sb = keras_roll.stability_bounds(model, x[:1])
    plt.imshow(np.minimum(sb.upper, -sb.lower)[0, ..., 0])   # stable pixels
    ```
    """
    opts = RunOptions.of(options, caller="stability_bounds", **overrides)
    method = Method.parse(method, default=Method.ANALYTIC)
    bisect_tol = check_bisect_tol(bisect_tol)
    lin = linearize(model)
    guard = guard_for(opts.rigor)
    twin = guard.twin(lin)
    budget = opts.budget(lin.memory_budget)
    parts = []
    batches = read_batches(x, lin.input_spec, batch_size=opts.batch_size)
    with opts.progress(batches.total, "stability bounds") as bar:
        for xb in (batch.x for batch in batches):
            if not twin.num_neurons(xb.shape[1:]):
                parts.append(_free(xb, method, opts))  # no neuron: every coordinate is free
                bar.update(int(xb.shape[0]))
            elif method is Method.ANALYTIC:
                parts.append(_axis_bounds(twin, xb, opts, budget, bar))
            else:
                parts.append(_bisected_bounds(twin, xb, opts, budget, bisect_tol, bar))
    sb = StabilityBounds.concat(parts)
    bad = sb.nonfinite
    warn_nonfinite(int(bad.sum()), bad.size, guard.evaluation(twin), "bounds")
    return sb


def _free(x, method: Method, opts: RunOptions) -> StabilityBounds:
    """Unbounded intervals for a batch of a model without neurons (or no example)."""
    shape = tuple(x.shape)
    return StabilityBounds(np.full(shape, -INF), np.full(shape, INF),
                           np.full(shape, -1, np.int64), np.full(shape, -1, np.int64), method,
                           opts.rigor, np.zeros(shape[0], bool))


def _axis_bounds(twin: Linearized, x, opts: RunOptions, budget: int, bar) -> StabilityBounds:
    """The closed-form intervals of one batch, streamed along the input axes."""
    b_total, d = int(x.shape[0]), int(np.prod(x.shape[1:]))
    upper, lower = np.full((b_total, d), INF), np.full((b_total, d), -INF)
    up_i, lo_i = np.full((b_total, d), -1, np.int64), np.full((b_total, d), -1, np.int64)
    bad = np.zeros(b_total, bool)
    axis_bounds = AxisBounds()
    ref = None
    for sl, fwd, start, k, jvp in twin.iter_axis_chunks(x, batch_size=opts.batch_size,
                                                        memory_budget=budget):
        if start == 0:
            ref, bad[sl] = _reference(twin, fwd, opts, budget)
        m = axis_bounds(jvp.neurons, *ref)
        stop = min(start + k, d)
        w = stop - start
        upper[sl, start:stop], up_i[sl, start:stop] = m.up.numpy()[:, :w], m.up_index.numpy()[:, :w]
        lower[sl, start:stop] = -m.down.numpy()[:, :w]
        lo_i[sl, start:stop] = m.down_index.numpy()[:, :w]
        if stop >= d:
            bar.update(sl.stop - sl.start)
    return _bounds(x, lower, upper, lo_i, up_i, bad, Method.ANALYTIC, opts)


def _reference(twin: Linearized, fwd, opts: RunOptions, budget: int) -> tuple:
    """`(AxisBounds arguments, [b] non-finite flags)` of one example slice: its
    distances and validity, and the rounding guard of a guarded rigor."""
    n = fwd.neurons
    ref = (n.below, n.above, n.valid)
    err = guard_for(opts.rigor).errors(twin, fwd, memory_budget=budget)
    if err is not None:
        e, f, slack = err.terms(scale=np.ones((1, 1, 1)))
        ref = ref + (tf.nest.map_structure(tf.constant, e),
                     tf.nest.map_structure(tf.constant, f), slack)
    return ref, nonfinite(fwd, n.valid.numpy(), None if err is None else err.overflow)


def _bisected_bounds(twin: Linearized, x, opts: RunOptions, budget: int, tol: float,
                     bar) -> StabilityBounds:
    """The intervals of one batch by bisection along the 2 D rays `+-e_k`."""
    b_total, d = int(x.shape[0]), int(np.prod(x.shape[1:]))
    upper, lower = np.full((b_total, d), INF), np.full((b_total, d), -INF)
    up_i, lo_i = np.full((b_total, d), -1, np.int64), np.full((b_total, d), -1, np.int64)
    bad = np.zeros(b_total, bool)
    eye = np.eye(d, dtype=twin.dtype)
    dirs = np.concatenate([eye, -eye]).reshape(2 * d, *x.shape[1:])
    # Examples per batch of rays: 2 D float64 rays of D entries each.
    plan = plan_chunks(b_total, 1, 8 * 2 * d * d, budget, opts.batch_size, max_examples=None)
    for sl in plan.example_slices():
        b = sl.stop - sl.start
        fwd = twin.forward(x[sl])
        _, _, valid, piece = neuron_arrays(fwd)
        bad[sl] = nonfinite(fwd, valid)
        base = np.repeat(np.arange(b), 2 * d)
        rays = np.broadcast_to(dirs[None], (b, *dirs.shape)).reshape(b * 2 * d, *dirs.shape[1:])
        t, j = bisect_region(twin, x[sl], base, rays, piece, valid, tol, budget)
        t, j = t.reshape(b, 2 * d), j.reshape(b, 2 * d)
        upper[sl], up_i[sl] = t[:, :d], j[:, :d]
        lower[sl], lo_i[sl] = -t[:, d:], j[:, d:]
        bar.update(b)
    return _bounds(x, lower, upper, lo_i, up_i, bad, Method.BISECT, opts)


def _bounds(x, lower, upper, lo_i, up_i, bad, method: Method,
            opts: RunOptions) -> StabilityBounds:
    """The `StabilityBounds` of one batch from its flat arrays (NaN where `bad`)."""
    upper[bad], lower[bad], up_i[bad], lo_i[bad] = np.nan, np.nan, -1, -1
    shape = tuple(x.shape)
    return StabilityBounds(lower.reshape(shape), upper.reshape(shape), lo_i.reshape(shape),
                           up_i.reshape(shape), method, opts.rigor, bad)
