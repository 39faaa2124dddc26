"""How far the model's own evaluation may stray from exact arithmetic, op by op.

The lower bounds of `keras_roll.robust` speak of the model as Keras evaluates it
(float32; float16 / bfloat16 under mixed precision; TF32 matmuls on GPUs that use
them). Every op of that evaluation computes its exact value on the inputs it was
given plus a rounding error `delta`: a sum of `n` products in unit roundoff `u` errs
by at most `gamma_n (|A| |a| + |b|)` (Higham, *Accuracy and Stability of Numerical
Algorithms*, Sec. 3.1; the op's rounding rule, `keras_roll.rounding.rules`), and each
rounding near zero by at most `eta` more (`keras_roll.rounding.precision`). The float64
twin that computes the bounds errs the same way with `u = 2^-53`; both are added.

So the computed network is the exact network with a bounded perturbation `delta_l`
added to the output of every op `l`, `|delta_l| <= Delta_l`, and a bound pulled back
through the network as a functional `Lambda_l` of that output loses at most
`sum |Lambda_l| Delta_l`: the signed functionals keep their cancellations, only the
last step takes absolute values (docs/design.md, section "Robustness radius").

Example:

```python
delta = OpRounding(evaluation_precision(twin.program))
d = delta(node, [tf.abs(a) for a in node_inputs], record, mask)   # [B, *out] or None
```
"""

from __future__ import annotations

from keras_roll.compile.rules.recurrent import SimpleRNNOp
from keras_roll.errors import UnsupportedModelError
from keras_roll.rounding import rules
from keras_roll.rounding.precision import (
    EvaluationPrecision,
    gamma,
    underflow_unit,
    unit_roundoff,
)

__all__ = ["OpRounding"]

_U64 = unit_roundoff("float64")
_ETA64 = underflow_unit("float64")


class OpRounding:
    """Per-op bounds `Delta_l` on the rounding of the model's evaluation and the twin's.

    Args:
        precision: how the model evaluates itself
            (`keras_roll.rounding.precision.evaluation_precision`).

    Calling it with an op's node, bounds on the absolute values of its inputs, its
    record and mask returns `[B, *output_shape]` bounds on the perturbation of its
    output (None for an op that does not round: ReLU, max, reshapes). Inputs that may
    be flushed to zero (subnormals) are covered by adding `eta / u` to every input
    magnitude, as the noise pass of `keras_roll.rounding.noise` does.
    """

    def __init__(self, precision: EvaluationPrecision):
        self.precision = precision

    def check(self, node) -> None:
        """Refuses an op whose rounding happens inside itself (a SimpleRNN's recursion)."""
        if isinstance(node.op, SimpleRNNOp):
            raise UnsupportedModelError(
                f"Layer '{node.name}' ({type(node.layer).__name__}) rounds inside itself (a "
                f"recurrence), which the rounding bound of robust_radius does not model. "
                f"Pass rigor='float32' (no rounding guard) for this model.")

    def roundings(self, node, inputs: list) -> int:
        """Roundings per output element of the op (static shapes)."""
        return rules.roundings(node.op, inputs)

    def unit(self, node, n: int) -> tuple[float, float]:
        """`(g, e)`: the perturbation is at most `g * magnitude + e`."""
        dtype = self.precision.dtype_of(node.op)
        g = self.precision.gamma_fn(node.op)(n, rules.matmul_like(node.op)) + gamma(n, _U64)
        return g, n * (underflow_unit(dtype) + _ETA64)

    def shift(self, node) -> float:
        """What every input magnitude is raised by for inputs flushed to zero."""
        dtype = self.precision.dtype_of(node.op)
        return underflow_unit(dtype) / unit_roundoff(dtype)

    def __call__(self, node, magnitudes: list, record, mask, affine: bool = True,
                 values=None):
        """`[B, *out]` bound on the perturbation of the op's output, or None.

        Args:
            node: the op's `Node`.
            magnitudes: `[B, *in]` bounds on the absolute values of the op's inputs.
            record, mask: the op's record and mask.
            affine: False for the growth term of an affine bound (no bias, no shift,
                no underflow term): the magnitudes are then a growth per unit radius.
            values: the op's inputs at `x` (for rounding rules derived from the op).
        """
        n = self.roundings(node, magnitudes)
        if n == 0:
            return None
        g, e = self.unit(node, n)
        if not affine:
            return g * rules.magnitude(node.op, magnitudes, record, False, mask, values)
        s = self.shift(node)
        m = rules.magnitude(node.op, [b + s for b in magnitudes], record, True, mask, values)
        return g * m + e
