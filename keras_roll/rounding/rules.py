"""How each op rounds: the per-op rules every rounding analysis shares.

The rounding analyses of `keras_roll.rounding` (the worst-case pass of
`worst_case`, the noise pass of `noise`, the float32 tangent bound of
`tangent_error`) walk the compiled program with the interpreter and, at every
op, ask its `RoundingRule`, in the manner of jax_verify's
`OpwiseGraphTransform(input_transform, primitive_transform)`:

* `magnitude`: from componentwise bounds `m >= |inputs|`, a bound on the
  absolute values of the op's output and of every partial sum it computes
  (`|A| m + |b|` for an affine op; `|A| m`, with `affine=False`, for its linear
  part, which bounds how differences and tangents propagate);
* `roundings`: how many roundings each output element takes when evaluated
  (its fan-in and a few more), so that its relative error is at most
  `gamma_n = n u / (1 - n u)` of its magnitude (Higham, *Accuracy and
  Stability of Numerical Algorithms*, Sec. 3.1);
* `neuron_magnitude`: the same bound for the neurons the op owns;
* `matmul_like`: whether it is a matrix product or a convolution (TF32).

Rules live in tables keyed by op type (`Activation`, `MaxWindows`,
`SimpleRNNOp`, ...) and, for the `Linear` and `LayerCall` ops of layers, by
layer class (`Dense`, `BatchNormalization`, `AveragePooling2D`, ...). Any other
op, such as one of a custom rule made with `keras_roll.register_rule`, gets
`DerivedRule`: its linear map read off its own `tangent` (the dense `|A|`, for
ops of up to 2^24 input x output elements) and a sum of products per output.
The built-in rules are in `keras_roll.rounding.layer_rules`;
`register_rounding_rule` adds or replaces a rule (docs/design.md, section "The
rounding bound", and docs/guide.md, "Custom rules").

Example:

```python
rule = rounding_rule(op)
out = rule.magnitude(op, [tf.abs(x)], record, affine=True)      # >= |op(x)|
n = rule.roundings(op, [x])                                      # e.g. fan-in + 2
```
"""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from keras_roll.compile.rules.affine import LayerCall
from keras_roll.compile.rules.base import (
    NO_RECORD,
    Linear,
    NoRecord,
    Op,
    Tangent,
    flatten_examples,
)
from keras_roll.rounding.precision import gamma, unit_roundoff

__all__ = [
    "MAX_DENSE_ABS",
    "DerivedRule",
    "RoundingRule",
    "magnitude",
    "magnitudes",
    "matmul_like",
    "register_rounding_rule",
    "rounding_rule",
    "roundings",
    "unregister_rounding_rule",
]

MAX_DENSE_ABS = 2**24  # entries of the dense |A| the derived rule may build


class RoundingRule:
    """How one kind of op rounds. Subclass it and override what differs.

    Attributes:
        matmul_like: whether the op is a matrix product or a convolution
            (TensorFloat-32 on GPUs rounds its operands to 10-bit mantissas).

    Example:

    ```python
    class TimesTwo(RoundingRule):
        def magnitude(self, op, bounds, record, affine, mask=None, values=None):
            return 2.0 * bounds[0]

        def roundings(self, op, inputs):
            return 0          # a product by 2 is exact

    register_rounding_rule(TimesTwoOp, TimesTwo())
    ```
    """

    matmul_like = False

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        """A componentwise bound on `|output|` (and on every partial sum of it).

        Args:
            op: the op.
            bounds: one `[B, *shape]` nonnegative tensor per input, `m >= |input|`.
            record: the op's record from the forward pass.
            affine: True for the op itself (`|A| m + |b|`); False for its linear
                part alone (`|A| m`), which bounds how differences propagate.
            mask: the Keras mask of the step's input (as `Op.tangent` gets it).
            values: the op's actual inputs at `x` (float64), for rules that
                need them (`DerivedRule` on an op with a pattern), or None.

        Must be monotone in `bounds` and satisfy, for the affine map `f` of
        the op on the pattern of `record`, `|f(a)| <= magnitude(|a|)` and
        `|f(a) - f(b)| <= magnitude(|a - b|, affine=False)`.
        """
        raise NotImplementedError

    def roundings(self, op, inputs) -> int:
        """Roundings per output element when the model evaluates the op: its
        computed output `y^` of exact inputs has `|y^ - y| <= gamma_n magnitude(|inputs|)`
        (shapes are static here)."""
        raise NotImplementedError

    def neuron_magnitude(self, op, bounds, record, affine, mask=None, values=None):
        """`[B, n]` bounds on `|z_j|` of the op's neurons; the default fits ops whose
        neurons are their input (activations)."""
        return flatten_examples(bounds[0])

    def tangent_roundings(self, op, inputs, single: bool) -> int | None:
        """Roundings per output element of the op's *tangent* pass (its linear part on
        tangents, `keras_roll.rounding.tangent_error`), or None if the tangent pass
        cannot be bounded this way. `single`: every tangent of the inputs has at most
        one nonzero term per output (one-hot directions, moved or scaled elementwise).
        The default is the evaluation's count: the same sums without the bias."""
        return self.roundings(op, inputs)

    def neuron_tangent_roundings(self, op) -> int:
        """Roundings of the neuron tangents beyond the input tangents (a difference)."""
        return 0

    def keeps_single_terms(self, op) -> bool:
        """Whether the op maps single-term tangents to single-term tangents (it moves
        or scales elements without summing them)."""
        return False

    def magnitudes(self, op, bounds, record, affine, mask=None, values=None):
        """`(output bound, [B, n] neuron bound or None)`; see `magnitude`."""
        out = self.magnitude(op, bounds, record, affine, mask, values)
        neurons = (self.neuron_magnitude(op, bounds, record, affine, mask, values)
                   if op.owns_neurons else None)
        return out, neurons


# --------------------------------------------------------------------------- derived rule


def _dense_abs(op, shapes, record, mask, dtype):
    """`(|A| [R, D_in, D_out], |J_n| [R, D_in, n] or None)` of the op's frozen linear map,
    read off its `tangent` on unit vectors (R = 1 for an example-independent map,
    else the batch)."""
    if not all(d is not None for s in shapes for d in s):
        raise ValueError(f"Layer '{op.name}': the derived rounding rule needs static shapes, "
                         f"got {shapes}; register a rounding rule for it "
                         f"(keras_roll.rounding.register_rounding_rule) or use "
                         f"rigor='float32'.")
    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    d_in = sum(sizes)
    eye = tf.eye(d_in, dtype=dtype)
    parts, start = [], 0
    for shape, size in zip(shapes, sizes):
        parts.append(Tangent(tf.reshape(eye[:, start:start + size], (d_in, *shape)), True))
        start += size
    out, neuron_t = op.tangent(parts, record, mask)
    cols = out.value if not out.shared else out.value[None]
    cols = tf.reshape(cols, tf.stack([tf.shape(cols)[0], d_in, -1]))
    if d_in * int(cols.shape[-1] or 1) > MAX_DENSE_ABS:
        raise ValueError(
            f"Layer '{op.name}' ({type(op.layer).__name__}): it has no rounding rule, and the "
            f"derived one would build a dense [{d_in}, {cols.shape[-1]}] matrix. Register a "
            f"rounding rule for it (keras_roll.rounding.register_rounding_rule; docs/design.md, "
            f"section 'The rounding bound') or use rigor='float32'.")
    return tf.abs(cols), None if neuron_t is None else tf.abs(tf.cast(neuron_t, dtype))


def _times(flat, mat):
    """`[B, D_in] x [R, D_in, n] -> [B, n]` (R = 1: one matrix for the batch)."""
    return tf.einsum("bi,rio->bo" if mat.shape[0] == 1 else "bi,bio->bo", flat, mat)


class DerivedRule(RoundingRule):
    """The rule of an op no table names: derived from the op itself.

    Its linear map `A` (with the recorded pattern) is read off `op.tangent` on
    unit vectors, so `|A| m` is exact; its offset `b` is `op.forward(0)` for an
    op without a pattern, else `f(a) - A a` at the actual inputs `a` (which the
    passes supply as `values`). Each output is taken to be one sum of products:
    its fan-in (nonzeros of its `|A|` column; all inputs for an op with a
    pattern) + 2 roundings. An op that rounds more (a recursion inside it)
    needs a rule of its own.
    """

    def magnitude(self, op, bounds, record, affine, mask=None, values=None):
        out = self._apply(op, bounds, record, affine, mask, values, neurons=False)
        ref = op.forward([b[:1] for b in bounds], None if mask is None else mask[:1])[0]
        return tf.reshape(out, tf.concat([tf.shape(bounds[0])[:1], tf.shape(ref)[1:]], 0))

    def neuron_magnitude(self, op, bounds, record, affine, mask=None, values=None):
        return self._apply(op, bounds, record, affine, mask, values, neurons=True)

    def tangent_roundings(self, op, inputs, single):
        if isinstance(op, LayerCall) and not op.bias_free:
            return None  # its tangent subtracts the layer's value at zero: not a plain sum
        return self.roundings(op, inputs)

    def roundings(self, op, inputs):
        shapes = [tuple(int(d) for d in x.shape[1:]) for x in inputs]
        d_in = int(sum(np.prod(s, dtype=np.int64) for s in shapes))
        if op.owns_neurons or not isinstance(op, (Linear, LayerCall)):
            return d_in + 2  # a pattern per example: every input may contribute
        absa, _ = _dense_abs(op, shapes, NO_RECORD, None, tf.float64)
        fan_in = tf.get_static_value(tf.reduce_max(tf.reduce_sum(tf.cast(absa > 0, tf.int32),
                                                                 1)))
        return (d_in if fan_in is None else int(fan_in)) + 2

    def _apply(self, op, bounds, record, affine, mask, values, neurons: bool):
        dtype = bounds[0].dtype
        shapes = [tuple(int(d) for d in b.shape[1:]) for b in bounds]
        absa, abs_n = _dense_abs(op, shapes, record, mask, dtype)
        mat = abs_n if neurons else absa
        out = _times(tf.concat([flatten_examples(m) for m in bounds], axis=1), mat)
        if affine:
            out += self._offset(op, record, mask, values, shapes, mat, neurons)
        return out

    def _offset(self, op, record, mask, values, shapes, mat, neurons: bool):
        """`|b|` of the op's outputs (or neurons) on the recorded piece, `[B or 1, n]`."""
        dtype = mat.dtype
        if isinstance(record, NoRecord) and not neurons:
            zeros = [tf.zeros((1, *s), dtype) for s in shapes]
            return tf.abs(flatten_examples(tf.cast(op.forward(zeros, None)[0], dtype)))
        if values is None:
            raise ValueError(f"Layer '{op.name}': the derived rounding rule of an op with a "
                             f"pattern needs its input values; register a rounding rule for "
                             f"{type(op).__name__} (keras_roll.rounding.register_rounding_rule).")
        values = [tf.cast(v, dtype) for v in values]
        batch = tf.shape(values[0])[0]
        out, neuron_t = op.tangent([Tangent(v[:, None]) for v in values], record, mask)
        if neurons:
            at = flatten_examples(tf.cast(op.neurons(record).z, dtype))
            lin = tf.reshape(tf.cast(neuron_t, dtype), tf.stack([batch, -1]))
        else:
            at = flatten_examples(tf.cast(op.forward(values, mask)[0], dtype))
            lin = tf.reshape(tf.cast(out.per_example(batch), dtype), tf.stack([batch, -1]))
        # f(a) - A a rounds in float64: add a bound on that rounding.
        size = _times(tf.concat([tf.abs(flatten_examples(v)) for v in values], axis=1), mat)
        slack = gamma(int(mat.shape[1]) + 4, unit_roundoff("float64"))
        return tf.abs(at - lin) + 2.0 * slack * (size + tf.abs(at))


# --------------------------------------------------------------------------- the tables

_DERIVED = DerivedRule()
# Values: a rule, or `fn(op) -> rule` for classes whose ops round in several ways.
_OP_RULES: dict = {}  # by exact op class
_LAYER_RULES: dict = {}  # the Linear / LayerCall op of a layer class
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_rounding_rule(cls: type, rule: RoundingRule, *, override: bool = False):
    """Registers how an op class, or the `Linear` / `LayerCall` op of a layer class, rounds.

    Args:
        cls: an `Op` subclass (a custom op), or a layer class whose rule compiles
            to a `Linear` or `LayerCall` op (e.g. a large custom linear layer,
            whose derived rule would build too big a dense `|A|`).
        rule: a `RoundingRule`, or `fn(op) -> RoundingRule` where the op decides.
        override: allow replacing an existing rule.

    Example:

    ```python
    class ScaleRule(keras_roll.rounding.RoundingRule):
        def magnitude(self, op, bounds, record, affine, mask=None, values=None):
            return bounds[0] * abs(op.layer.factor)

        def roundings(self, op, inputs):
            return 1

    keras_roll.rounding.register_rounding_rule(MyScale, ScaleRule())
    ```
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_rounding_rule expects an op or layer class, got {cls!r}.")
    if not (isinstance(rule, RoundingRule) or callable(rule)):
        raise TypeError(f"A rounding rule must be a keras_roll.rounding.RoundingRule (or a "
                        f"function of the op returning one), got {rule!r}.")
    table = _OP_RULES if issubclass(cls, Op) else _LAYER_RULES
    if cls in table and not override and table[cls] is not rule:
        raise ValueError(f"A rounding rule for {cls.__name__} is already registered; pass "
                         f"override=True to replace it.")
    table[cls] = rule
    _CACHE.clear()


def unregister_rounding_rule(cls: type) -> None:
    """Removes the rounding rule registered for `cls` (no error if absent)."""
    _OP_RULES.pop(cls, None)
    _LAYER_RULES.pop(cls, None)
    _CACHE.clear()


def rounding_rule(op) -> RoundingRule:
    """The `RoundingRule` of `op`: by its layer class for a `Linear` / `LayerCall`
    op, else by its exact op class, else `DerivedRule` (cached per op).

    Example:

    ```python
    rounding_rule(lin.program.steps[0].ops[0])      # e.g. a WeightedSumRule for Dense
    ```
    """
    rule = _CACHE.get(op)
    if rule is None:
        rule = _lookup(op)
        _CACHE[op] = rule
    return rule


def _lookup(op) -> RoundingRule:
    rule = None
    if isinstance(op, (Linear, LayerCall)):
        rule = _LAYER_RULES.get(type(op.layer))
    if rule is None:
        rule = _OP_RULES.get(type(op), _DERIVED)
    return rule if isinstance(rule, RoundingRule) else rule(op)


def magnitude(op, bounds, record, affine, mask=None, values=None):
    """`rounding_rule(op).magnitude(...)`."""
    return rounding_rule(op).magnitude(op, bounds, record, affine, mask, values)


def magnitudes(op, bounds, record, affine, mask=None, values=None):
    """`rounding_rule(op).magnitudes(...)`: `(output bound, neuron bound or None)`."""
    return rounding_rule(op).magnitudes(op, bounds, record, affine, mask, values)


def roundings(op, inputs) -> int:
    """`rounding_rule(op).roundings(op, inputs)`."""
    return int(rounding_rule(op).roundings(op, inputs))


def matmul_like(op) -> bool:
    """Whether `op` is a matrix product or a convolution (`RoundingRule.matmul_like`)."""
    return bool(rounding_rule(op).matmul_like)
