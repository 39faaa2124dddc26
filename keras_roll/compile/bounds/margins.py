"""The logit margins `f_y - f_j` that the bound passes bound: one capture of the batch,
its flattened logits and the rows `e_y - e_j` of every other class.

Every user of the bound passes on a classifier starts the same way: capture the
batch (`traversal.capture`), read the logits, build the functionals `e_y - e_j` of
the `L - 1` classes `j != y` (in cyclic order `y + 1, ..., y + L - 1 mod L`) and
take the margins at `x`. `logit_margins` is that preamble; `margin_rows` the rows
alone (for a forward pass that is not a capture).

Example:

```python
lm = logit_margins(twin.interpreter, x, labels)
low = lm.margins + lower_bounds(lm.structure, lm.values, lm.rows, eps, p, method,
                                arithmetic)                   # [B, L-1]
certified = tf.reduce_all(low > 0, axis=-1)
```
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds.traversal import Values, capture
from keras_roll.compile.structure import ProgramStructure, structure_of

__all__ = ["LogitMargins", "logit_margins", "margin_rows"]


class LogitMargins(NamedTuple):
    """A captured batch and its logit margins (tensors).

    Attributes:
        structure: the program's `ProgramStructure`.
        values: the `capture` of the batch, for `lower_bounds` / `pull_back`.
        logits: `[B, L]` the flattened output at `x`.
        rows: `[B, L-1, L]` the functionals `e_y - e_j` (None without labels).
        others: `[B, L-1]` the class `j` of every row (None without labels).
        margins: `[B, L-1]` `f_y(x) - f_j(x)` (None without labels).
    """

    structure: ProgramStructure
    values: Values
    logits: tf.Tensor
    rows: tf.Tensor | None
    others: tf.Tensor | None
    margins: tf.Tensor | None


def margin_rows(labels: tf.Tensor, classes: int, dtype) -> tuple:
    """`([B, L-1, L] rows e_y - e_j, [B, L-1] classes j)` for `j != y`, in cyclic order
    `j = y + 1, ..., y + L - 1 (mod L)`.

    Example:

    ```python
    rows, others = margin_rows(tf.constant([0]), 3, tf.float32)
    # rows [[[1, -1, 0], [1, 0, -1]]], others [[1, 2]]
    ```
    """
    labels = tf.convert_to_tensor(labels)
    others = (labels[:, None] + 1 + tf.range(classes - 1, dtype=labels.dtype)[None]) % classes
    rows = tf.one_hot(labels, classes, dtype=dtype)[:, None] - tf.one_hot(others, classes,
                                                                           dtype=dtype)
    return rows, others


def logit_margins(interpreter, x: tf.Tensor, labels: tf.Tensor | None = None
                  ) -> LogitMargins:
    """Captures `x` and measures the logit margins from `labels`.

    Args:
        interpreter: an `Interpreter` (a twin's `.interpreter`).
        x: `[B, *input_shape]` inputs in the interpreter's dtype.
        labels: `[B]` integer classes `y` the margins are measured from, or None for
            the capture and the logits alone.

    Returns:
        `LogitMargins`.

    Example:

    ```python
    lm = logit_margins(lin.interpreter, x, y)
    lm.margins                  # [B, L-1] f_y - f_j at x
    ```
    """
    structure = structure_of(interpreter.program)
    values = capture(interpreter, x)
    logits = values.value(structure, structure.output_key)
    logits = tf.reshape(logits, [-1, int(np.prod(logits.shape[1:]))])
    if labels is None:
        return LogitMargins(structure, values, logits, None, None, None)
    rows, others = margin_rows(labels, int(logits.shape[-1]), logits.dtype)
    margins = tf.reduce_sum(rows * logits[:, None], -1)
    return LogitMargins(structure, values, logits, rows, others, margins)
