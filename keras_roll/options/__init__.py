"""Run options of the certify / evaluation family, and their validators.

`RunOptions(batch_size, memory_budget, verbose, rigor)` is the one frozen set of
options that `certify`, `stability_bounds`, `count_regions`, `lp_margins` and
the evaluation functions share. It is validated once, on construction; each
argument has one validator here, which also serves the functions that take a
single one of them (`linearize(memory_budget=...)`, for example). `Rigor` is the
rounding guard of certificates as an enum; the strings "float64", "strict" and
"float32" are accepted wherever a public function takes a rigor. docs/design.md,
section "Options and results", says which function takes what. The modes (`Choice`,
`Rigor`, `Method`) live in `keras_roll.options.choices`, the progress bar in
`keras_roll.options.progress`; both are re-exported here.

Example:

```python
opts = RunOptions(batch_size=64, rigor="strict")     # validated here, once
opts.rigor is Rigor.STRICT                           # True
cert = keras_roll.certify(model, x, options=opts)
cert = keras_roll.certify(model, x, rigor="float32") # keyword arguments still work
```
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import tensorflow as tf
from tqdm.auto import tqdm

from keras_roll.options.choices import AUTO, Choice, Method, Rigor
from keras_roll.options.progress import Verbose, check_verbose, progress_bar

__all__ = ["AUTO", "Choice", "FIELDS", "GRADIENT_FIELDS", "Method", "Norm", "Norms",
           "ONE_DEVICE_FIELDS", "Rigor", "RunOptions", "Seed", "Verbose", "check_batch_size",
           "check_bisect_tol", "check_memory_budget", "check_strategy", "check_verbose",
           "fixed_budget", "parse_norm", "parse_norms", "progress_bar"]

INF = math.inf

Norm = int | float | str
"""1, 2, `np.inf` (or "l1", "l2", "linf", "inf")."""

Norms = Norm | Sequence[Norm] | None
"""One norm or several."""

Seed = int | tf.Tensor | Sequence[int] | None
"""None (fresh randomness), an int, or a `[2]` int tensor for stateless sampling."""


def check_bisect_tol(bisect_tol) -> float:
    """A relative tolerance of the bisection in (0, 1).

    Example:

    ```python
    check_bisect_tol(1e-4)      # 0.0001
    ```
    """
    if not (isinstance(bisect_tol, numbers.Real) and not isinstance(bisect_tol, bool)
            and 0 < bisect_tol < 1):
        raise ValueError(f"bisect_tol must be a relative tolerance in (0, 1), got "
                         f"{bisect_tol!r}.")
    return float(bisect_tol)


def check_batch_size(batch_size) -> int | None:
    """None or a positive int (examples per chunk).

    Example:

    ```python
    check_batch_size(64)       # 64
    ```
    """
    if batch_size is not None and (not isinstance(batch_size, numbers.Integral)
                                   or isinstance(batch_size, bool) or batch_size <= 0):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}.")
    return None if batch_size is None else int(batch_size)


def check_seed(seed) -> int | None:
    """None (fresh entropy) or a non-negative int.

    Example:

    ```python
    check_seed(0)       # 0
    ```
    """
    if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)
                             or seed < 0):
        raise ValueError(f"seed must be None or a non-negative integer, got {seed!r}.")
    return None if seed is None else int(seed)


def check_memory_budget(memory_budget, allow_default: bool = True) -> int | str | None:
    """A memory budget: a number of bytes >= 1 (returned as an int), "auto" or None.

    None means the twin's own budget (`linearize(model, memory_budget=...)`) and
    "auto" lets the chunk planner choose. 0.5 is refused, not floored to 0.

    Args:
        memory_budget: the value to check.
        allow_default: whether None and "auto" are accepted (False where a
            number of bytes is needed).

    Example:

    ```python
    check_memory_budget(2**26)        # 67108864
    check_memory_budget("auto")       # 'auto'
    ```
    """
    if allow_default and (memory_budget is None or memory_budget == AUTO):
        return memory_budget
    if (isinstance(memory_budget, numbers.Real) and not isinstance(memory_budget, bool)
            and math.isfinite(memory_budget) and memory_budget >= 1):
        return int(memory_budget)
    choices = "a number of bytes >= 1, 'auto' or None" if allow_default else \
        "a number of bytes >= 1"
    raise ValueError(f"memory_budget must be {choices}, got {memory_budget!r}; e.g. "
                     f"memory_budget=2**26 for 64 MiB.")


def fixed_budget(memory_budget) -> int | None:
    """The bytes of an explicit memory budget, or None for the defaults (None, "auto").

    Example:

    ```python
    fixed_budget(2**26), fixed_budget("auto")     # (67108864, None)
    ```
    """
    budget = check_memory_budget(memory_budget)
    return None if budget in (None, AUTO) else budget


def check_strategy(strategy) -> tf.distribute.Strategy | None:
    """None (the strategy in scope at the call) or a `tf.distribute.Strategy` whose
    replicas are local devices: `MirroredStrategy`, `OneDeviceStrategy`,
    `MultiWorkerMirroredStrategy` (this worker's devices) or the default strategy.

    Raises:
        ValueError: another object, or a TPU / parameter-server / central-storage
            strategy (evaluation runs on the replicas' devices one slice each).

    Example:

    ```python
    check_strategy(tf.distribute.MirroredStrategy())     # the strategy
    ```
    """
    if strategy is None:
        return None
    if not isinstance(strategy, tf.distribute.Strategy):
        raise ValueError(f"strategy must be a tf.distribute.Strategy or None (the strategy in "
                         f"scope), got {type(strategy).__name__}: {strategy!r}.")
    supported = (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy,
                 tf.distribute.MultiWorkerMirroredStrategy)
    if isinstance(strategy, supported):
        return strategy
    try:
        _ = strategy.extended.worker_devices
    except RuntimeError:  # only the default strategy has no devices of its own
        return strategy
    raise ValueError(f"strategy={type(strategy).__name__} is not supported: keras_roll "
                     f"evaluates on local replicas (MirroredStrategy, OneDeviceStrategy, "
                     f"MultiWorkerMirroredStrategy). Evaluate under a MirroredStrategy, or "
                     f"give each worker a shard and join the results with their concat "
                     f"(docs/guide.md, \"Distribution\").")


_NORM_NAMES = {"inf": INF, "np.inf": INF, "linf": INF, "l_inf": INF, "l1": 1, "l2": 2}


def parse_norm(p: Norm):
    """1, 2 or `math.inf` from `p` (1, 2, inf, 1.0, 'l1', 'l2', 'linf', 'inf', 'np.inf').

    Example:

    ```python
    parse_norm("l2"), parse_norm(np.inf)     # (2, inf)
    ```
    """
    if isinstance(p, str) and p.strip().lower() in _NORM_NAMES:
        return _NORM_NAMES[p.strip().lower()]
    if isinstance(p, numbers.Real) and not isinstance(p, bool):
        value = float(p)
        if value == 1.0:
            return 1
        if value == 2.0:
            return 2
        if value == INF:
            return INF
    raise ValueError(f"Unsupported norm {p!r}: keras_roll certifies lp balls for p = 1, 2 "
                     f"or np.inf; pass e.g. norms=(1, 2, np.inf).")


def parse_norms(norms: Norms) -> tuple:
    """A tuple of distinct norms (see `parse_norm`) in the given order; None gives ().

    Example:

    ```python
    parse_norms((2.0, "inf", 2))     # (2, inf)
    ```
    """
    if norms is None:
        return ()
    if isinstance(norms, (str, numbers.Real)):
        norms = (norms,)
    try:
        items = list(norms)
    except TypeError:
        raise ValueError(f"norms must be a sequence of 1, 2 and np.inf, got {norms!r}.") from None
    out = []
    for p in items:
        q = parse_norm(p)
        if q not in out:
            out.append(q)
    return tuple(out)


FIELDS = ("batch_size", "memory_budget", "verbose", "rigor", "strategy")
"""The fields of `RunOptions`, in order."""

ONE_DEVICE_FIELDS = FIELDS[:4]
"""The fields of a function that runs on one device (the default `uses` of `RunOptions.of`)."""

GRADIENT_FIELDS = ("memory_budget", "verbose")
"""The fields a gradient method reads (`integrated_gradients`, `gradient_distortion`, ...)."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a certify / evaluation run is executed, validated once on construction.

    None stands for a field's default everywhere (`RunOptions(rigor=None).rigor is
    Rigor.FLOAT64`, and `certify(model, x, rigor=None)` runs the default).

    Attributes:
        batch_size: examples per chunk (None: from the memory budget); for
            streams of single examples, also the batch they are grouped into.
        memory_budget: bytes of tangents a chunk may hold; None (the twin's own
            budget, see `keras_roll.linearize`) or "auto" (chosen for the twin).
        verbose: progress bar: "auto" (the default; only for runs over a
            second), True or False.
        rigor: the rounding guard of certificates (`Rigor`; strings accepted;
            default "float64").
        strategy: the `tf.distribute.Strategy` whose replicas share the
            examples (`certify`, `robust_radius`, `saliency`,
            `integrated_gradients`, `gradient_distortion`); None: the strategy
            in scope at the call (one device outside any scope).

    Example:

    ```python
    opts = keras_roll.RunOptions(batch_size=32, verbose=False)
    keras_roll.certify(model, x, options=opts)
    keras_roll.certify(model, x, options=opts, rigor="strict")   # one field overridden
    ```
    """

    batch_size: int | None = None
    memory_budget: int | str | None = None
    verbose: Verbose = AUTO
    rigor: Rigor = Rigor.FLOAT64
    strategy: tf.distribute.Strategy | None = None

    def __post_init__(self):
        set_field = object.__setattr__  # frozen: normalise the validated values once
        set_field(self, "batch_size", check_batch_size(self.batch_size))
        set_field(self, "memory_budget", check_memory_budget(self.memory_budget))
        set_field(self, "verbose", AUTO if self.verbose is None else check_verbose(self.verbose))
        set_field(self, "rigor", Rigor.parse(self.rigor, default=Rigor.FLOAT64))
        set_field(self, "strategy", check_strategy(self.strategy))

    @classmethod
    def of(cls, options: RunOptions | None = None, *, uses: Sequence[str] = ONE_DEVICE_FIELDS,
           caller: str | None = None, **overrides) -> RunOptions:
        """`options` (or the defaults) with the given fields replaced.

        The public functions call this with their `options=` and keyword
        arguments. A keyword that names no field, or a field the function does
        not read (`uses`), is a `TypeError` naming it; a `RunOptions` object may
        carry fields a function does not read (one object serves a whole
        analysis), and they are ignored. None means the field's default.

        Args:
            options: a `RunOptions`, or None (the defaults).
            uses: the fields the caller reads.
            caller: the caller's name, for the error message.
            **overrides: the fields to replace.

        Raises:
            TypeError: `options` is not a `RunOptions`, or a keyword names no field,
                or a field outside `uses`.
            ValueError: a bad value (the field's validator).

        Example:

        ```python
        RunOptions.of(None, rigor="float32").rigor     # Rigor.FLOAT32
        RunOptions.of(None, uses=("verbose",), rigor="strict")   # TypeError: rigor
        ```
        """
        if options is not None and not isinstance(options, RunOptions):
            raise TypeError(f"options must be a keras_roll.RunOptions or None, got "
                            f"{type(options).__name__}: {options!r}.")
        unknown = sorted(set(overrides) - set(FIELDS))
        if unknown:
            raise TypeError(f"Unexpected keyword argument(s) {unknown}; the run options are "
                            f"{sorted(FIELDS)} (or options=keras_roll.RunOptions(...)).")
        unused = [f for f in FIELDS if f in overrides and f not in uses]
        if unused:
            who = f"{caller}()" if caller else "This function"
            raise TypeError(f"{who} does not use the run option(s) {unused}: it reads "
                            f"{[f for f in FIELDS if f in uses] or 'none'}; leave "
                            f"{unused} out.")
        if options is None:
            return cls(**overrides)
        return dataclasses.replace(options, **overrides) if overrides else options

    def budget(self, default: int) -> int:
        """The memory budget in bytes: `default` (the twin's) for None and "auto"."""
        budget = fixed_budget(self.memory_budget)
        return default if budget is None else budget

    def progress(self, total: int | None, desc: str, unit: str = "ex") -> tqdm:
        """A `progress_bar` for this run's `verbose`."""
        return progress_bar(total, self.verbose, desc, unit)
