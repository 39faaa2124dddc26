"""Gradient norms from a float32 tangent pass, with a rigorous bound on its rounding.

The default certificate needs, per neuron, the dual norms `||g_j||_q` of its
input gradient (the exact gradient of the float64 twin's pattern). Pushing all
`D` input axes through the twin is most of its cost, and float64 costs about
twice float32 on CPUs and more on GPUs. This module runs that pass in float32
with the pattern of the float64 forward pass and bounds its error *a
posteriori*, from the magnitudes the pass itself computed (docs/design.md,
section "The float32 tangent pass"):

* every op of the tangent pass computes its output from its computed input
  tangents `t^` with `|error| <= gamma_n |A| |t^|` per direction (`n`: the
  op's `RoundingRule.tangent_roundings`; one product on single-term tangents,
  i.e. one-hot directions before the first sum), so over the `D` directions
  `||error_i||_q <= gamma_n (|A| P_q)_i` with `P_q` the q-norms over directions
  of the op's input tangents, element by element (reduced in the same pass);
* those local errors propagate through the rest of the frozen linear network,
  so the error of every later tangent obeys `W_q <- |A| (W_q + gamma_n P_q +
  eta_q) + n eta_q` (`eta_q`: underflow, `D^(1/q) 2^-126`), one magnitude pass
  per norm with the ops' `RoundingRule.magnitude`;
* the error of a neuron's gradient norm is then at most `W_q` of the neuron
  plus the rounding of the float32 reduction over directions.

The bound compounds `|A|` from each op to the neuron (about `sqrt(width)` per
layer), so it is tight for shallow networks (3.5 % at depth 4 of a
784-300x4-10 MLP) and vacuous for deep ones; the certificate uses it only to
choose the few neurons whose exact float64 norms can decide a margin
(`keras_roll.rounding.exact_norms`: reverse mode through the float64 twin), and
falls back to the
float64 pass where it chooses too many.

Example:

```python
fwd = twin64.compiled.primal(x)
tn = tangent_norms(twin64, fwd, memory_budget)   # TangentNorms: [b, N] per norm
upper_l2 = tn.norms.l2 + tn.error.l2             # >= ||g_j||_2, rigorously
```
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.autotune import probed_budget
from keras_roll.compile.caches import batch_polymorphic
from keras_roll.compile.chunking import auto_candidates, plan_chunks, remembered_budget
from keras_roll.compile.interpreter import (
    Interpreter,
    TangentTransform,
    Transform,
    cast_records,
    propagate,
)
from keras_roll.compile.rules.base import Tangent, flatten_examples
from keras_roll.rounding import rules
from keras_roll.rounding.precision import gamma, underflow_unit, unit_roundoff

__all__ = ["SLICE_EXAMPLES", "Norms", "TangentNorms", "UnsupportedTangentBound",
           "tangent_budget", "tangent_norms"]

U32 = unit_roundoff("float32")
ETA32 = underflow_unit("float32")
QS = (1, 2, math.inf)  # the norms over directions: l1, l2, l_inf
# Examples per slice of the default certificate at most (memory allowing): each slice
# has fixed costs (forward, noise and error passes, candidates), so slices are wide.
SLICE_EXAMPLES = 1024


class UnsupportedTangentBound(ValueError):
    """An op of the model has no bound on its float32 tangent pass (e.g. a recurrence)."""


class Norms(NamedTuple):
    """Per-neuron norms of the input gradients, `[b, N]` float64 each."""

    l2: np.ndarray
    linf: np.ndarray
    l1: np.ndarray


class TangentNorms(NamedTuple):
    """Gradient norms of a float32 tangent pass and rigorous bounds on their error.

    Attributes:
        norms: the computed norms (float32 tangents, sums accumulated in float64);
            `linf` is None when the pass was asked not to compute it.
        error: bounds on `|norms - exact norms|`, norm by norm: the tangent
            pass's own rounding and the reduction's.
        finite: `[b]` bool, False where the float32 pass overflowed (the norms
            of that example are then meaningless: use float64).
    """

    norms: Norms
    error: Norms
    finite: np.ndarray

    @property
    def upper(self) -> Norms:
        """Rigorous upper bounds on the exact norms (None where not computed)."""
        return Norms(*(None if n is None else n + e for n, e in zip(self.norms, self.error)))

    @property
    def lower(self) -> Norms:
        """Rigorous lower bounds on the exact norms (None where not computed)."""
        return Norms(*(None if n is None else np.maximum(n - e, 0.0)
                       for n, e in zip(self.norms, self.error)))


# --------------------------------------------------------------------------- the float32 pass


def _reduce(t: Tangent, with_max: bool = True):
    """`(sum |t|, sum t^2[, max |t|])` over the directions: `[B or 1, *shape]` each."""
    v = t.value
    axis = 0 if t.shared else 1
    out = (tf.reduce_sum(tf.abs(v), axis), tf.reduce_sum(tf.square(v), axis))
    if with_max:
        out += (tf.maximum(tf.reduce_max(v, axis), -tf.reduce_min(v, axis)),)
    return tuple(o[None] for o in out) if t.shared else out


def _example_view(t: Tangent):
    """A `[B or K, *shape]` tensor with the tangent's per-example shape (for the rules)."""
    return t.value if t.shared else t.value[:, 0]


class NormsTransform(TangentTransform):
    """The float32 tangent pass that also reduces the input tangents of every op that
    rounds to their norms over the directions (`P_q`, see the module docstring), and
    the neuron tangents to theirs.

    An activation whose frozen slopes are all 0 or 1 (ReLU) multiplies its input
    tangent exactly, so the norms of its output are its neurons' norms times the
    slopes: the next op's `P_q` costs no second pass over the tangents.

    Args:
        folds: the interpreter's `folds`.
        with_max: whether to reduce to `max |t|` too (the dual norm of l1 balls).
    """

    def __init__(self, folds, with_max: bool = True):
        super().__init__(folds)
        self.with_max = with_max
        self.input_norms: list = []
        self.neuron_norms: list = []
        self._known: dict = {}  # id(tangent value) -> (value, its norms)

    def _norms(self, t: Tangent):
        known = self._known.get(id(t.value))
        return _reduce(t, self.with_max) if known is None else known[1]

    def apply(self, op, inputs, mask, record):
        rule = rules.rounding_rule(op)
        n = rule.tangent_roundings(op, [_example_view(t) for t in inputs], False)
        if n is None:
            raise UnsupportedTangentBound(
                f"Layer '{op.name}' ({type(op).__name__}) rounds inside its tangent pass.")
        need = (n or rule.neuron_tangent_roundings(op)) and id(self._step) not in self._folded
        self.input_norms.append([self._norms(t) for t in inputs] if need else None)
        count = len(self.neuron_tangents)
        out = super().apply(op, inputs, mask, record)
        if len(self.neuron_tangents) > count:
            norms = _reduce(Tangent(self.neuron_tangents[-1]), self.with_max)  # -> [B, n]
            self.neuron_norms.append(norms)
            if getattr(op, "binary_slopes", False):
                slope = record.slope  # [B, *shape], 0 or 1
                self._known[id(out.value)] = (out.value, tuple(
                    slope * tf.reshape(r, tf.shape(slope)) for r in norms))
        return out


def _chunk(program, folds, trace, start, k, example_shape, with_max):
    """One chunk of input axes in float32: `((sum |g|, sum g^2[, max |g|]) [b, N], input
    norms per op)`; `trace` has float32 records; `example_shape` a tuple of ints."""
    d = tf.reduce_prod(example_shape)
    axes = start + tf.range(k)
    dirs = tf.reshape(tf.one_hot(axes, d, dtype=tf.float32), tf.concat([[k], example_shape], 0))
    transform = NormsTransform(folds, with_max)
    propagate(program, transform, Tangent(dirs, True, axes=tf.where(axes < d, axes, -1)), trace)
    if not transform.neuron_norms:
        empty = tf.zeros(tf.stack([tf.shape(trace.input)[0], 0]), tf.float32)
        return (empty,) * (3 if with_max else 2), transform.input_norms
    parts = transform.neuron_norms
    return tuple(tf.concat(p, axis=-1) for p in zip(*parts)), transform.input_norms


# --------------------------------------------------------------------------- the error pass


class ErrorTransform(Transform):
    """`W_q <- |A| (W_q + gamma_n P_q + eta_q) + n eta_q` through the float64 twin, and
    the neurons' share: a rigorous bound on the q-norm error of every neuron's
    float32 tangents. Edges carry `(W_q, single)`.

    Args:
        program: the compiled model (for the folded BatchNormalizations).
        folds: the interpreter's `folds`.
        norms: per op, the input norms `P_q` (`[B, *shape]` float64 each) or None.
        eta: `eta_q`, the underflow term of the q-norm over all directions.
    """

    def __init__(self, folds, norms, eta):
        self.folds = folds
        self.norms = norms
        self.eta = eta
        self.index = 0
        self.neurons: list = []
        self.step = None
        self.folded: set = set()

    def enter_step(self, step, inputs, record):
        self.step = step
        return record.mask

    def _fold_roundings(self, op, ws) -> int | None:
        """Roundings of a BatchNormalization folded into this op's kernel (its scale's
        own and the product), or None if no scale is folded (as `TangentTransform`)."""
        after = self.folds.get(id(self.step))
        if after is None or after.ops[0].channel_scale(tf.float64, len(ws[0].shape)) is None:
            return None
        self.folded.add(id(after))
        return rules.roundings(after.ops[0], ws) + 1

    def apply(self, op, inputs, mask, record):
        rule = rules.rounding_rule(op)
        ws = [w for w, _ in inputs]
        single = all(s for _, s in inputs)
        p = self.norms[self.index]
        self.index += 1
        if id(self.step) in self.folded:  # its scale is in the previous op's kernel
            n = 0
        else:
            n = rule.tangent_roundings(op, ws, single)
            fold = self._fold_roundings(op, ws)
            n += fold or 0
        g = gamma(n, U32)
        inj = [w + self.eta + (g * pq if n else 0.0) for w, pq in zip(ws, p or [None] * len(ws))]
        out = rule.magnitude(op, inj, record, False, mask) + n * self.eta
        if op.owns_neurons:
            nn = rule.neuron_tangent_roundings(op)
            gn = gamma(nn, U32)
            neuron_in = [w + (gn * pq + self.eta if nn else 0.0)
                         for w, pq in zip(ws, p or [None] * len(ws))]
            self.neurons.append(rule.neuron_magnitude(op, neuron_in, record, False, mask)
                                + nn * self.eta)
        return out, single and rule.keeps_single_terms(op)


def _error_pass(interpreter, trace, norms, eta):
    """`[B, N]` bounds on the q-norm errors of the neurons' float32 tangents."""
    x = trace.input
    transform = ErrorTransform(interpreter.folds, norms, eta)
    propagate(interpreter.program, transform, (tf.zeros_like(x), True), trace)
    if not transform.neurons:
        return tf.zeros(tf.stack([tf.shape(x)[0], 0]), tf.float64)
    return tf.concat([flatten_examples(n) for n in transform.neurons], axis=1)


# --------------------------------------------------------------------------- drivers


class _Compiled(NamedTuple):
    chunk: object
    errors: object


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(twin) -> _Compiled:
    fns = _COMPILED.get(twin)
    if fns is None:
        interp = twin.interpreter if twin.dtype == "float64" else \
            Interpreter(twin.program, "float64")

        def compiled(fn):  # one trace serves every batch size (a slice's, the last's)
            return batch_polymorphic(tf.function(fn, reduce_retracing=True, autograph=False))

        fns = _Compiled(compiled(functools.partial(_chunk, interp.program, interp.folds)),
                        compiled(functools.partial(_error_pass, interp)))
        _COMPILED[twin] = fns
    return fns


def _accumulate(acc, part):
    """Adds one chunk's (sum, sum of squares[, max]) into `acc` (numpy float64)."""
    part = [np.asarray(t, np.float64) for t in part]
    if acc is None:
        return part
    return [acc[0] + part[0], acc[1] + part[1], *(np.maximum(a, t)
                                                  for a, t in zip(acc[2:], part[2:]))]


def tangent_norms(twin, fwd, memory_budget: int | None = None,
                  with_max: bool = True) -> TangentNorms:
    """Gradient norms of every neuron of `fwd`'s examples from a float32 tangent pass
    with the pattern of `fwd`, and rigorous bounds on their error (module docstring).

    Args:
        twin: the float64 `Linearized` that made `fwd`.
        fwd: its `ForwardPass` on one slice of examples.
        memory_budget: bytes of float32 tangents per chunk (default the twin's).
        with_max: whether to compute `max_k |g_jk|` (the dual norm of l1 balls);
            without it the pass skips two reductions per tangent and an error pass.

    Returns:
        A `TangentNorms`.

    Raises:
        UnsupportedTangentBound: an op rounds inside its tangent pass (SimpleRNN).

    Example:

    ```python
    tn = tangent_norms(twin, twin.forward(x))
    tn.upper.l1            # >= the exact ||g_j||_1 of every neuron
    ```
    """
    fns = _compiled(twin)
    trace = fwd.trace
    shape = tuple(int(s) for s in trace.input.shape[1:])
    d = int(np.prod(shape))
    b = int(trace.input.shape[0])
    per = twin.layout(shape).tangent_bytes(4)
    plan = plan_chunks(1, d, per * b, int(memory_budget or twin.memory_budget))
    trace32 = cast_records(trace, tf.float32)
    neurons, inputs = None, None
    for start in plan.direction_starts():
        out, norms = fns.chunk(trace32, tf.constant(start, tf.int32),
                               tf.constant(plan.per_chunk, tf.int32), shape, bool(with_max))
        neurons = _accumulate(neurons, out)
        if inputs is None:
            inputs = [None if n is None else [_accumulate(None, t) for t in n] for n in norms]
        else:
            inputs = [None if a is None else [_accumulate(x, t) for x, t in zip(a, n)]
                      for a, n in zip(inputs, norms)]
    return _bounds(fns, trace, neurons, inputs, d, plan.per_chunk, b)


def tangent_budget(twin, x, batch_size: int | None = None, with_max: bool = True) -> int:
    """The chunk budget of the float32 pass of `x`: the twin's, or under
    `memory_budget="auto"` the fastest of the candidates that cut `x` into the
    fewest example slices, by a timed probe of one chunk
    (`keras_roll.compile.autotune`), remembered per model and per-example shape.

    Args:
        twin: the float64 `Linearized`.
        x: `[B, *input_shape]` checked inputs.
        batch_size: the caller's examples per slice, or None.
        with_max: as in `tangent_norms`.
    """
    if not getattr(twin, "auto_budget", False) or int(x.shape[0]) == 0:
        return twin.memory_budget
    shape = tuple(int(s) for s in x.shape[1:])
    layout = twin.layout(shape)
    per = layout.tangent_bytes(4)

    def plan_for(budget):
        return plan_chunks(int(x.shape[0]), layout.input_size, per, budget, batch_size,
                           max_examples=SLICE_EXAMPLES)

    def widest(plans):
        # Each example slice has fixed costs (the forward, noise and error passes, the
        # candidates) that one timed chunk cannot show: time only the widest slicings.
        fewest = min(p.example_chunks for p in plans.values())
        return {b: p for b, p in plans.items() if p.example_chunks == fewest}

    key = ("float32 tangents", shape, batch_size, bool(with_max))
    return remembered_budget(twin.model, key, lambda: probed_budget(
        auto_candidates(plan_for), _chunk_seconds(twin, x, per, with_max), widest),
        default=twin.memory_budget)


def _chunk_seconds(twin, x, per, with_max):
    """`seconds(budget, plan)`: the float32 pass of one chunk of `plan` on the first
    examples of `x`, per example and direction (as `tangent_norms` cuts it)."""
    fns = _compiled(twin)
    shape = tuple(int(s) for s in x.shape[1:])
    d = int(np.prod(shape))
    traces = {}

    def seconds(budget, plan):
        b = min(plan.examples_per_chunk, int(x.shape[0]))
        if b not in traces:
            trace = twin.compiled.primal(tf.cast(x[:b], twin.dtype)).trace
            traces[b] = cast_records(trace, tf.float32)
        k = plan_chunks(1, d, per * b, budget).per_chunk
        start = time.perf_counter()
        out = fns.chunk(traces[b], tf.constant(0, tf.int32), tf.constant(k, tf.int32), shape,
                        with_max)
        _ = [t.numpy() for t in tf.nest.flatten(out) if t is not None]
        return (time.perf_counter() - start) / (b * k)

    return seconds


def _bounds(fns, trace, neurons, inputs, d: int, k: int, b: int) -> TangentNorms:
    """The `TangentNorms` from accumulated sums: the error pass per norm plus the
    reductions' own rounding (chunk sums of at most `k` float32 terms)."""
    finite = np.all(np.isfinite(neurons[1]), axis=1) & np.all(np.isfinite(neurons[0]), axis=1)
    for a in inputs:
        for t in a or ():
            finite &= np.all(np.isfinite(t[1].reshape(t[1].shape[0], -1)), axis=1)
    g_red = gamma(k + 1, U32) * 1.01
    s1, s2, mx = (*neurons, None)[:3]
    l2 = np.sqrt(s2)
    l2_hi = np.sqrt((s2 + d * ETA32**2) / (1.0 - g_red))
    l2_lo = np.sqrt(np.maximum(s2 - d * ETA32**2, 0.0) / (1.0 + g_red))
    errs = {}
    for q in QS if mx is not None else QS[:2]:
        p = [None if a is None else [_input_norm(t, q, b, d, g_red) for t in a] for a in inputs]
        eta = (d ** (1.0 / q) if q != math.inf else 1.0) * ETA32
        errs[q] = fns.errors(trace, p, tf.constant(eta, tf.float64)).numpy()
    safety = 1.0 + 2.0**-20
    error = Norms((np.maximum(l2_hi - l2, l2 - l2_lo) + errs[2]) * safety,
                  None if mx is None else errs[math.inf] * safety,
                  (g_red * s1 + d * ETA32 + errs[1]) * safety)
    return TangentNorms(Norms(l2, mx, s1), error, finite)


def _input_norm(t, q, b: int, d: int, g_red: float) -> tf.Tensor:
    """An upper bound on the q-norm over directions of one input tangent, `[b, *shape]`
    float64, from its accumulated (sum, sum of squares, max) with `d` terms each and
    the reduction's relative error `g_red`."""
    if q == 1:
        v = t[0] * (1.0 + g_red) + d * ETA32
    elif q == 2:
        v = np.sqrt((t[1] + d * ETA32**2) / (1.0 - g_red))
    else:
        v = t[2]
    return tf.constant(np.broadcast_to(v, (b, *v.shape[1:])), tf.float64)
