"""Where ROLL's tangents enter the program: `wrt=` layers and padded steps.

By default ROLL's directions are axes of the model input. With `wrt="<layer>"`,
a leading elementwise affine layer (Rescaling, Normalization, per-channel
too), they are axes of that layer's output: the tangent pass enters the
program right after it (`tangent_entry`), so the loss equals the loss of the
model without that layer fed the layer's outputs (the paper's normalised
units; docs/design.md, "The maths", Units).

Behind a leading Masking layer the padded steps of an example have zero
gradient by construction; `padding_mask` reads which steps are valid, so that
the estimators push directions only through those.

Example:

```python
lin = keras_roll.linearize(keras_roll.models.fc())
entry = tangent_entry(lin.program, "normalize")     # 1: tangents enter at dense_1
keep = padding_mask(lin.program, lin.primal(x).trace, entry)   # None: no Masking layer
```
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.rules.recurrent import MaskingOp
from keras_roll.compile.structure import structure_of
from keras_roll.roll.config import RollConfig, RollPlan

__all__ = ["AFFINE_ENTRY_LAYERS", "affine_problem", "entry_readers", "masking_reader",
           "padding_mask", "roll_plan", "tangent_entry"]

AFFINE_ENTRY_LAYERS = (keras.layers.Rescaling, keras.layers.Normalization)


def entry_readers(program, entry: int) -> list[int]:
    """The indices of the steps that read the value tangents enter at (step `entry`'s
    input; `ProgramStructure.entry_readers`)."""
    return structure_of(program).entry_readers(entry)


def masking_reader(program, entry: int) -> int | None:
    """The index of the step that alone reads the tangents' entry value when it is
    a lone Masking op (the only reader that leaves padded steps without a
    gradient), else None.

    Example:

    ```python
    step = masking_reader(lin.program, 0)   # not None for Masking -> SimpleRNN models
    ```
    """
    readers = entry_readers(program, entry)
    if len(readers) != 1:
        return None
    step = program.steps[readers[0]]
    if len(step.ops) != 1 or not isinstance(step.ops[0], MaskingOp):
        return None
    return readers[0]


def _broadcasts_elementwise(value, example_shape) -> bool:
    """Whether an array `value` broadcasts against `[B, *example_shape]` elementwise."""
    shape = np.shape(value)
    full = (None, *example_shape)
    if len(shape) > len(full):
        return False
    for dim, want in zip(shape[::-1], full[::-1]):
        if dim != 1 and (want is None or dim != want):
            return False
    return True


def affine_problem(step, example_shape) -> str | None:
    """Why `step` is not an elementwise affine map of its input (None if it is)."""
    layer = step.layer
    if not isinstance(layer, AFFINE_ENTRY_LAYERS):
        return (f"a {type(layer).__name__}, not an elementwise affine layer (Rescaling or "
                f"Normalization)")
    if isinstance(layer, keras.layers.Rescaling):
        for attr in ("scale", "offset"):
            value = getattr(layer, attr)
            if not _broadcasts_elementwise(value, example_shape):
                return (f"a Rescaling whose {attr} of shape {np.shape(value)} does not "
                        f"broadcast elementwise against inputs of shape {example_shape}")
    return None


def _leading_chain(program) -> list[tuple[str, int]]:
    """`(name, index)` of the leading elementwise affine steps, in order.

    Step `i` belongs to the chain when it reads only the output of step
    `i - 1` (the model input for the first one), nothing else reads that
    value, and it is a Rescaling or Normalization that acts elementwise.
    """
    chain = []
    for i in structure_of(program).leading_chain():
        step = program.steps[i]
        if affine_problem(step, program.input_shape) is not None:
            break
        chain.append((step.name, i))
    return chain


def roll_plan(lin, config: RollConfig | RollPlan) -> RollPlan:
    """`config` resolved against the twin `lin`: the one place ROLL's entry step is
    computed (a `RollPlan` is returned as it is).

    Raises:
        ValueError: a `wrt=` that names no leading elementwise affine layer (see
            `tangent_entry`).

    Example:

    ```python
    plan = roll_plan(lin, RollConfig(wrt="normalize"))
    plan.entry                                   # 1
    ```
    """
    if isinstance(config, RollPlan):
        return config
    return RollPlan(config, tangent_entry(lin.program, config.wrt))


def tangent_entry(program, wrt: str | None) -> int:
    """The program step ROLL's tangents enter at for `wrt=` (0: the model input).

    Args:
        program: the model's `keras_roll.compile.graph.Program` (`lin.program`).
        wrt: None, or the name of a leading elementwise affine layer
            (Rescaling / Normalization, scalar or per-channel), possibly after
            other such layers: its step name, or its layer name when that is
            unique.

    Returns:
        The index of the first step after the `wrt` layer (0 for `wrt=None`).

    Raises:
        ValueError: no such layer, a layer that is not elementwise affine, or
            one that does not lead the model (the message lists the valid names).

    Example:

    ```python
    lin = keras_roll.linearize(keras_roll.models.fc())
    tangent_entry(lin.program, "normalize")     # 1: tangents enter at dense_1
    ```
    """
    if wrt is None:
        return 0
    chain = _leading_chain(program)
    valid = [name for name, _ in chain]
    for name, index in chain:
        if name == wrt or (name.split("/")[-1] == wrt
                           and sum(s.layer.name == wrt for s in program.steps) == 1):
            return index + 1
    hint = (f"valid names for this model: {valid}" if valid else
            "this model has none: put a keras.layers.Rescaling or Normalization right after "
            "its Input")
    matches = [s for s in program.steps if s.name == wrt or getattr(s.layer, "name", None) == wrt]
    if not matches:
        names = [s.name for s in program.steps]
        raise ValueError(f"wrt={wrt!r}: the model has no layer of that name (its layers: "
                         f"{names}); wrt names a leading Rescaling / Normalization layer, "
                         f"{hint}.")
    problem = affine_problem(matches[0], program.input_shape)
    if problem is not None:
        raise ValueError(f"wrt={wrt!r} names {problem}; ROLL's gradients can be taken with "
                         f"respect to the output of a leading elementwise affine layer only, "
                         f"{hint}.")
    raise ValueError(f"wrt={wrt!r} names a {type(matches[0].layer).__name__} that does not lead "
                     f"the model: it must read the model input (possibly after other "
                     f"Rescaling / Normalization layers) and be the only layer that reads it, "
                     f"so that the model is a function of its output; {hint}.")


def padding_mask(program, trace, entry: int = 0):
    """`[B, P]` bool: the unpadded positions (all axes but the channels) of each
    example, when a leading Masking layer reads the tangents' entry, else None.

    The Masking op multiplies the tangents by its `keep` record, so along a
    padded position every neuron has derivative zero. Only a Masking layer
    that is the single reader of the entry value qualifies (otherwise another
    path could give padded steps a gradient).

    Example:

    ```python
    keep = padding_mask(lin.program, lin.primal(x).trace)   # [B, T] for [B, T, C] inputs
    ```
    """
    reader = masking_reader(program, entry)
    if reader is None:
        return None
    keep = trace.steps[reader].ops[0].keep  # [B, *shape[:-1], 1]
    batch = tf.shape(keep)[0]
    return tf.reshape(keep > 0, tf.stack([batch, -1]))


