"""What a twin answers about its program and its neurons without running a pass.

`Linearized` (`keras_roll.compile.twin`) mixes these in: `ProgramQueries` reads
its compiled `Program` (output link, training-dependent layers, a `Summary`
of the program), `NeuronQueries` its `NeuronLayout`s (neuron names, counts,
tangent sizes).

Example:

```python
lin = keras_roll.linearize(model)
print(lin.summary())                # one line per op
lin.neuron_name(17, (784,))         # ('dense', 17)
```
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_roll.compile.graph import Program
from keras_roll.compile.interpreter import ForwardPass
from keras_roll.compile.layout import NeuronLayout
from keras_roll.compile.prefix import AffinePrefix, affine_prefix
from keras_roll.compile.rules.activations import Link
from keras_roll.summary import Summary

__all__ = ["NeuronQueries", "ProgramQueries"]


class ProgramQueries:
    """The structure queries of a twin, answered from its compiled `Program`.

    The class that mixes it in provides `program`, `interpreter`, `model`,
    `input_shape` and `dtype`.

    Example:

    ```python
    lin.output_link, lin.inference_equals_training     # (Link.SOFTMAX, True)
    ```
    """

    program: Program

    @property
    def inference_equals_training(self) -> bool:
        """True when no layer behaves differently in training (BatchNorm, dropout,
        noise: `Op.training_dependent`), so the twin's forward pass is also the
        training-mode forward pass."""
        return not any(op.training_dependent for step in self.program.steps for op in step.ops)

    @property
    def affine_prefix(self) -> AffinePrefix | None:
        """The affine ops the program starts with (`keras_roll.compile.prefix`), or None."""
        return affine_prefix(self.program)

    @property
    def output_link(self) -> Link | None:
        """The `Link` folded into the loss (`Link.SOFTMAX`, `Link.SIGMOID`, equal to
        "softmax" and "sigmoid"), or None for a model that ends in logits."""
        return self.program.output_link

    def apply_output_link(self, logits):
        """The model output from the twin's logits (re-applies a folded softmax/sigmoid)."""
        if self.output_link is None:
            return logits
        return self.output_link.apply(logits)

    def summary(self, print_fn=None) -> Summary:
        """The compiled program, one line per op: a `Summary` (its `str` is the
        table; a notebook or a REPL shows it once). Nothing is printed unless
        `print_fn` is given (a logger's function, say), which gets the text once.

        Example:

        ```python
        lin.summary()                         # shows the table in a notebook
        print(lin.summary())                  # the same table, once
        lin.summary(print_fn=logging.info)    # also handed to a logger
        ```
        """
        lines = [f"Linearized '{self.model.name}': input {self.input_shape}, "
                 f"dtype {self.dtype}, output link {self.output_link}"]
        for step in self.program.steps:
            kinds = ", ".join(type(op).__name__ for op in step.ops) or "(folded)"
            lines.append(f"  {step.name:<30} {type(step.layer).__name__:<24} {kinds}")
        return Summary.emit(lines, print_fn)

    def units(self, fwd: ForwardPass) -> dict[str, dict[str, tf.Tensor]]:
        """The records of every piecewise-linear unit of a forward pass, by name.

        Activation units (and SimpleRNN layers) give `z` (pre-activations) and
        `slope` (the frozen mask); max-pooling units give `argmax` (`[B, *out,
        C]`, the chosen window element) beside their windows.

        Example:

        ```python
        fwd = lin.forward(x)
        lin.units(fwd)["dense"]["slope"]     # [B, units] 0/1 mask of a ReLU
        ```
        """
        return {op.name: rec.as_dict() for op, rec in self.interpreter.units(fwd.trace)}


class NeuronQueries:
    """The neuron queries of a twin, answered from its `NeuronLayout`s.

    A mixin of `keras_roll.compile.twin.Linearized`: the class provides
    `layout(example_shape)` and `input_shape`.

    Example:

    ```python
    lin.num_neurons((784,)), lin.neuron_name(17, (784,))    # 1210, ('dense', 17)
    ```
    """

    input_shape: tuple

    def layout(self, example_shape) -> NeuronLayout:
        raise NotImplementedError

    @property
    def neuron_names(self) -> list[tuple[str, int | tuple]]:
        """`(layer name, unit index)` for every neuron row, in program order.

        The unit index is an int for 1-D units and a tuple (numpy order) for
        multi-dimensional ones; max-pooling neurons index `(*position, window
        element, channel)`. Needs a fixed input shape; for variable-length
        inputs use `neuron_names_for(x)`.
        """
        if any(d is None for d in self.input_shape):
            raise ValueError(
                f"The model input shape {self.input_shape} has a variable axis, so the "
                f"neurons depend on the input length; use lin.neuron_names_for(x)."
            )
        return self.layout(self.input_shape).names

    def neuron_names_for(self, x) -> list[tuple[str, int | tuple]]:
        """`neuron_names` for inputs shaped like `x` (a list of N tuples)."""
        return self.layout(np.shape(x)[1:]).names

    def neuron_name(self, index: int, example_shape) -> tuple[str, int | tuple]:
        """The `(layer name, unit index)` of neuron row `index`, without building
        the whole list (cheap for models with millions of neurons)."""
        return self.layout(example_shape).name(index)

    def num_neurons(self, example_shape) -> int:
        """N, the number of neuron rows for inputs of per-example shape `example_shape`."""
        return self.layout(example_shape).num_neurons

    def neuron_layout(self, example_shape) -> NeuronLayout:
        """The layout; iterating it gives `(name, first row, per-example shape)` per unit."""
        return self.layout(example_shape)

    def tangent_size(self, example_shape) -> int:
        """Tangent elements per example and direction (the outputs of every op, as
        `ForwardPass.tangent_size`) for inputs of per-example shape `example_shape`."""
        return self.layout(example_shape).tangent_size
