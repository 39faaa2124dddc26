"""Chunk plans: how `examples x directions` of work is cut to fit a memory budget.

Every streamed computation in keras_roll pushes, for a batch of examples, a
number of directions per example through the twin (input axes, sampled axes,
random probes, rays of the bisection; a plain forward batch is one direction).
Its memory is about `examples * directions * bytes_per_item`, where each caller
estimates `bytes_per_item` (usually from `NeuronLayout.tangent_bytes`). This
module is the one place that turns such an estimate and a budget into chunk
sizes, so that the planner (`keras_roll.roll.loss.memory_plan`) and every executor
(the twin's axis stream, ROLL, directional margins, region counts, the
bisection) agree by construction. See docs/design.md, section "Memory".

`memory_budget="auto"` (the default of `keras_roll.linearize`) chooses among
the plans of a few candidate budgets by timing them (`auto_candidates`,
`choose_budget`) and remembers the choice per model and shape
(`remembered_budget`); the executors that time their work are
`keras_roll.roll.autotune` (ROLL) and `keras_roll.compile.autotune` (the axis
stream of certificates). docs/design.md, "Chunk sizes by measurement".

Example:

```python
plan = plan_chunks(examples=1000, directions=784, bytes_per_item=4 * 1510,
                   budget=64 * 2**20)
plan.examples_per_chunk, plan.per_chunk, plan.chunks    # 64, 157, 80
for sl in plan.example_slices():
    for start in plan.direction_starts():
        ...
```
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator

import tensorflow as tf

__all__ = [
    "AUTO_BUDGETS",
    "AUTO_CAP",
    "AUTO_MIN_CHUNKS",
    "DEFAULT_EXAMPLES",
    "MIN_DIRECTIONS",
    "ChunkPlan",
    "auto_candidates",
    "balanced_split",
    "choose_budget",
    "map_chunks",
    "plan_chunks",
    "plan_directions",
    "remembered_budget",
]

DEFAULT_EXAMPLES = 64  # examples per chunk by default: enough rows for efficient matmuls
MIN_DIRECTIONS = 32  # fewer examples per chunk rather than fewer directions than this


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """How `examples x directions` are streamed in chunks within `memory_budget`.

    Attributes:
        examples: examples in all (B).
        directions: directions per example in all (D for the exact ROLL loss).
        examples_per_chunk: examples per chunk (b >= 1).
        per_chunk: directions per chunk (k >= 1), balanced so that the last
            chunk is not almost empty.
        bytes_per_item: estimated bytes of one example and direction.
        memory_budget: the budget in bytes.
        fits: whether one direction of `examples_per_chunk` examples fits in
            the budget (if not, the plan still runs one direction at a time,
            over budget; ROLL refuses it with a `MemoryError`).
    """

    examples: int
    directions: int
    examples_per_chunk: int
    per_chunk: int
    bytes_per_item: int
    memory_budget: int
    fits: bool = True

    @property
    def bytes_per_direction(self) -> int:
        """Bytes of one direction for a whole example chunk."""
        return self.examples_per_chunk * self.bytes_per_item

    @property
    def direction_chunks(self) -> int:
        """Chunks of directions per example chunk."""
        return -(-self.directions // self.per_chunk)

    @property
    def example_chunks(self) -> int:
        return -(-self.examples // self.examples_per_chunk)

    @property
    def chunks(self) -> int:
        """Tangent passes in all (example chunks times direction chunks)."""
        return self.example_chunks * self.direction_chunks

    def example_slices(self) -> Iterator[slice]:
        """The example slices, in order."""
        b = self.examples_per_chunk
        for start in range(0, self.examples, b):
            yield slice(start, min(start + b, self.examples))

    def direction_starts(self) -> range:
        """The first direction of every direction chunk."""
        return range(0, self.directions, self.per_chunk)


def balanced_split(total, fit):
    """`(per_chunk, chunks)` for `total` items when `fit >= 1` fit in one chunk.

    `chunks = ceil(total / fit)` and `per_chunk = ceil(total / chunks)`, so the
    chunks are as even as possible. Works on Python ints and on integer tensors
    (inside graphs with a dynamic batch).
    """
    chunks = (total + fit - 1) // fit
    if isinstance(chunks, int):
        return (total + chunks - 1) // max(chunks, 1), chunks
    return (total + chunks - 1) // tf.maximum(chunks, 1), chunks


def plan_directions(total, bytes_per_direction, budget):
    """`(per_chunk, chunks, fits)` for `total` directions of `bytes_per_direction` each.

    Python ints give Python results; if any argument is a tensor, the results
    are int64 tensors (the dynamic path of ROLL inside `tf.function`).
    """
    if all(isinstance(v, int) for v in (total, bytes_per_direction, budget)):
        fit = min(budget // max(1, bytes_per_direction), total)
        per_chunk, chunks = balanced_split(total, max(fit, 1))
        return per_chunk, chunks, fit >= 1 or total == 0
    total = tf.cast(total, tf.int64)
    fit = tf.minimum(tf.cast(budget, tf.int64)
                     // tf.maximum(tf.cast(bytes_per_direction, tf.int64), 1), total)
    per_chunk, chunks = balanced_split(total, tf.maximum(fit, 1))
    return per_chunk, chunks, (fit >= 1) | (total == 0)


def plan_chunks(examples: int, directions: int, bytes_per_item: int, budget: int,
                batch_size: int | None = None, max_examples: int | None = DEFAULT_EXAMPLES,
                min_directions: int = MIN_DIRECTIONS) -> ChunkPlan:
    """Chooses examples and directions per chunk so that `b * k * bytes <= budget`.

    Examples per chunk are `batch_size` if given, else at most `max_examples`
    (None: no cap), reduced if needed so that at least `min(directions,
    min_directions)` directions fit; directions fill the rest of the budget,
    balanced so the last chunk is not almost empty.

    Args:
        examples: examples in all.
        directions: directions per example in all (1 for a plain forward batch).
        bytes_per_item: bytes of one example and direction.
        budget: memory budget in bytes.
        batch_size: fixed examples per chunk (the caller's choice), or None.
        max_examples: cap on the examples per chunk when `batch_size` is None.
        min_directions: see above.

    Returns:
        A `ChunkPlan`.

    Example:

    ```python
    plan_chunks(32, 299 * 299 * 3, 8_000_000, 256 * 2**20)  # b=1, k=33: 264 MB
    ```
    """
    per = max(1, int(bytes_per_item))
    budget = int(budget)
    b = max(1, min(int(examples), batch_size or max_examples or max(int(examples), 1)))
    want = min(int(directions), min_directions)
    if batch_size is None and budget // (b * per) < want:
        b = max(1, min(b, budget // (per * want)))
    k, _, fits = plan_directions(int(directions), b * per, budget)
    return ChunkPlan(int(examples), int(directions), b, max(1, k), per, budget, bool(fits))


def map_chunks(fn: Callable[[tf.Tensor], tf.Tensor], total: int, per_chunk: int,
               dtype) -> tf.Tensor:
    """`[B, total]`: the columns `fn` makes chunk by chunk, in one traced loop.

    `fn(start)` gets the first column of a chunk as an int32 scalar tensor and
    returns the `[B, per_chunk]` columns `start .. start + per_chunk - 1` (columns
    past `total` in the last chunk are computed and dropped). The chunks run in a
    `tf.while_loop` one at a time (`parallel_iterations=1`), so the graph holds
    one chunk's ops whatever their number, and the memory of one chunk at a time
    follows the budget that sized `per_chunk`. The loop is differentiable with
    respect to the tensors `fn` reads (the weights in a training step). A single
    chunk runs without a loop.

    Args:
        fn: `fn(start) -> [B, per_chunk]` tensor of `dtype`, the same shape for
            every chunk.
        total: columns in all.
        per_chunk: columns per chunk (from a `ChunkPlan` or `balanced_split`).
        dtype: the dtype of `fn`'s results.

    Example:

    ```python
    k, _ = balanced_split(2 * n, fit)
    low = map_chunks(lambda start: bounds_of_rows(start, k), 2 * n, k, tf.float64)
    ```
    """
    total, per_chunk = int(total), max(1, int(per_chunk))
    chunks = -(-total // per_chunk)
    if chunks <= 1:
        return fn(tf.constant(0, tf.int32))[:, :total]
    parts = tf.TensorArray(dtype, size=chunks)

    def body(i, parts):
        return i + 1, parts.write(i, fn(i * per_chunk))

    _, parts = tf.while_loop(lambda i, _: i < chunks, body,
                             (tf.constant(0, tf.int32), parts), parallel_iterations=1)
    out = parts.stack()  # [chunks, B, per_chunk]
    out = tf.transpose(out, [1, 0, 2])
    return tf.reshape(out, [tf.shape(out)[0], chunks * per_chunk])[:, :total]


# --------------------------------------------------------------------------- memory_budget="auto"

AUTO_BUDGETS = (16 * 2**20, 64 * 2**20, 256 * 2**20)  # the fixed candidates of "auto"
AUTO_CAP = 2**30  # the most memory "auto" lets a chunk hold (its one-chunk candidate too)
AUTO_MIN_CHUNKS = 4  # below this many chunks under every candidate, no probe is worth it


def auto_candidates(plan_for: Callable[[int], ChunkPlan],
                    cap: int | None = None) -> dict[int, ChunkPlan]:
    """The candidate budgets of `memory_budget="auto"` and their plans, one per plan.

    The candidates are 16, 64 and 256 MiB and "one chunk": the budget that holds
    all the directions of an example chunk, if that is within `cap`. Budgets
    whose plans cut the work the same way are one candidate (the smallest).

    Args:
        plan_for: `fn(budget) -> ChunkPlan`, the caller's plan for a budget
            (built with `plan_chunks` / `plan_directions`).
        cap: the largest budget considered (default `AUTO_CAP`).

    Example:

    ```python
    plans = auto_candidates(lambda b: plan_chunks(64, 784, 4 * 1510, b))
    sorted(plans)    # [16 MiB, 64 MiB, 256 MiB, one chunk] when they all differ
    ```
    """
    cap = AUTO_CAP if cap is None else int(cap)
    budgets = [b for b in AUTO_BUDGETS if b <= cap]
    widest = plan_for(cap)
    one_chunk = widest.bytes_per_direction * widest.directions
    if one_chunk <= cap:
        budgets.append(max(int(one_chunk), 1))
    plans: dict[int, ChunkPlan] = {}
    seen = set()
    for budget in sorted(budgets):
        plan = plan_for(budget)
        cut = (plan.examples_per_chunk, plan.per_chunk)
        if cut not in seen and plan.fits:
            seen.add(cut)
            plans[budget] = plan
    return plans or {budgets[0]: plan_for(budgets[0])}


def choose_budget(plans: dict[int, ChunkPlan], seconds: Callable[[int, ChunkPlan], float],
                  repeats: int = 2, min_chunks: int = AUTO_MIN_CHUNKS) -> int:
    """The budget of `plans` whose work `seconds` measures fastest.

    `seconds(budget, plan)` runs the caller's work under `plan` once and returns
    its cost in seconds per unit of work (comparable between plans: a whole
    step, or one chunk divided by its examples and directions). Every
    candidate is run once untimed (tracing), then `repeats` times round-robin;
    the smallest of its times counts. When a single plan is left, or no
    candidate would cut the work into `min_chunks` chunks, nothing is run and
    the smallest budget is returned.

    Example:

    ```python
    budget = choose_budget(auto_candidates(plan_for), lambda b, p: time_step(b))
    ```
    """
    budgets = sorted(plans)
    if len(budgets) == 1 or max(p.chunks for p in plans.values()) < min_chunks:
        return budgets[0]
    for budget in budgets:
        seconds(budget, plans[budget])  # the first call traces
    best = {budget: math.inf for budget in budgets}
    for _ in range(max(1, repeats)):
        for budget in budgets:
            best[budget] = min(best[budget], seconds(budget, plans[budget]))
    return min(budgets, key=lambda b: (best[b], b))


_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remembered_budget(owner, key, choose: Callable[[], int | None],
                      default: int | None = None) -> int:
    """`choose()` the first time `owner` (a model) meets `key`, the same budget after.

    The choices of "auto" are kept per model (weakly: they go with it) and per
    key, e.g. the kind of work, the dtype and the per-example shape. A `choose`
    that returns None made no measurement (the work was too short to time):
    `default` is used and nothing is remembered, so that a first small call does
    not fix the budget of the larger ones after it.

    Example:

    ```python
    budget = remembered_budget(model, ("certify", "float64", (32, 32, 3)), probe)
    ```
    """
    choices = _CHOICES.setdefault(owner, {})
    if key not in choices:
        choice = choose()
        if choice is None:
            return int(default)
        choices[key] = int(choice)
    return choices[key]
