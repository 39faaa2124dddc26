"""Training for the comparison: the network, one model per method and knob value (stored
and reused), and the search of each method's two operating points.

Every model starts from the same initial weights and trains on the same batches for the
same epochs with Adam; the weights after the last epoch are kept (the certified-training
methods ramp their objective, so no epoch's validation loss compares with another's).
The search bisects each method's knob (`examples.common.search.bisect_lam`) on
validation accuracy in whole percent: the largest value that keeps vanilla's accuracy,
and the largest within one point of it.

Example:

```python
data = load(config)
vanilla = train_or_load(METHODS["vanilla"], 0.0, data, config, out)
points = search(METHODS["roll"], vanilla, data, config, out)
```
"""

from __future__ import annotations

import enum
import time
from pathlib import Path
from typing import NamedTuple

import keras
import numpy as np

import keras_roll
from examples.common import app
from examples.common.data import Data, load_split
from examples.common.runs import load_stored
from examples.common.search import bisect_lam, meets
from examples.common.selection import DROPS
from examples.common.tables import write_json
from examples.common.training import array_dataset, fit_verbosity
from examples.compare.configs.default import TRAINING_FIELDS, Arch, Config
from examples.compare.methods import Method

__all__ = ["EpochTimes", "OperatingPoint", "build_model", "load", "search", "settings",
           "train_or_load"]


def load(config: Config) -> Data:
    """The MNIST split of `keras_roll.data.mnist_splits` ([0, 1] pixels, flat, no
    normalisation), cut to `--train_size` / `--test_size`.

    Raises:
        UsageError: no data where `--data_dir` points, or too few images.
    """
    return load_split(config)


def build_model(config: Config, input_dim: int = 784, classes: int = 10) -> keras.Model:
    """The network of `--arch` on [0, 1] pixels (no normalisation layer, so every radius
    is in pixel units), seeded by `--seed`: every method starts from the same weights.

    Example:

    ```python
    model = build_model(config)            # 784-300x4-10, softmax output
    ```
    """
    keras.utils.set_random_seed(config.seed)
    if config.arch == Arch.mlp:
        return keras_roll.models.fc(input_shape=(input_dim,), depth=config.depth,
                                    width=config.width, classes=classes, normalize=None)
    side = int(round(np.sqrt(input_dim)))
    if side * side != input_dim:
        raise app.UsageError(f"--arch=cnn needs square images; got {input_dim} pixels.")
    x = inputs = keras.Input((input_dim,), name="pixels")
    x = keras.layers.Reshape((side, side, 1))(x)
    x = keras.layers.Conv2D(16, 4, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Conv2D(32, 4, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(100, activation="relu")(x)
    outputs = keras.layers.Dense(classes, activation="softmax", name="predictions")(x)
    return keras.Model(inputs, outputs, name="cnn")


class EpochTimes(keras.callbacks.Callback):
    """The training time of each epoch: from its start to its last batch's end (no
    validation, no callbacks after the epoch)."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = self.last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.last = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(self.last - self.start)


def settings(method: Method, config: Config, data: Data) -> dict:
    """What a stored model of `method` depends on: the shared training fields, the
    method's own and the data's fingerprint."""
    names = TRAINING_FIELDS + method.fields
    values = {k: getattr(config, k) for k in names}
    values = {k: v.value if isinstance(v, enum.Enum) else v for k, v in values.items()}
    return {**values, "data": data.fingerprint}


def tag(method: Method, value: float) -> str:
    """The model's name in files and tables, e.g. `ibp_eps0.05`."""
    return method.name if not method.tuned else f"{method.name}_{method.knob}{value:g}"


def train_or_load(method: Method, value: float, data: Data, config: Config,
                  out: Path) -> dict:
    """The row of `method` at knob `value`: stored (same settings, with `--resume`), or
    trained now. The row holds `tag`, `method`, `knob`, `value`, `val_acc`,
    `epoch_s` (median training time of the epochs after the first) and `weights`."""
    runs = app.output_dir(Path(out) / "runs")
    name = tag(method, value)
    wanted = settings(method, config, data)
    row = load_stored(runs / f"{name}.json", wanted, config.resume)
    if row is not None and (runs / f"{name}.weights.h5").is_file():
        return row
    (xtr, ytr), (xv, yv) = data.train, data.val
    model = build_model(config, xtr.shape[1], data.classes)
    fit_model = method.wrap(model, config, value)
    fit_model.compile(optimizer=keras.optimizers.Adam(config.lr),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    steps = int(np.ceil(len(xtr) / config.batch_size))
    times = EpochTimes()
    knob = f" {method.knob}={value:g}" if method.tuned else ""
    app.log(f"\n== {method.label}{knob}: {len(xtr)} training images, {config.epochs} epochs")
    history = fit_model.fit(array_dataset(xtr, ytr, config.batch_size, seed=config.seed),
                            epochs=config.epochs, verbose=fit_verbosity(), shuffle=False,
                            callbacks=[times, *method.ramps(config, value, steps)])
    model.save_weights(runs / f"{name}.weights.h5")
    val_acc = accuracy(model, xv, yv)
    app.log(f"   validation accuracy {100 * val_acc:.2f} %")
    row = {"tag": name, "method": method.name, "knob": method.knob, "value": value,
           "val_acc": val_acc, "epoch_s": float(np.median(times.seconds[1:] or times.seconds)),
           "epoch_seconds": times.seconds, "weights": f"{name}.weights.h5",
           "history": {k: [float(v) for v in vals] for k, vals in history.history.items()},
           "settings": wanted}
    write_json(runs / f"{name}.json", row)
    return row


def accuracy(model: keras.Model, x, y, batch_size: int = 1000) -> float:
    """The share of `x` the plain model classifies as `y`."""
    pred = np.argmax(model.predict(x, batch_size=batch_size, verbose=0), axis=-1)
    return float(np.mean(pred == np.asarray(y).reshape(-1)))


class OperatingPoint(NamedTuple):
    """One method's model at one accuracy target.

    Attributes:
        method: the method's name.
        drop: the target: vanilla's validation accuracy minus `drop` whole percent
            (None: a model of `--fixed`, no target).
        row: the chosen model's row (None: no value tried meets the target).
        note: how it was found (the values tried and their accuracies).
    """

    method: str
    drop: int | None
    row: dict | None
    note: str


def search(method: Method, vanilla: dict, data: Data, config: Config,
           out: Path) -> list[OperatingPoint]:
    """`method`'s model at each operating point (`DROPS`: vanilla's validation accuracy,
    and one point less): the largest knob value whose validation accuracy meets it, by
    bisection from the method's start value, `--search_steps` new trainings per point
    (trainings are shared between the points); each point then takes the largest value
    tried that meets it."""
    rows, known = {}, {}

    def val_acc_of(value):
        rows[value] = train_or_load(method, value, data, config, out)
        return rows[value]["val_acc"]

    for drop, _, _ in DROPS:
        cutoff = round(100 * vanilla["val_acc"]) - drop
        bisect_lam(val_acc_of, cutoff, method.start(config), config.search_steps, known=known)
    tried = ", ".join(f"{v:g}: {100 * a:.1f} %" for v, a in sorted(known.items()))
    note = f"{method.knob} tried (validation accuracy): {tried}"
    points = []
    for drop, _, what in DROPS:
        # the largest value tried that meets the point (a later search may find one)
        cutoff = round(100 * vanilla["val_acc"]) - drop
        value = max((v for v, a in known.items() if meets(a, cutoff)), default=None)
        row = None if value is None else rows[value]
        found = "none meets it" if row is None else f"{method.knob}={value:g}"
        app.log(f"-- {method.label} at {what} (validation accuracy >= {cutoff} %): {found}; "
                f"{note}")
        points.append(OperatingPoint(method.name, drop, row, note))
    return points

