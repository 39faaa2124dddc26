"""Gradient norms and rounding guards of a batch: float32 speed, float64 where it decides.

An lp margin is `min_j ratio_j` with `ratio_j = max(0, dist_j - E_j) /
(||g_j||_q (1 + s) + F_j)` (docs/design.md, "The rounding bound"). Only the
neurons that can attain the minimum need exact gradient norms; every other one
needs only a rigorous upper bound on its norm, which keeps its ratio above the
minimum. So under the default guard (`Rigor.FLOAT64`) a batch is certified as:

1. the float64 forward pass and the guard's terms at `x` (`E_j`);
2. examples where some neuron has `dist_j <= E_j` certify 0 whatever the
   gradients: the first such neuron with a nonzero gradient (its exact norms
   from `rounding.exact_norms`) binds, and no tangent pass runs;
3. the others: a float32 tangent pass over all input axes with the float64
   pattern and a rigorous bound on its own rounding (`tangent_error`), which
   brackets every `||g_j||_q`; the guard's growth terms `F_j` from the upper
   brackets; every neuron whose lowest possible ratio is not above the
   smallest highest possible ratio is a *candidate*, and gets exact float64
   norms (reverse mode through the float64 twin, a few directions each);
4. an example with too many candidates, or whose float32 pass overflowed,
   gets the float64 pass of every neuron (as every rigor "strict" batch does,
   and every model with fewer than `MIN_AXES` input axes or an op whose
   tangents cannot be bounded).

The radii and binding neurons are those of the float64 pass: the candidates
contain every neuron that can bind, and their norms are exact. The norms
yielded are exact (float64) for candidates and rigorous upper bounds for the
rest, 0 for a neuron that cannot bind in a zero-radius example.

Example:

```python
for sl, fwd, gn, err in guarded_norms(twin, x, None, budget, Rigor.FLOAT64):
    eps, j = margins_from_norms(dist, gn.dual(2), valid, *err.terms())
```
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import tensorflow as tf

from keras_roll.certification.gradient_norms import GradNorms, iter_gradient_norms
from keras_roll.certification.margin_math import neuron_arrays, neuron_distances
from keras_roll.compile.chunking import plan_chunks
from keras_roll.options import parse_norm
from keras_roll.rounding.exact_norms import exact_norms
from keras_roll.rounding.guard import Float64Guard, RoundingErrors, guard_for
from keras_roll.rounding.tangent_error import (
    SLICE_EXAMPLES,
    Norms,
    UnsupportedTangentBound,
    tangent_budget,
    tangent_norms,
)

__all__ = ["MAX_CANDIDATES", "MIN_AXES", "guarded_norms"]

MAX_CANDIDATES = 64  # candidates per example above which its float64 pass is cheaper
MIN_AXES = 128  # fewer input axes: the float64 pass costs less than the extra passes
ZERO_PROBES = 4  # neurons within the guard tried per example for a nonzero gradient
_FLOAT64_ONLY: weakref.WeakSet = weakref.WeakSet()  # twins whose tangents cannot be bounded


def guarded_norms(twin, x, batch_size, memory_budget, rigor, norms=(1, 2, math.inf)):
    """Yields `(example_slice, forward_pass, GradNorms, RoundingErrors or None)`.

    Under `Rigor.FLOAT64` as in the module docstring; under the other rigors
    the float64 (or float32, unguarded) pass of every neuron. Without l1 among
    `norms`, the float32 pass skips `max_k |g_jk|` (its dual norm) and
    `GradNorms.linf` holds it only where it is exact (candidates, zero radii),
    +inf elsewhere.

    Args:
        twin: the twin of the rigor (`guard_for(rigor).twin(lin)`).
        x: `[B, *input_shape]` checked inputs.
        batch_size: examples per slice (default from the memory budget).
        memory_budget: bytes of tangents per chunk (default the twin's, or under
            "auto" the float32 pass's timed choice, `tangent_budget`).
        rigor: the `Rigor`.
        norms: the lp norms the caller's margins use.
    """
    guard = guard_for(rigor)
    budget = int(memory_budget or twin.memory_budget)
    small = int(np.prod(tuple(x.shape[1:]))) < MIN_AXES
    if not isinstance(guard, Float64Guard) or small or twin in _FLOAT64_ONLY:
        # memory_budget as given: None lets an "auto" twin time its chunks
        for sl, fwd, gn in iter_gradient_norms(twin, x, batch_size, memory_budget):
            yield sl, fwd, gn, guard.errors(twin, fwd, l1=gn.l1, memory_budget=budget)
        return
    x = twin.check_input(x, keep_float=True)
    with_max = 1 in tuple(parse_norm(p) for p in norms)
    budget = int(memory_budget or tangent_budget(twin, x, batch_size, with_max))
    layout = twin.layout(x.shape[1:])
    plan = plan_chunks(int(x.shape[0]), layout.input_size, layout.tangent_bytes(4), budget,
                       batch_size, max_examples=SLICE_EXAMPLES)
    for sl in plan.example_slices():
        fwd = twin.compiled.primal(tf.cast(x[sl], twin.dtype))
        try:
            gn, err = _slice(guard, twin, x[sl], fwd, budget, with_max)
        except UnsupportedTangentBound:
            _FLOAT64_ONLY.add(twin)
            yield from guarded_norms(twin, x[sl.start:], batch_size, memory_budget, rigor,
                                     norms)
            return
        yield sl, fwd, gn, err


def _slice(guard, twin, xs, fwd, budget, with_max):
    """`(GradNorms, RoundingErrors)` of one example slice (steps 1-4 of the module
    docstring)."""
    below, above, valid, _ = neuron_arrays(fwd)
    dist = neuron_distances(below, above)
    at_x = guard.at_x(twin, fwd, budget)
    b, n = dist.shape
    norms = Norms(*(np.zeros((b, n)) for _ in range(3)))
    zero = _zero_radius(twin, fwd, dist, valid, at_x.smallest_at_x(), norms, budget)
    rest = np.flatnonzero(~zero)
    l1 = np.full((b, n), np.inf)
    tn = fwd_rest = None
    if rest.size:
        fwd_rest = fwd if rest.size == b else twin.compiled.primal(
            tf.cast(tf.gather(xs, rest), twin.dtype))
        tn = tangent_norms(twin, fwd_rest, budget, with_max)
        l1[rest] = tn.upper.l1
    err = guard.errors(twin, fwd, l1=np.where(np.isfinite(l1), l1, np.inf),
                       memory_budget=budget, at_x=at_x)
    if rest.size:
        full = _decide(twin, fwd_rest, tn, dist[rest], valid[rest], err, rest, norms, budget)
        if full.size:
            _float64_norms(twin, xs, full, norms, budget)
    return GradNorms(norms.l2, norms.linf, norms.l1), err


def _zero_radius(twin, fwd, dist, valid, e_min, norms: Norms, budget) -> np.ndarray:
    """`[b]` examples whose radius is 0 whatever the gradients: a neuron with
    `dist <= E` (every guard alternative) and a nonzero gradient, the first such
    in row order (the one the margin formulas pick), gets its exact norms in
    `norms`; the other neurons keep 0 (they cannot bind before it)."""
    inside = valid & (dist <= e_min)
    b = dist.shape[0]
    zero = np.zeros(b, bool)
    if not inside.any():
        return zero
    rows = np.full((b, ZERO_PROBES), -1, np.int64)
    for e in np.flatnonzero(inside.any(axis=1)):
        first = np.flatnonzero(inside[e])[:ZERO_PROBES]
        rows[e, :first.size] = first
    ex = exact_norms(twin, fwd, rows, budget)
    for e in np.flatnonzero(rows[:, 0] >= 0):
        hit = np.flatnonzero((rows[e] >= 0) & (ex.l1[e] > 0))
        if hit.size:  # all rows before it have a zero gradient: they never bind
            j, c = rows[e, hit[0]], hit[0]
            for out, val in zip(norms, ex):
                out[e, j] = val[e, c]
            zero[e] = True
    return zero


def _ratios(dist, valid, g, err_e, err_f, slack):
    """`[b, N]` ratio of every neuron for gradient norms `g` (the largest over guard
    alternatives; inf where `g == 0` or the neuron is not valid)."""
    out = None
    for e, f in zip(err_e, err_f):
        den = g * (1.0 + slack) + f
        ok = valid & (g > 0)
        r = np.where(ok, np.maximum(dist - e, 0.0) / np.where(ok, den, 1.0), np.inf)
        out = r if out is None else np.maximum(out, r)
    return out


def _decide(twin, fwd, tn, dist, valid, err: RoundingErrors, rest, norms: Norms, budget):
    """Fills `norms` for the examples `rest`: exact for the candidates, upper bounds
    for the others. Returns the positions (in the slice) that need the float64 pass."""
    e_alt, f_alt, slack = err.terms(rows=rest)
    e_alt = e_alt if isinstance(e_alt, list) else [e_alt]
    f_alt = f_alt if isinstance(f_alt, list) else [f_alt]
    upper, lower = tn.upper, tn.lower
    cand = np.zeros(dist.shape, bool)
    for hi, lo in zip(upper, lower):  # l2, linf, l1: the dual norms of l2, l1, l_inf
        if hi is None:  # not computed: no margin uses it
            continue
        worst = _ratios(dist, valid, hi, e_alt, f_alt, slack)  # smallest possible ratio
        best = _ratios(dist, valid, lo, e_alt, f_alt, slack)  # largest possible ratio
        cand |= valid & (worst <= best.min(axis=1, keepdims=True))
    counts = cand.sum(axis=1)
    limit = min(MAX_CANDIDATES, max(1, dist.shape[1]))
    full = ~tn.finite | (counts > limit)
    for out, hi in zip(norms, upper):
        out[rest] = np.inf if hi is None else hi
    c = int(counts[~full].max(initial=0))
    if c:
        rows = np.full((rest.size, c), -1, np.int64)
        for i in np.flatnonzero(~full):
            picked = np.flatnonzero(cand[i])
            rows[i, :picked.size] = picked
        ex = exact_norms(twin, fwd, rows, budget)
        for i in np.flatnonzero(~full):
            k = int(counts[i])
            for out, val in zip(norms, ex):
                out[rest[i], rows[i, :k]] = val[i, :k]
        _add_reverse_error(err, rest, rows, full)
    return rest[full]


def _add_reverse_error(err: RoundingErrors, rest, rows, full) -> None:
    """The candidates' norms come from reverse mode: add the twin's rigorous bound on
    its error (`exact_per_radius`, counted for reverse mode) to the worst-case guard
    alternative, which bounds the forward-mode error only."""
    if err.strict_per_radius is None or err.exact_per_radius is None:
        return
    for i in np.flatnonzero(~full):
        r = rows[i][rows[i] >= 0]
        e = rest[i]
        err.strict_per_radius[e, r] += 2.0 * err.exact_per_radius[e, r]


def _float64_norms(twin, xs, where, norms: Norms, budget) -> None:
    """The float64 pass of every neuron for the examples `where` of the slice."""
    sub = tf.gather(xs, where)
    for sl, _, gn in iter_gradient_norms(twin, sub, None, budget):
        for out, val in zip(norms, (gn.l2, gn.linf, gn.l1)):
            out[where[sl]] = val
