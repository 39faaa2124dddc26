"""Floating-point precisions: unit roundoffs, underflow, TF32 and mixed precision.

Every bound of `keras_roll.rounding` speaks of roundings in some dtype: the
model's own evaluation (its layers' compute dtypes: float32, float16 /
bfloat16 under mixed precision, TensorFloat-32 matmuls on recent GPUs) and the
twin that computes the certificate (float64, or float32 tangents with a bound
of their own). This module holds those numbers and `EvaluationPrecision`, how a
compiled model evaluates itself op by op (docs/design.md, section "The
rounding bound").

Example:

```python
unit_roundoff("float32")                                  # 2**-24
gamma(785, unit_roundoff("float32"))                      # 4.68e-05
evaluation_precision(lin.program).describe()              # 'float32'
```
"""

from __future__ import annotations

import math
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

__all__ = [
    "TF32_UNIT_ROUNDOFF",
    "EvaluationPrecision",
    "evaluation_precision",
    "gamma",
    "largest_finite",
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


def underflow_unit(dtype) -> float:
    """`eta`: the absolute error one rounding near zero may add in `dtype`.

    Example:

    ```python
    underflow_unit("float16")     # 5.96e-08 (subnormal spacing)
    ```
    """
    return _UNDERFLOW[keras.backend.standardize_dtype(dtype)]


def largest_finite(dtype) -> float:
    """The largest finite number of `dtype` (bfloat16 shares float32's exponent range).

    Example:

    ```python
    largest_finite("float16")     # 65504.0
    ```
    """
    name = keras.backend.standardize_dtype(dtype)
    return 3.38e38 if name == "bfloat16" else float(np.finfo(name).max)


def gamma(n, u: float) -> float:
    """`gamma_n = n u / (1 - n u)`: the relative error of `n` roundings (inf if `n u >= 1`).

    Example:

    ```python
    gamma(2, 2.0**-53)            # 2.2e-16
    ```
    """
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

    def noise_unit(self, op, n: int, matmul_like: bool) -> float:
        """`c` such that `c m` is the Hoeffding scale of one evaluation of `op`.

        In the probabilistic model of rounding (Higham & Mary, SIAM J. Sci.
        Comput. 41(5), 2019: independent, mean-zero relative errors bounded by
        `u`), an output of `op` computed with `n` roundings in unit roundoff
        `u` from inputs of magnitude `m` (`|A| |a| + |b|`) has an error that is
        a sum of independent terms with `sum c_i^2 <= n u^2 m^2` (every partial
        sum is at most `m`); rounding the inputs and weights to float16 /
        bfloat16 adds `2 u^2 m^2` (as 2 more roundings), TF32 operands
        `2 u_tf32^2 m^2` before float32 sums. Returns `sqrt(sum c_i^2) / m`
        (see `keras_roll.rounding.noise`).

        Example:

        ```python
        evaluation_precision(lin.program).noise_unit(op, 785, True)   # sqrt(785) 2^-24
        ```
        """
        dtype = self.dtype_of(op)
        u = unit_roundoff(dtype)
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
