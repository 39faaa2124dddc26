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

An op that rounds inside itself has a rule of its own (`register_noise_rule`;
a SimpleRNN injects noise at every step of its recursion); every other op
rounds each output once. `keras_roll.rounding.guard` turns a `NoiseBound` into
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
import math
import weakref
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.interpreter import Trace, Transform, cast_records, propagate
from keras_roll.compile.rules.base import Op, Tangent, flatten_examples
from keras_roll.compile.rules.recurrent import SimpleRNNOp
from keras_roll.rounding import rules
from keras_roll.rounding.noise_recurrent import recurrent_noise
from keras_roll.rounding.precision import (
    EvaluationPrecision,
    evaluation_precision,
    gamma,
    largest_finite,
    underflow_unit,
    unit_roundoff,
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
SEED = 20190601  # fixed probes: reproducible certificates

NOISE_SCALE = 2.0**24  # noise tangents carry errors x 2^24 (exact): float32 stays normal
U64 = unit_roundoff("float64")
ETA64 = underflow_unit("float64")


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


class Edge(NamedTuple):
    """What flows along an edge of the noise pass: the value at `x`, `p >= ||grad||_1`
    (track 1), the twin's error bounds at `x` (track 0) and of its gradient (track 1),
    None where not computed, and the noise tangent (None: 0)."""

    value: tf.Tensor
    pr: tf.Tensor | None
    w0: tf.Tensor | None
    w1: tf.Tensor | None
    noise: Tangent | None


class Samples(NamedTuple):
    """The noise samples one pass carries: `(track, first, count)` segments of the
    `[total, *shape]` draws of each op and track."""

    segments: tuple
    total: int

    @property
    def count(self) -> int:  # samples in all
        return sum(c for _, _, c in self.segments)

    @property
    def tracks(self) -> tuple:  # the tracks that have samples
        return tuple(t for t, _, c in self.segments if c)

    @classmethod
    def chunk(cls, tracks, start: int, k: int, total: int) -> Samples:
        """Samples `start .. start + k - 1` of `tracks` laid end to end."""
        segments = []
        for i, track in enumerate(tracks):
            lo, hi = max(start, i * total), min(start + k, (i + 1) * total)
            if hi > lo:
                segments.append((track, lo - i * total, hi - lo))
        return cls(tuple(segments), int(total))


class NoiseTransform(Transform):
    """The noise pass: values, `||grad||_1` bounds, twin errors and noise tangents.

    Args:
        precision: the model's `EvaluationPrecision`.
        samples: the `Samples` this pass carries (no segment: bounds only).
        l1: optional `[B, N]` upper bounds on the l1 norms of the twin's neuron
            gradients: they bound `||grad||_1` at neurons that are the input of
            their op (track 1).
        dtype: the dtype of the values and bounds (that of the trace).
        exact: which rigorous twin terms to collect: a subset of `(0, 1)` (`w0`
            and the overflow flags with track 0; `w1` with track 1, which the
            gradient bounds `p` of track 1 need anyway).
        tangent_dtype: the dtype of the noise tangents (float32: an estimate
            needs no more; errors are carried times `NOISE_SCALE`).
        readers: a bound on how many ops read one tensor (the steps of the
            program): `w1` also bounds the error of the twin's gradient computed
            in reverse mode, whose sums run over an op's outputs and readers.

    Example:

    ```python
    t = NoiseTransform(precision, Samples.chunk((0,), 0, 32, 32), None, "float64", (0,))
    propagate(twin.program, t, Edge(x, None, 0 * x, None, None), fwd.trace)
    sums, exact, overflow = t.results(batch)   # sums[0] / 32: estimates of sum J^2 e0^2
    ```
    """

    def __init__(self, precision: EvaluationPrecision, samples: Samples, l1, dtype,
                 exact=(0, 1), tangent_dtype="float32", readers: int = 0):
        self.precision = precision
        self.readers = int(readers)
        self.samples = samples
        self.l1 = l1
        self.dtype = tf.as_dtype(dtype)
        self.tangent_dtype = tf.as_dtype(tangent_dtype)
        self.exact = tuple(exact)
        self.index = 0
        self.cursor = tf.constant(0, tf.int32)
        self.sumsq: dict[int, list] = {0: [], 1: []}
        self.exact_terms: dict[int, list] = {0: [], 1: []}
        self.overflow = None

    def enter_step(self, step, inputs, record):
        return record.mask

    def apply(self, op, inputs, mask, record):
        handler = _NOISE_RULES.get(type(op))
        if handler is not None:
            return handler(self, op, inputs, mask, record)
        return self._one_rounding(op, inputs, mask, record)

    # ------------------------------------------------------------------ helpers

    @property
    def tracks(self) -> tuple:
        """The tracks whose bounds this pass carries (their samples or twin terms)."""
        return tuple(sorted(set(self.samples.tracks) | set(self.exact)))

    def flag_overflow(self, m0, dtype):
        """Records examples whose actual magnitudes `m0` exceed `dtype`'s range."""
        if 0 not in self.exact:
            return
        big = tf.reduce_any(flatten_examples(m0) > largest_finite(dtype), axis=1)
        self.overflow = big if self.overflow is None else tf.logical_or(self.overflow, big)

    def draw(self, rest):
        """Standard normal `[k, *rest]`: this pass's rows of one draw per op and track."""
        self.index += 1
        out = []
        for track, first, count in self.samples.segments:
            seed = tf.stack([tf.constant(SEED, tf.int32), tf.constant(2 * self.index + track)])
            shape = tf.concat([[self.samples.total], rest], 0)
            out.append(tf.random.stateless_normal(shape, seed, dtype=self.tangent_dtype)
                       [first:first + count])
        return tf.concat(out, axis=0)

    def scales(self, op, n, m0, m1, matmul_like):
        """`{track: e}` local noise scales of `n` roundings of outputs of magnitude
        `m0 + r m1`, for the tracks whose samples this pass carries."""
        unit = self.precision.noise_unit(op, n, matmul_like)
        eta = math.sqrt(n) * underflow_unit(self.precision.dtype_of(op))
        tracks = self.samples.tracks
        return {t: unit * m0 + eta if t == 0 else unit * m1 for t in tracks}

    def sampled(self, scales, rest):
        """`[B, k, *rest]` noise `e_track g` (times `NOISE_SCALE`, in the tangents'
        dtype) for `scales` `{track: [B, *rest]}`."""
        g = self.draw(rest)
        parts, at = [], 0
        for track, _, count in self.samples.segments:
            e = tf.cast(scales[track] * NOISE_SCALE, self.tangent_dtype)
            parts.append(e[:, None] * g[None, at:at + count])
            at += count
        return tf.concat(parts, axis=1)

    def known_l1(self, size, shape):
        """The next `size` gradient l1 bounds, reshaped to `shape` (None without `l1`)."""
        if self.l1 is None:
            return None
        block = self.l1[:, self.cursor:self.cursor + size]
        return tf.reshape(tf.cast(block, self.dtype), shape)

    def collect(self, neuron_t, w0n, w1n, z):
        """Adds one op's neurons (`z`: their values): sums of squares of their noise
        tangents `[B, k, n]` (None: no noise reached them) per track, twin terms."""
        z = flatten_examples(z)
        at = 0
        for track, _, k in self.samples.segments:
            if neuron_t is None:
                self.sumsq[track].append(tf.zeros_like(z, tf.float64))
            else:
                t = tf.cast(neuron_t[:, at:at + k], tf.float64) * (1.0 / NOISE_SCALE)
                self.sumsq[track].append(tf.reduce_sum(t * t, axis=1))
            at += k
        for track, w in ((0, w0n), (1, w1n)):
            if track in self.exact:
                self.exact_terms[track].append(tf.cast(w, tf.float64))
        self.cursor += tf.shape(z)[1]

    def input_noise(self, inputs):
        """The inputs' noise tangents (zeros where none), or None if all are zero."""
        if not self.samples.count or all(e.noise is None for e in inputs):
            return None
        k = self.samples.count
        return [e.noise if e.noise is not None else Tangent(
            tf.zeros(tf.concat([[k], tf.shape(e.value)[1:]], 0), self.tangent_dtype), True)
            for e in inputs]

    def results(self, batch):
        """`({track: [B, N] sums of squares}, {track: [B, N] twin terms}, overflow)`."""
        empty = tf.zeros(tf.stack([batch, 0]), tf.float64)

        def cat(parts):
            return tf.concat(parts, 1) if parts else empty

        sums = {t: cat(self.sumsq[t]) for t in self.samples.tracks}
        exact = {t: cat(self.exact_terms[t]) for t in self.exact}
        overflow = self.overflow
        if overflow is None:
            overflow = tf.zeros(tf.reshape(batch, [1]), tf.bool)
        return sums, exact, overflow

    # ------------------------------------------------------------------ ops

    def _one_rounding(self, op, inputs, mask, record):
        """An op that rounds each output once after its inputs' errors reach it."""
        rule = rules.rounding_rule(op)
        values = [e.value for e in inputs]
        out = tf.cast(op.forward(values, mask)[0], self.dtype)
        n = rule.roundings(op, values)
        pr_out = self._gradient_bound(op, rule, inputs, record, mask, values)
        m0 = None
        if n and 0 in self.tracks:
            dtype = self.precision.dtype_of(op)
            shift = underflow_unit(dtype) / unit_roundoff(dtype)  # flushed inputs
            m0 = rule.magnitude(op, [tf.abs(v) + shift for v in values], record, True, mask,
                                values)
            self.flag_overflow(m0, dtype)
        w0, w1, w0n, w1n = self._twin_terms(op, rule, inputs, record, mask, values, n, m0,
                                            pr_out, int(np.prod(out.shape[1:])))
        tangents = self.input_noise(inputs)
        noise, neuron_t = None, None
        if tangents is not None:
            noise, neuron_t = op.tangent(tangents, cast_records(record, self.tangent_dtype),
                                         cast_records(mask, self.tangent_dtype))
        if op.owns_neurons:
            self.collect(neuron_t, w0n, w1n, op.neurons(record).z)
        if n and self.samples.count:
            extra = self.sampled(self.scales(op, n, m0, pr_out, rule.matmul_like),
                                 tf.shape(out)[1:])
            batch = tf.shape(out)[0]
            noise = Tangent(extra if noise is None else noise.per_example(batch) + extra)
        return Edge(out, pr_out, w0, w1, noise)

    def _gradient_bound(self, op, rule, inputs, record, mask, values):
        """`p_out >= ||grad||_1` of the op's output (track 1 only, else None)."""
        if 1 not in self.tracks:
            return None
        pr = [e.pr for e in inputs]
        neurons_are_input = op.owns_neurons and len(inputs) == 1 and \
            type(rule).neuron_magnitude is rules.RoundingRule.neuron_magnitude
        if neurons_are_input and self.l1 is not None:
            # the neurons are the op's input: their gradients' l1 norms bound pr
            size = tf.reduce_prod(tf.shape(values[0])[1:])
            known = self.known_l1(size, tf.shape(values[0])) + inputs[0].w1
            pr = [tf.minimum(pr[0], known)]
        return rule.magnitude(op, pr, record, False, mask, values)

    def _twin_terms(self, op, rule, inputs, record, mask, values, n, m0, pr_out, size):
        """`(w0, w1, w0 of the neurons, w1 of the neurons)`: the twin's own rigorous
        error at `x` and of its gradient, `|A| w_in + gamma_n(u_64) m` (None where
        this pass does not compute it); for the gradient, `n` covers reverse mode
        too (`size` outputs per example and the readers)."""
        w0 = w1 = w0n = w1n = None
        g64 = gamma(n, U64)
        if 0 in self.exact:
            w0 = rule.magnitude(op, [e.w0 + ETA64 for e in inputs], record, False, mask, values)
            if n:
                w0 = w0 + g64 * m0 + n * ETA64
            if op.owns_neurons:
                w0n = rule.neuron_magnitude(op, [e.w0 for e in inputs], record, False, mask,
                                            values)
        if 1 in self.tracks:  # p needs w1 (a neuron's gradient bound is l1 + w1)
            w1 = rule.magnitude(op, [e.w1 for e in inputs], record, False, mask, values)
            w1 = w1 + gamma(max(n, size + self.readers), U64) * pr_out
            if op.owns_neurons:
                w1n = rule.neuron_magnitude(op, [e.w1 for e in inputs], record, False, mask,
                                            values)
        return w0, w1, w0n, w1n


_NOISE_RULES = {SimpleRNNOp: recurrent_noise}


def register_noise_rule(op_class: type, rule) -> None:
    """Registers how the noise pass runs through ops of `op_class` (an op that rounds
    inside itself): `rule(transform, op, inputs, mask, record) -> Edge`, as
    `noise_recurrent.recurrent_noise` does for SimpleRNN (example:
    `register_noise_rule(MyRecurrentOp, my_noise_rule)`)."""
    if not (isinstance(op_class, type) and issubclass(op_class, Op)):
        raise TypeError(f"register_noise_rule expects an Op subclass, got {op_class!r}.")
    _NOISE_RULES[op_class] = rule


# --------------------------------------------------------------------------- the pass


def _noise_pass(interpreter, trace: Trace, l1, samples: Samples, exact: tuple,
                precision: EvaluationPrecision):
    """One noise pass over `trace`: `({track: sums of squares}, {track: twin terms},
    overflow)`, `[B, N]` / `[B]` tensors."""
    x = trace.input
    transform = NoiseTransform(precision, samples, l1, x.dtype, exact,
                               readers=len(interpreter.program.steps))
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
        fn = tf.function(functools.partial(_noise_pass, twin.interpreter),
                         reduce_retracing=True, autograph=False)
        _COMPILED[twin] = fn
    return fn


def noise_bound(twin, fwd, l1=None, memory_budget: int | None = None,
                samples: int = SAMPLES, tracks=(0, 1)) -> NoiseBound:
    """Runs the noise pass on a forward pass of a float64 twin (see the module docstring).

    One pass per batch carries the samples of both tracks and computes the
    twin's rigorous terms once; examples and samples are streamed in chunks
    planned by `keras_roll.compile.chunking` within the memory budget (a sample
    of an example costs what a tangent direction does).

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
    parts = []
    for sl in plan.example_slices():
        tr = trace if (sl.start == 0 and sl.stop == b) else \
            twin.compiled.primal(tf.cast(x[sl], twin.dtype)).trace
        l1_part = None if l1 is None else tf.constant(np.asarray(l1)[sl], tf.float64)
        sums, exact = {}, None
        for start in (plan.direction_starts() if directions else (0,)):
            k = min(plan.per_chunk, directions - start)
            chunk = Samples.chunk(tracks, start, k, samples)
            out = fn(tr, l1_part, chunk, tracks if exact is None else (), precision)
            for track, sq in out[0].items():
                sums[track] = sums.get(track, 0.0) + sq.numpy()
            if exact is None:
                exact = ({t: w.numpy() for t, w in out[1].items()}, out[2].numpy())
        parts.append(_slice_bound(sums, exact, tracks, samples))
    if not parts:
        empty = np.zeros((0, twin.num_neurons(x.shape[1:])))
        return NoiseBound(*(empty if t in tracks else None for t in (0, 1)),
                          *(empty if t in tracks else None for t in (0, 1)),
                          np.zeros(0, bool) if 0 in tracks else None)
    return NoiseBound(*(None if p[0] is None else np.concatenate(p, axis=0)
                        for p in zip(*parts)))


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
