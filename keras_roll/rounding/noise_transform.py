"""The noise pass of the probabilistic guard: a tangent-like pass of the interpreter.

`NoiseTransform` recomputes the float64 values of every op, the bounds `p >=
||grad||_1` and the twin's own rigorous errors, and injects Gaussian noise
scaled by every rounded op output's local error into float32 tangents pushed
through the ops' frozen-pattern `tangent` (`keras_roll.rounding.noise` has
the analysis and runs it). An op that rounds inside itself has a rule of its
own (`register_noise_rule`; `noise_recurrent.recurrent_noise` for SimpleRNN).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.interpreter import Transform, cast_records
from keras_roll.compile.rules.base import Op, Tangent, flatten_examples
from keras_roll.compile.rules.recurrent import SimpleRNNOp
from keras_roll.rounding import rules
from keras_roll.rounding.noise_recurrent import recurrent_noise
from keras_roll.rounding.precision import (
    EvaluationPrecision,
    gamma,
    largest_finite,
    underflow_unit,
    unit_roundoff,
)

__all__ = ["NOISE_SCALE", "SEED", "SELECTED", "Edge", "NoiseTransform", "Samples",
           "register_noise_rule"]

SEED = 20190601  # fixed probes: reproducible certificates
NOISE_SCALE = 2.0**24  # noise tangents carry errors x 2^24 (exact): float32 stays normal
U64 = unit_roundoff("float64")
ETA64 = underflow_unit("float64")
SELECTED = -1  # a samples segment whose track is a graph input (`NoiseTransform(which=)`)


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
    `[total, *shape]` draws of each op and track (`SELECTED`: the track the pass's
    `which` input names)."""

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
        readers: None, or a bound on how many ops read one tensor (the steps
            of the program): `w1` then also bounds the error of the twin's
            gradient computed in reverse mode, whose sums run over an op's
            outputs and readers.
        which: None, or an int32 scalar tensor (0 or 1): the track of the
            `SELECTED` segment of `samples`, chosen when the graph runs, so that
            one trace serves either track (with `exact=(0, 1)`, which computes
            the magnitudes of both).

    Example:

    ```python
    t = NoiseTransform(precision, Samples.chunk((0,), 0, 32, 32), None, "float64", (0,))
    propagate(twin.program, t, Edge(x, None, 0 * x, None, None), fwd.trace)
    sums, exact, overflow = t.results(batch)   # sums[0] / 32: estimates of sum J^2 e0^2
    ```
    """

    def __init__(self, precision: EvaluationPrecision, samples: Samples, l1, dtype,
                 exact=(0, 1), tangent_dtype="float32", readers: int | None = None,
                 which=None):
        if (SELECTED in samples.tracks) != (which is not None):
            raise ValueError(f"NoiseTransform: which={which!r} must be given exactly when a "
                             f"segment of {samples!r} is SELECTED.")
        if which is not None and tuple(exact) != (0, 1):
            raise ValueError(f"NoiseTransform: a SELECTED segment needs the magnitudes of "
                             f"both tracks, exact=(0, 1); got exact={exact!r}.")
        self.which = which
        self.precision = precision
        self.readers = readers
        self.samples = samples
        self.l1 = l1
        self.dtype = tf.as_dtype(dtype)
        self.tangent_dtype = tf.as_dtype(tangent_dtype)
        self.exact = tuple(exact)
        self.index = 0
        self.cursor = tf.constant(0, tf.int32)
        self.sumsq: dict[int, list] = {0: [], 1: [], SELECTED: []}
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
            stream = tf.constant(2 * self.index + track) if track != SELECTED else \
                tf.constant(2 * self.index, tf.int32) + self.which
            seed = tf.stack([tf.constant(SEED, tf.int32), stream])
            shape = tf.concat([[self.samples.total], rest], 0)
            out.append(tf.random.stateless_normal(shape, seed, dtype=self.tangent_dtype)
                       [first:first + count])
        return tf.concat(out, axis=0)

    def scales(self, op, n, m0, m1, matmul_like):
        """`{track: e}` local noise scales of `n` roundings of outputs of magnitude
        `m0 + r m1`, for the tracks whose samples this pass carries."""
        unit = self.precision.noise_unit(op, n, matmul_like)
        eta = math.sqrt(n) * underflow_unit(self.precision.dtype_of(op))
        out = {}
        for t in self.samples.tracks:
            if t == SELECTED:
                out[t] = tf.where(tf.equal(self.which, 0), unit * m0 + eta, unit * m1)
            else:
                out[t] = unit * m0 + eta if t == 0 else unit * m1
        return out

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
            count = n if self.readers is None else max(n, size + self.readers)
            if count:
                w1 = w1 + gamma(count, U64) * pr_out
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
