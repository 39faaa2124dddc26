"""The intermediate bounds of the linear relaxation as a user's choice: CROWN at every
layer, intervals then CROWN at the output (CROWN-IBP), or an automatic choice that
takes the tightest one fitting a work budget and says which it took.

The relaxation needs bounds `[l, u]` on the input of every activation. CROWN pulls
the `+-I` rows of each activation's input back to the input (the tightest; its cost
grows with neurons x layers); CROWN-IBP takes them from interval bounds and runs one
backward pass, from the output's functionals. `crown_cost` estimates both from the
shapes of a `capture` (no pass is run): the functional entries pulled through ops
(`elements`, the work) and the largest chunk of functionals (`chunk_bytes`, the
memory, which the memory budget caps). `choose_intermediate` resolves
`IntermediateBounds.AUTO` to CROWN when its `elements` fit `max_elements`, else to
intervals, and returns an `IntermediateChoice` that names the choice, the
`BoundMethod` to run, both costs and the reason, to be recorded on the caller's
result. docs/guide.md, section "Intermediate bounds", gives measured costs.

Example:

```python
values = capture(twin.interpreter, x)
choice = choose_intermediate("auto", structure, values, rows=9, budget=64 * 2**20)
low = lower_bounds(structure, values, rows, eps, np.inf, choice.method, arithmetic)
choice.bounds, choice.reason      # IntermediateBounds.CROWN, "CROWN's 3.1e+08 ... fit ..."
```
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

from keras_roll.compile.bounds.crown import layer_rows_per_chunk
from keras_roll.compile.bounds.methods import DEFAULT_BUDGET, BoundMethod
from keras_roll.compile.bounds.rules import bound_rule
from keras_roll.compile.bounds.traversal import Values
from keras_roll.compile.chunking import DEFAULT_EXAMPLES
from keras_roll.compile.structure import ProgramStructure

__all__ = ["DEFAULT_MAX_ELEMENTS", "BoundCost", "IntermediateBounds", "IntermediateChoice",
           "choose_intermediate", "crown_cost"]

# Functional entries CROWN may pull through ops per call under "auto": a little more than
# a CROWN pass of the CROWN-IBP paper's large MNIST CNN on one image (docs/guide.md).
DEFAULT_MAX_ELEMENTS = 3 * 10**9


class IntermediateBounds(enum.Enum):
    """Where the relaxation's bounds on every activation's input come from.

    * `CROWN`: the relaxation itself, layer by layer (`BoundMethod.RELAXATION`): the
      tightest, with cost growing with neurons x layers;
    * `INTERVALS`: interval bounds, then one backward pass from the output
      (`BoundMethod.CROWN_IBP`): one pass, looser (much looser on naturally trained
      networks);
    * `AUTO`: CROWN if its estimated work fits the budget, else intervals; the
      choice is reported (`IntermediateChoice`).
    """

    CROWN = "crown"
    INTERVALS = "intervals"
    AUTO = "auto"

    @property
    def method(self) -> BoundMethod:
        """The `BoundMethod` that runs a resolved choice (AUTO has none of its own)."""
        if self is IntermediateBounds.AUTO:
            raise ValueError("IntermediateBounds.AUTO is resolved by choose_intermediate "
                             "first; it has no BoundMethod of its own.")
        return _METHODS[self]


_METHODS = {IntermediateBounds.CROWN: BoundMethod.RELAXATION,
            IntermediateBounds.INTERVALS: BoundMethod.CROWN_IBP}


class BoundCost(NamedTuple):
    """The estimated cost of one bound pass, per call of `examples` examples.

    Attributes:
        elements: functional entries pulled through ops (the work: about one
            multiply-add per entry and input of an elementwise op, more for a
            convolution or a dense layer).
        pullbacks: backward passes (chunks) in all.
        chunk_bytes: bytes of the largest chunk of functionals (at most the budget
            when the chunk plan fits).
    """

    elements: int
    pullbacks: int
    chunk_bytes: int


class IntermediateChoice(NamedTuple):
    """What `choose_intermediate` chose, and why.

    Attributes:
        bounds: `IntermediateBounds.CROWN` or `.INTERVALS` (never AUTO).
        method: the `BoundMethod` to run.
        crown: CROWN's estimated `BoundCost`.
        intervals: CROWN-IBP's estimated `BoundCost`.
        reason: one sentence for the user (what was taken and what it gave up).
    """

    bounds: IntermediateBounds
    method: BoundMethod
    crown: BoundCost
    intervals: BoundCost
    reason: str


def _sizes(values: Values) -> tuple[int, list[int]]:
    return (int(np.prod(values.x.shape[1:])),
            [int(np.prod(v.shape[1:])) for v in values.outputs])


def crown_cost(structure: ProgramStructure, values: Values, rows: int,
               budget: int = DEFAULT_BUDGET,
               examples: int | None = None) -> tuple[BoundCost, BoundCost]:
    """`(CROWN's cost, CROWN-IBP's cost)` of bounding `rows` functionals of the output.

    Estimated from the static shapes of `values` (nothing runs): a pull-back of `k`
    rows from op `i` costs `k` times the sizes of the values of the ops before it.

    Args:
        structure, values: the program's structure and a `capture` of the batch.
        rows: functionals of the output per example (e.g. 9 margins of 10 classes).
        budget: bytes of functionals per pull-back of CROWN's layer bounds.
        examples: examples per call (default the static batch size, else 64).

    Example:

    ```python
    crown, ibp = crown_cost(structure, values, rows=9)
    crown.elements / ibp.elements          # how much more work CROWN is
    ```
    """
    b = int(examples or values.x.shape[0] or DEFAULT_EXAMPLES)
    input_size, sizes = _sizes(values)
    below = np.cumsum([input_size, *sizes])  # below[i]: the values up to op i's input
    itemsize = values.x.dtype.size
    elements = pullbacks = widest = 0
    for i, node in enumerate(structure.nodes):
        if bound_rule(node.op) is None or bound_rule(node.op).linear:
            continue
        n = int(np.prod(values.inputs[i][0].shape[1:]))
        if n == 0:
            continue
        k = layer_rows_per_chunk(values, i, n, budget, b)
        chunks = -(-2 * n // k)
        elements += chunks * k * b * int(below[i])
        pullbacks += chunks
        widest = max(widest, 3 * itemsize * k * b * max([input_size, *sizes[:i + 1]]))
    out = b * rows * int(below[-1])
    final = 3 * itemsize * b * rows * max([input_size, *sizes])
    return (BoundCost(elements + out, pullbacks + 1, max(widest, final)),
            BoundCost(out, 1, final))


def choose_intermediate(choice: IntermediateBounds | str, structure: ProgramStructure,
                        values: Values, rows: int, budget: int = DEFAULT_BUDGET,
                        examples: int | None = None,
                        max_elements: int = DEFAULT_MAX_ELEMENTS) -> IntermediateChoice:
    """Resolves a user's `IntermediateBounds` for one call, with the reason.

    Args:
        choice: an `IntermediateBounds` or its value ("crown", "intervals", "auto").
        structure, values, rows, budget, examples: as `crown_cost`.
        max_elements: the work AUTO allows CROWN per call (`BoundCost.elements`).

    Returns:
        An `IntermediateChoice`.

    Raises:
        ValueError: an unknown choice, naming the valid ones.

    Example:

    ```python
    choice = choose_intermediate("auto", structure, values, rows=9)
    result_note = choice.reason
    ```
    """
    try:
        choice = IntermediateBounds(choice)
    except ValueError:
        valid = ", ".join(repr(c.value) for c in IntermediateBounds)
        raise ValueError(f"Unknown intermediate bounds {choice!r}; use one of {valid} or a "
                         f"keras_roll.compile.bounds.IntermediateBounds.") from None
    crown, ibp = crown_cost(structure, values, rows, budget, examples)
    ratio = crown.elements / max(ibp.elements, 1)
    if choice is IntermediateBounds.AUTO:
        fits = crown.elements <= max_elements
        choice = IntermediateBounds.CROWN if fits else IntermediateBounds.INTERVALS
        if fits:
            reason = (f"CROWN at every layer: its {crown.elements:.2g} functional entries "
                      f"fit the budget of {max_elements:.2g}.")
        else:
            reason = (f"intervals, then CROWN at the output (CROWN-IBP): CROWN at every "
                      f"layer needs {crown.elements:.2g} functional entries, over the budget "
                      f"of {max_elements:.2g} ({ratio:.0f}x CROWN-IBP's); the bounds are "
                      f"looser, often far looser on naturally trained networks.")
    elif choice is IntermediateBounds.CROWN:
        reason = f"CROWN at every layer, as asked ({ratio:.0f}x CROWN-IBP's work)."
    else:
        reason = "intervals, then CROWN at the output (CROWN-IBP), as asked."
    return IntermediateChoice(choice, choice.method, crown, ibp, reason)
