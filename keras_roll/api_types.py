"""Type aliases for the arguments of keras_roll's public API.

Example:

```python
def certify(model: ModelOrTwin, x: Array, norms: Norms = (1, 2, np.inf), ...) -> Certificate:
    ...
```
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Union

import keras
import tensorflow as tf
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from keras_roll.compile.twin import Linearized

__all__ = ["Array", "Method", "ModelOrTwin", "Norm", "Norms", "Rigor", "Seed", "Verbose"]

Array = ArrayLike | tf.Tensor
"""Numeric data: a numpy array (or anything `np.asarray` reads) or a tensor."""

ModelOrTwin = Union[keras.Model, "Linearized"]
"""A functional / Sequential Keras model, or its `keras_roll.linearize` twin."""

Norm = int | float | str
"""1, 2, `np.inf` (or the string "inf")."""

Norms = Norm | Sequence[Norm] | None
"""One norm or several."""

Method = Literal["analytic", "bisect"]
"""Closed forms (exact, streamed) or the bisection cross-check."""

Rigor = Literal["float64", "strict", "float32"]
"""Rounding guard of certificates: float64 twin + probabilistic bound ("float64"), float64
twin + worst-case bound ("strict"), or the twin's own dtype without a guard ("float32")."""

Verbose = bool | int | Literal["auto"]
"""Progress bar: "auto" (only for runs over a second), True or False."""

Seed = int | tf.Tensor | Sequence[int] | None
"""None (fresh randomness), an int, or a `[2]` int tensor for stateless sampling."""
