"""The worst-case rounding bound (`rigor="strict"`): how far computed neurons may stray.

A certificate is a statement about exact arithmetic on the model's (float32)
weights; the model itself runs in float32 (float16 / bfloat16 under mixed
precision, TensorFloat-32 on recent GPUs), and every sum rounds. A neuron
whose value is smaller than its rounding error can come out on the wrong
side of its breakpoint. This module bounds that error for every neuron by a
standard forward error analysis (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., Sec. 3.1), run as one more pass of the interpreter
(`RoundingTransform`) with every op's `RoundingRule` (`keras_roll.rounding.rules`):

* magnitudes `m`: every op maps bounds on `|inputs|` to a bound on `|output|`
  (`|A| m + |b|` for an affine op), starting from `|x|`;
* relative error bounds `g`: an op that rounds each output `n` times in unit
  roundoff `u` has relative error `gamma_n = n u / (1 - n u)` of its
  magnitude, and errors compose as `(1 + g_in)(1 + gamma_n) - 1`;
* absolute error bounds `a` for results near zero (subnormals, or
  flush-to-zero as TensorFlow sets on CPUs): each rounding and each flushed
  input adds at most `eta` (`underflow_unit`), carried through the ops'
  linear parts;

so that the model's computed neuron `z^_j` and the exact `z_j` satisfy
`|z^_j - z_j| <= (1 + g_j)(g_j m_j + a_j)`. The same recursion with the unit
roundoff of float64 bounds the error of the float64 twin that certificates are
computed with. How `g` and `a` grow through an op is the op's `ErrorGrowth`,
from a table keyed by op type (a SimpleRNN rounds at every step of its
recursion). docs/design.md, section "The rounding bound", has the derivation
and its assumptions.

Example:

```python
twin = lin.at_dtype("float64")
rb = rounding_bound(twin, twin.forward(x).trace)     # RoundingBound: [B, N] bounds
err = (rb.g_eval + rb.g_exact) * rb.at_x + rb.abs_eval + rb.abs_exact   # per neuron
```
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import tensorflow as tf

from keras_roll.compile.caches import batch_polymorphic
from keras_roll.compile.interpreter import Interpreter, Trace, Transform, cast_records, propagate
from keras_roll.compile.records import Record
from keras_roll.compile.rules.base import flatten_examples
from keras_roll.compile.rules.recurrent import SimpleRNNOp
from keras_roll.rounding import rules
from keras_roll.rounding.layer_rules import RecurrentRule
from keras_roll.rounding.precision import (
    EvaluationPrecision,
    evaluation_precision,
    gamma,
    largest_finite,
    underflow_unit,
    unit_roundoff,
)

__all__ = [
    "Bound",
    "ErrorBounds",
    "ErrorGrowth",
    "RoundingBound",
    "RoundingTransform",
    "register_error_growth",
    "rounding_bound",
]


@dataclasses.dataclass(frozen=True, eq=False)
class ErrorBounds(Record):
    """Magnitude and rounding error bounds of values of the model, float64 each.

    At any `x'` with `||x' - x||_inf <= r` (on the activation pattern of `x`), the
    model's own evaluation of a value differs from its exact one by at most
    `(1 + g_eval)(g_eval (at_x + r per_radius) + abs_eval)`, and the float64 twin's
    by the same with `g_exact`, `abs_exact`.

    Attributes:
        at_x: bound on `|value(x)|`.
        per_radius: bound on `|value(x') - value(x)| / ||x' - x||_inf` (the
            magnitudes of the linear part, from an all-ones input).
        g_eval: relative error bound of the model's own evaluation.
        g_exact: relative error bound of the float64 twin.
        abs_eval: absolute (underflow) error bound of the model's evaluation.
        abs_exact: the same for the float64 twin.
    """

    at_x: tf.Tensor
    per_radius: tf.Tensor
    g_eval: tf.Tensor
    g_exact: tf.Tensor
    abs_eval: tf.Tensor
    abs_exact: tf.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class Bound(ErrorBounds):
    """The `ErrorBounds` of one tensor of the model (`[B, *shape]`; `g_eval`,
    `g_exact` may be scalars), and its value.

    Attributes:
        value: `[B, *shape]` its value at `x` (float64), a keyword argument.

    Example:

    ```python
    zero = tf.constant(0.0, tf.float64)
    start = Bound(tf.abs(x), tf.ones_like(x), zero, zero, tf.zeros_like(x),
                  tf.zeros_like(x), value=x)
    ```
    """

    value: tf.Tensor = dataclasses.field(kw_only=True)


@dataclasses.dataclass(frozen=True, eq=False)
class RoundingBound(ErrorBounds):
    """Per-neuron rounding error bounds of a batch: `ErrorBounds`, `[B, N]` each.

    `g_exact_j per_radius_j` also bounds the l1 norm of the error of the twin's
    float64 gradient of neuron `j`.

    Attributes:
        overflow: `[B]` bool: some intermediate value of the model may exceed
            the largest finite number of its compute dtype at `x` (a keyword
            argument).

    Example:

    ```python
    rb = rounding_bound(twin, twin.forward(x).trace)
    err = (rb.g_eval + rb.g_exact) * rb.at_x + rb.abs_eval + rb.abs_exact
    ```
    """

    overflow: tf.Tensor = dataclasses.field(kw_only=True)


# --------------------------------------------------------------------------- error growth


class ErrorGrowth:
    """How relative and absolute error bounds grow through one kind of op.

    The default fits an op that rounds each output `n` times
    (`RoundingRule.roundings`) after its inputs' errors reach it.
    """

    def relative(self, op, g_in, gamma_fn, inputs):
        """`(g_out, g_neurons)`: the relative error bound of the output and of the
        neurons, from that of the inputs (`|error| <= g m`) and `gamma_fn(n,
        matmul_like)`, the relative error of `n` roundings in the op's precision.
        Errors compose as `(1 + g_in)(1 + gamma) - 1`."""
        g = gamma_fn(rules.roundings(op, inputs), rules.matmul_like(op))
        return (1.0 + g_in) * (1.0 + g) - 1.0, g_in

    def absolute(self, op, errors, record, mask, eta, values=None):
        """`(output bound, [B, n] neuron bound or None)` of absolute (underflow) errors:
        `|A| (errors + eta) + n eta` (inputs may be flushed to zero, each of the `n`
        roundings may underflow) and the neurons' share of `errors`."""
        n = rules.roundings(op, errors)
        out, _ = rules.magnitudes(op, [e + eta for e in errors], record, False, mask, values)
        neurons = None
        if op.owns_neurons:
            neurons = rules.rounding_rule(op).neuron_magnitude(op, errors, record, False, mask,
                                                               values)
        return out + n * eta, neurons


class RecurrentGrowth(ErrorGrowth):
    """A SimpleRNN layer rounds its sums and its activation again at every step."""

    def relative(self, op, g_in, gamma_fn, inputs):
        """The neurons of step `t` (processing order, as laid out) have
        `(1 + g_in) ((1 + g_sum) (1 + g_act))^t / (1 + g_act) - 1`."""
        g_sum = gamma_fn(rules.roundings(op, inputs), True)
        g_act = gamma_fn(rules.roundings(op.act, inputs), False)
        steps = tf.shape(inputs[0])[1]
        t = tf.cast(tf.range(1, steps + 1), tf.float64)
        growth = tf.constant((1.0 + g_sum) * (1.0 + g_act), tf.float64)
        g_in = tf.cast(g_in, tf.float64)
        g_z = (1.0 + g_in) * tf.pow(growth, t) / (1.0 + g_act) - 1.0  # [T]
        g_neurons = tf.reshape(tf.tile(g_z[:, None], [1, op.cell.units]), [1, -1])
        g_out = (1.0 + g_in) * tf.pow(growth, tf.cast(steps, tf.float64)) - 1.0
        return g_out, g_neurons

    def absolute(self, op, errors, record, mask, eta, values=None):
        """Every step's sums add `n eta`, its inputs and state may be flushed
        (`+ eta`), its activation adds `eta`s: the recursion on absolute errors."""
        dtype = errors[0].dtype
        recurrent = tf.abs(tf.cast(op.cell.recurrent_kernel, dtype))
        n = rules.roundings(op, errors)
        bias = eta * (n + tf.reduce_sum(recurrent, axis=0))
        slope = tf.abs(tf.cast(record.slope, dtype))
        offset = eta * (slope + rules.roundings(op.act, errors) + 1.0)
        return RecurrentRule.recursion(op, errors[0] + eta, record, bias, offset)


_DEFAULT_GROWTH = ErrorGrowth()
_GROWTH: dict[type, ErrorGrowth] = {SimpleRNNOp: RecurrentGrowth()}


def register_error_growth(op_class: type, growth: ErrorGrowth) -> None:
    """Registers how errors grow through ops of `op_class` (an op that rounds inside
    itself, such as a recursion), for the worst-case bound.

    Example:

    ```python
    register_error_growth(MyRecurrentOp, MyGrowth())
    ```
    """
    if not isinstance(growth, ErrorGrowth):
        raise TypeError(f"Expected an ErrorGrowth, got {growth!r}.")
    _GROWTH[op_class] = growth


def _growth(op) -> ErrorGrowth:
    return _GROWTH.get(type(op), _DEFAULT_GROWTH)


# --------------------------------------------------------------------------- the pass


class RoundingTransform(Transform):
    """The magnitude pass: `Bound`s flow along the edges, neuron bounds are collected.

    Args:
        precision: the model's `EvaluationPrecision`.
        batch: the batch size.
    """

    def __init__(self, precision: EvaluationPrecision, batch):
        self.precision = precision
        self.exact_u = unit_roundoff("float64")
        self.neurons: list[tuple] = []
        self.overflow = tf.zeros(tf.reshape(batch, [1]), tf.bool)

    def enter_step(self, step, inputs, record):
        return record.mask

    def apply(self, op, inputs, mask, record):
        values = [b.value for b in inputs]
        value = tf.cast(op.forward(values, mask)[0], tf.float64)
        at_x, at_x_n = rules.magnitudes(op, [b.at_x for b in inputs], record, True, mask, values)
        per_r, per_r_n = rules.magnitudes(op, [b.per_radius for b in inputs], record, False,
                                          mask, values)
        growth = _growth(op)
        shapes = [b.at_x for b in inputs]
        g_eval, gn_eval = growth.relative(op, _max_g([b.g_eval for b in inputs]),
                                          self.precision.gamma_fn(op), shapes)
        g_exact, gn_exact = growth.relative(op, _max_g([b.g_exact for b in inputs]),
                                            lambda n, matmul_like=False: gamma(n, self.exact_u),
                                            shapes)
        dtype = self.precision.dtype_of(op)
        a_eval, an_eval = growth.absolute(op, [b.abs_eval for b in inputs], record, mask,
                                          underflow_unit(dtype), values)
        a_exact, an_exact = growth.absolute(op, [b.abs_exact for b in inputs], record, mask,
                                            underflow_unit("float64"), values)
        big = tf.reduce_any(flatten_examples(at_x) * (1.0 + g_eval) > largest_finite(dtype),
                            axis=1)
        self.overflow = tf.logical_or(self.overflow, big)
        if op.owns_neurons:
            shape = tf.shape(at_x_n)
            self.neurons.append((at_x_n, per_r_n,
                                 tf.broadcast_to(tf.cast(gn_eval, tf.float64), shape),
                                 tf.broadcast_to(tf.cast(gn_exact, tf.float64), shape),
                                 an_eval, an_exact))
        return Bound(at_x, per_r, tf.cast(g_eval, tf.float64), tf.cast(g_exact, tf.float64),
                     a_eval, a_exact, value=value)


def _max_g(values):
    out = tf.cast(values[0], tf.float64)
    for v in values[1:]:
        out = tf.maximum(out, tf.cast(v, tf.float64))
    return out


def _bound_pass(interpreter, trace: Trace, precision: EvaluationPrecision) -> RoundingBound:
    x = tf.cast(trace.input, tf.float64)
    batch = tf.shape(x)[0]
    zero = tf.constant(0.0, tf.float64)
    start = Bound(tf.abs(x), tf.ones_like(x), zero, zero, tf.zeros_like(x), tf.zeros_like(x),
                  value=x)
    transform = RoundingTransform(precision, batch)
    propagate(interpreter.program, transform, start, trace)
    if not transform.neurons:
        empty = tf.zeros(tf.stack([batch, 0]), tf.float64)
        return RoundingBound(empty, empty, empty, empty, empty, empty, overflow=transform.overflow)
    parts = [tf.concat(list(p), axis=1) for p in zip(*transform.neurons)]
    return RoundingBound(*parts, overflow=transform.overflow)


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rounding_bound(twin, trace: Trace) -> RoundingBound:
    """Runs the worst-case pass over a trace of `twin` (see the module docstring).

    Computed in float64 whatever the twin's dtype, compiled once per twin.

    Args:
        twin: a `Linearized` model.
        trace: the `Trace` of its forward pass on the batch.

    Returns:
        A `RoundingBound` (neurons in the twin's row order).

    Example:

    ```python
    rb = rounding_bound(twin, twin.forward(x).trace)
    ```
    """
    fn = _COMPILED.get(twin)
    if fn is None:  # a partial per twin: TensorFlow counts retracings per function
        interp = Interpreter(twin.program, "float64")
        fn = batch_polymorphic(tf.function(functools.partial(_bound_pass, interp),
                                           reduce_retracing=True, autograph=False))
        _COMPILED[twin] = fn
    trace64 = cast_records(trace, tf.float64)
    return fn(trace64, evaluation_precision(twin.program))
