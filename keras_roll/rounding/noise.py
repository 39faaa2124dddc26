"""The probabilistic rounding guard of `rigor="float64"` (the default of certificates).

The worst-case bound of `keras_roll.rounding.worst_case` (`rigor="strict"`) assumes every
rounding error has the worst sign and compounds magnitudes through `|W|`; on
float32 networks of thousands of neurons it exceeds the distance of some
neuron of almost every input and certifies 0. This module bounds the model's
own evaluation the way it actually errs, in the probabilistic model of
rounding (Higham & Mary, "A New Approach to Probabilistic Rounding Error
Analysis", SIAM J. Sci. Comput. 41(5), 2019: the relative errors of the
roundings are independent, mean zero and bounded by `u`):

* **Local errors.** An op output `(l, k)` evaluated with `n` roundings in unit
  roundoff `u` (its compute dtype: mixed precision, TF32 included) from
  inputs `a` has an error that is a sum of independent terms whose squared
  bounds add up to at most `e_lk^2`, `e_lk = c_l (|A| |a(x')| + |b|)_k`
  (`EvaluationPrecision.noise_unit`: `c = sqrt(n) u`), with the *actual*
  magnitudes of the inputs at `x'` (the op's `RoundingRule.magnitude` applied
  to `|a(x)|`), not magnitudes compounded through `|W|`. Inside a certified
  ball every neuron keeps its piece, so `|a(x')| <= |a(x)| + r p`,
  `r = ||x' - x||_inf`, where `p` bounds `||grad a||_1`: 1 at the input,
  `|A| p` through an op, and `|slope| ||g_j||_1` at a neuron whose gradient
  norm is known (`l1=`); hence `e_lk <= e0_lk + r e1_lk`.
* **Propagation.** The error of neuron `j` is `sum_lk J_j<-lk delta_lk` with
  the frozen-pattern Jacobian `J` (signed, not `|J|`), so by Hoeffding's
  inequality `|error_j| <= lambda sqrt(V_j(r))` with probability at least
  `1 - 2 exp(-lambda^2 / 2)`, `V_j(r) = sum_lk J^2 (e0 + r e1)^2`, and
  `sqrt(V_j(r)) <= sigma0_j + r sigma1_j` (Minkowski) with
  `sigma_i = sqrt(sum J^2 e_i^2)`.
* **Estimation.** `NoiseTransform`, one tangent-like pass of the
  interpreter (float32 tangents), injects `e_lk g_lk` at every rounded op
  output (standard normal `g`, shared by the examples of a batch, so that
  certificates do not depend on batching) and propagates it with the pattern
  frozen: each neuron's tangent is then exactly `N(0, V_j)`, and the mean of
  `K = SAMPLES = 32` squares exceeds `V_j / KAPPA^2` except with probability
  `P(chi2_32 / 32 < 1/16) = 1.9e-14` (Gaussian probes make this lower tail
  exact whatever `J` is; random signs would not). Both tracks (`e0`, `e1`)
  run in one pass per batch when memory allows.
* **Guard.** `E_j(r) = LAMBDA KAPPA (sigma^0_j + r sigma^1_j)` with
  `LAMBDA = 8` (`2 exp(-32) = 2.5e-14`), so each neuron of each point of the
  ball fails with probability below `FAILURE_PROBABILITY = 6.3e-14` (union of
  the two estimates and Hoeffding), plus a rigorous (worst-case, ~1e-16
  relative) bound on the float64 twin's own error, computed in the same pass
  from the same actual magnitudes.

The pass is `noise_transform.NoiseTransform`. An op that rounds inside itself
has a rule of its own (`noise_transform.register_noise_rule`; a SimpleRNN
injects noise at every step of its recursion); every other op rounds each
output once. `keras_roll.rounding.guard` turns a `NoiseBound` into
the terms of the shrink formula (docs/design.md, "The rounding bound").

Example:

```python
twin = keras_roll.linearize(model).at_dtype("float64")
fwd = twin.forward(x)
nb = noise_bound(twin, fwd)              # NoiseBound: [B, N] arrays
guard = LAMBDA * KAPPA * nb.sigma_at_x   # the model's evaluation at x, per neuron
```
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.caches import batch_polymorphic
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.interpreter import Trace, propagate
from keras_roll.rounding.noise_transform import (
    SELECTED,
    Edge,
    NoiseTransform,
    Samples,
)
from keras_roll.rounding.precision import (
    EvaluationPrecision,
    evaluation_precision,
)

__all__ = [
    "FAILURE_PROBABILITY",
    "KAPPA",
    "LAMBDA",
    "SAMPLES",
    "Edge",
    "NoiseBound",
    "NoiseTransform",
    "Samples",
    "noise_bound",
]

SAMPLES = 32  # Gaussian probes per example and track
KAPPA = 4.0  # P(chi2_32 / 32 < 1 / 16) = 1.9e-14
LAMBDA = 8.0  # Hoeffding: 2 exp(-LAMBDA^2 / 2) = 2.5e-14
FAILURE_PROBABILITY = 6.3e-14  # per neuron and point: 2 estimates + Hoeffding


class NoiseBound(NamedTuple):
    """Per-neuron rounding terms of a batch, `[B, N]` float64 numpy each.

    Attributes:
        sigma_at_x: estimated `sqrt(sum J^2 e0^2)`: the scale of the model's
            own rounding error of neuron `j` at `x` (not yet inflated).
        sigma_per_radius: the same with `e1`: its growth per unit of `||x' - x||_inf`.
        exact_at_x: rigorous bound on the float64 twin's error of `z_j(x)`.
        exact_per_radius: rigorous bound on the l1 norm of the error of the
            twin's gradient `g_j`.
        overflow: `[B]` bool, some intermediate value of the model's evaluation
            may exceed the largest finite number of its dtype at `x`.

    Fields of a track the pass did not run (`noise_bound(tracks=...)`) are None.
    """

    sigma_at_x: np.ndarray | None
    sigma_per_radius: np.ndarray | None
    exact_at_x: np.ndarray | None
    exact_per_radius: np.ndarray | None
    overflow: np.ndarray | None

    def nonfinite(self) -> np.ndarray:
        """`[B]` examples whose terms are not all finite (the pass overflowed)."""
        fields = [f for f in self[:4] if f is not None]
        return ~np.all([np.all(np.isfinite(f), axis=1) for f in fields], axis=0)


# --------------------------------------------------------------------------- the pass


def _noise_pass(interpreter, trace: Trace, l1, samples: Samples, exact: tuple,
                precision: EvaluationPrecision, tangent_dtype: str, reverse: bool,
                which=None):
    """One noise pass over `trace`: `({track: sums of squares}, {track: twin terms},
    overflow)`, `[B, N]` / `[B]` tensors; `which` the track of a `SELECTED` segment."""
    x = trace.input
    transform = NoiseTransform(precision, samples, l1, x.dtype, exact, tangent_dtype,
                               len(interpreter.program.steps) if reverse else None, which)
    tracks = transform.tracks
    zeros = tf.zeros_like(x)
    start = Edge(x, tf.ones_like(x) if 1 in tracks else None, zeros if 0 in exact else None,
                 zeros if 1 in tracks else None, None)
    propagate(interpreter.program, transform, start, trace)
    return transform.results(tf.shape(x)[0])


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(twin):
    fn = _COMPILED.get(twin)
    if fn is None:  # a partial per twin: TensorFlow counts retracings per function
        fn = batch_polymorphic(tf.function(functools.partial(_noise_pass, twin.interpreter),
                                           reduce_retracing=True, autograph=False))
        _COMPILED[twin] = fn
    return fn


def noise_bound(twin, fwd, l1=None, memory_budget: int | None = None,
                samples: int = SAMPLES, tracks=(0, 1), reverse: bool = False) -> NoiseBound:
    """Runs the noise pass on a forward pass of a float64 twin (see the module docstring).

    One pass per batch carries the samples of both tracks and computes the
    twin's rigorous terms once; examples and samples are streamed in chunks
    planned by `keras_roll.compile.chunking` within the memory budget (a sample
    of an example costs what a tangent direction does). The passes of one track,
    track 0 or track 1 with `reverse` (certify's two passes, before and after the
    gradients are known), share one graph: the track is its input, and both
    tracks' magnitudes are computed (those of the other track are dropped).

    Args:
        twin: the (float64) `Linearized` that made `fwd`.
        fwd: its `ForwardPass` on a batch.
        l1: optional `[B, N]` upper bounds on the l1 norms of the neuron
            gradients (`GradNorms.l1`, inflated by their own error): without
            them the growth term compounds `|A|` through every layer.
        memory_budget: bytes per chunk (default the twin's).
        samples: Gaussian probes per example and track (0: only the rigorous
            float64 terms and the overflow flags).
        tracks: which terms to compute: 0 (at `x`: `sigma_at_x`, `exact_at_x`,
            `overflow`), 1 (per unit radius: `sigma_per_radius`,
            `exact_per_radius`, which use `l1`), or both.
        reverse: whether `exact_per_radius` also bounds gradients computed in
            reverse mode (`keras_roll.rounding.exact_norms`).

    Returns:
        A `NoiseBound` (None for the fields of tracks not computed).

    Example:

    ```python
    for sl, fwd, gn in iter_gradient_norms(twin, x):
        nb = noise_bound(twin, fwd, l1=gn.l1)
    ```
    """
    trace = fwd.trace
    x = trace.input
    b = int(x.shape[0])
    tracks = tuple(sorted(set(tracks)))
    fn = _compiled(twin)
    precision = evaluation_precision(twin.program)
    budget = int(memory_budget or twin.memory_budget)
    per = twin.layout(x.shape[1:]).tangent_bytes(np.dtype(twin.dtype).itemsize)
    directions = samples * len(tracks)
    plan = plan_chunks(b, max(directions, 1), per, budget, max_examples=None)
    shared = bool(samples) and (tracks == (0,) or (tracks == (1,) and reverse))
    if shared:  # one graph for either track
        if l1 is None:  # no gradient bound known: inf bounds nothing (min(p, inf) = p)
            l1 = np.full((b, twin.num_neurons(x.shape[1:])), np.inf)
        reverse = True  # only the gradient terms of track 1 read it
    parts = []
    for sl in plan.example_slices():
        tr = trace if (sl.start == 0 and sl.stop == b) else \
            twin.compiled.primal(tf.cast(x[sl], twin.dtype)).trace
        l1_part = None if l1 is None else np.asarray(l1)[sl]
        part = _slice_pass(fn, tr, l1_part, plan, tracks, samples, precision, "float32", reverse,
                           shared)
        bad = np.flatnonzero(part.nonfinite())
        if bad.size:  # float32 noise tangents overflowed: those examples in float64
            sub = twin.compiled.primal(tf.gather(tf.cast(x[sl], twin.dtype), bad)).trace
            redo = _slice_pass(fn, sub, None if l1_part is None else l1_part[bad], plan, tracks,
                               samples, precision, "float64", reverse, shared)
            part = NoiseBound(*(None if f is None else _put(f, bad, g)
                                for f, g in zip(part, redo)))
        parts.append(part)
    if not parts:
        empty = np.zeros((0, twin.num_neurons(x.shape[1:])))
        return NoiseBound(*(empty if t in tracks else None for t in (0, 1)),
                          *(empty if t in tracks else None for t in (0, 1)),
                          np.zeros(0, bool) if 0 in tracks else None)
    return NoiseBound(*(None if p[0] is None else np.concatenate(p, axis=0)
                        for p in zip(*parts)))


def _slice_pass(fn, trace, l1, plan, tracks, samples, precision, tangent_dtype,
                reverse, shared) -> NoiseBound:
    """The `NoiseBound` of one example slice: its sample chunks, the twin's rigorous
    terms from the first; `shared`: the graph that takes the (one) track as an input."""
    l1 = None if l1 is None else tf.constant(l1, tf.float64)
    directions = samples * len(tracks)
    which = tf.constant(tracks[0], tf.int32) if shared else None
    sums, exact = {}, None
    for start in (plan.direction_starts() if directions else (0,)):
        k = min(plan.per_chunk, directions - start)
        if shared:
            chunk = Samples.chunk((SELECTED,), start, k, samples)
            out = fn(trace, l1, chunk, (0, 1), precision, tangent_dtype, reverse, which)
            out = ({tracks[0]: out[0][SELECTED]}, {tracks[0]: out[1][tracks[0]]}, out[2])
        else:
            chunk = Samples.chunk(tracks, start, k, samples)
            out = fn(trace, l1, chunk, tracks if exact is None else (), precision,
                     tangent_dtype, reverse)
        for track, sq in out[0].items():
            sums[track] = sums.get(track, 0.0) + sq.numpy()
        if exact is None:
            exact = ({t: w.numpy() for t, w in out[1].items()}, out[2].numpy())
    return _slice_bound(sums, exact, tracks, samples)


def _put(full, rows, values):
    """`full` with `rows` replaced by `values` (a copy)."""
    full = np.array(full)
    full[rows] = values
    return full


def _slice_bound(sums, exact, tracks, samples) -> NoiseBound:
    """The `NoiseBound` of one example slice from its accumulated sums of squares."""
    w, overflow = exact

    def sigma(track):
        if track not in tracks:
            return None
        if not samples:
            return np.zeros_like(w[track])
        return np.sqrt(sums[track] / samples)

    return NoiseBound(sigma(0), sigma(1), w.get(0), w.get(1), overflow if 0 in tracks else None)
