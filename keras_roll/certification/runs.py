"""What the certification functions share: the checks of an example slice.

`certify`, `lp_margins`, `stability_bounds` and `count_regions` flag the
examples whose neurons or logits are not finite, or whose evaluation may
overflow (`nonfinite`, with one warning per call: `warn_nonfinite`), and report
which steps of a masked sequence each certificate covers (`input_mask`). The
twin each runs on is its rigor's (`keras_roll.rounding.guard_for(rigor).twin`).

Example:

```python
fwd = twin.forward(x)
bad = nonfinite(fwd, fwd.neurons.valid.numpy())
```
"""

from __future__ import annotations

import warnings

import numpy as np

from keras_roll.compile.interpreter import ForwardPass

__all__ = ["input_mask", "nonfinite", "warn_nonfinite"]


def nonfinite(fwd: ForwardPass, valid: np.ndarray,
              overflow: np.ndarray | None = None) -> np.ndarray:
    """`[b]` examples with a non-finite valid neuron or logit, or whose evaluation
    may overflow (`overflow`, from the rounding errors).

    Example:

    ```python
    bad = nonfinite(fwd, fwd.neurons.valid.numpy(), err.overflow)
    ```
    """
    z = fwd.neurons.z.numpy()
    logits = fwd.logits.numpy().reshape(z.shape[0], -1)
    bad = ~np.all(np.isfinite(z) | ~valid, axis=1) | ~np.all(np.isfinite(logits), axis=1)
    if overflow is not None:
        bad |= overflow
    return bad


def warn_nonfinite(count: int, total: int, evaluation: str, what: str) -> None:
    """One warning for the `count` of `total` examples whose `what` (margins,
    bounds) are NaN."""
    if count:
        warnings.warn(
            f"{count} of {total} examples have a non-finite neuron or logit (NaN / inf), or "
            f"may overflow when the model evaluates itself in {evaluation}: their {what} "
            f"are NaN (see .nonfinite). Check the inputs' scale.", stacklevel=3)


def input_mask(fwd: ForwardPass) -> np.ndarray | None:
    """`[b, T]` True at the unpadded steps of a masked sequence model, else None."""
    for step_rec in fwd.trace.steps:
        for rec in step_rec.ops:
            keep = getattr(rec, "keep", None)
            if keep is not None:
                return keep.numpy()[..., 0] > 0
    return None
