"""The bound passes of `keras_roll.compile.bounds` with the rounding of the model's
evaluation: the relaxation and interval bounds of `robust_radius`, and `interval_bounds`,
the same passes as a differentiable function for certified training.

The compiler's passes ask their caller for an op's `|A|` and, under a rounding guard,
for the bound `Delta_l` of its rounding (`Arithmetic`); both come from the rounding
rules of `keras_roll.rounding` (`keras_roll.robust.float_error`). `margin_bounds` runs
the passes compiled, in chunks within the memory budget, on numpy batches (the
searches of `robust_radius`); `interval_bounds` runs them in the caller's graph on
tensors, so that `tape.gradient` of its bounds reaches the model's weights (IBP,
CROWN-IBP and CROWN training). docs/design.md, section "Robustness radius".

Example:

```python
with tf.GradientTape() as tape:
    bounds = interval_bounds(model, x, 0.1, y)                  # l_inf ball, IBP
    loss = keras.losses.sparse_categorical_crossentropy(y, -bounds.lower, from_logits=True)
grads = tape.gradient(loss, model.trainable_weights)
```
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds import Arithmetic, BoundMethod, logit_margins, lower_bounds
from keras_roll.compile.caches import cached
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.structure import structure_of
from keras_roll.compile.twin import linearize
from keras_roll.options import parse_norm
from keras_roll.robust.compiled import compile_batched
from keras_roll.robust.float_error import OpRounding
from keras_roll.rounding import rules
from keras_roll.rounding.precision import evaluation_precision

__all__ = ["MarginBounds", "arithmetic_of", "example_chunk", "interval_bounds",
           "margin_bounds"]


def linear_magnitude(op, bounds, record, mask, values):
    """`|A| bounds` for the linear part of `op`: its rounding rule's `magnitude`."""
    return rules.magnitude(op, bounds, record, False, mask, values)


def arithmetic_of(twin, guard: bool) -> Arithmetic:
    """The `Arithmetic` of the bound passes on `twin`'s program: `|A|` from the rounding
    rules and, with `guard`, the rounding of the model's evaluation (`OpRounding`)."""
    if not guard:
        return Arithmetic(linear_magnitude)
    rounding = OpRounding(evaluation_precision(twin.program))
    for node in structure_of(twin.program).nodes:
        rounding.check(node)
    return Arithmetic(linear_magnitude, rounding)


def _bounds_fn(twin, p, method: BoundMethod, guard: bool, budget: int, examples: int, x,
               pred, eps):
    """`[B, L-1]` lower bounds of the margins `f_y - f_j` over the ball (compiled)."""
    lm = logit_margins(twin.interpreter, x, pred)
    return lm.margins + lower_bounds(lm.structure, lm.values, lm.rows, eps, p, method,
                                     arithmetic_of(twin, guard), budget, examples)


def margin_bounds(twin, x: np.ndarray, pred: np.ndarray, eps: np.ndarray, p,
                  method: BoundMethod | str = BoundMethod.RELAXATION, guard: bool = True,
                  memory_budget: int | None = None) -> np.ndarray:
    """`[B, L-1]` lower bounds of `f_y - f_j` over the lp balls of radii `eps` (numpy).

    Args:
        twin: a float64 `Linearized`.
        x: `[B, *input_shape]` inputs (run in chunks of `example_chunk` examples).
        pred: `[B]` the classes the margins are measured from.
        eps: `[B]` radii.
        p: the norm of the balls.
        method: the `BoundMethod` (or its value): "relaxation" (CROWN, the default),
            "crown_ibp" or "interval" (interval bounds alone).
        guard: bound the rounding of the model's evaluation.
        memory_budget: bytes of functionals per pull-back.

    Example:

    ```python
    lower = margin_bounds(twin, x, pred, eps, p=np.inf)
    certified = (lower > 0).all(axis=1)
    ```
    """
    budget = int(memory_budget or twin.memory_budget)
    x = np.asarray(x, np.float64)
    chunk = example_chunk(twin, x.shape[1:], budget)
    key = (p, BoundMethod(method), bool(guard), budget, chunk)
    fn = cached(twin, ("relaxation", *key), lambda: compile_batched(
        functools.partial(_bounds_fn, twin, *key), twin, "xye"))
    out = []
    for s in range(0, x.shape[0], chunk):
        out.append(fn(tf.constant(x[s:s + chunk]),
                      tf.constant(np.asarray(pred[s:s + chunk], np.int64)),
                      tf.constant(np.asarray(eps[s:s + chunk], np.float64))).numpy())
    return np.concatenate(out) if out else np.zeros((0, 0))


def example_chunk(twin, example_shape, budget: int | None = None) -> int:
    """Examples per call of `margin_bounds` such that the widest activation's `2 n`
    functionals fit in the memory budget."""
    layout = twin.layout(example_shape)
    widest = max([int(np.prod(s)) for _, _, s in layout] + [1])
    largest = max(layout.input_size, widest)
    plan = plan_chunks(64, 2 * widest, 3 * 8 * largest, int(budget or twin.memory_budget),
                       min_directions=2 * widest)
    return plan.examples_per_chunk


class MarginBounds(NamedTuple):
    """Bounds on the logit margins `f_y(x') - f_j(x')` over a ball, `[B, L]` tensors each
    (column `y` is 0: `-lower` are the worst-case logits of IBP training).

    Attributes:
        lower: lower bounds; the ball is certified where every other column is > 0.
        upper: upper bounds.
    """

    lower: tf.Tensor
    upper: tf.Tensor


def interval_bounds(model, x, eps, labels, *, p=np.inf, method: BoundMethod | str = "interval",
                    guard: bool = False, dtype: str | None = None,
                    memory_budget: int | None = None) -> MarginBounds:
    """Bounds on the logit margins over the lp ball of radius `eps` around every `x`, as
    differentiable TensorFlow (for certified training: IBP, CROWN-IBP, CROWN).

    Args:
        model: a Keras model keras_roll can linearize, or its `Linearized`.
        x: `[B, *input_shape]` inputs (a tensor, in a training step too).
        eps: a radius, or `[B]` radii.
        labels: `[B]` integer classes `y`.
        p: the norm of the ball: 1, 2 or `np.inf` (or 'l1', 'l2', 'linf'); intervals
            use its bounding box (exact for l_inf).
        method: "interval" (IBP), "crown_ibp" or "relaxation" (CROWN), or a
            `keras_roll.compile.bounds.BoundMethod`.
        guard: also bound the rounding of the model's evaluation (as `robust_radius`
            does under a guarded rigor); off for training.
        dtype: the dtype of the pass (default the twin's, float32 for a float32
            model; "float64" for bounds to check against).
        memory_budget: bytes of functionals per pull-back of CROWN's layer bounds.

    Returns:
        `MarginBounds` of `[B, L]` tensors in the pass's dtype.

    Raises:
        keras_roll.UnsupportedModelError: a layer the passes do not bound, naming it.

    Example:

    ```python
    bounds = interval_bounds(model, x, 0.1, y, method="crown_ibp")
    certified = tf.reduce_all(bounds.lower + tf.one_hot(y, 10) > 0, axis=-1)
    ```
    """
    p = parse_norm(p)
    lin = linearize(model)
    twin = lin if dtype is None else lin.at_dtype(dtype)
    x = tf.cast(x, twin.dtype)
    lm = logit_margins(twin.interpreter, x, tf.cast(labels, tf.int32))
    rows = lm.margins.shape[-1]
    low = lower_bounds(lm.structure, lm.values, tf.concat([lm.rows, -lm.rows], 1), eps, p,
                       BoundMethod(method), arithmetic_of(twin, guard),
                       int(memory_budget or lin.memory_budget))
    # back to [B, L] with 0 in column y
    columns = tf.one_hot(lm.others, int(lm.logits.shape[-1]), dtype=lm.logits.dtype)
    lower = tf.einsum("bk,bkl->bl", lm.margins + low[:, :rows], columns)
    upper = tf.einsum("bk,bkl->bl", lm.margins - low[:, rows:], columns)
    return MarginBounds(lower, upper)
