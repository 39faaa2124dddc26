"""Caltech-256: train the paper's ResNet-18 with the sampled ROLL loss, then evaluate it.

The experiment of Lee, Alvarez-Melis & Jaakkola (ICLR 2019, Sec. 5 and Appendix I):
ResNet-18 with average pooling after the stem (`keras_roll.models.resnet18`) on
299 x 299 Caltech-256 images, per class 5 validation and 15 test images, SGD with
Nesterov momentum 0.5, batch 32, learning rate 0.005 and 0.0005 after epoch 10, 20
epochs, the best validation-loss epoch kept; ROLL with lam = 0.001, C = 8,
gamma = 100 and 120 sampled axes per colour channel (360 directions per image).

    python -m examples.caltech256 --flagfile=examples/configs/caltech256_roll.flags \\
        --data_dir=~/data --out=runs/caltech_roll [--strategy=mirrored] [--mixed_precision]
    python -m examples.caltech256 --flagfile=examples/configs/caltech256_roll.flags --quick

It writes under `--out`:

* `run_config.json`: the flags that define the training run (a rerun must match);
* `checkpoint/`: the training state (weights, optimizer, ROLL sampling counter, epoch,
  step, best validation loss, history) every `--save_freq` steps and every epoch: kill
  the run and rerun the same command, it continues from there;
* `best.weights.h5`: the plain model at the epoch of lowest validation loss;
* `tensorboard/`: loss, roll_loss, accuracy, top-5 accuracy, l2 margin percentiles
  (`keras_roll.MarginMonitor` on `--monitor_images` validation images), step time and
  learning rate (`tensorboard --logdir <out>/tensorboard`);
* `results.md`, `results.json`: P@1 and P@5 on the test split, the expected and
  worst-case l1 gradient distortion at eps = 8/256 (P25 / P50 / P75 / P100) on
  `--num_eval` test images, how many worst-case points change the prediction;
* `figure4.png`: the Figure 4-style grid (image, gradient, worst-case gradient and
  integrated gradients at the examples of P50 and P75 worst-case distortion; with
  `--compare_with=<another run's --out>` both models side by side).

`--quick` runs the whole pipeline in a few minutes on 2 CPU cores: a generated image
tree (`keras_roll.data.make_synthetic_caltech256`, 4 classes) when no `--data_dir` is
given, 32 x 32 inputs, 2 epochs, 2 axes per channel and small distortion searches.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags
from tensorflow.core.framework import summary_pb2

import keras_roll
from examples import common
from keras_roll.data import caltech256_dataset, caltech256_splits, make_synthetic_caltech256
from keras_roll.data.caltech256 import WHERE_TO_GET

STRATEGIES = ("default", "mirrored", "multiworker")
NORMALIZE = ("imagenet", "paper")
PERCENTILES = (25, 50, 75, 100)
QUICK_CLASSES, QUICK_IMAGES_PER_CLASS = 4, 40

# --quick: (the paper's value, the quick value). A flag still at the paper's value
# (its default, or set to it by a flagfile) takes the quick value; any other value wins.
QUICK = {
    "image_size": (299, 32),
    "epochs": (20, 2),
    "lr_decay_epochs": (["10"], ["1"]),
    "samples": (120, 2),
    "val_per_class": (5, 2),
    "test_per_class": (15, 3),
    "num_eval": (100, 4),
    "distortion_samples": (8000, 64),
    "population": (4800, 32),
    "generations": (30, 3),
    "monitor_images": (4, 2),
    "save_freq": (200, 2),
    "ig_steps": (64, 16),
}

# Flags that define a training run: a rerun with another value of one of them is
# refused (it would mix two runs in one checkpoint). The rest (strategy, evaluation,
# logging) may change between the interrupted run and its continuation.
RUN_KEYS = (
    "data_root", "classes", "quick", "image_size", "normalize", "stem_pool", "weights",
    "seed", "epochs", "batch_size", "steps_per_epoch", "lr", "lr_decay_epochs",
    "lr_decay_factor", "momentum", "nesterov", "roll", "lam", "C", "gamma", "samples",
    "strata", "roll_wrt", "mixed_precision", "val_per_class", "test_per_class",
    "max_per_class",
)


class UsageError(ValueError):
    """A bad flag, input or output folder; the message says the way forward."""


# ----------------------------------------------------------------------------- flags


def define_flags(fv: flags.FlagValues) -> None:
    """Defines the example's flags on `fv` (defaults: the paper's ROLL run).

    Example:

    ```python
    fv = common.parse_flags(define_flags, ["--quick", "--out=/tmp/caltech"])
    results = run(fv)
    ```
    """
    common.define_common_flags(
        fv, out="runs/caltech256",
        data_help="The extracted 256_ObjectCategories folder or its parent "
                  "(https://data.caltech.edu/records/nyy15-4j048). With --quick and no "
                  "--data_dir, a generated tree is used.")
    d = dict(flag_values=fv)
    flags.DEFINE_string("weights", None, "Initial weights: a torchvision resnet18 state "
                        "dict saved as .npz (ImageNet; fc is skipped when its shape does not "
                        "fit) or a .weights.h5 file of this model. With --eval_only: the "
                        "weights to evaluate (default: <out>/best.weights.h5).", **d)
    flags.DEFINE_enum("strategy", "default", STRATEGIES, "tf.distribute strategy: default "
                      "(one device), mirrored (every GPU of this host), multiworker (several "
                      "hosts, set up with TF_CONFIG).", **d)
    flags.DEFINE_bool("mixed_precision", False, "Train under mixed precision (float16 on "
                      "GPUs, bfloat16 on CPUs); evaluation runs in float32.", **d)
    flags.DEFINE_bool("eval_only", False, "Skip training: evaluate --weights (or "
                      "<out>/best.weights.h5).", **d)
    flags.DEFINE_integer("num_eval", 100, "Test images for the gradient distortion.", **d)
    flags.DEFINE_bool("deterministic", False, "tf.config.experimental.enable_op_determinism"
                      "(): bit-identical reruns, slower on GPUs.", **d)
    # Data and model.
    flags.DEFINE_integer("image_size", 299, "Images are resized to image_size^2.", **d)
    flags.DEFINE_integer("val_per_class", 5, "Validation images per class.", **d)
    flags.DEFINE_integer("test_per_class", 15, "Test images per class.", **d)
    flags.DEFINE_integer("max_per_class", None, "Use at most this many images per class.",
                         **d)
    flags.DEFINE_enum("cache", "auto", ("auto", "memory", "none"), "Cache of the decoded "
                      "validation and test images (auto: in memory when they fit).", **d)
    flags.DEFINE_enum("normalize", "imagenet", NORMALIZE, "Input normalisation inside the "
                      "model: imagenet (per-channel std) or paper (the single std 0.225).",
                      **d)
    flags.DEFINE_enum("stem_pool", "avg", ("avg", "max"), "Pooling after the stem (the "
                      "paper: avg).", **d)
    # Optimisation.
    flags.DEFINE_integer("epochs", 20, "Training epochs.", **d)
    flags.DEFINE_integer("batch_size", 32, "Global batch size (split over the replicas).",
                         **d)
    flags.DEFINE_integer("steps_per_epoch", 0, "Steps per epoch (0: every full batch of the "
                         "training split).", **d)
    flags.DEFINE_float("lr", 0.005, "Initial learning rate.", **d)
    flags.DEFINE_list("lr_decay_epochs", ["10"], "Epochs after which the learning rate is "
                      "multiplied by --lr_decay_factor.", **d)
    flags.DEFINE_float("lr_decay_factor", 0.1, "Learning-rate decay factor.", **d)
    flags.DEFINE_float("momentum", 0.5, "SGD momentum.", **d)
    flags.DEFINE_bool("nesterov", True, "Nesterov momentum.", **d)
    # ROLL.
    flags.DEFINE_bool("roll", True, "Train with the ROLL regularizer (--noroll: vanilla).",
                      **d)
    flags.DEFINE_float("lam", 0.001, "ROLL weight lambda.", **d)
    flags.DEFINE_float("C", 8.0, "ROLL hinge weight C.", **d)
    flags.DEFINE_float("gamma", 100.0, "Percentage of neurons in the ROLL loss.", **d)
    flags.DEFINE_integer("samples", 120, "Sampled input axes (per channel with "
                         "--strata=channel); 0: the exact loss.", **d)
    flags.DEFINE_string("strata", "channel", "Stratification of the sampled axes: channel "
                        "or none.", **d)
    flags.DEFINE_string("roll_wrt", "normalize", "Layer whose output ROLL differentiates "
                        "with respect to (the normalisation layer: the paper's units); "
                        "empty: the [0, 1] pixels.", **d)
    flags.DEFINE_integer("memory_budget", 2**30, "Bytes of tangents per chunk of the "
                         "twin (ROLL, margins, distortion).", **d)
    # Logging and checkpoints.
    flags.DEFINE_integer("save_freq", 200, "Save the training state every this many steps "
                         "(and after every epoch).", **d)
    flags.DEFINE_integer("monitor_images", 4, "Validation images whose l2 margins are "
                         "logged (0: none).", **d)
    flags.DEFINE_integer("monitor_every", 1, "Log the margins every this many epochs.", **d)
    flags.DEFINE_integer("log_every", 10, "Write step-level TensorBoard scalars every this "
                         "many steps.", **d)
    flags.DEFINE_integer("verbose", -1, "Keras fit verbosity (0, 1: progress bar, 2: one "
                         "line per epoch, -1: 1 on a terminal, 2 otherwise).", **d)
    # Evaluation.
    flags.DEFINE_float("eps", 8 / 256, "l_inf radius of the distortion ball.", **d)
    flags.DEFINE_integer("distortion_samples", 8000, "Uniform draws per image for the "
                         "expected distortion.", **d)
    flags.DEFINE_integer("population", 4800, "Population of the genetic algorithm.", **d)
    flags.DEFINE_integer("generations", 30, "Generations of the genetic algorithm.", **d)
    flags.DEFINE_list("figure_percentiles", ["50", "75"], "Rows of the figure: the test "
                      "images at these percentiles of the worst-case distortion.", **d)
    flags.DEFINE_integer("ig_steps", 64, "Riemann points of the integrated gradients in the "
                         "figure (0: exact, region by region).", **d)
    flags.DEFINE_string("compare_with", None, "Another run's --out (e.g. the vanilla run): "
                        "its best model is drawn beside this one in the figure.", **d)


def check_flagfiles(argv) -> None:
    """Exits with a clear message when a `--flagfile` does not exist (before absl does).

    Example:

    ```python
    check_flagfiles(sys.argv)
    ```
    """
    for arg in argv[1:]:
        if arg.startswith("--flagfile="):
            path = arg.split("=", 1)[1]
            if not os.path.isfile(os.path.expanduser(path)):
                configs = Path(__file__).resolve().parent / "configs"
                known = sorted(p.name for p in configs.glob("caltech256_*.flags"))
                sys.exit(f"--flagfile={path}: no such file (relative paths start from the "
                         f"current folder, {os.getcwd()}). The Caltech-256 configs are "
                         f"{', '.join(str(configs / k) for k in known)}.")


class Config:
    """The resolved settings of a run: the flags, with `--quick` applied."""

    def __init__(self, fv: flags.FlagValues):
        self.values = {name: fv[name].value for name in fv}
        self.quick_changes = {}
        if fv.quick:
            for name, (paper, quick) in QUICK.items():
                if self.values[name] == paper:
                    self.values[name] = quick
                    self.quick_changes[name] = (paper, quick)
        self._check()

    def __getattr__(self, name):
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def _check(self):
        v = self.values
        for name in ("image_size", "epochs", "batch_size", "save_freq", "monitor_every",
                     "log_every", "distortion_samples", "population", "memory_budget"):
            if v[name] < 1:
                raise UsageError(f"--{name} must be a positive integer, got {v[name]}.")
        for name in ("num_eval", "monitor_images", "steps_per_epoch", "generations",
                     "ig_steps", "samples", "val_per_class", "test_per_class"):
            if v[name] < 0:
                raise UsageError(f"--{name} must be >= 0, got {v[name]}.")
        if v["max_per_class"] is not None and v["max_per_class"] < 1:
            raise UsageError(f"--max_per_class must be positive, got {v['max_per_class']}.")
        if not (0 < v["eps"] < 1):
            raise UsageError(f"--eps is an l_inf radius in [0, 1] pixel units, got {v['eps']}"
                             " (the paper: 8/256 = 0.03125).")
        if v["strata"] not in ("channel", "none", ""):
            raise UsageError(f"--strata must be 'channel' or 'none', got {v['strata']!r}.")
        if v["verbose"] not in (-1, 0, 1, 2):
            raise UsageError(f"--verbose must be -1, 0, 1 or 2, got {v['verbose']}.")
        for name in ("lr_decay_epochs", "figure_percentiles"):
            try:
                [float(e) for e in v[name]]
            except ValueError:
                raise UsageError(f"--{name} takes comma-separated numbers, got "
                                 f"{','.join(v[name])!r}.") from None
        if any(not 0 <= float(q) <= 100 for q in v["figure_percentiles"]):
            raise UsageError("--figure_percentiles must lie in [0, 100], got "
                             f"{','.join(v['figure_percentiles'])!r}.")
        if any(int(float(e)) != float(e) or float(e) < 1 for e in v["lr_decay_epochs"]):
            raise UsageError("--lr_decay_epochs takes whole epochs >= 1, got "
                             f"{','.join(v['lr_decay_epochs'])!r}.")

    @property
    def decay_epochs(self) -> list[int]:
        return sorted(int(float(e)) for e in self.lr_decay_epochs)

    def roll_kwargs(self) -> dict:
        strata = None if self.strata in ("none", "") else self.strata
        return dict(lam=self.lam, C=self.C, gamma=self.gamma,
                    samples=self.samples or None, strata=strata if self.samples else None,
                    seed=self.seed, memory_budget=self.memory_budget)

    def run_record(self, data_root, classes) -> dict:
        """The values that define the training run (`RUN_KEYS`)."""
        record = dict(self.values, data_root=str(data_root), classes=int(classes))
        if record["weights"]:
            record["weights"] = str(Path(os.path.expanduser(record["weights"])).resolve())
        return {k: record[k] for k in RUN_KEYS}


# ----------------------------------------------------------------------------- set-up


def make_strategy(name: str):
    """The `tf.distribute` strategy `--strategy` names (create it before any other op).

    Example:

    ```python
    strategy = make_strategy("mirrored")   # every GPU of this host
    ```
    """
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multiworker":
        if not os.environ.get("TF_CONFIG"):
            raise UsageError(
                "--strategy=multiworker needs TF_CONFIG on every host, e.g. TF_CONFIG='"
                '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
                '"task": {"type": "worker", "index": 0}}\' on host1 and index 1 on host2 '
                "(see the README, 'Caltech-256'). For the GPUs of one host use "
                "--strategy=mirrored.")
        return tf.distribute.MultiWorkerMirroredStrategy()
    raise UsageError(f"Unknown --strategy={name!r}; expected one of {STRATEGIES}.")


def is_multiworker(strategy) -> bool:
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def worker_role(strategy) -> tuple[bool, str]:
    """`(is_chief, name)`: the chief writes the outputs, other workers a scratch folder."""
    resolver = getattr(strategy, "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None)
    task_id = getattr(resolver, "task_id", None) or 0
    if task_type is None:
        return True, "chief"
    cluster = resolver.cluster_spec().as_dict() if resolver is not None else {}
    chief = task_type == "chief" or (task_type == "worker" and task_id == 0
                                      and "chief" not in cluster)
    return chief, f"{task_type}_{task_id}"


def prepare_data(cfg: Config, out: Path, worker: str, is_chief: bool):
    """The paper's split of the Caltech-256 tree (generated under `--quick`)."""
    data_dir = cfg.data_dir
    if data_dir is None:
        if not cfg.quick:
            raise UsageError(f"No --data_dir given. {WHERE_TO_GET}")
        parent = out / "quick_data" if is_chief else out / "workers" / worker / "quick_data"
        if not (parent / "256_ObjectCategories").is_dir():
            print(f"--quick: generating {QUICK_CLASSES} classes x {QUICK_IMAGES_PER_CLASS} "
                  f"synthetic JPEGs under {parent}")
            make_synthetic_caltech256(parent, classes=QUICK_CLASSES,
                                      images_per_class=QUICK_IMAGES_PER_CLASS, seed=0)
        data_dir = parent
    cache = {"auto": "auto", "memory": "memory", "none": False}[cfg.cache]
    try:
        data = caltech256_splits(
            data_dir, image_size=cfg.image_size, batch_size=cfg.batch_size, seed=cfg.seed,
            val_per_class=cfg.val_per_class, test_per_class=cfg.test_per_class,
            max_per_class=cfg.max_per_class, cache=cache, verbose=1)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from e
    for split in ("train", "val", "test"):
        if not data.index.files[split] and not (split == "test" and cfg.test_per_class == 0):
            raise UsageError(f"The {split} split of {data.index.root} is empty; check "
                             "--val_per_class / --test_per_class / --max_per_class.")
    return data


def build_model(cfg: Config, classes: int, dtype=None):
    """ResNet-18 of the paper giving logits (the softmax is in the loss)."""
    return keras_roll.models.resnet18(
        (cfg.image_size, cfg.image_size, 3), classes=classes, stem_pool=cfg.stem_pool,
        normalize=cfg.normalize, classifier_activation=None, dtype=dtype)


def load_weights(model, path) -> str:
    """Loads a torchvision `.npz` or a Keras `.weights.h5` file into the plain model."""
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_file():
        raise UsageError(f"--weights={path}: no such file.")
    if p.name.endswith(".npz"):
        res = keras_roll.models.load_torchvision_resnet18(model, p)
        return f"torchvision weights {p} ({len(res.loaded)} tensors; skipped {res.skipped})"
    if p.name.endswith(".weights.h5"):
        model.load_weights(p)
        return f"Keras weights {p}"
    raise UsageError(f"--weights={path}: expected a torchvision state dict saved as .npz or "
                     "a Keras .weights.h5 file.")


def mixed_policy() -> str:
    return "mixed_float16" if tf.config.list_logical_devices("GPU") else "mixed_bfloat16"


# ----------------------------------------------------------------------------- run folder


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

    def check_run(self, record: dict) -> None:
        """Writes `run_config.json`, or refuses a run that differs from the saved one."""
        saved = self._saved_record()
        if saved is None:
            if self.state_file.exists() or self.best.exists():
                raise UsageError(
                    f"{self.out} holds a checkpoint ({self.state_file.name} or "
                    f"{self.best.name}) but no readable {self.run_config.name}, so the run "
                    "cannot be checked and resumed. Delete the folder to start over, or "
                    "pass another --out.")
            if self.is_chief:
                self.out.mkdir(parents=True, exist_ok=True)
                _write_json_atomic(self.run_config, record)
            return
        differ = [k for k in RUN_KEYS if _norm(saved.get(k)) != _norm(record.get(k))]
        if differ:
            rows = "; ".join(f"--{k}: {saved.get(k)!r} in the checkpoint, {record.get(k)!r} "
                             "now" for k in differ)
            raise UsageError(
                f"{self.out} holds the run of {self.run_config} and these settings differ: "
                f"{rows}. Rerun with the checkpoint's settings to resume it, pass another "
                "--out for a new run, or delete the folder to start over.")

    def _saved_record(self):
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


def _flag_text(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def _norm(v):
    return json.loads(json.dumps(v))  # tuples -> lists, as in the saved JSON


def _write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    common.write_json(tmp, data)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- callbacks


def _write_scalars(writer, values: dict, step: int, prefix: str) -> None:
    """Scalar summaries TensorBoard reads, without needing the tensorboard package."""
    meta = summary_pb2.SummaryMetadata()
    meta.plugin_data.plugin_name = "scalars"
    meta = meta.SerializeToString()
    with writer.as_default():
        for key, value in values.items():
            if isinstance(value, (int, float, np.floating, np.integer)) and math.isfinite(value):
                tf.summary.write(prefix + key, tf.constant(float(value), tf.float32),
                                 step=int(step), metadata=meta)
    writer.flush()


class StepTimer(keras.callbacks.Callback):
    """Wall time per training step (input pipeline included): the epoch's median is
    added to the epoch logs as `step_time_ms`; `first` is the first step of the run
    (it includes tracing the step function)."""

    def __init__(self):
        super().__init__()
        self.times, self._last, self.first = [], None, None

    def on_epoch_begin(self, epoch, logs=None):
        self.times, self._last = [], time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self.first is None:
            self.first = now - self._last
        else:
            self.times.append(now - self._last)
        self._last = now

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


class TrainingState(keras.callbacks.Callback):
    """Saves the run's state every `save_freq` steps and after every epoch.

    The state is the weights of the model given to `fit` (with its optimizer's slots
    and step, and the ROLL sampling counter) in `state-<step>.weights.h5`, then
    `state.json` pointing to it with the position (`epoch` done, `step` within the
    next one), the best validation loss and the history. After an epoch whose
    validation loss is the lowest so far (`best`, a `common.BestValLoss`) the plain
    model is saved as `best_path` first.
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
        _write_json_atomic(self.dir / "state.json",
                           {k: v for k, v in self.state.items() if k != "weights_path"})
        for old in self.dir.glob("state-*.weights.h5"):
            if old.name != name:
                old.unlink()


class TensorBoardScalars(keras.callbacks.Callback):
    """Every epoch's logs (and the learning rate) under `train/` and `validation/`,
    and the step logs every `every` steps (`batch_*`)."""

    def __init__(self, log_dir: Path, steps_per_epoch: int, every: int):
        super().__init__()
        self.train = tf.summary.create_file_writer(str(log_dir / "train"))
        self.val = tf.summary.create_file_writer(str(log_dir / "validation"))
        self.steps, self.every = steps_per_epoch, every
        self.epoch, self.offset = 0, 0

    def start(self, epoch, offset):
        self.epoch, self.offset = epoch, offset

    def on_train_batch_end(self, batch, logs=None):
        step = self.epoch * self.steps + self.offset + batch + 1
        if step % self.every == 0 and logs:
            _write_scalars(self.train, {k: float(v) for k, v in logs.items()}, step, "batch_")

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        logs["learning_rate"] = float(np.asarray(self.model.optimizer.learning_rate))
        _write_scalars(self.train, {k: v for k, v in logs.items() if not k.startswith("val_")},
                       epoch + 1, "epoch_")
        _write_scalars(self.val, {k[4:]: v for k, v in logs.items() if k.startswith("val_")},
                       epoch + 1, "epoch_")


class TopKAccuracy(keras.metrics.SparseTopKCategoricalAccuracy):
    """Top-k accuracy that also takes float16 / bfloat16 logits (mixed precision):
    TensorFlow's `in_top_k` only takes float32."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(y_true, keras.ops.cast(y_pred, "float32"), sample_weight)


def make_callbacks(cfg: Config, folder: RunFolder, model, x_monitor, steps_per_epoch: int,
                   state: dict):
    """The training callbacks, in the order they must see the epoch logs, and those
    that must be told where each `fit` call starts."""
    best = common.BestValLoss(model)
    if state["best_epoch"] is not None:
        best.best, best.epoch = state["best_val_loss"], state["best_epoch"]
    timer = StepTimer()
    saver = TrainingState(folder.write_checkpoint_dir(), state, model, best,
                          folder.best if folder.is_chief else folder.scratch / "best.weights.h5",
                          steps_per_epoch, cfg.epochs, cfg.save_freq)
    scalars = TensorBoardScalars(folder.tensorboard, steps_per_epoch, cfg.log_every)
    callbacks = [timer]
    if x_monitor is not None:
        callbacks.append(PlainMarginMonitor(model, x_monitor, cfg.monitor_every))
    callbacks += [best, saver, scalars]
    return callbacks, (saver, scalars), timer


# ----------------------------------------------------------------------------- training


def train_epoch_dataset(cfg: Config, index, epoch: int, steps: int, skip: int):
    """The batches of one epoch, in an order fixed by (seed, epoch), the first `skip`
    batches left out (a resumed epoch); every batch is full."""
    files = np.asarray(index.files["train"])
    labels = index.labels["train"]
    order = np.random.default_rng([cfg.seed, epoch]).permutation(len(files))
    order = order[skip * cfg.batch_size: steps * cfg.batch_size]
    return caltech256_dataset(files[order].tolist(), labels[order], image_size=cfg.image_size,
                              batch_size=cfg.batch_size, shuffle=False, cache=False)


def numpy_images(cfg: Config, files, labels):
    """Decoded `[n, H, W, 3]` images in [0, 1] and their labels."""
    ds = caltech256_dataset(list(files), labels, image_size=cfg.image_size, batch_size=None,
                            cache=False)
    xs, ys = zip(*ds.as_numpy_iterator())
    return np.stack(xs).astype(np.float32), np.asarray(ys, np.int64)


def train(cfg: Config, strategy, data, folder: RunFolder, extra_callbacks=()):
    """Trains (or resumes) the run in `folder`; returns the training summary."""

    replicas = strategy.num_replicas_in_sync
    if cfg.batch_size % replicas:
        raise UsageError(
            f"--batch_size={cfg.batch_size} is the global batch and must be divisible by the "
            f"{replicas} replicas of --strategy={cfg.strategy}; use e.g. "
            f"--batch_size={max(replicas, cfg.batch_size // replicas * replicas)}.")
    n_train = len(data.index.files["train"])
    steps = n_train // cfg.batch_size
    if steps == 0:
        raise UsageError(f"The training split has {n_train} images, fewer than one batch of "
                         f"--batch_size={cfg.batch_size}.")
    if cfg.steps_per_epoch:
        steps = min(steps, cfg.steps_per_epoch)
    classes = len(data.class_names)
    folder.check_run(cfg.run_record(data.index.root, classes))
    state = folder.load_state()
    if state is not None and state.get("done"):
        print(f"Training finished earlier ({folder.state_file}: epoch {state['epoch']} of "
              f"{cfg.epochs}, best epoch {state['best_epoch']}); evaluating its best weights.")
        return summary_of(state, steps, replicas)

    policy = mixed_policy() if cfg.mixed_precision else "float32"
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(cfg.seed)
    try:
        with strategy.scope():
            model = build_model(cfg, classes)
            if state is None and cfg.weights:
                print("Initial weights:", load_weights(model, cfg.weights))
            if cfg.roll:
                train_model = keras_roll.wrap(model, wrt=cfg.roll_wrt or None,
                                              **cfg.roll_kwargs())
            elif is_multiworker(strategy):
                # keras_roll.RollModel works around Keras 3.15's multi-worker fit
                # (keras-team/keras#20585); without a regularizer it is the plain model.
                train_model = keras_roll.RollModel(model.inputs, model.outputs,
                                                   name=model.name)
            else:
                train_model = model
            # "After epoch e": the steps from e * steps on take the next rate.
            boundaries = [e * steps - 1 for e in cfg.decay_epochs]
            values = [cfg.lr * cfg.lr_decay_factor ** i for i in range(len(boundaries) + 1)]
            schedule = keras.optimizers.schedules.PiecewiseConstantDecay(boundaries, values)
            optimizer = keras.optimizers.SGD(schedule, momentum=cfg.momentum,
                                             nesterov=cfg.nesterov)
            k = min(5, classes)
            train_model.compile(
                optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
                         TopKAccuracy(k, name=f"top{k}")])
            if state is not None:
                optimizer.build(train_model.trainable_variables)
                train_model.load_weights(state["weights_path"])
                print(f"Resuming {folder.out} at epoch {state['epoch'] + 1}, step "
                      f"{state['step']} of {steps} (global step {state['global_step']}; "
                      f"optimizer step {int(optimizer.iterations.numpy())}).")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    if state is None:
        state = dict(epoch=0, step=0, global_step=0, best_val_loss=None, best_epoch=None,
                     history=[], done=False)
    x_monitor = None
    if cfg.monitor_images:  # spread over the classes (the split is in class order)
        val_files, val_labels = data.index.files["val"], data.index.labels["val"]
        pick = np.unique(np.linspace(0, len(val_files) - 1, cfg.monitor_images).round()
                         .astype(int))
        x_monitor, _ = numpy_images(cfg, [val_files[i] for i in pick], val_labels[pick])
    callbacks, starters, timer = make_callbacks(cfg, folder, model, x_monitor, steps, state)
    callbacks += list(extra_callbacks)
    verbose = common.fit_verbosity() if cfg.verbose == -1 else cfg.verbose
    what = (f"ROLL (lam={cfg.lam:g}, C={cfg.C:g}, gamma={cfg.gamma:g}, "
            f"samples={cfg.samples or 'exact'}"
            f"{' per channel' if cfg.samples and cfg.strata == 'channel' else ''}, "
            f"wrt={cfg.roll_wrt or 'pixels'})" if cfg.roll else "vanilla")
    print(f"Training ResNet-18 {what} on {n_train} images of {classes} classes at "
          f"{cfg.image_size}x{cfg.image_size}: {steps} steps of {cfg.batch_size} per epoch "
          f"on {replicas} replica(s) ({type(strategy).__name__}, policy {policy}); "
          f"TensorBoard: {folder.tensorboard}")
    for epoch in range(state["epoch"], cfg.epochs):
        skip = state["step"] if epoch == state["epoch"] else 0
        for cb in starters:
            cb.start(epoch, skip)
        ds = train_epoch_dataset(cfg, data.index, epoch, steps, skip)
        train_model.fit(ds, epochs=epoch + 1, initial_epoch=epoch, validation_data=data.val,
                        callbacks=callbacks, verbose=verbose, shuffle=False)
        logs = state["history"][-1]
        print(f"epoch {epoch + 1}/{cfg.epochs}: step time "
              f"{logs.get('step_time_ms', float('nan')):.0f} ms (median; first step of the "
              f"run {timer.first or 0:.1f} s incl. tracing), val_loss "
              f"{logs.get('val_loss', float('nan')):.4g}, best epoch {state['best_epoch']}")
    return summary_of(state, steps, replicas)


def summary_of(state: dict, steps: int, replicas: int) -> dict:
    times = [h["step_time_ms"] for h in state["history"] if "step_time_ms" in h]
    return dict(epochs_trained=state["epoch"], steps_per_epoch=steps, replicas=replicas,
                best_epoch=state["best_epoch"], best_val_loss=state["best_val_loss"],
                step_time_ms=float(np.median(times)) if times else None,
                history=state["history"])


# ----------------------------------------------------------------------------- evaluation


def evaluation_model(cfg: Config, classes: int, path):
    """A float32 plain model (no strategy) with the weights of `path`."""
    keras.mixed_precision.set_global_policy("float32")
    model = build_model(cfg, classes)
    note = load_weights(model, path)
    return model, note


def evaluate(cfg: Config, data, folder: RunFolder, weights, train_summary=None) -> dict:
    """P@1 / P@5, gradient distortion and the figure; writes results.md / .json."""
    classes = len(data.class_names)
    model, note = evaluation_model(cfg, classes, weights)
    print(f"Evaluating {note}")
    k = min(5, classes)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="p1"),
                           keras.metrics.SparseTopKCategoricalAccuracy(k, name="pk")])
    test = model.evaluate(data.test, return_dict=True, verbose=0)
    n_test = len(data.index.files["test"])
    print(f"Test split ({n_test} images): P@1 {test['p1']:.4f}, P@{k} {test['pk']:.4f}")

    results = dict(
        model="ResNet-18", roll=cfg.roll, weights=str(weights),
        settings={k_: cfg.values[k_] for k_ in RUN_KEYS if k_ in cfg.values},
        quick_changes={k_: list(v) for k_, v in cfg.quick_changes.items()},
        data=dict(root=str(data.index.root), classes=classes, **data.index.counts()),
        test=dict(images=n_test, k=k, p_at_1=test["p1"], p_at_k=test["pk"],
                  loss=test["loss"]),
        training=train_summary)

    distortion, rows = {}, None
    if cfg.num_eval:
        rng = np.random.default_rng(cfg.seed)
        n = min(cfg.num_eval, n_test)
        pick = np.sort(rng.choice(n_test, n, replace=False))
        files = [data.index.files["test"][i] for i in pick]
        x, y = numpy_images(cfg, files, data.index.labels["test"][pick])
        lin = keras_roll.linearize(model, memory_budget=cfg.memory_budget)
        print(f"Gradient distortion on {n} test images, eps={cfg.eps:g}:")
        expected = keras_roll.gradient_distortion(
            lin, x, y, eps=cfg.eps, domain=(0.0, 1.0), mode="expected",
            samples=cfg.distortion_samples, seed=cfg.seed)
        worst = keras_roll.gradient_distortion(
            lin, x, y, eps=cfg.eps, domain=(0.0, 1.0), mode="max", population=cfg.population,
            generations=cfg.generations, seed=cfg.seed)
        expected.summary()
        worst.summary()
        distortion = dict(
            eps=cfg.eps, images=n, files=files, labels=y,
            expected=dict(samples=cfg.distortion_samples, **_pcts(expected.distortion)),
            max=dict(population=cfg.population, generations=cfg.generations,
                     evaluations=worst.evaluations, **_pcts(worst.distortion)),
            changed=int(worst.changed.sum()),
            per_image=dict(expected=expected.distortion, max=worst.distortion,
                           changed=worst.changed))
        rows = figure(cfg, folder, lin, x, y, worst, data.class_names)
    results["distortion"] = distortion or None
    results["figure"] = rows
    write_results(folder.out, results)
    return results


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _pcts(values) -> dict:
    v = np.asarray(values, np.float64)
    return {**{f"P{q}": float(np.percentile(v, q)) for q in PERCENTILES}, "mean": float(v.mean())}


def figure(cfg: Config, folder: RunFolder, lin, x, y, worst, class_names):
    """Figure 4: image, gradient, worst-case gradient, integrated gradients."""
    d = worst.distortion
    order = np.argsort(d, kind="stable")
    qs = [float(q) for q in cfg.figure_percentiles]
    ranks = [max(0, math.ceil(q / 100 * len(d)) - 1) for q in qs]  # nearest rank
    qs = [q for i, q in enumerate(qs) if ranks[i] not in ranks[:i]]
    picks = [int(order[r]) for r in dict.fromkeys(ranks)]
    steps = cfg.ig_steps or None
    models = {("ROLL" if cfg.roll else "vanilla"): (lin, worst.points[picks])}
    if cfg.compare_with:
        other, other_cfg = compare_model(cfg, len(class_names))
        w2 = keras_roll.gradient_distortion(
            other, x[picks], y[picks], eps=cfg.eps, domain=(0.0, 1.0), mode="max",
            population=cfg.population, generations=cfg.generations, seed=cfg.seed)
        name = "ROLL" if other_cfg.get("roll") else "vanilla"
        if name in models:
            name += " (compared)"
        models[name] = (other, w2.points)
    columns = {}
    for name, (m, points) in models.items():
        columns[f"{name}\ngradient"] = keras_roll.saliency(m, x[picks], y[picks]).gradient
        columns[f"{name}\nadv. gradient"] = keras_roll.saliency(m, points, y[picks]).gradient
        columns[f"{name}\nintegrated grad."] = keras_roll.integrated_gradients(
            m, x[picks], y[picks], steps=steps).attributions
        columns[f"{name}\nadv. integrated grad."] = keras_roll.integrated_gradients(
            m, points, y[picks], steps=steps).attributions
    labels = [f"P{q:g}: {class_names[y[i]]}\nmax l1 {d[i]:.4g}" for q, i in zip(qs, picks)]
    path = folder.out / "figure4.png"
    keras_roll.plots.plot_attribution_grid(
        x[picks], columns, row_labels=labels, path=path,
        title=f"Gradients and worst-case gradients (eps={cfg.eps:g}) at the P"
              f"{'/P'.join(f'{q:g}' for q in qs)} worst-case distortion")
    print(f"Figure: {path}")
    return dict(path=path.name, percentiles=qs, images=picks,
                ig="exact" if steps is None else f"Riemann, {steps} points",
                models=list(models))


def compare_model(cfg: Config, classes: int):
    other = Path(os.path.expanduser(cfg.compare_with))
    try:
        record = json.loads((other / "run_config.json").read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--compare_with={cfg.compare_with}: cannot read its "
                         f"run_config.json ({e}); pass the --out of a finished run.") from e
    for key, value in (("image_size", cfg.image_size), ("classes", classes)):
        if record.get(key) != value:
            raise UsageError(f"--compare_with={cfg.compare_with} was trained with {key}="
                             f"{record.get(key)}, this run has {value}.")
    keras.mixed_precision.set_global_policy("float32")
    model = keras_roll.models.resnet18(
        (cfg.image_size, cfg.image_size, 3), classes=classes, stem_pool=record["stem_pool"],
        normalize=record["normalize"], classifier_activation=None)
    best = other / "best.weights.h5"
    if not best.is_file():
        raise UsageError(f"--compare_with={cfg.compare_with} has no best.weights.h5 yet.")
    model.load_weights(best)
    return keras_roll.linearize(model, memory_budget=cfg.memory_budget), record


def write_results(out: Path, results: dict) -> None:
    """`results.json` (everything) and `results.md` (the tables)."""
    fmt, pct = common.fmt, common.percent
    k = results["test"]["k"]
    s = results["settings"]
    lines = [f"# Caltech-256, ResNet-18 {'ROLL' if results['roll'] else 'vanilla'}", ""]
    if results["roll"]:
        lines.append(f"ROLL: lam={s['lam']:g}, C={s['C']:g}, gamma={s['gamma']:g}, "
                     f"samples={s['samples'] or 'exact'}"
                     f"{' per channel' if s['samples'] and s['strata'] == 'channel' else ''}"
                     f", wrt={s['roll_wrt'] or 'pixels'}.")
    lines.append(f"{s['image_size']}x{s['image_size']} images, batch {s['batch_size']}, "
                 f"{s['epochs']} epochs, lr {s['lr']:g} (x{s['lr_decay_factor']:g} after "
                 f"epochs {', '.join(s['lr_decay_epochs'])}), SGD momentum {s['momentum']:g}"
                 f"{' (Nesterov)' if s['nesterov'] else ''}.")
    if results["quick_changes"]:
        lines.append("--quick: " + ", ".join(
            f"{k_} {_flag_text(a)} -> {_flag_text(b)}"
            for k_, (a, b) in results["quick_changes"].items()) + ".")
    dd = results["data"]
    lines += [f"Data: {dd['root']}: {dd['classes']} classes, {dd['train']} train / "
              f"{dd['val']} val / {dd['test']} test images ({dd['skipped']} files skipped).",
              f"Weights: {results['weights']}."]
    tr = results.get("training")
    if tr:
        lines.append(f"Training: {tr['epochs_trained']} epochs of {tr['steps_per_epoch']} "
                     f"steps on {tr['replicas']} replica(s), median step time "
                     f"{_ms(tr['step_time_ms'])} ms; best validation loss "
                     f"{fmt(tr['best_val_loss'])} at epoch {tr['best_epoch']}.")
    t = results["test"]
    lines += ["", "## Test accuracy", "",
              common.markdown_table([("images", "test images", fmt), ("p_at_1", "P@1", pct),
                                     ("p_at_k", f"P@{k}", pct)], [t])]
    dist = results.get("distortion")
    if dist:
        cols = [("name", "l1 gradient distortion", str)] + [
            (f"P{q}", f"P{q}", fmt) for q in PERCENTILES] + [("mean", "mean", fmt)]
        rows = [dict(dist["expected"], name=f"expected ({dist['expected']['samples']} "
                                           "uniform draws)"),
                dict(dist["max"], name=f"worst case (GA: population {dist['max']['population']}"
                                       f", {dist['max']['generations']} generations)")]
        lines += ["", f"## Gradient distortion (eps = {dist['eps']:g}, l_inf ball, "
                      f"{dist['images']} test images)", "", common.markdown_table(cols, rows),
                  "", f"Predictions changed at the worst-case point: {dist['changed']} of "
                      f"{dist['images']}."]
    fig = results.get("figure")
    if fig:
        lines += ["", "## Figure 4", "",
                  f"Rows: the test images at P{', P'.join(f'{q:g}' for q in fig['percentiles'])}"
                  f" of the worst-case distortion; integrated gradients: {fig['ig']}.", "",
                  f"![Figure 4]({fig['path']})"]
    (out / "results.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    common.write_json(out / "results.json", results)


# ----------------------------------------------------------------------------- entry


def run(fv: flags.FlagValues, callbacks=()) -> dict | None:
    """Trains (unless `--eval_only`) and evaluates; returns the results (chief only).

    Args:
        fv: parsed flags (`common.parse_flags(define_flags, argv)` or `flags.FLAGS`).
        callbacks: extra Keras callbacks for `fit` (after the example's own).

    Returns:
        The `results.json` content, or None on a worker that is not the chief.

    Raises:
        UsageError: bad flags, data or output folder (the message says what to do).

    Example:

    ```python
    fv = common.parse_flags(define_flags, ["--quick", "--out=/tmp/caltech"])
    print(run(fv)["test"])
    ```
    """
    cfg = Config(fv)
    if cfg.strategy not in STRATEGIES:
        raise UsageError(f"Unknown --strategy={cfg.strategy!r}; expected one of {STRATEGIES}.")
    # A multi-worker strategy must exist before any other TensorFlow op runs.
    if cfg.eval_only and cfg.strategy == "multiworker":
        raise UsageError("--eval_only evaluates in one process; drop --strategy=multiworker "
                         "and run it on one host.")
    strategy = make_strategy("default" if cfg.eval_only else cfg.strategy)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()
    is_chief, worker = worker_role(strategy)
    out = common.output_dir(cfg.out)
    folder = RunFolder(out, is_chief, worker)
    if cfg.quick_changes:
        print("--quick: " + ", ".join(f"--{k}={_flag_text(b)}"
                                      for k, (_, b) in cfg.quick_changes.items()))
    data = prepare_data(cfg, out, worker, is_chief)
    counts = data.index.counts()
    print(f"Caltech-256 at {data.index.root}: {len(data.class_names)} classes, "
          f"{counts['train']} train / {counts['val']} val / {counts['test']} test images, "
          f"{counts['skipped']} files skipped.")
    summary = None
    if cfg.eval_only:
        weights = cfg.weights or folder.best
        if not Path(os.path.expanduser(os.fspath(weights))).is_file():
            raise UsageError(f"--eval_only: no weights at {weights}; train first (the same "
                             "command without --eval_only) or pass --weights.")
        if not cfg.weights and folder.run_config.exists():
            folder.check_run(cfg.run_record(data.index.root, len(data.class_names)))
    else:
        summary = train(cfg, strategy, data, folder, callbacks)
        weights = folder.best
        if not is_chief:
            return None
        if not weights.is_file():
            raise UsageError(f"No epoch had a finite validation loss, so {weights} was never "
                             "written (did the training diverge? try a lower --lr).")
    if data.test is None:
        raise UsageError("--test_per_class=0 leaves no test split to evaluate.")
    results = evaluate(cfg, data, folder, weights, summary)
    print((out / "results.md").read_text())
    return results


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}.")
    try:
        run(flags.FLAGS)
    except UsageError as e:  # a clear message, not a traceback or the whole flag list
        sys.exit(f"ERROR: {e}")


if __name__ == "__main__":
    define_flags(flags.FLAGS)
    check_flagfiles(sys.argv)
    app.run(main)
