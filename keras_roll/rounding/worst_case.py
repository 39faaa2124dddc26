"""A bound on floating-point rounding: how far computed neurons stray from exact ones.

A certificate is a statement about exact arithmetic on the model's (float32)
weights; the model itself runs in float32 (float16 / bfloat16 under mixed
precision, TensorFloat-32 on recent GPUs), and every sum rounds. A neuron
whose value is smaller than its rounding error can come out on the wrong
side of its breakpoint. This module bounds that error for every neuron by a
standard forward error analysis (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., Sec. 3.1), run as one more pass of the interpreter
(`RoundingTransform`):

* magnitudes `m`: every op maps bounds on `|inputs|` to a bound on `|output|`
  (`|A| m + |b|` for an affine op: `Op.magnitude`), starting from `|x|`;
* relative error bounds `g`: an op that rounds each output `n` times
  (`Op.roundings`: the fan-in of a sum and a few more) in unit roundoff `u`
  has relative error `gamma_n = n u / (1 - n u)` of its magnitude, and errors
  compose as `(1 + g_in)(1 + gamma_n) - 1` (`Op.rounding_growth`);
* absolute error bounds `a` for results near zero (subnormals, or
  flush-to-zero as TensorFlow sets on CPUs): each rounding and each flushed
  input adds at most `eta` (`underflow_unit`), carried through the ops'
  linear parts (`Op.absolute_growth`);

so that the model's computed neuron `z^_j` and the exact `z_j` satisfy
`|z^_j - z_j| <= (1 + g_j)(g_j m_j + a_j)`. The same recursion with the unit roundoff of
float64 bounds the error of the float64 twin that certificates are computed
with. `margins` turns both into smaller, sound radii; docs/design.md, section
"The rounding bound", has the derivation and its assumptions.

Example:

```python
twin = lin.at_dtype("float64")
fwd = twin.forward(x)
rb = twin.compiled.rounding(fwd.trace)     # RoundingBound: [B, N] bounds
err = (rb.g_eval + rb.g_exact) * rb.at_x + rb.abs_eval + rb.abs_exact   # per neuron
```
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.interpreter import Trace, Transform, propagate
from keras_roll.compile.records import Record
from keras_roll.compile.rules.base import flatten_examples

__all__ = [
    "Bound",
    "RoundingBound",
    "RoundingTransform",
    "evaluation_precision",
    "gamma",
    "rounding_bound",
    "tensor_float_32_active",
    "underflow_unit",
    "unit_roundoff",
]

_UNIT_ROUNDOFF = {
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float32": 2.0**-24,
    "float64": 2.0**-53,
}
TF32_UNIT_ROUNDOFF = 2.0**-11  # TensorFloat-32 keeps 10 mantissa bits


def unit_roundoff(dtype) -> float:
    """`u`: half the distance from 1 to the next float of `dtype` (round to nearest).

    Example:

    ```python
    unit_roundoff("float32")      # 5.96e-08
    ```
    """
    name = keras.backend.standardize_dtype(dtype)
    if name not in _UNIT_ROUNDOFF:
        raise ValueError(f"No unit roundoff for dtype {name!r}; expected one of "
                         f"{sorted(_UNIT_ROUNDOFF)}.")
    return _UNIT_ROUNDOFF[name]


# The absolute error of one rounding near zero: the smallest normal number where
# CPUs may flush subnormal results and inputs to zero (TensorFlow sets
# flush-to-zero and denormals-are-zero for float32 / float64 / bfloat16 on CPUs);
# float16 keeps IEEE gradual underflow on GPUs and in CPU conversions, so its
# error there is half the subnormal spacing (we take the full spacing).
_UNDERFLOW = {
    "float16": 2.0**-24,
    "bfloat16": 2.0**-126,
    "float32": 2.0**-126,
    "float64": 2.0**-1022,
}


def underflow_unit(dtype) -> float:
    """`eta`: the absolute error one rounding near zero may add in `dtype`.

    Example:

    ```python
    underflow_unit("float16")     # 5.96e-08 (subnormal spacing)
    ```
    """
    return _UNDERFLOW[keras.backend.standardize_dtype(dtype)]


def gamma(n, u: float) -> float:
    """`gamma_n = n u / (1 - n u)`: the relative error of `n` roundings (inf if `n u >= 1`)."""
    nu = float(n) * float(u)
    return math.inf if nu >= 1.0 else nu / (1.0 - nu)


def tensor_float_32_active() -> bool:
    """Whether float32 matmuls and convolutions may run in TensorFloat-32 here.

    TensorFlow enables TF32 by default on GPUs that have it (Ampere and later);
    it rounds both operands to 10-bit mantissas before an exact product and a
    float32 sum. keras_roll cannot see where an op will be placed, so any
    visible GPU with TF32 enabled counts.
    """
    if not tf.config.experimental.tensor_float_32_execution_enabled():
        return False
    return bool(tf.config.list_physical_devices("GPU"))


def _compute_dtype(layer) -> str | None:
    policy = getattr(layer, "dtype_policy", None)
    name = getattr(policy, "compute_dtype", None) or getattr(layer, "compute_dtype", None)
    return keras.backend.standardize_dtype(name) if name else None


class EvaluationPrecision(NamedTuple):
    """How the model evaluates itself, op by op.

    Attributes:
        default: the coarsest compute dtype of the model's layers (ops of
            Keras operations, which have no dtype policy, use it).
        tf32: whether float32 matmuls / convolutions may run in TensorFloat-32.
    """

    default: str
    tf32: bool

    def dtype_of(self, op) -> str:
        """The compute dtype the model evaluates `op` in."""
        return _compute_dtype(op.layer) or self.default

    def gamma_fn(self, op):
        """`gamma(n, matmul_like)` of `op`'s evaluation (input and weight casts included)."""
        dtype = self.dtype_of(op)
        u = unit_roundoff(dtype)
        narrow = u > unit_roundoff("float32")  # float16 / bfloat16: inputs and weights cast
        tf32 = self.tf32 and dtype == "float32"

        def fn(n, matmul_like=False):
            extra = 2 if narrow else 0
            if tf32 and matmul_like:  # operands rounded to TF32, exact products, f32 sums
                return (1 + TF32_UNIT_ROUNDOFF) ** 2 * (1 + gamma(n, u)) - 1
            return gamma(n + extra, u)

        return fn

    def noise_unit(self, op, n: int, matmul_like: bool | None = None) -> float:
        """`c` such that `c m` is the Hoeffding scale of one evaluation of `op`.

        In the probabilistic model of rounding (Higham & Mary, SIAM J. Sci.
        Comput. 41(5), 2019: independent, mean-zero relative errors bounded by
        `u`), an output of `op` computed with `n` roundings in unit roundoff
        `u` from inputs of magnitude `m` (`Op.magnitude`: `|A| |a| + |b|`) has
        an error that is a sum of independent terms with `sum c_i^2 <= n u^2
        m^2` (every partial sum is at most `m`); rounding the inputs and
        weights to float16 / bfloat16 adds `2 u^2 m^2` (as 2 more roundings),
        TF32 operands `2 u_tf32^2 m^2` before float32 sums. Returns
        `sqrt(sum c_i^2) / m` (see `keras_roll.rounding.noise`).

        Example:

        ```python
        evaluation_precision(lin.program).noise_unit(op, 785)   # sqrt(785) 2^-24
        ```
        """
        dtype = self.dtype_of(op)
        u = unit_roundoff(dtype)
        matmul_like = op.matmul_like if matmul_like is None else matmul_like
        if self.tf32 and dtype == "float32" and matmul_like:
            return math.sqrt(n * u * u + 2 * TF32_UNIT_ROUNDOFF**2) * (1 + TF32_UNIT_ROUNDOFF)
        narrow = u > unit_roundoff("float32")
        return math.sqrt(n + (2 if narrow else 0)) * u

    def describe(self) -> str:
        """E.g. 'float32', 'float16 (mixed precision)', 'float32 (TF32 matmuls)'."""
        if self.default in ("float16", "bfloat16"):
            return f"{self.default} (mixed precision)"
        if self.tf32 and self.default == "float32":
            return "float32 (TensorFloat-32 matmuls and convolutions)"
        return self.default


def evaluation_precision(program) -> EvaluationPrecision:
    """The `EvaluationPrecision` of a compiled program's model.

    Example:

    ```python
    evaluation_precision(lin.program).describe()    # 'float32'
    ```
    """
    dtypes = [d for d in (_compute_dtype(step.layer) for step in program.steps) if d]
    dtypes = [d for d in dtypes if d in _UNIT_ROUNDOFF] or ["float32"]
    coarsest = max(dtypes, key=unit_roundoff)
    return EvaluationPrecision(coarsest, tensor_float_32_active())


@dataclasses.dataclass(frozen=True, eq=False)
class Bound(Record):
    """Magnitude bounds of one tensor of the model, and its relative error bounds.

    Attributes:
        at_x: `[B, *shape]` bound on `|value(x)|`.
        per_radius: `[B, *shape]` bound on `|value(x') - value(x)| / ||x' - x||_inf`
            (the magnitudes of the linear part, from an all-ones input).
        g_eval: relative error bound of the model's own evaluation.
        g_exact: relative error bound of the float64 twin.
        abs_eval: `[B, *shape]` absolute (underflow) error bound of the model's
            evaluation.
        abs_exact: the same for the float64 twin.
    """

    at_x: tf.Tensor
    per_radius: tf.Tensor
    g_eval: tf.Tensor
    g_exact: tf.Tensor
    abs_eval: tf.Tensor
    abs_exact: tf.Tensor


class RoundingBound(NamedTuple):
    """Per-neuron rounding error bounds of a batch, `[B, N]` float64 each.

    At any `x'` with `||x' - x||_inf <= r` (on the activation pattern of `x`),
    the model's own evaluation of neuron `j` differs from its exact value by at
    most `(1 + g_eval_j) (g_eval_j (at_x_j + r per_radius_j) + abs_eval_j)`,
    and the float64 twin's by the same with `g_exact`, `abs_exact`;
    `g_exact_j per_radius_j` also bounds the l1 norm of the error of the
    twin's float64 gradient of neuron `j`.

    Attributes:
        at_x: `[B, N]` bound on `|z_j(x)|`.
        per_radius: `[B, N]` growth of that bound per unit of `||x' - x||_inf`.
        g_eval: `[B, N]` relative error of the model's evaluation.
        g_exact: `[B, N]` relative error of the float64 twin.
        abs_eval: `[B, N]` absolute (underflow) error of the model's evaluation.
        abs_exact: `[B, N]` absolute (underflow) error of the float64 twin.
        overflow: `[B]` bool: some intermediate value of the model may exceed
            the largest finite number of its compute dtype at `x`.
    """

    at_x: tf.Tensor
    per_radius: tf.Tensor
    g_eval: tf.Tensor
    g_exact: tf.Tensor
    abs_eval: tf.Tensor
    abs_exact: tf.Tensor
    overflow: tf.Tensor


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
        at_x, at_x_n = op.magnitudes([b.at_x for b in inputs], record, True, mask)
        per_r, per_r_n = op.magnitudes([b.per_radius for b in inputs], record, False, mask)
        g_in_eval = _max_g([b.g_eval for b in inputs])
        g_in_exact = _max_g([b.g_exact for b in inputs])
        shapes = [b.at_x for b in inputs]
        g_eval, gn_eval = op.rounding_growth(g_in_eval, self.precision.gamma_fn(op), shapes)
        g_exact, gn_exact = op.rounding_growth(
            g_in_exact, lambda n, matmul_like=False: gamma(n, self.exact_u), shapes)
        eta_eval = underflow_unit(self.precision.dtype_of(op))
        eta_exact = underflow_unit("float64")
        a_eval, an_eval = op.absolute_growth([b.abs_eval for b in inputs], record, mask,
                                             eta_eval)
        a_exact, an_exact = op.absolute_growth([b.abs_exact for b in inputs], record, mask,
                                               eta_exact)
        dtype = self.precision.dtype_of(op)
        limit = float(np.finfo(dtype).max) if dtype != "bfloat16" else 3.38e38
        big = tf.reduce_any(flatten_examples(at_x) * (1.0 + g_eval) > limit, axis=1)
        self.overflow = tf.logical_or(self.overflow, big)
        if op.owns_neurons:
            shape = tf.shape(at_x_n)
            self.neurons.append((at_x_n, per_r_n,
                                 tf.broadcast_to(tf.cast(gn_eval, tf.float64), shape),
                                 tf.broadcast_to(tf.cast(gn_exact, tf.float64), shape),
                                 an_eval, an_exact))
        return Bound(at_x, per_r, tf.cast(g_eval, tf.float64), tf.cast(g_exact, tf.float64),
                     a_eval, a_exact)


def _max_g(values):
    out = tf.cast(values[0], tf.float64)
    for v in values[1:]:
        out = tf.maximum(out, tf.cast(v, tf.float64))
    return out


def rounding_bound(interpreter, trace: Trace, precision: EvaluationPrecision) -> RoundingBound:
    """Runs the magnitude pass over a float64 trace (see the module docstring).

    Args:
        interpreter: a float64 `Interpreter`.
        trace: the `Trace` of its forward pass on the batch.
        precision: how the model evaluates itself.

    Returns:
        A `RoundingBound` (neurons in the twin's row order).
    """
    x = tf.cast(trace.input, tf.float64)
    batch = tf.shape(x)[0]
    zero = tf.constant(0.0, tf.float64)
    start = Bound(tf.abs(x), tf.ones_like(x), zero, zero, tf.zeros_like(x), tf.zeros_like(x))
    transform = RoundingTransform(precision, batch)
    propagate(interpreter.program, transform, start, trace)
    if not transform.neurons:
        empty = tf.zeros(tf.stack([batch, 0]), tf.float64)
        return RoundingBound(empty, empty, empty, empty, empty, empty, transform.overflow)
    parts = [tf.concat(list(p), axis=1) for p in zip(*transform.neurons)]
    return RoundingBound(*parts, transform.overflow)
