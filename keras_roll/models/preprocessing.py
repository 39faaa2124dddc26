"""Input normalisation as a layer inside the model.

Keeping ``(x - mean) / std`` inside the network means the model's inputs, and so
every certified margin, stability bound and gradient distortion, are in the units
of the data as loaded: ``[0, 1]`` pixel intensities for the paper's models. (A
margin ``eps`` in normalised units is ``std * eps`` in pixel units; with the layer
inside, keras_roll reports the pixel-unit value directly.)
"""

from __future__ import annotations

import numbers

import keras
import numpy as np


def input_normalization(mean, std, name="normalize", dtype=None):
    """Builds a ``keras.layers.Normalization`` layer computing ``(x - mean) / std``.

    The layer is affine, so keras_roll's compiler treats it as part of the first
    affine map (its tangent is ``v / std``).

    Args:
        mean: a number, or one number per channel (last axis).
        std: a positive number, or one positive number per channel.
        name: the layer's name.
        dtype: the layer's dtype (policy), ``None`` for Keras' default.

    Returns:
        A ``keras.layers.Normalization`` layer with fixed (non-adapted) statistics.

    Raises:
        ValueError: for a non-positive or non-finite ``std``, a non-finite ``mean``,
            or per-channel values of different lengths.

    Example:

    ```python
    layer = input_normalization(0.1307, 0.3081)               # MNIST
    layer = input_normalization((0.485, 0.456, 0.406), 0.225)  # the paper's single std
    ```
    """
    m = np.asarray(mean, dtype=np.float64)
    s = np.asarray(std, dtype=np.float64)
    if m.ndim > 1 or s.ndim > 1 or (m.ndim == s.ndim == 1 and len(m) != len(s)):
        raise ValueError(
            f"mean and std must be numbers or equal-length per-channel sequences, got "
            f"mean={mean!r} and std={std!r}."
        )
    if not np.all(np.isfinite(m)):
        raise ValueError(f"mean must be finite, got {mean!r}.")
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise ValueError(f"std must be positive and finite, got {std!r}.")
    if m.ndim == 1 and s.ndim == 0:
        s = np.full_like(m, float(s))
    if s.ndim == 1 and m.ndim == 0:
        m = np.full_like(s, float(m))
    variance = np.square(s)
    if m.ndim == 0:
        return keras.layers.Normalization(
            mean=float(m), variance=float(variance), name=name, dtype=dtype
        )
    return keras.layers.Normalization(
        mean=m.tolist(), variance=variance.tolist(), name=name, dtype=dtype
    )


def is_number(value) -> bool:
    """True for real numbers (not bools)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def compute_dtype(dtype):
    """The compute dtype of a dtype or dtype-policy name (``"mixed_float16"`` -> float16),
    ``None`` for ``None`` (Keras' default)."""
    if dtype is None:
        return None
    return keras.dtype_policies.get(dtype).compute_dtype
