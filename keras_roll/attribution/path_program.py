"""The twin's passes along straight paths, for the exact integrated-gradients walk.

Along `x(t) = x0 + t d` the ops before the first neuron-owning op (the *affine
prefix*: a first Dense or convolution, rescaling, a folded batch norm) are affine
in `t`: their output is `u(t) = u0 + t u1`, with `u0` the prefix at `x0` and `u1`
its linear part applied to `d`. `PathTwin` computes `u0` and `u1` once per path and
starts every probe from `u(t)`, so the prefix costs nothing per region crossed:
no forward product, no tangent product, and no backward product (the gradients
with respect to `u`, weighted by the lengths of their regions, are summed per path
and pulled back through the prefix once at the end).

When the first neuron-owning op is a pointwise activation (ReLU and its
relatives), its pre-activations are `u(t)` itself, affine along the whole path:
every crossing of its breakpoints is known from `u0` and `u1` alone
(`first_crossings`), so the probes leave its neurons out of their margins and
pattern keys. See docs/design.md, section "Exact integrated gradients".

Example:

```python
twin = PathTwin.of(LogitGradients.of(model))
u0, u1 = twin.ends(base, d)                # [n, *u_shape] each
fwd, back, keys, grad_u = twin.probe(u0, u1, owner, t, weights[owner])
grad_x = twin.pull_back(weighted_grad_u)   # [n, *input_shape]
```
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_roll.compile.caches import cached
from keras_roll.compile.interpreter import (
    PrimalTransform,
    TangentTransform,
    Trace,
    propagate,
)
from keras_roll.compile.prefix import affine_prefix
from keras_roll.compile.rules import NO_RECORD, Activation, Tangent
from keras_roll.compile.rules.recurrent import MaskingOp

__all__ = ["HYPERPLANE_EPSILONS", "PathTwin", "first_crossings", "in_hyperplanes"]

_KEY_RANGE = 2**20  # pattern keys: integer weights below this, sums exact in float64
HYPERPLANE_EPSILONS = 2**12  # within this many epsilons of the unit's scale: in the plane


class _Given:
    """Stands in for a skipped prefix op: returns a given value, records nothing."""

    owns_neurons = False

    def __init__(self, value):
        self.value = value

    def forward(self, inputs, mask):
        return self.value, NO_RECORD


class _PathPrimal(PrimalTransform):
    """The forward pass with the prefix ops replaced by the given `u`."""

    def __init__(self, program, u, dtype, skipped):
        super().__init__(program, u, dtype)
        self.skipped = skipped
        self.given = _Given(u)

    def apply(self, op, inputs, in_masks, record):
        return super().apply(self.given if id(op) in self.skipped else op, inputs, in_masks,
                             record)


class _PathTangent(TangentTransform):
    """The frozen-pattern tangent pass with the prefix ops replaced by `u1`."""

    def __init__(self, folds, skipped, tangent):
        super().__init__(folds)
        self.skipped = skipped
        self.given = tangent

    def apply(self, op, inputs, mask, record):
        if id(op) in self.skipped:
            return self.given
        return super().apply(op, inputs, mask, record)


def _affine_prefix(program) -> tuple[list, object]:
    """The ops of the program's affine prefix (`keras_roll.compile.prefix`), and the op
    after them if it is a pointwise activation with constant breakpoints (else None);
    no prefix before a Masking layer (its mask reads the values themselves)."""
    prefix = affine_prefix(program)
    if prefix is None:
        return [], None
    op = program.steps[prefix.start].ops[prefix.start_op]
    if isinstance(op, MaskingOp):
        return [], None
    plain = isinstance(op, Activation) and all(
        isinstance(b, (int, float)) for b in op.breakpoints)
    return list(prefix.ops), op if plain else None


class PathTwin:
    """Compiled probes of a model along straight paths (see the module docstring).

    Args:
        engine: a `keras_roll.attribution.gradients.LogitGradients`.
    """

    def __init__(self, engine):
        self.lin = engine.lin
        self.dtype = self.lin.dtype
        self.prefix, self.first = _affine_prefix(self.lin.program)
        self.skipped = frozenset(id(op) for op in self.prefix)
        compiled = lambda fn: tf.function(fn, reduce_retracing=True, autograph=False)  # noqa: E731
        self._ends = compiled(self._ends_impl)
        self._probe = compiled(self._probe_impl)
        self._pull = compiled(self._pull_impl)

    @classmethod
    def of(cls, engine) -> PathTwin:
        return cached(engine, ("path_twin", cls), lambda: cls(engine))

    @property
    def hoists_first_unit(self) -> bool:
        """Whether the first activation's crossings come from `first_crossings`."""
        return self.first is not None

    # ------------------------------------------------------------------ compiled

    def _prefix(self, x):
        for op in self.prefix:
            x = tf.cast(op.forward([x], None)[0], x.dtype)
        return x

    def _ends_impl(self, base, d):
        t = Tangent(d[:, None], shared=False)
        for op in self.prefix:
            t = op.tangent([t], NO_RECORD, None)[0]
        return self._prefix(base), tf.cast(t.per_example(tf.shape(d)[0])[:, 0], base.dtype)

    def _pull_impl(self, x, s):
        with tf.GradientTape() as tape:
            tape.watch(x)
            u = self._prefix(x)
        return tape.gradient(u, x, output_gradients=s)

    def _probe_impl(self, u0, u1, owner, t, weights):
        program = self.lin.program
        rate = tf.gather(u1, owner)
        shape = tf.concat([[-1], tf.ones(tf.rank(rate) - 1, tf.int32)], 0)
        u = tf.gather(u0, owner) + tf.reshape(t, shape) * rate
        with tf.GradientTape() as tape:
            tape.watch(u)
            primal = _PathPrimal(program, u, self.dtype, self.skipped)
            logits = propagate(program, primal, u)
            logits = tf.reshape(logits, tf.stack([tf.shape(u)[0], -1]))
            total = tf.reduce_sum(logits * weights)
        grad = tape.gradient(total, u)
        if grad is None:  # the selected logit does not depend on the input
            grad = tf.zeros_like(u)
        tangent = _PathTangent(self.lin.interpreter.folds, self.skipped,
                               Tangent(rate[:, None], shared=False))
        propagate(program, tangent, Tangent(rate[:, None], shared=False),
                  Trace(u, tuple(primal.steps)))
        units = [(op, rec) for step, srec in zip(program.steps, primal.steps)
                 for op, rec in zip(step.ops, srec.ops) if op.owns_neurons]
        start = 1 if self.first is not None else 0
        forward, back, keys = _unit_margins(units[start:], primal.neurons[start:],
                                            tangent.neuron_tangents[start:], start,
                                            tf.shape(u)[0], self.dtype)
        return forward, back, keys, grad

    # ------------------------------------------------------------------ public

    def ends(self, base: np.ndarray, d: np.ndarray):
        """`(u0, u1)` tensors: the prefix at the baselines and its linear part along `d`."""
        u0, u1 = self._ends(tf.constant(base), tf.constant(d))
        self._u_shape = tuple(u0.shape[1:])
        return u0, u1

    def probe(self, u0, u1, owner, t, weights):
        """Probes points `t` of the paths `owner` for the targets `weights [P, L]`:
        `(forward [P], back [P], keys [P, 2], grad_u [P, *u_shape])` as numpy (margins
        in units of `t`; `grad_u` the gradient of `sum(weights * logits)`)."""
        out = self._probe(u0, u1, tf.constant(owner, tf.int32), tf.constant(t, self.dtype),
                          tf.constant(weights, self.dtype))
        return tuple(o.numpy() for o in out)

    def pull_back(self, s: np.ndarray, ex_shape) -> np.ndarray:
        """`J^T s` through the prefix, in float64: `[n, *u_shape]` gradients with respect
        to `u` to `[n, *input_shape]` gradients with respect to the input."""
        if not self.prefix:
            return s.reshape(s.shape[0], *ex_shape)
        x = tf.zeros((s.shape[0], *ex_shape), tf.float64)
        return self._pull(x, tf.constant(s.reshape(-1, *self._u_shape))).numpy()


def _unit_margins(units, neurons, tangents, first_block: int, batch, dtype):
    """`(forward [P], back [P], keys [P, 2])`: the directional margins along `+d` and
    `-d` over the neurons of every unit, and integer-valued keys of their pattern.

    Pointwise activations work from their pre-activations and breakpoints (a neuron
    on a breakpoint is on the piece below it, as in `Activation.neurons`); other units
    from their neurons' distances (`keras_roll.certification.margin_math`).
    """
    if len(units) != len(neurons) or len(units) != len(tangents):
        raise RuntimeError(f"{len(units)} units but {len(neurons)} neuron blocks and "
                           f"{len(tangents)} tangent blocks.")
    forward = back = keys = None
    for i, ((op, rec), block, rates) in enumerate(zip(units, neurons, tangents)):
        rates = tf.reshape(rates, tf.stack([tf.shape(rates)[0], -1]))
        if _plain_activation(op) and rec.mask is None:
            z = tf.reshape(rec.z, tf.shape(rates))
            f, b, pattern = _activation_margins(z, rates, op.breakpoints)
        else:
            f, b = _distance_margins(rates, block)
            pattern = tf.where(block.valid, block.piece + 1, tf.zeros_like(block.piece))
        weights = tf.random.stateless_uniform(
            tf.stack([tf.shape(pattern)[1], 2]), seed=[first_block + i, 19], minval=0,
            maxval=_KEY_RANGE, dtype=tf.int64)
        k = tf.matmul(tf.cast(pattern, tf.float64), tf.cast(weights, tf.float64))
        forward = f if forward is None else tf.minimum(forward, f)
        back = b if back is None else tf.minimum(back, b)
        keys = k if keys is None else keys + k
    if forward is None:  # no neurons (beyond the first unit's): nothing binds
        inf = tf.fill(tf.reshape(batch, [1]), tf.constant(np.inf, dtype))
        return inf, inf, tf.zeros(tf.stack([batch, 2]), tf.float64)
    return forward, back, keys


def _plain_activation(op) -> bool:
    return isinstance(op, Activation) and all(isinstance(b, (int, float))
                                              for b in op.breakpoints)


def _activation_margins(z, rates, breakpoints):
    inf = tf.fill(tf.shape(z), tf.constant(np.inf, z.dtype))
    moving = tf.not_equal(rates, 0)
    safe = tf.where(moving, rates, tf.ones_like(rates))
    up = rates > 0
    forward = back = None
    piece = tf.zeros(tf.shape(z), tf.int32)
    for b in breakpoints:
        over = z > b
        piece += tf.cast(over, tf.int32)
        c = (b - z) / safe  # when the neuron reaches b, forward (> 0) or back (< 0)
        ahead = moving & tf.not_equal(up, over)  # moving towards b
        f = tf.reduce_min(tf.where(ahead, c, inf), axis=1)
        k = tf.reduce_min(tf.where(moving & ~ahead, -c, inf), axis=1)
        forward = f if forward is None else tf.minimum(forward, f)
        back = k if back is None else tf.minimum(back, k)
    return forward, back, piece


def _distance_margins(rates, neurons):
    inf = tf.fill(tf.shape(rates), tf.constant(np.inf, rates.dtype))
    below = tf.where(neurons.valid, tf.cast(neurons.below, rates.dtype), inf)
    above = tf.where(neurons.valid, tf.cast(neurons.above, rates.dtype), inf)
    speed = tf.abs(rates)
    moving = speed > 0
    safe = tf.where(moving, speed, tf.ones_like(speed))
    up = rates > 0
    ahead = tf.where(moving, tf.where(up, above, below) / safe, inf)
    behind = tf.where(moving, tf.where(up, below, above) / safe, inf)
    return tf.reduce_min(ahead, axis=1), tf.reduce_min(behind, axis=1)


def first_crossings(u0: np.ndarray, u1: np.ndarray, breakpoints) -> list[np.ndarray]:
    """Sorted crossing times `t` in `[0, 1]` of the first activation's breakpoints
    along each path (`u0 + t u1`), per path."""
    u0 = u0.reshape(u0.shape[0], -1).astype(np.float64)
    u1 = u1.reshape(u1.shape[0], -1).astype(np.float64)
    out = []
    for a, r in zip(u0, u1):
        moving = r != 0
        times = [(b - a[moving]) / r[moving] for b in breakpoints]
        t = np.concatenate(times) if times else np.zeros(0)
        out.append(np.sort(t[(t >= 0) & (t <= 1)]))
    return out


def in_hyperplanes(u0: np.ndarray, u1: np.ndarray, breakpoints):
    """`(u0, u1)` with the neurons whose whole path runs inside a breakpoint's hyperplane
    put exactly on it: `u0 = b`, `u1 = 0`.

    A neuron lies in the hyperplane `u = b` along the path when both its distance to
    `b` at the start and its rate are within `HYPERPLANE_EPSILONS` machine epsilons of
    the largest of the unit's (per path): they are then rounding noise of an exact
    zero. On the breakpoint, the neuron is on the piece below it all along (the slope
    TensorFlow's ReLU gradient takes at 0), so the path takes that one-sided limit
    and the neuron never ends a region.
    """
    dtype = u0.dtype
    shape = u0.shape
    a = u0.reshape(shape[0], -1).astype(np.float64)
    r = u1.reshape(shape[0], -1).astype(np.float64)
    tol = HYPERPLANE_EPSILONS * float(np.finfo(dtype).eps)
    flat_rate = np.abs(r) <= tol * np.abs(r).max(axis=1, keepdims=True)
    scale = np.abs(a).max(axis=1, keepdims=True)
    a_out, r_out = a.copy(), r.copy()
    for b in breakpoints:
        on = flat_rate & (np.abs(a - b) <= tol * np.maximum(scale, abs(b)))
        a_out[on], r_out[on] = b, 0.0
    return a_out.astype(dtype).reshape(shape), r_out.astype(dtype).reshape(shape)
