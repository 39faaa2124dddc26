"""Resumable training: the files of `--out` (run record, training state, best weights)
and the callback that saves the state every `--save_freq` steps and every epoch.

`keras.callbacks.BackupAndRestore` restores only the epoch (an epoch interrupted after
step k restarts from its first batch on weights that have seen k batches), so a
mid-epoch resume would not be the run that was killed; the example keeps its own
position (epoch, step) beside the weights and skips the batches already done.

Example:

```python
folder = RunFolder(out, is_chief=True, worker="chief")
folder.check_run(record)          # refuses a rerun with other settings
state = folder.load_state()       # None for a fresh run
```
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import keras

from examples.common.app import UsageError
from examples.common.tables import jsonable, write_json

__all__ = ["RunFolder", "TrainingState", "fresh_state", "write_json_atomic"]


def write_json_atomic(path: Path, data) -> None:
    """`data` as JSON at `path`, replaced in one step (a kill leaves the old file)."""
    tmp = path.with_name(path.name + ".tmp")
    write_json(tmp, data)
    os.replace(tmp, path)


def fresh_state() -> dict:
    """The training state of a run that has not started."""
    return dict(epoch=0, step=0, global_step=0, best_val_loss=None, best_epoch=None,
                history=[], done=False)


class RunFolder:
    """The files of `--out`: run record, training state, best weights, results."""

    def __init__(self, out: Path, is_chief: bool, worker: str):
        self.out = out
        self.is_chief = is_chief
        self.run_config = out / "run_config.json"
        self.checkpoint = out / "checkpoint"
        self.state_file = self.checkpoint / "state.json"
        self.best = out / "best.weights.h5"
        # Other workers write what the chief writes to a scratch folder of their own.
        self.scratch = out if is_chief else out / "workers" / worker
        self.tensorboard = self.scratch / "tensorboard"

    def write_checkpoint_dir(self) -> Path:
        return self.checkpoint if self.is_chief else self.scratch / "checkpoint"

    def best_weights_path(self) -> Path:
        return self.best if self.is_chief else self.scratch / "best.weights.h5"

    def check_run(self, record: dict) -> None:
        """Writes `run_config.json`, or refuses a run that differs from the saved one."""
        saved = self.saved_record()
        record = jsonable(record)
        if saved is None:
            if self.state_file.exists() or self.best.exists():
                raise UsageError(
                    f"{self.out} holds a checkpoint ({self.state_file.name} or "
                    f"{self.best.name}) but no readable {self.run_config.name}, so the run "
                    "cannot be checked and resumed. Delete the folder to start over, or "
                    "pass another --out.")
            if self.is_chief:
                self.out.mkdir(parents=True, exist_ok=True)
                write_json_atomic(self.run_config, record)
            return
        differ = [k for k in record if saved.get(k) != record[k]]
        if differ:
            rows = "; ".join(f"--{k}: {saved.get(k)!r} in the checkpoint, {record[k]!r} now"
                             for k in differ)
            raise UsageError(
                f"{self.out} holds the run of {self.run_config} and these settings differ: "
                f"{rows}. Rerun with the checkpoint's settings to resume it, pass another "
                "--out for a new run, or delete the folder to start over.")

    def saved_record(self):
        """The saved run record, or None."""
        if not self.run_config.exists():
            return None
        try:
            return json.loads(self.run_config.read_text())
        except (OSError, ValueError):
            return None

    def load_state(self):
        """The saved training state (dict), or None for a fresh run."""
        if not self.state_file.exists():
            return None
        try:
            state = json.loads(self.state_file.read_text())
        except ValueError as e:
            raise UsageError(f"{self.state_file} is not valid JSON ({e}); delete "
                             f"{self.checkpoint} to restart from scratch.") from e
        weights = self.checkpoint / state["weights"]
        if not weights.is_file():
            raise UsageError(f"{self.state_file} names {weights}, which is missing; delete "
                             f"{self.checkpoint} to restart from scratch.")
        state["weights_path"] = weights
        return state


class TrainingState(keras.callbacks.Callback):
    """Saves the run's state every `save_freq` steps and after every epoch.

    The state is the weights of the model given to `fit` (with its optimizer's slots
    and step, and the ROLL sampling counter) in `state-<step>.weights.h5`, then
    `state.json` pointing to it with the position (`epoch` done, `step` within the
    next one), the best validation loss and the history; a kill between the two
    leaves the previous pair valid. After an epoch whose validation loss is the lowest
    so far (`best`, a `BestValLoss`) the plain model is saved as `best_path` first.
    """

    def __init__(self, directory: Path, state: dict, plain, best, best_path,
                 steps_per_epoch: int, epochs: int, save_freq: int):
        super().__init__()
        self.dir, self.state, self.plain, self.best = directory, state, plain, best
        self.best_path, self.steps, self.epochs = best_path, steps_per_epoch, epochs
        self.save_freq = save_freq
        self.epoch, self.offset = 0, 0

    def start(self, epoch, offset):
        """The next `fit` call runs epoch `epoch` (0-based) from step `offset`."""
        self.epoch, self.offset = epoch, offset

    def on_train_batch_end(self, batch, logs=None):
        step = self.offset + batch + 1
        if step < self.steps and (self.epoch * self.steps + step) % self.save_freq == 0:
            self.save(self.epoch, step)

    def on_epoch_end(self, epoch, logs=None):
        logs = {k: float(v) for k, v in (logs or {}).items()}
        self.state["history"].append(dict(logs, epoch=epoch + 1))
        if self.best.epoch == epoch + 1:
            self.state["best_val_loss"], self.state["best_epoch"] = self.best.best, epoch + 1
            tmp = self.dir.parent / ("tmp." + Path(self.best_path).name)
            self.plain.save_weights(tmp)
            os.replace(tmp, self.best_path)
        self.state["done"] = epoch + 1 == self.epochs
        self.save(epoch + 1, 0)

    def save(self, epoch, step):
        self.dir.mkdir(parents=True, exist_ok=True)
        global_step = epoch * self.steps + step
        name = f"state-{global_step:08d}.weights.h5"
        self.model.save_weights(self.dir / name)
        self.state.update(epoch=epoch, step=step, global_step=global_step, weights=name,
                          saved_at=time.strftime("%Y-%m-%d %H:%M:%S"))
        write_json_atomic(self.dir / "state.json",
                          {k: v for k, v in self.state.items() if k != "weights_path"})
        for old in self.dir.glob("state-*.weights.h5"):
            if old.name != name:
                old.unlink()
