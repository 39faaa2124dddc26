"""Training as the paper does it: `fit` with validation data, then the weights of the
best validation-loss epoch (`BestValLoss`), and a warning when that epoch is the last.

Keras' `ModelCheckpoint(save_best_only=True)` keeps the best weights on disk only;
`BestValLoss` keeps them in memory too and puts them back into the plain model that a
ROLL wrapper shares, which the selection and the certificates then read.

Example:

```python
result = fit_best(model, wrapped, (x, y), (xv, yv), epochs=20, batch_size=64, seed=0)
result.best.epoch, result.history["val_loss"], result.seconds
```

Arrays go to `fit` through `array_dataset`, a `tf.data` pipeline with autotuning off:
with Keras' own pipeline for arrays, `fit` sat idle at the end of some epochs until
tf.data's autotuning thread woke up (docs/guide.md, "Idle epoch ends with `tf.data`").
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import NamedTuple

import keras
import numpy as np

from examples.common.app import log

__all__ = ["BestValLoss", "EpochProgress", "FitResult", "array_dataset", "fit_best",
           "fit_verbosity", "last_epoch_warning", "without_autotune"]


class FitResult(NamedTuple):
    """What `fit_best` returns: the `BestValLoss` callback, the History dict (floats)
    and the training time in seconds."""

    best: BestValLoss
    history: dict
    seconds: float


def fit_verbosity() -> int:
    """Keras `fit` verbosity: the progress bar (1) on a terminal, one line per epoch (2)
    in a log file."""
    return 1 if sys.stdout.isatty() else 2


def without_autotune(ds):
    """`ds` with tf.data's autotuning off.

    With it on, `fit` can sit idle at the end of an epoch: deleting the epoch's iterator
    waits for the autotuning thread, which sleeps between rounds (seconds; with
    TensorFlow 2.21, up to a third of a ROLL epoch). Use it on pipelines without
    `AUTOTUNE` stages (docs/guide.md, "Idle epoch ends with `tf.data`").

    Example:

    ```python
    ds = without_autotune(tf.data.Dataset.from_tensor_slices((x, y)).batch(64).prefetch(2))
    ```
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def array_dataset(x, y, batch_size: int, seed: int | None = None):
    """Batches of `(x, y)` for `fit`, like Keras' own pipeline for arrays (the last
    batch may be short), reshuffled every epoch when `seed` is given, with a fixed
    `prefetch(2)` and autotuning off (`without_autotune`).

    Args:
        x, y: arrays with the same first dimension.
        batch_size: examples per batch.
        seed: the shuffle's seed; None keeps the order (validation data).

    Returns:
        A batched `tf.data.Dataset`.

    Example:

    ```python
    model.fit(array_dataset(x, y, 64, seed=0), epochs=10,
              validation_data=array_dataset(xv, yv, 64))
    ```
    """
    import tensorflow as tf

    if len(x) != len(y):
        raise ValueError(f"x and y must have the same number of examples; got {len(x)} "
                         f"and {len(y)}.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer; got {batch_size}.")
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if seed is not None:
        ds = ds.shuffle(len(x), seed=seed, reshuffle_each_iteration=True)
    return without_autotune(ds.batch(batch_size).prefetch(2))


def fit_best(model: keras.Model, fit_model: keras.Model, train, val, epochs: int,
             batch_size: int | None = None, weights_path=None, verbose=None,
             progress: str | None = None, name: str = "the model",
             seed: int = 0, warn_last_epoch: bool = True) -> FitResult:
    """`fit_model.fit` on `train` with `val` as validation data, then the weights of the
    best validation-loss epoch put back into `model` (which `fit_model` wraps or is).

    Args:
        model: the plain model whose weights are kept.
        fit_model: the model `fit` runs on (a ROLL wrapper of `model`, or `model`).
        train, val: `(x, y)` pairs (batched by `batch_size` with `array_dataset`) or
            batched `tf.data` datasets.
        epochs: training epochs.
        batch_size: batch size of array data.
        weights_path: optional `.weights.h5` written at every improvement.
        verbose: Keras' verbosity (default: `fit_verbosity()`).
        progress: with a description, a tqdm bar over the epochs instead (for many
            short epochs; pass `verbose=0`).
        name: the model's name in the last-epoch warning.
        seed: the seed of the training arrays' shuffle.
        warn_last_epoch: log `last_epoch_warning` when the best epoch is the last
            (off where the user did not choose the epochs, who could not act on it).

    Returns:
        A `FitResult`.

    Example:

    ```python
    best, history, seconds = fit_best(model, wrapped, (x, y), (xv, yv), 20, 64)
    ```
    """
    best = BestValLoss(model, path=weights_path)
    callbacks = [best] if progress is None else [best, EpochProgress(epochs, progress)]
    if isinstance(train, tuple):
        if batch_size is None:
            raise ValueError("fit_best: array data needs a batch_size; got None.")
        train = array_dataset(*train, batch_size, seed=seed)
    if isinstance(val, tuple):
        val = array_dataset(*val, batch_size or 32)
    start = time.perf_counter()
    # shuffle=False: datasets shuffle themselves (array_dataset, with the seed).
    history = fit_model.fit(train, validation_data=val, epochs=epochs, shuffle=False,
                            verbose=fit_verbosity() if verbose is None else verbose,
                            callbacks=callbacks)
    seconds = time.perf_counter() - start
    for cb in callbacks:
        getattr(cb, "close", lambda: None)()
    best.restore()
    warning = last_epoch_warning(best.epoch, epochs, name)
    if warning and warn_last_epoch:
        log(warning)
    hist = {k: [float(v) for v in vals] for k, vals in history.history.items()}
    return FitResult(best, hist, seconds)


def last_epoch_warning(best_epoch: int | None, epochs: int, name: str) -> str | None:
    """The warning for a best validation epoch that is the last one, else None.

    Example:

    ```python
    last_epoch_warning(20, 20, "vanilla")   # 'WARNING: vanilla: the best validation ...'
    ```
    """
    if best_epoch is None or best_epoch < epochs:
        return None
    return (f"WARNING: {name}: the best validation loss is at the last epoch ({best_epoch} "
            f"of {epochs}); the loss may still be falling, so training may be too short: "
            f"try more --epochs.")


class EpochProgress(keras.callbacks.Callback):
    """A tqdm progress bar over the epochs of `fit` (on stderr), showing the losses.

    Example:

    ```python
    model.fit(x, y, epochs=500, verbose=0, callbacks=[EpochProgress(500, "vanilla")])
    ```
    """

    def __init__(self, epochs: int, desc: str):
        super().__init__()
        from tqdm import tqdm

        self.bar = tqdm(total=epochs, desc=desc, unit="epoch", file=sys.stderr,
                        disable=None)  # no bar in log files

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        self.bar.set_postfix({k: f"{float(v):.3g}" for k, v in logs.items()
                              if k in ("loss", "val_loss", "val_accuracy")}, refresh=False)
        self.bar.update(1)

    def close(self):
        self.bar.close()


class BestValLoss(keras.callbacks.Callback):
    """Keeps the weights of the epoch with the lowest validation loss.

    At the end of every epoch, if `logs[monitor]` is the lowest so far, the weights
    of `model` (the plain model; a wrapped model shares them) are copied in memory
    and, with `path`, saved as a `.weights.h5` file. `restore()` puts them back.

    Args:
        model: the model whose weights are kept.
        monitor: the validation metric to minimise.
        path: optional `.weights.h5` file written at every improvement.

    Example:

    ```python
    best = BestValLoss(model)
    wrapped.fit(x, y, validation_data=(xv, yv), epochs=20, callbacks=[best])
    best.restore()          # model now holds the best validation-loss epoch
    best.epoch, best.logs   # 1-based epoch and its logs
    ```
    """

    def __init__(self, model: keras.Model, monitor: str = "val_loss", path=None):
        super().__init__()
        self.target = model
        self.monitor = monitor
        self.path = None if path is None else os.fspath(path)
        self.best = math.inf
        self.epoch = None
        self.logs = None
        self.weights = None

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        if self.monitor not in logs:
            raise KeyError(f"BestValLoss monitors {self.monitor!r}, which is not in the "
                           f"epoch logs {sorted(logs)}; pass validation_data to fit.")
        value = float(logs[self.monitor])
        if math.isfinite(value) and value < self.best:
            self.best, self.epoch = value, epoch + 1
            self.logs = {k: float(v) for k, v in logs.items()}
            self.weights = [np.array(w) for w in self.target.get_weights()]
            if self.path:
                self.target.save_weights(self.path)

    def restore(self) -> None:
        """Sets the model's weights to those of the best epoch."""
        if self.weights is None:
            raise RuntimeError(f"No epoch had a finite {self.monitor}; nothing to restore "
                               f"(did the training diverge? try a lower --lr).")
        self.target.set_weights(self.weights)
