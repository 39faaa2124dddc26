"""What a program's shape answers, computed once: who reads a value, where tangents enter,
which ops a value flows through.

Every pass that looks at a `Program` beyond running it asks the same few questions:
which steps read a value (a value read by one step only may be replaced by something
equal to it on the path that matters), which value tangents entering at a step read,
which steps form a single chain from the input (the affine prefix, ROLL's `wrt=`),
and, for the bound passes, the program's ops one by one with the keys of the values
they read and write (a layer call with several ops gets intermediate keys; a folded
softmax is an alias). `structure_of(program)` answers them, once per program
(docs/design.md, section "Module map").

Example:

```python
s = structure_of(lin.program)
s.readers(s.input_key)                   # (0,): the first step alone reads the input
s.entry_readers(1)                       # the steps reading the output of step 0
[n.name for n in s.nodes]                # every op, in execution order
```
"""

from __future__ import annotations

import dataclasses

from keras_roll.compile.caches import cached
from keras_roll.compile.graph import Program
from keras_roll.compile.rules.base import Op

__all__ = ["Node", "ProgramStructure", "structure_of"]


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One op of the program with the keys of the values it reads and writes.

    Attributes:
        op: the op (`keras_roll.compile.rules.base.Op`).
        inputs: keys of its input values.
        output: key of its output value (negative for a value inside a step).
        step: index of its program step; `position`: its index in the step.
        name: the layer name its neurons are reported under.
        layer: the Keras layer.
    """

    op: Op
    inputs: tuple
    output: int
    step: int
    position: int
    name: str
    layer: object


class ProgramStructure:
    """The structure queries of one `Program` (build it with `structure_of`).

    Attributes:
        program: the program.
        nodes: its ops as `Node`s, in execution order.
        input_key: the key of the model input.
        output_key: the key of the model output, before a folded output link.
        producer: `{key: index of the node that writes it}`.
    """

    def __init__(self, program: Program):
        self.program = program
        self.input_key = program.input_key
        step_readers: dict[int, list[int]] = {}
        for index, step in enumerate(program.steps):
            for key in dict.fromkeys(step.inputs):
                step_readers.setdefault(key, []).append(index)
        self.step_readers = {k: tuple(v) for k, v in step_readers.items()}
        self.nodes, alias = self._nodes(program)
        key = program.output_key
        while key in alias:
            key = alias[key]
        self.output_key = key
        self.producer = {n.output: i for i, n in enumerate(self.nodes)}

    @staticmethod
    def _nodes(program: Program) -> tuple[tuple, dict]:
        alias: dict[int, int] = {}
        nodes: list[Node] = []
        fresh = 0
        for index, step in enumerate(program.steps):
            ins = []
            for k in step.inputs:
                while k in alias:
                    k = alias[k]
                ins.append(k)
            ins = tuple(ins)
            if not step.ops:  # a folded output link: its value is its input
                alias[step.output] = ins[0]
                continue
            for position, op in enumerate(step.ops):
                if position == len(step.ops) - 1:
                    out = step.output
                else:
                    fresh -= 1
                    out = fresh
                nodes.append(Node(op, ins, out, index, position, step.name, step.layer))
                ins = (out,)
        return tuple(nodes), alias

    def readers(self, key: int) -> tuple[int, ...]:
        """The indices of the steps that read the value `key`, in program order."""
        return self.step_readers.get(key, ())

    def entry_key(self, entry: int) -> int:
        """The value tangents entering at step `entry` are directions of: the model
        input for 0, else the output of step `entry - 1`."""
        return self.input_key if entry == 0 else self.program.steps[entry - 1].output

    def entry_readers(self, entry: int) -> list[int]:
        """The indices of the steps that read the value tangents enter at (`entry_key`)."""
        return list(self.readers(self.entry_key(entry)))

    def leading_chain(self) -> list[int]:
        """The steps that form a single chain from the input, in order: step `i` reads
        only the value of step `i - 1` (the input for the first), and nothing else reads
        that value. The first step that does not ends the chain."""
        chain, key = [], self.input_key
        for index, step in enumerate(self.program.steps):
            if step.inputs != [key] or self.readers(key) != (index,):
                break
            chain.append(index)
            key = step.output
        return chain


def structure_of(program: Program) -> ProgramStructure:
    """The `ProgramStructure` of `program`, built once and kept on it.

    Example:

    ```python
    structure_of(keras_roll.linearize(model).program).readers(1)
    ```
    """
    return cached(program, ("structure",), lambda: ProgramStructure(program))
