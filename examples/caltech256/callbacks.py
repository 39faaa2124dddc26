"""The callbacks of the Caltech-256 training, in the order they must see the epoch
logs: the step timer and the margin monitor add to the logs, `BestValLoss` and the
training state read them, `keras.callbacks.TensorBoard` writes them all.

TensorBoard logs one point per epoch: the example calls `fit` once per epoch (so that
a resumed run skips the batches already done), and Keras' TensorBoard counts batches
from 0 in every `fit` call, so step-level points would overlap.

Example:

```python
cbs = make_callbacks(config, folder, model, x_monitor, steps_per_epoch, state)
cbs.resume_points   # told where each fit call starts
```
"""

from __future__ import annotations

import importlib.util
import time
from typing import NamedTuple

import keras
import numpy as np

import keras_roll
from examples.caltech256.checkpoint import TrainingState
from examples.common.app import log
from examples.common.training import BestValLoss

__all__ = ["Callbacks", "PlainMarginMonitor", "StepTimer", "TopKAccuracy", "make_callbacks"]


class StepTimer(keras.callbacks.Callback):
    """Wall time per training step (input pipeline included): the epoch's median is
    added to the epoch logs as `step_time_ms`; `first` is the first step of the run
    (it includes tracing the step function)."""

    def __init__(self):
        super().__init__()
        self.times, self.last, self.first = [], None, None

    def on_epoch_begin(self, epoch, logs=None):
        self.times, self.last = [], time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self.first is None:
            self.first = now - self.last
        else:
            self.times.append(now - self.last)
        self.last = now

    def on_epoch_end(self, epoch, logs=None):
        if self.times and logs is not None:
            logs["step_time_ms"] = 1000 * float(np.median(self.times))


class PlainMarginMonitor(keras.callbacks.Callback):
    """`keras_roll.MarginMonitor` bound to the plain model, whatever `fit` runs on:
    margins in [0, 1] pixel units, added to the epoch logs."""

    def __init__(self, model, x, every):
        super().__init__()
        self.inner = keras_roll.MarginMonitor(x, every=every)
        self.inner.set_model(model)

    def on_epoch_end(self, epoch, logs=None):
        self.inner.on_epoch_end(epoch, logs)


class TopKAccuracy(keras.metrics.SparseTopKCategoricalAccuracy):
    """Top-k accuracy that also takes float16 / bfloat16 logits (mixed precision):
    TensorFlow's `in_top_k` only takes float32."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(y_true, keras.ops.cast(y_pred, "float32"), sample_weight)


class Callbacks(NamedTuple):
    """The training callbacks (`all`, in order), those told where each `fit` call
    starts (`resume_points`), the step timer and the best-epoch keeper."""

    all: list
    resume_points: tuple
    timer: StepTimer
    best: BestValLoss


def make_callbacks(config, folder, model, x_monitor, steps_per_epoch: int,
                   state: dict) -> Callbacks:
    """The training callbacks of `config` writing into the run folder `folder`."""
    best = BestValLoss(model)
    if state["best_epoch"] is not None:
        best.best, best.epoch = state["best_val_loss"], state["best_epoch"]
    timer = StepTimer()
    saver = TrainingState(folder.write_checkpoint_dir(), state, model, best,
                          folder.best_weights_path(), steps_per_epoch, config.epochs,
                          config.save_freq)
    callbacks = [timer]
    if x_monitor is not None:
        callbacks.append(PlainMarginMonitor(model, x_monitor, config.monitor_every))
    callbacks += [best, saver]
    if importlib.util.find_spec("tensorboard") is not None:
        callbacks.append(keras.callbacks.TensorBoard(str(folder.tensorboard),
                                                     update_freq="epoch", write_graph=False))
    else:
        log("TensorBoard logs are off: the tensorboard package is not installed "
            "(pip install tensorboard, or keras_roll[examples]).")
    return Callbacks(callbacks, (saver,), timer, best)
