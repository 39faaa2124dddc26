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
  magnitudes of the inputs at `x'` (`Op.magnitude` applied to `|a(x)|`), not
  magnitudes compounded through `|W|`. Inside a certified ball every neuron
  keeps its piece, so `|a(x')| <= |a(x)| + r p`, `r = ||x' - x||_inf`, where
  `p` bounds `||grad a||_1`: 1 at the input, `|A| p` through an op, and
  `|slope| ||g_j||_1` at a neuron whose gradient norm is known (`l1=`);
  hence `e_lk <= e0_lk + r e1_lk`.
* **Propagation.** The error of neuron `j` is `sum_lk J_j<-lk delta_lk` with
  the frozen-pattern Jacobian `J` (signed, not `|J|`), so by Hoeffding's
  inequality `|error_j| <= lambda sqrt(V_j(r))` with probability at least
  `1 - 2 exp(-lambda^2 / 2)`, `V_j(r) = sum_lk J^2 (e0 + r e1)^2`, and
  `sqrt(V_j(r)) <= sigma0_j + r sigma1_j` (Minkowski) with
  `sigma_i = sqrt(sum J^2 e_i^2)`.
* **Estimation.** `NoiseTransform`, one tangent-like pass of the
  interpreter (float32 tangents), injects `e_lk g_lk` at every rounded op
  output (independent standard normal `g` per sample and element; the
  examples of a batch share them, which their separate estimates allow, so
  that certificates do not depend on batching) and propagates it with the
  pattern frozen: each neuron's tangent is then exactly `N(0, V_j)`, so the
  mean of `K` squares is `V_j chi2_K / K`. With `K = SAMPLES = 32`,
  `P(chi2_32 / 32 < 1 / KAPPA^2 = 1/16) = 1.9e-14`: `KAPPA sigma^_j` exceeds
  `sigma_j` except with that probability (Gaussian probes, unlike random
  signs, make this lower tail exact whatever `J` is: with signs, two equal
  terms cancel in half the samples).
* **Guard.** `E_j(r) = LAMBDA KAPPA (sigma^0_j + r sigma^1_j)` with
  `LAMBDA = 8` (`2 exp(-32) = 2.5e-14`), so each neuron of each point of the
  ball fails with probability below `FAILURE_PROBABILITY = 6.3e-14` (union of
  the two estimates and Hoeffding), plus a rigorous (worst-case, ~1e-16
  relative) bound on the float64 twin's own error, computed in the same pass
  from the same actual magnitudes.

`keras_roll.certification.margins.rounding_errors` turns a `NoiseBound` into the terms of
the shrink formula (docs/design.md, section "The rounding bound").

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
from keras_roll.compile.rules.base import Op, Tangent, flatten_directions, flatten_examples
from keras_roll.compile.rules.recurrent import SimpleRNNOp
from keras_roll.rounding.worst_case import EvaluationPrecision, gamma, underflow_unit, unit_roundoff

__all__ = [
    "FAILURE_PROBABILITY",
    "KAPPA",
    "LAMBDA",
    "SAMPLES",
    "NoiseBound",
    "NoiseTransform",
    "noise_bound",
]

SAMPLES = 32  # Gaussian probes per example and track
KAPPA = 4.0  # P(chi2_32 / 32 < 1 / 16) = 1.9e-14
LAMBDA = 8.0  # Hoeffding: 2 exp(-LAMBDA^2 / 2) = 2.5e-14
FAILURE_PROBABILITY = 6.3e-14  # per neuron and point: 2 estimates + Hoeffding
SEED = 20190601  # fixed probes: reproducible certificates

NOISE_SCALE = 2.0**24  # noise tangents carry errors x 2^24 (exact): float32 stays normal
_U64 = unit_roundoff("float64")
_ETA64 = underflow_unit("float64")


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
    """

    sigma_at_x: np.ndarray
    sigma_per_radius: np.ndarray
    exact_at_x: np.ndarray
    exact_per_radius: np.ndarray
    overflow: np.ndarray


class _Edge(NamedTuple):
    """What flows along an edge: the value at `x`, the bound `p >= ||grad||_1`, the
    twin's error bounds at `x` and of its gradient, and the noise tangent (None: 0)."""

    value: tf.Tensor
    pr: tf.Tensor
    w0: tf.Tensor
    w1: tf.Tensor
    noise: Tangent | None


def _limit(dtype: str) -> float:
    return float(np.finfo(dtype).max) if dtype != "bfloat16" else 3.38e38


def _custom_rounding(op) -> bool:
    """Whether `op` rounds inside itself beyond `magnitude` / `roundings` (a recurrence)."""
    cls = type(op)
    return cls.rounding_growth is not Op.rounding_growth or cls.magnitudes is not Op.magnitudes


class NoiseTransform(Transform):
    """The noise pass: values, `||grad||_1` bounds, twin errors and noise tangents.

    Args:
        precision: the model's `EvaluationPrecision`.
        samples: noise samples `k` of this pass (0: no tangents, bounds only).
        track: 0 injects `e0` (the magnitudes at `x`), 1 injects `e1` (their
            growth per unit radius); a scalar int32 tensor.
        start: the index of the first sample of this pass (a scalar int32 tensor).
        total: the samples of all passes (the noise of sample `s` is row `s`
            of one `[total, *shape]` draw per op and track, shared by the
            examples: each example's estimate only needs its own samples to be
            independent, and certificates do not depend on batching or
            chunking).
        l1: optional `[B, N]` l1 norms of the twin's neuron gradients: they
            bound `||grad||_1` at neurons that are the input of their op.
        dtype: the dtype of the values and bounds (that of the trace).
        slack: relative error bound of `l1`.
        tangent_dtype: the dtype of the noise tangents (float32: an estimate
            needs no more; errors are carried times `NOISE_SCALE`).

    Example:

    ```python
    t = NoiseTransform(twin.evaluation_precision, 32, tf.constant(0), tf.constant(0), 32,
                       None, "float64")
    propagate(twin.program, t, _Edge(x, tf.ones_like(x), 0 * x, 0 * x, None), fwd.trace)
    v = tf.concat(t.sumsq, 1) / 32          # [B, N] estimates of sum J^2 e0^2
    ```
    """

    def __init__(self, precision: EvaluationPrecision, samples: int, track, start,
                 total: int, l1, dtype, slack: float = 0.0, tangent_dtype="float32"):
        self.precision = precision
        self.samples = int(samples)
        self.track = track
        self.start = start
        self.total = int(total)
        self.l1 = l1
        self.dtype = tf.as_dtype(dtype)
        self.tangent_dtype = tf.as_dtype(tangent_dtype)
        self.slack = float(slack)
        self.index = 0
        self.cursor = tf.constant(0, tf.int32)
        self.sumsq: list[tf.Tensor] = []
        self.exact0: list[tf.Tensor] = []
        self.exact1: list[tf.Tensor] = []
        self.overflow = None

    def enter_step(self, step, inputs, record):
        return record.mask

    # ------------------------------------------------------------------ helpers

    def _flag_overflow(self, m0, dtype):
        big = tf.reduce_any(flatten_examples(m0) > _limit(dtype), axis=1)
        self.overflow = big if self.overflow is None else tf.logical_or(self.overflow, big)

    def _draw(self, rest):
        """Standard normal `[k, *rest]`: rows `start .. start + k - 1` of one draw per op
        and track."""
        self.index += 1
        seed = tf.stack([tf.constant(SEED, tf.int32), 2 * self.index + self.track])
        shape = tf.concat([[self.total], rest], 0)
        draw = tf.random.stateless_normal(shape, seed, dtype=self.tangent_dtype)
        return draw[self.start:self.start + self.samples]

    def _scale(self, op, n, m0, m1, matmul_like=None):
        """`e0` or `e1` (by track) of `n` roundings of outputs of magnitude `m0 + r m1`."""
        dtype = self.precision.dtype_of(op)
        unit = self.precision.noise_unit(op, n, matmul_like)
        eta = underflow_unit(dtype)
        return tf.where(tf.equal(self.track, 0), unit * m0 + math.sqrt(n) * eta, unit * m1)

    def _l1_block(self, size, shape):
        """The next `size` gradient l1 norms, reshaped to `shape` (None without `l1`)."""
        if self.l1 is None:
            return None
        block = self.l1[:, self.cursor:self.cursor + size]
        return tf.reshape(tf.cast(block, self.dtype), shape) * (1.0 + self.slack)

    def _collect(self, neuron_t, w0n, w1n):
        if neuron_t is None:
            self.sumsq.append(tf.zeros_like(w0n, tf.float64))
        else:
            t = tf.cast(neuron_t, tf.float64) * (1.0 / NOISE_SCALE)
            self.sumsq.append(tf.reduce_sum(t * t, axis=1))
        self.exact0.append(tf.cast(w0n, tf.float64))
        self.exact1.append(tf.cast(w1n, tf.float64))
        self.cursor += tf.shape(w0n)[1]

    def _noise_inputs(self, inputs):
        """The inputs' noise tangents (zeros where none), or None if all are zero."""
        if self.samples == 0 or all(e.noise is None for e in inputs):
            return None
        out = []
        for e in inputs:
            if e.noise is None:
                shape = tf.concat([[self.samples], tf.shape(e.value)[1:]], 0)
                out.append(Tangent(tf.zeros(shape, self.tangent_dtype), shared=True))
            else:
                out.append(e.noise)
        return out

    def _tangent_scale(self, scale):
        """A float64 noise scale in the tangents' dtype, times `NOISE_SCALE` (a power of 2
        that keeps float32 tangents of errors ~1e-7 x the values far from underflow)."""
        return tf.cast(scale * NOISE_SCALE, self.tangent_dtype)

    def _inject(self, tangent, scale):
        """`tangent + scale g`, `g` standard normal `[B, k, *shape]`."""
        if self.samples == 0 or scale is None:
            return tangent
        batch = tf.shape(scale)[0]
        noise = self._tangent_scale(scale)[:, None] * self._draw(tf.shape(scale)[1:])[None]
        return Tangent(noise if tangent is None else tangent.per_example(batch) + noise)

    # ------------------------------------------------------------------ ops

    def apply(self, op, inputs, mask, record):
        if isinstance(op, SimpleRNNOp):
            return self._recurrent(op, inputs, mask, record)
        if _custom_rounding(op):
            raise ValueError(
                f"The op {type(op).__name__} of layer '{op.name}' rounds inside itself "
                f"(it overrides rounding_growth / magnitudes), which the probabilistic "
                f"rounding guard of rigor='float64' cannot see into. Certify this model "
                f"with rigor='strict' (the worst-case bound) or rigor='float32' (no guard).")
        values = [e.value for e in inputs]
        out = tf.cast(op.forward(values, mask)[0], self.dtype)
        pr = [e.pr for e in inputs]
        reset = (op.owns_neurons and self.l1 is not None and len(inputs) == 1
                 and type(op).neuron_magnitude is Op.neuron_magnitude)
        if reset:  # the neurons are the op's input: their gradients' l1 norms bound pr
            size = tf.reduce_prod(tf.shape(values[0])[1:])
            known = self._l1_block(size, tf.shape(values[0])) + inputs[0].w1
            pr = [tf.minimum(pr[0], known)]
        pr_out = op.magnitude(pr, record, False, mask)
        w0 = op.magnitude([e.w0 + _ETA64 for e in inputs], record, False, mask)
        w1 = op.magnitude([e.w1 for e in inputs], record, False, mask)
        n = op.roundings(values)
        scale = None
        if n:
            dtype = self.precision.dtype_of(op)
            shift = underflow_unit(dtype) / unit_roundoff(dtype)  # flushed inputs
            m0 = op.magnitude([tf.abs(v) + shift for v in values], record, True, mask)
            self._flag_overflow(m0, dtype)
            g64 = gamma(n, _U64)
            w0 = w0 + g64 * m0 + n * _ETA64
            w1 = w1 + g64 * pr_out
            scale = self._scale(op, n, m0, pr_out)
        tangents = self._noise_inputs(inputs)
        noise, neuron_t = None, None
        if tangents is not None:
            noise, neuron_t = op.tangent(tangents, cast_records(record, self.tangent_dtype),
                                         cast_records(mask, self.tangent_dtype))
        if op.owns_neurons:
            w0n = op.neuron_magnitude([e.w0 for e in inputs], record, False, mask)
            w1n = op.neuron_magnitude([e.w1 for e in inputs], record, False, mask)
            self._collect(neuron_t, w0n, w1n)
        return _Edge(out, pr_out, w0, w1, self._inject(noise, scale))

    def _recurrent(self, op: SimpleRNNOp, inputs, mask, record):
        """A SimpleRNN layer: noise at every step's sum and activation, inside the recursion.

        Mirrors `SimpleRNNOp.forward` / `tangent`: per step (processing order)
        `z_t = x_t K + h_t-1 U + b` (`n` roundings) and `h_t = f(z_t)` on the
        recorded piece (`f`'s roundings), padded steps carrying the state.
        """
        (edge,) = inputs
        dt = self.dtype
        out = tf.cast(op.forward([edge.value], mask)[0], dt)
        cell, layer, act = op.cell, op.layer, op.act
        kernel = tf.cast(cell.kernel, dt)
        recurrent = tf.cast(cell.recurrent_kernel, dt)
        abs_k, abs_u = tf.abs(kernel), tf.abs(recurrent)
        abs_b = tf.abs(tf.cast(cell.bias, dt)) if cell.bias is not None else tf.zeros([], dt)
        z = tf.cast(record.z, dt)  # [B, T, units], processing order
        slope = tf.abs(tf.cast(record.slope, dt))
        act_mag = slope * tf.abs(z) + tf.abs(tf.cast(act.fn(z), dt) - tf.cast(record.slope,
                                                                                 dt) * z)
        keep = tf.cast(record.mask, tf.bool)
        dtype = self.precision.dtype_of(op)
        shift = underflow_unit(dtype) / unit_roundoff(dtype)
        n = op.roundings([edge.value])
        n_act = act.roundings([edge.value])
        g64, g64_act = gamma(n, _U64), gamma(n_act, _U64)

        def order(t):  # [B, T, ...] in processing order
            return tf.reverse(t, [1]) if layer.go_backwards else t

        def time_major(t):
            return tf.transpose(t, [1, 0] + list(range(2, len(t.shape))))

        x_mag = tf.matmul(order(tf.abs(edge.value)) + shift, abs_k) + abs_b
        x_pr = tf.matmul(order(edge.pr), abs_k)
        x_w0 = tf.matmul(order(edge.w0) + _ETA64, abs_k)
        x_w1 = tf.matmul(order(edge.w1), abs_k)
        batch, steps, units = tf.shape(z)[0], tf.shape(z)[1], cell.units
        l1 = self._l1_block(steps * units, tf.shape(z))
        if l1 is None:  # no known gradient norms: the growth compounds through |U|
            l1 = tf.fill(tf.shape(z), tf.constant(math.inf, dt))
        zeros = tf.zeros(tf.stack([batch, units]), dt)

        def step(carry, elems):
            h, ph, w0h, w1h = carry[:4]
            xm, xp, xw0, xw1, hv, s, am, k_t, l1_t = elems
            m0 = xm + tf.matmul(tf.abs(h) + shift, abs_u)
            m1 = xp + tf.matmul(ph, abs_u)
            w0 = xw0 + tf.matmul(w0h + _ETA64, abs_u) + g64 * m0 + n * _ETA64
            w1 = xw1 + tf.matmul(w1h, abs_u) + g64 * m1
            pz = tf.minimum(m1, l1_t + w1)  # a bound on ||grad z_t||_1
            new = (hv, s * pz, s * w0 + g64_act * am + n_act * _ETA64, s * w1 + g64_act * s * pz)
            state = tuple(tf.where(k_t[:, None], a, b) for a, b in zip(new, (h, ph, w0h, w1h)))
            return state + (m0, m1, pz, w0, w1)

        elems = tuple(time_major(t) for t in (x_mag, x_pr, x_w0, x_w1, tf.cast(act.fn(z), dt),
                                              slope, act_mag, keep, l1))
        res = tf.scan(step, elems, initializer=(zeros,) * 9)
        _, ph_seq, w0h_seq, w1h_seq, m0, m1, pz, w0z, w1z = res  # time major
        self._flag_overflow(time_major(m0), dtype)

        def outputs(seq):  # like the layer's output, from time-major per-step states
            if layer.zero_output_for_mask:
                seq = tf.where(time_major(keep)[:, :, None], seq, tf.zeros_like(seq))
            seq = time_major(seq)
            return seq if layer.return_sequences else seq[:, -1]

        pr_out, w0_out, w1_out = outputs(ph_seq), outputs(w0h_seq), outputs(w1h_seq)
        noise = None
        neuron_t = None
        if self.samples:
            e_z = self._scale(op, n, m0, m1, matmul_like=True)  # [T, B, units]
            e_h = (self._scale(op, n_act, time_major(act_mag), time_major(slope) * pz, False)
                   if n_act else None)
            k = self.samples
            def draw():  # [T, 1, k, units]
                return tf.transpose(self._draw(tf.stack([steps, units])), [1, 0, 2])[:, None]

            draw_z = draw()
            draw_h = draw() if n_act else None
            dx = edge.noise
            tdt = self.tangent_dtype
            if dx is None:
                tw = tf.zeros(tf.stack([steps, batch, k, units]), tdt)
            else:
                dxv = dx.per_example(batch)  # [B, k, T, F]
                tw = tf.matmul(dxv, tf.cast(kernel, tdt))
                if layer.go_backwards:
                    tw = tf.reverse(tw, [2])
                tw = tf.transpose(tw, [2, 0, 1, 3])
            slope_t = time_major(tf.cast(record.slope, tdt))[:, :, None]
            recurrent_t = tf.cast(recurrent, tdt)
            e_z = self._tangent_scale(e_z)
            e_h = None if e_h is None else self._tangent_scale(e_h)
            keep_t = time_major(keep)[:, :, None, None]
            inject_h = e_h is not None

            def noise_step(carry, el):
                dh = carry[0]
                if inject_h:
                    tw_t, ez, gz, s_t, k_t, eh, gh = el
                else:
                    tw_t, ez, gz, s_t, k_t = el
                dz = tw_t + tf.matmul(dh, recurrent_t) + ez[:, None] * gz
                new = s_t * dz
                if inject_h:
                    new += eh[:, None] * gh
                return tf.where(k_t, new, dh), dz

            el = (tw, e_z, draw_z, slope_t, keep_t)
            if inject_h:
                el += (e_h, draw_h)
            dh0 = tf.zeros(tf.stack([batch, k, units]), tdt)
            dhs, dzs = tf.scan(noise_step, el, initializer=(dh0, dh0))
            if layer.zero_output_for_mask:
                dhs = tf.where(keep_t, dhs, tf.zeros_like(dhs))
            outs = tf.transpose(dhs, [1, 2, 0, 3])
            noise = Tangent(outs if layer.return_sequences else outs[:, :, -1])
            neuron_t = flatten_directions(tf.transpose(dzs, [1, 2, 0, 3]))
        self._collect(neuron_t, flatten_examples(time_major(w0z)),
                      flatten_examples(time_major(w1z)))
        return _Edge(out, pr_out, w0_out, w1_out, noise)


# --------------------------------------------------------------------------- the pass


def _noise_pass(interpreter, trace: Trace, l1, track, start, samples: int, total: int,
                precision: EvaluationPrecision, slack: float):
    """One noise pass over `trace`: `(sumsq, exact0, exact1, overflow)`, `[B, N]` / `[B]`."""
    x = trace.input
    dtype = x.dtype
    batch = tf.shape(x)[0]
    transform = NoiseTransform(precision, samples, track, start, total, l1, dtype, slack)
    start = _Edge(x, tf.ones_like(x), tf.zeros_like(x), tf.zeros_like(x), None)
    propagate(interpreter.program, transform, start, trace)
    overflow = transform.overflow
    if overflow is None:
        overflow = tf.zeros(tf.reshape(batch, [1]), tf.bool)
    if not transform.sumsq:
        empty = tf.zeros(tf.stack([batch, 0]), tf.float64)
        return empty, empty, empty, overflow
    return (tf.concat(transform.sumsq, 1), tf.concat(transform.exact0, 1),
            tf.concat(transform.exact1, 1), overflow)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(twin):
    fn = _COMPILED.get(twin)
    if fn is None:  # a partial per twin: TensorFlow counts retracings per function
        fn = tf.function(functools.partial(_noise_pass, twin.interpreter),
                         reduce_retracing=True, autograph=False)
        _COMPILED[twin] = fn
    return fn


def noise_bound(twin, fwd, l1=None, memory_budget: int | None = None,
                samples: int = SAMPLES, slack: float = 0.0) -> NoiseBound:
    """Runs the noise pass on a forward pass of a float64 twin (see the module docstring).

    Streams examples and samples in chunks planned by `keras_roll.compile.chunking`
    within the memory budget (a sample of an example costs what a tangent
    direction does).

    Args:
        twin: the (float64) `Linearized` that made `fwd`.
        fwd: its `ForwardPass` on a batch.
        l1: optional `[B, N]` l1 norms of the neuron gradients (`GradNorms.l1`):
            without them the growth term compounds `|A|` through every layer.
        memory_budget: bytes per chunk (default the twin's).
        samples: Gaussian probes per example and track (0: only the rigorous
            float64 terms and the overflow flags).
        slack: relative error bound of `l1`.

    Returns:
        A `NoiseBound`.

    Example:

    ```python
    for sl, fwd, gn in iter_gradient_norms(twin, x):
        nb = noise_bound(twin, fwd, l1=gn.l1)
    ```
    """
    trace = fwd.trace
    x = trace.input
    b = int(x.shape[0])
    fn = _compiled(twin)
    precision = twin.evaluation_precision
    budget = int(memory_budget or twin.memory_budget)
    per = twin.layout(x.shape[1:]).tangent_bytes(np.dtype(twin.dtype).itemsize)
    plan = plan_chunks(b, max(samples, 1), per, budget, max_examples=None)
    parts = []
    for sl in plan.example_slices():
        tr = trace if (sl.start == 0 and sl.stop == b) else \
            twin.compiled.primal(tf.cast(x[sl], twin.dtype)).trace
        l1_part = None if l1 is None else tf.constant(np.asarray(l1)[sl], tf.float64)
        sums = [None, None]
        exact = None
        for track in ((0, 1) if samples else (0,)):
            for start in (plan.direction_starts() if samples else (0,)):
                k = min(plan.per_chunk, samples - start) if samples else 0
                sq, w0, w1, overflow = fn(tr, l1_part, tf.constant(track, tf.int32),
                                          tf.constant(start, tf.int32), k, samples,
                                          precision, float(slack))
                sq = sq.numpy()
                sums[track] = sq if sums[track] is None else sums[track] + sq
                if exact is None:
                    exact = (w0.numpy(), w1.numpy(), overflow.numpy())
        if samples:
            sig = [np.sqrt(s / samples) for s in sums]
        else:
            sig = [np.zeros_like(exact[0]), np.zeros_like(exact[0])]
        parts.append((sig[0], sig[1], *exact))
    if not parts:
        empty = np.zeros((0, twin.num_neurons(x.shape[1:])))
        return NoiseBound(empty, empty, empty, empty, np.zeros(0, bool))
    return NoiseBound(*(np.concatenate(p, axis=0) for p in zip(*parts)))
