"""The intermediate bounds of the linear relaxation as a user's choice: CROWN at every
layer, intervals then CROWN at the output (CROWN-IBP), or an automatic choice that
takes the tightest one fitting the call's memory and time budgets and says which it
took.

The relaxation needs bounds `[l, u]` on the input of every activation. CROWN pulls
the `+-I` rows of each activation's input back to the input (the tightest; its cost
grows with neurons x layers); CROWN-IBP takes them from interval bounds and runs one
backward pass, from the output's functionals. `crown_cost` estimates both from the
shapes of a `capture` (no pass is run): the functional entries pulled through ops
(`elements`, the work) and the largest chunk of functionals (`chunk_bytes`, the
memory, which the memory budget caps). `probe_seconds` times one chunk of CROWN's
pull-backs where the call runs, per entry. `choose_intermediate` resolves
`IntermediateBounds.AUTO` to CROWN when its chunks fit the memory budget and its
entries, times the probe's seconds per entry, fit the time budget (no probe where a
pessimistic rate already fits), else to intervals, and returns an
`IntermediateChoice` that names the choice, the `BoundMethod` to run, both costs,
CROWN's estimated seconds and the reason (with what it gave up), to be recorded on the
caller's result (`RobustRadius.intermediate`). docs/guide.md, section "Intermediate
bounds", gives measured costs.

Example:

```python
values = capture(twin.interpreter, x)
choice = choose_intermediate("auto", structure, values, rows=9, budget=64 * 2**20)
low = lower_bounds(structure, values, rows, eps, np.inf, choice.method, arithmetic)
choice.bounds, choice.reason      # IntermediateBounds.CROWN, "CROWN at every layer: ..."
```
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds.crown import RelaxedOps, layer_plan
from keras_roll.compile.bounds.methods import DEFAULT_BUDGET, BoundMethod
from keras_roll.compile.bounds.priors import skips_inactive
from keras_roll.compile.bounds.rules import Box, bound_rule
from keras_roll.compile.bounds.traversal import Values, pull_back
from keras_roll.compile.bounds.windows import conv_windows, rows_per_pull
from keras_roll.compile.chunking import DEFAULT_EXAMPLES
from keras_roll.compile.structure import ProgramStructure
from keras_roll.options import Choice

__all__ = ["DEFAULT_MAX_SECONDS", "SURE_SECONDS_PER_ELEMENT", "BoundCost", "IntermediateBounds",
           "IntermediateChoice", "choose_intermediate", "crown_cost", "interval_lines",
           "probe_seconds"]

# The time AUTO allows one CROWN pass per example, in seconds (docs/guide.md).
DEFAULT_MAX_SECONDS = 10.0
# A pessimistic cost of a functional entry: CROWN passes whose entries fit the time
# budget at this rate are taken without timing a chunk (about 10x the slowest rate
# measured on a 2-core CPU, float64; docs/guide.md, "Intermediate bounds").
SURE_SECONDS_PER_ELEMENT = 1e-6


class IntermediateBounds(Choice):
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

    @classmethod
    def hints(cls) -> dict[str, str]:
        return {"crown": "CROWN at every layer, the tightest",
                "intervals": "intervals, then CROWN at the output: CROWN-IBP",
                "auto": "CROWN if it fits the time and memory budgets"}

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
        seconds: CROWN's estimated seconds per pass and example (NaN where not
            estimated).
        auto: whether the choice was AUTO's.
    """

    bounds: IntermediateBounds
    method: BoundMethod
    crown: BoundCost
    intervals: BoundCost
    reason: str
    seconds: float = float("nan")
    auto: bool = False

    @property
    def gave_up(self) -> bool:
        """Whether AUTO took intervals where CROWN was possible (bounds given up)."""
        return self.auto and self.bounds is IntermediateBounds.INTERVALS


def _sizes(values: Values) -> tuple[int, list[int]]:
    return (int(np.prod(values.x.shape[1:])),
            [int(np.prod(v.shape[1:])) for v in values.outputs])


def crown_cost(structure: ProgramStructure, values: Values, rows: int,
               budget: int = DEFAULT_BUDGET,
               examples: int | None = None) -> tuple[BoundCost, BoundCost]:
    """`(CROWN's cost, CROWN-IBP's cost)` of bounding `rows` functionals of the output.

    Estimated from the static shapes of `values` (nothing runs): a pull-back of `k`
    rows from op `i` costs `k` times the sizes of the values of the ops before it; the
    units of a "valid" convolution pull both rows back through their receptive fields
    (`keras_roll.compile.bounds.windows`; an affine value's `+e_j` rows alone), at the
    cost of the windows. Every unit is counted, open or not (which units are open
    depends on the ball).

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
        view = conv_windows(structure, values, node.inputs[0])
        signs, k, b_i = layer_plan(structure, values, i, budget, b)
        if view is not None:  # every unit's rows through its receptive field, at most
            width = signs * view.channels  # an affine value's +e_j rows only
            pull = (rows_per_pull(width) if signs == 2 and skips_inactive(structure, node)
                    else width)
            fit = view.items_per_chunk(budget, b, pull)
            elements += b * view.positions * width * view.entries
            pullbacks += -(-b * view.positions * -(-width // pull) // fit)
            widest = max(widest, 3 * itemsize * fit * pull * view.largest)
            continue
        chunks = -(-signs * n // k)
        elements += chunks * k * b_i * int(below[i])
        pullbacks += chunks
        widest = max(widest, 3 * itemsize * k * b_i * max([input_size, *sizes[:i + 1]]))
    out = b * rows * int(below[-1])
    final = 3 * itemsize * b * rows * max([input_size, *sizes])
    return (BoundCost(elements + out, pullbacks + 1, max(widest, final)),
            BoundCost(out, 1, final))


def interval_lines(structure: ProgramStructure, values: Values, boxes: dict,
                   lines: RelaxedOps | None = None) -> RelaxedOps:
    """CROWN-IBP's relaxation: every relaxed op's lines on its input's interval (`boxes`,
    `interval_pass(...).boxes`), set in `lines` (a new `RelaxedOps` by default).

    Example:

    ```python
    lines = interval_lines(structure, values, interval_pass(...).boxes)
    ```
    """
    lines = RelaxedOps(values) if lines is None else lines
    for i, node in enumerate(structure.nodes):
        if not bound_rule(node.op).linear:
            lines.set(i, node, boxes[node.inputs[0]])
    return lines


def probe_seconds(structure: ProgramStructure, values: Values, budget: int = DEFAULT_BUDGET,
                  examples: int | None = None, repeats: int = 2) -> float:
    """Seconds per functional entry of CROWN's pull-backs where it runs: one chunk of the
    layer bounds of the last relaxed op (the one with the most ops below it) is traced,
    then timed `repeats` times (the fastest counts), and its time divided by the entries
    it pulls through ops (as `crown_cost` counts them).

    Example:

    ```python
    crown, _ = crown_cost(structure, values, rows=9)
    seconds = crown.elements * probe_seconds(structure, values)     # one CROWN pass
    ```
    """
    b = int(examples or values.x.shape[0] or DEFAULT_EXAMPLES)
    relaxed = [i for i, node in enumerate(structure.nodes)
               if bound_rule(node.op) is not None and not bound_rule(node.op).linear]
    if not relaxed:
        return 0.0
    lines = RelaxedOps(values)
    for i in relaxed[:-1]:  # any lines cost the same: a unit box around x
        z0 = values.inputs[i][0]
        lines.set(i, structure.nodes[i], Box(-tf.ones_like(z0), tf.ones_like(z0)))
    last = relaxed[-1]
    shape = [int(d) for d in values.inputs[last][0].shape[1:]]
    n = int(np.prod(shape))
    _, k, _ = layer_plan(structure, values, last, budget, b)
    key = structure.nodes[last].inputs[0]

    @tf.function(autograph=False)
    def chunk():
        eye = tf.one_hot(tf.range(k) % n, n, dtype=values.x.dtype)
        res = pull_back(structure, values, key, tf.reshape(eye, [1, k, *shape]), relax=lines)
        return tf.reduce_sum(res.lam_input) + tf.reduce_sum(res.const)

    chunk().numpy()  # traced
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        chunk().numpy()
        times.append(time.perf_counter() - start)
    input_size, sizes = _sizes(values)
    entries = k * b * (input_size + sum(sizes[:last]))
    return min(times) / max(entries, 1)


def choose_intermediate(choice: IntermediateBounds | str, structure: ProgramStructure,
                        values: Values, rows: int, budget: int = DEFAULT_BUDGET,
                        examples: int | None = None, *,
                        max_seconds: float | None = DEFAULT_MAX_SECONDS,
                        seconds_per_element: float | Callable[[], float] | None = None,
                        max_elements: int | None = None) -> IntermediateChoice:
    """Resolves a user's `IntermediateBounds` for one call, with the reason.

    AUTO takes CROWN where all of these hold, else intervals (CROWN-IBP):

    1. memory: CROWN's largest chunk (`BoundCost.chunk_bytes`) fits `budget`;
    2. work: CROWN's `elements` fit `max_elements` (if given);
    3. time: CROWN's estimated seconds per pass and example fit `max_seconds` (if
       given): its `elements` per example times `SURE_SECONDS_PER_ELEMENT` (no probe)
       where that already fits, else times `seconds_per_element` (by default
       `probe_seconds`, a timed chunk of CROWN's pull-backs).

    Args:
        choice: an `IntermediateBounds` or its value ("crown", "intervals", "auto").
        structure, values, rows, budget, examples: as `crown_cost`.
        max_seconds: the time AUTO allows one CROWN pass per example, or None.
        seconds_per_element: seconds per entry (`probe_seconds`), a callable that
            returns it (called only where needed), or None: `probe_seconds`.
        max_elements: the work AUTO allows CROWN per call, or None.

    Returns:
        An `IntermediateChoice`.

    Raises:
        ValueError: an unknown choice, naming the valid ones.

    Example:

    ```python
    choice = choose_intermediate("auto", structure, values, rows=9, max_seconds=5.0)
    choice.bounds, choice.reason
    ```
    """
    choice = IntermediateBounds.parse(choice, "intermediate")
    b = int(examples or values.x.shape[0] or DEFAULT_EXAMPLES)
    crown, ibp = crown_cost(structure, values, rows, budget, b)
    ratio = crown.elements / max(ibp.elements, 1)
    if choice is IntermediateBounds.CROWN:
        return IntermediateChoice(choice, choice.method, crown, ibp, f"CROWN at every "
                                  f"layer, as asked ({ratio:.0f}x CROWN-IBP's work).")
    if choice is IntermediateBounds.INTERVALS:
        return IntermediateChoice(choice, choice.method, crown, ibp, "intervals, then CROWN "
                                  "at the output (CROWN-IBP), as asked.")
    seconds, over, how = float("nan"), None, ""
    if crown.chunk_bytes > budget:
        over = (f"its smallest chunk of layer bounds needs {crown.chunk_bytes / 2**20:.3g} "
                f"MiB, over the memory budget of {budget / 2**20:.3g} MiB")
    elif max_elements is not None and crown.elements > max_elements:
        over = (f"it needs {crown.elements:.2g} functional entries, over the budget of "
                f"{max_elements:.2g}")
    elif max_seconds is not None:
        work = crown.elements / b
        if work * SURE_SECONDS_PER_ELEMENT <= max_seconds:
            seconds, how = work * SURE_SECONDS_PER_ELEMENT, "at most about"
        else:
            rate = seconds_per_element
            if rate is None:
                rate = probe_seconds(structure, values, budget, b, repeats=1)
            seconds, how = work * float(rate() if callable(rate) else rate), "about"
            if seconds > max_seconds:
                over = (f"it would take about {seconds:.2g} s per pass and input (a timed "
                        f"chunk, extrapolated), over the time budget of {max_seconds:g} s")
    if over is None:
        took = "" if np.isnan(seconds) else f", {how} {seconds:.2g} s per pass and input"
        return IntermediateChoice(IntermediateBounds.CROWN, BoundMethod.RELAXATION, crown, ibp,
                                  f"CROWN at every layer: it fits the budgets{took}.",
                                  seconds, True)
    return IntermediateChoice(
        IntermediateBounds.INTERVALS, BoundMethod.CROWN_IBP, crown, ibp,
        f"intervals, then CROWN at the output (CROWN-IBP), not CROWN at every layer: {over}. "
        f"Given up: CROWN's tighter layer bounds; the bounds are looser, often far looser "
        f"on naturally trained networks (radii 2-5x smaller on small MNIST networks, up to "
        f"170x on a large CNN; docs/guide.md, \"Intermediate bounds\").", seconds, True)
