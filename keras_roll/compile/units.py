"""The units radii are stated in: the model input, or the output of a leading affine layer.

A model that starts with `u = a x + b` (a `Rescaling`, a `Normalization`, or a
chain of them) maps the lp ball of radius `r` around `x` onto the lp ball of
radius `|a| r` around `u(x)` when the scale `a` is one number: every radius,
margin and distance measured in `x` is `|a|` times smaller or larger in `u`, and
nothing else changes. `wrt="<layer>"` (as ROLL's `wrt=`) states results in the
units of that layer's output, e.g. [0, 1] pixels for a model that takes 0-255
pixels and starts with `Rescaling(1 / 255)`. A per-channel scale maps a ball to
an ellipsoid, so it is refused (docs/design.md, section "Units (wrt=)").

`resolve_units(program, wrt)` resolves a `Units` once per call, from the
program's leading chain of elementwise affine steps, evaluated in float64.

Example:

```python
units = resolve_units(keras_roll.linearize(model).program, "rescaling")
units.describe()              # "units of 'rescaling' output"
units.to_units(margins)       # radii in [0, 1] pixels: margins / 255
units.from_units(8 / 255)     # an l_inf radius given in [0, 1] pixels, in 0-255 pixels
```
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from keras_roll.compile.prefix import AffinePrefix

__all__ = ["INPUT_UNITS", "UNIT_LAYERS", "Units", "resolve_units"]

UNIT_LAYERS = (keras.layers.Rescaling, keras.layers.Normalization)
# Scales of the chain that differ by less than this (relative) count as one number:
# a per-channel layer with equal statistics computed in float32.
SCALAR_RTOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Units:
    """The units of a result: `u = scale * x + offset` of the model input `x`.

    Attributes:
        name: the layer whose output the units are (its step name), or None for
            the model's input units.
        scale: the scalar `a` (1.0 for input units).
        offset: `b`, a float or an array broadcastable to an example (0.0 for
            input units).

    Example:

    ```python
    Units("rescaling", 1 / 255, 0.0).to_units(np.array([25.5]))    # [0.1]
    ```
    """

    name: str | None = None
    scale: float = 1.0
    offset: float | np.ndarray = 0.0

    @property
    def is_input(self) -> bool:
        """Whether these are the model's input units (no `wrt`)."""
        return self.name is None

    def describe(self) -> str:
        """E.g. "input units" or "units of 'rescaling' output"."""
        return "input units" if self.is_input else f"units of '{self.name}' output"

    def to_units(self, radius):
        """A radius (or distance, margin) in input units, stated in these units."""
        return np.asarray(radius, np.float64) * abs(self.scale) if not self.is_input \
            else radius

    def from_units(self, radius):
        """A radius given in these units, in input units."""
        return np.asarray(radius, np.float64) / abs(self.scale) if not self.is_input \
            else radius

    def point_from_units(self, u):
        """A point (or box bound) given in these units, in input units: `(u - b) / a`."""
        if self.is_input:
            return u
        return (np.asarray(u, np.float64) - self.offset) / self.scale

    def gradient_norm_to_units(self, norm):
        """The norm of a gradient with respect to the input, as one with respect to
        `u`: `grad_u = grad_x / a`, so the norm divided by `|a|`."""
        return norm if self.is_input else np.asarray(norm, np.float64) / abs(self.scale)


INPUT_UNITS = Units()


def _readers(program, key) -> list[int]:
    return [i for i, step in enumerate(program.steps) if key in step.inputs]


def _leading_chain(program) -> list[int]:
    """Indices of the leading steps that are Rescaling / Normalization layers, each
    reading only the value before it, which nothing else reads."""
    chain, key = [], program.input_key
    for i, step in enumerate(program.steps):
        if step.inputs != [key] or _readers(program, key) != [i] \
                or not isinstance(step.layer, UNIT_LAYERS):
            break
        chain.append(i)
        key = step.output
    return chain


def _matches(program, step, wrt: str) -> bool:
    if step.name == wrt:
        return True
    layer_name = getattr(step.layer, "name", None)
    return layer_name == wrt and sum(getattr(s.layer, "name", None) == wrt
                                     for s in program.steps) == 1


def _find(program, wrt: str) -> int:
    """The index of the chain step `wrt` names; a clear error otherwise."""
    chain = _leading_chain(program)
    for i in chain:
        if _matches(program, program.steps[i], wrt):
            return i
    valid = [program.steps[i].name for i in chain]
    hint = (f"valid names for this model: {valid}" if valid else
            "this model has none: its first layer is not a Rescaling or Normalization")
    hits = [s for s in program.steps if _matches(program, s, wrt)]
    if not hits:
        raise ValueError(f"wrt={wrt!r}: the model has no layer of that name (its layers: "
                         f"{[s.name for s in program.steps]}); wrt names a leading "
                         f"Rescaling or Normalization layer whose output units the radii "
                         f"are stated in ({hint}), or wrt=None for input units.")
    layer = hits[0].layer
    if not isinstance(layer, UNIT_LAYERS):
        raise ValueError(f"wrt={wrt!r} names a {type(layer).__name__}, not a Rescaling or "
                         f"Normalization: radii can be stated in the units of a leading "
                         f"elementwise affine layer only ({hint}), or pass wrt=None for "
                         f"input units.")
    raise ValueError(f"wrt={wrt!r} names a {type(layer).__name__} that does not lead the "
                     f"model: it must read the model input (possibly after other Rescaling / "
                     f"Normalization layers) and be its only reader ({hint}), or pass "
                     f"wrt=None for input units.")


def resolve_units(program, wrt: str | None) -> Units:
    """The `Units` that `wrt` names for a compiled program (`lin.program`).

    Args:
        program: the model's program (`keras_roll.linearize(model).program`).
        wrt: None (input units), or the name of a leading Rescaling /
            Normalization layer (its step name, or its layer name when unique),
            possibly after other such layers: the radii are then stated in the
            units of its output.

    Returns:
        A `Units`; for `wrt=None`, `INPUT_UNITS`.

    Raises:
        ValueError: an unknown name, a layer that is not a leading Rescaling /
            Normalization, or a scale that is not one number (a per-channel
            scale maps an lp ball onto an ellipsoid); each message names the
            layer and what works.
        TypeError: `wrt` not a string.

    Example:

    ```python
    resolve_units(lin.program, "rescaling").scale      # 1 / 255
    ```
    """
    if wrt is None:
        return INPUT_UNITS
    if not isinstance(wrt, str):
        raise TypeError(f"wrt must be a layer name (str) or None, got {wrt!r}.")
    last = _find(program, wrt)
    ops = tuple(op for step in program.steps[:last + 1] for op in step.ops)
    prefix = AffinePrefix(ops, last + 1, 0)
    shape = [1] + [1 if d is None else int(d) for d in program.input_shape]
    offset = prefix.apply(np.zeros(shape), "float64").numpy()[0]
    scale = prefix.apply(np.ones(shape), "float64").numpy()[0] - offset
    a = float(np.median(scale))
    name = program.steps[last].name
    if not np.all(np.isfinite(scale)) or a == 0 or \
            np.max(np.abs(scale - a)) > SCALAR_RTOL * abs(a):
        raise ValueError(
            f"wrt={wrt!r}: the layers up to '{name}' scale the input by "
            f"{float(np.min(scale)):.6g} to {float(np.max(scale)):.6g} (per channel or "
            f"zero), so an lp ball of the input is not a ball of their output and no radius "
            f"can be stated in its units. wrt works where the scale is one nonzero number "
            f"(e.g. Rescaling(1 / 255), or a Normalization with one mean and variance); "
            f"pass wrt=None for input units.")
    flat = offset.reshape(-1)
    b = float(flat[0]) if flat.size and np.all(flat == flat[0]) else offset
    return Units(name, a, b)
