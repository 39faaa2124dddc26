"""Evaluation over the replicas of a `tf.distribute` strategy: one executor.

`certify`, `robust_radius`, `saliency`, `integrated_gradients` and
`gradient_distortion` take a `strategy=` run option (`RunOptions.strategy`;
default: the strategy in scope, `tf.distribute.get_strategy()`). `Replicas.of`
turns it into the devices of its replicas; `Replicas.map` cuts the examples of
a batch into one contiguous slice per replica, runs the per-batch work of each
slice under its device (`tf.device`), the replicas concurrently in threads, and
returns the parts in order, for the caller to join (`np.concatenate`, or the
result class's `concat`). Every example is computed exactly as on one device:
only the grouping of examples into slices differs.

Work that a replica's work calls (`robust_radius` certifies its batch) stays on
that replica. Under the default strategy (one device, nothing in scope) `map` calls the work
once on the whole batch, in the caller's thread and device scope: it costs
nothing. Strategies whose replicas are not local devices (TPU, parameter
servers) are refused by `keras_roll.options.check_strategy`. Across several
workers, each worker evaluates its own shard and the results are joined with
`concat` (docs/guide.md, "Distribution").

Compiled passes are `tf.function`s that the replicas share (`keras_roll.compile.caches`
builds each once, under a lock); a trace serves every device, since placement happens
when a call runs. TensorFlow does not serialise tracing, so replicas that make the very
first call of a pass at the same moment may each trace it once.

Example:

```python
replicas = Replicas.of(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
parts = replicas.map(lambda sl: np.square(x[sl]), len(x))   # two slices, in order
np.concatenate(parts)                                      # == np.square(x)
```
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import tensorflow as tf

from keras_roll.inputs import Batch
from keras_roll.options import check_strategy

__all__ = ["Replicas", "split_batch"]


@dataclasses.dataclass(frozen=True)
class Replicas:
    """The devices one evaluation is spread over.

    Attributes:
        devices: the replicas' devices, in order; `()` for the default strategy
            (one replica, no device scope: the caller's own placement).
    """

    devices: tuple[str, ...] = ()

    @classmethod
    def of(cls, strategy: tf.distribute.Strategy | None = None) -> Replicas:
        """The replicas of `strategy` (None: the strategy in scope).

        Raises:
            ValueError: a strategy whose replicas are not local devices (see
                `keras_roll.options.check_strategy`).

        Example:

        ```python
        Replicas.of(None).count                      # 1 outside any strategy scope
        with strategy.scope():
            Replicas.of(None).devices                # the strategy's devices
        ```
        """
        strategy = check_strategy(tf.distribute.get_strategy() if strategy is None else strategy)
        if getattr(_replica, "device", None) is not None:  # nested: stay on this replica
            return cls()
        try:
            devices = tuple(strategy.extended.worker_devices)
        except RuntimeError:  # the default strategy has no devices of its own
            return cls()
        return cls(devices)

    @property
    def count(self) -> int:
        """The number of replicas (1 for the default strategy)."""
        return max(1, len(self.devices))

    def slices(self, n: int) -> list[slice]:
        """Contiguous slices of `n` examples, one per replica that gets any.

        The first `n % count` replicas get one example more; with fewer examples
        than replicas the last replicas get none (and are not called).

        Example:

        ```python
        Replicas(("/cpu:0", "/cpu:1")).slices(5)     # [slice(0, 3), slice(3, 5)]
        ```
        """
        k = self.count
        bounds = np.cumsum([0] + [n // k + (i < n % k) for i in range(k)])
        return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]

    def map(self, fn: Callable[[slice], Any], n: int) -> list:
        """`[fn(sl) for sl in slices(n)]`, each on its replica's device, concurrently.

        Under the default strategy: `[fn(slice(0, n))]`, called directly. `fn`
        must not share mutable state between slices other than through
        `serial` (a progress bar, a user's callback).

        Raises:
            The first error of any replica (after every replica finished).

        Example:

        ```python
        parts = replicas.map(lambda sl: engine.gradients(x[sl]), len(x))
        grad = np.concatenate(parts)
        ```
        """
        if not self.devices:
            return [fn(slice(0, n))]
        jobs = list(zip(self.devices, self.slices(n)))
        if len(jobs) == 1:
            return [_on(jobs[0][0], fn, jobs[0][1])]
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="keras_roll") as pool:
            futures = [pool.submit(_on, d, fn, sl) for d, sl in jobs]
            return [f.result() for f in futures]

    def map_batch(self, fn: Callable[[Batch], Any], batch: Batch) -> list:
        """`map` over the examples of a checked `Batch`: `fn` gets each replica's
        sub-batch (`split_batch`), with its `index` in the whole input.

        Example:

        ```python
        for batch in read_batches(x, spec):
            parts += replicas.map_batch(lambda sub: work(sub), batch)
        ```
        """
        if not self.devices:
            return [fn(batch)]
        return self.map(lambda sl: fn(split_batch(batch, sl)), int(batch.x.shape[0]))

    def serial(self, target):
        """`target` made safe to share between replicas: a callable, or an object
        whose `update` is called (a progress bar), run one call at a time.
        Returned unchanged for one replica.

        Example:

        ```python
        with opts.progress(n, "certify") as bar:
            bar = replicas.serial(bar)
        ```
        """
        return target if self.count == 1 else _Serial(target)


_replica = threading.local()  # the device a replica's work runs on, in its thread


def _on(device: str, fn, sl: slice):
    _replica.device = device
    try:
        with tf.device(device):
            return fn(sl)
    finally:
        _replica.device = None


def split_batch(batch: Batch, sl: slice) -> Batch:
    """The examples `sl` (relative to the batch) of `batch`, with their position in
    the whole input.

    Example:

    ```python
    split_batch(batch, slice(0, 2)).index       # slice(batch.index.start, ... + 2)
    ```
    """
    y = batch.y
    if y is not None and np.ndim(y):
        y = y[sl]
    start = batch.index.start + sl.start
    return Batch(batch.x[sl], y, None if batch.directions is None else batch.directions[sl],
                 slice(start, start + (sl.stop - sl.start)))


class _Serial:
    """Calls `target` (or its `update`) under one lock; other attributes pass through."""

    def __init__(self, target):
        self._target = target
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._target(*args, **kwargs)

    def update(self, *args, **kwargs):
        with self._lock:
            return self._target.update(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)
