"""Trains the paper's ResNet-18 on Caltech-256 (vanilla or with sampled ROLL),
resumably, under a `tf.distribute` strategy, then evaluates it:
`train_and_evaluate(config, workdir)`.

Example:

```python
from examples.caltech256 import train
from examples.caltech256.configs import quick

results = train.train_and_evaluate(quick.get_config(), "/tmp/caltech")
results.summary["test"]["p_at_1"]
```
"""

from __future__ import annotations

import os
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import keras_roll
from examples.caltech256 import evaluate, input_pipeline
from examples.caltech256.callbacks import TopKAccuracy, make_callbacks
from examples.caltech256.checkpoint import RunFolder, fresh_state
from examples.caltech256.configs.default import RUN_FIELDS, Config, Strata, Strategy
from examples.caltech256.models import build_model, load_weights
from examples.common import app
from examples.common.training import fit_verbosity, last_epoch_warning

__all__ = ["make_strategy", "train", "train_and_evaluate", "worker_role"]


def make_strategy(strategy: Strategy):
    """The `tf.distribute` strategy `--strategy` names (create it before any other op)."""
    if strategy == Strategy.mirrored:
        return tf.distribute.MirroredStrategy()
    if strategy == Strategy.multiworker:
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


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


def steps_per_epoch(config: Config, n_train: int, replicas: int) -> int:
    """Full batches per epoch (at most `--steps_per_epoch`), after checking the batch."""
    if config.batch_size % replicas:
        raise app.UsageError(
            f"--batch_size={config.batch_size} is the global batch and must be divisible by "
            f"the {replicas} replicas of --strategy={config.strategy.value}; use e.g. "
            f"--batch_size={max(replicas, config.batch_size // replicas * replicas)}.")
    steps = n_train // config.batch_size
    if steps == 0:
        raise app.UsageError(f"The training split has {n_train} images, fewer than one batch "
                             f"of --batch_size={config.batch_size}.")
    return min(steps, config.steps_per_epoch) if config.steps_per_epoch else steps


def run_record(config: Config, index) -> dict:
    """The values that define the training run (`RUN_FIELDS`, the data's root and
    number of classes)."""
    record = {k: getattr(config, k) for k in RUN_FIELDS}
    if record["weights"]:
        record["weights"] = str(Path(os.path.expanduser(record["weights"])).resolve())
    return dict(record, data_root=str(index.root), classes=len(index.class_names))


def compile_train_model(config: Config, model, strategy, steps: int, classes: int):
    """The model `fit` runs on (ROLL's wrapper, or the plain model), compiled with SGD and
    the learning-rate schedule keyed on the optimizer step."""
    if config.roll:
        sampled = config.samples > 0
        train_model = keras_roll.wrap(
            model, wrt=config.roll_wrt or None, lam=config.lam, C=config.C, gamma=config.gamma,
            samples=config.samples if sampled else None,
            strata="channel" if sampled and config.strata == Strata.channel else None,
            seed=config.seed, memory_budget=config.memory_budget)
    elif isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        # keras_roll.RollModel works around Keras 3.15's multi-worker fit
        # (keras-team/keras#20585); without a regularizer it is the plain model.
        train_model = keras_roll.RollModel(model.inputs, model.outputs, name=model.name)
    else:
        train_model = model
    # "After epoch e": the steps from e * steps on take the next rate.
    boundaries = [int(e) * steps - 1 for e in sorted(config.lr_decay_epochs)]
    values = [config.lr * config.lr_decay_factor ** i for i in range(len(boundaries) + 1)]
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay(boundaries, values)
    optimizer = keras.optimizers.SGD(schedule, momentum=config.momentum,
                                     nesterov=config.nesterov)
    k = min(5, classes)
    train_model.compile(
        optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
                 TopKAccuracy(k, name=f"top{k}")])
    return train_model, optimizer


def build_for_training(config: Config, strategy, state, folder: RunFolder, steps: int,
                       classes: int):
    """`(plain model, model fit runs on, policy)` under the strategy, resumed from
    `state` when there is one."""
    policy = (("mixed_float16" if tf.config.list_logical_devices("GPU") else "mixed_bfloat16")
              if config.mixed_precision else "float32")
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(config.seed)
    try:
        with strategy.scope():
            model = build_model(config, classes)
            if state is None and config.weights:
                app.log("Initial weights:", load_weights(model, config.weights))
            train_model, optimizer = compile_train_model(config, model, strategy, steps,
                                                         classes)
            if state is not None:
                optimizer.build(train_model.trainable_variables)
                train_model.load_weights(state["weights_path"])
                app.log(f"Resuming {folder.out} at epoch {state['epoch'] + 1}, step "
                        f"{state['step']} of {steps} (global step {state['global_step']}; "
                        f"optimizer step {int(optimizer.iterations.numpy())}).")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, train_model, policy


def train(config: Config, strategy, data, folder: RunFolder, extra_callbacks=()) -> dict:
    """Trains (or resumes) the run in `folder`; returns the training summary."""
    replicas = strategy.num_replicas_in_sync
    n_train = len(data.index.files["train"])
    steps = steps_per_epoch(config, n_train, replicas)
    classes = len(data.class_names)
    folder.check_run(run_record(config, data.index))
    state = folder.load_state()
    if state is not None and state.get("done"):
        app.log(f"Training finished earlier ({folder.state_file}: epoch {state['epoch']} of "
                f"{config.epochs}, best epoch {state['best_epoch']}); evaluating its best "
                f"weights.")
        return summary_of(state, steps, replicas)
    model, train_model, policy = build_for_training(config, strategy, state, folder, steps,
                                                    classes)
    state = fresh_state() if state is None else state
    x_monitor = input_pipeline.monitor_images(config, data.index)
    cbs = make_callbacks(config, folder, model, x_monitor, steps, state)
    verbose = fit_verbosity() if config.verbose == -1 else config.verbose
    app.log(f"Training {model.name} {describe(config)} on {n_train} images of {classes} "
            f"classes at {config.image_size}x{config.image_size}: {steps} steps of "
            f"{config.batch_size} per epoch on {replicas} replica(s) "
            f"({type(strategy).__name__}, policy {policy}); TensorBoard: {folder.tensorboard}")
    for epoch in range(state["epoch"], config.epochs):
        skip = state["step"] if epoch == state["epoch"] else 0
        for cb in cbs.resume_points:
            cb.start(epoch, skip)
        ds = input_pipeline.train_epoch_dataset(config, data.index, epoch, steps, skip)
        train_model.fit(ds, epochs=epoch + 1, initial_epoch=epoch, validation_data=data.val,
                        callbacks=cbs.all + list(extra_callbacks), verbose=verbose,
                        shuffle=False)
        logs = state["history"][-1]
        app.log(f"epoch {epoch + 1}/{config.epochs}: step time "
                f"{logs.get('step_time_ms', float('nan')):.0f} ms (median; first step of the "
                f"run {cbs.timer.first or 0:.1f} s incl. tracing), val_loss "
                f"{logs.get('val_loss', float('nan')):.4g}, best epoch {state['best_epoch']}")
    warning = last_epoch_warning(state["best_epoch"], config.epochs, model.name)
    if warning:
        app.log(warning)
    return summary_of(state, steps, replicas)


def describe(config: Config) -> str:
    """'vanilla' or the ROLL settings, in words."""
    if not config.roll:
        return "vanilla"
    per = " per channel" if config.samples and config.strata == Strata.channel else ""
    return (f"ROLL (lam={config.lam:g}, C={config.C:g}, gamma={config.gamma:g}, "
            f"samples={config.samples or 'exact'}{per}, wrt={config.roll_wrt or 'pixels'})")


def summary_of(state: dict, steps: int, replicas: int) -> dict:
    """The training summary of `results.json`."""
    times = [h["step_time_ms"] for h in state["history"] if "step_time_ms" in h]
    return dict(epochs_trained=state["epoch"], steps_per_epoch=steps, replicas=replicas,
                best_epoch=state["best_epoch"], best_val_loss=state["best_val_loss"],
                step_time_ms=float(np.median(times)) if times else None,
                history=state["history"])


def train_and_evaluate(config: Config, workdir, callbacks=()) -> app.ExampleResult | None:
    """Trains (unless `--eval_only`) and evaluates; returns the results on the chief,
    None on the other workers.

    Args:
        config: the run's settings (`data_dir` None: the generated tree of `--quick`).
        workdir: the work folder (`--out`).
        callbacks: extra Keras callbacks for `fit` (after the example's own).

    Raises:
        UsageError: bad flags, data or output folder (the message says what to do).
    """
    app.start_tensorflow(config.seed)
    # A multi-worker strategy must exist before any other TensorFlow op runs.
    strategy = make_strategy(Strategy.default if config.eval_only else config.strategy)
    if config.deterministic:
        tf.config.experimental.enable_op_determinism()
    is_chief, worker = worker_role(strategy)
    out = app.output_dir(workdir)
    folder = RunFolder(out, is_chief, worker)
    data = input_pipeline.prepare_data(config, out, None if is_chief else worker)
    counts = data.index.counts()
    app.log(f"Caltech-256 at {data.index.root}: {len(data.class_names)} classes, "
            f"{counts['train']} train / {counts['val']} val / {counts['test']} test images, "
            f"{counts['skipped']} files skipped.")
    if data.test is None:
        raise app.UsageError("--test_per_class=0 leaves no test split to evaluate.")
    summary = None
    if config.eval_only:
        weights = evaluate.eval_only_weights(config, folder, run_record(config, data.index))
    else:
        summary = train(config, strategy, data, folder, callbacks)
        weights = folder.best
        if not is_chief:
            return None
        if not weights.is_file():
            raise app.UsageError(f"No epoch had a finite validation loss, so {weights} was "
                                 "never written (did the training diverge? try a lower --lr).")
    return evaluate.evaluate(config, data, folder, weights, summary)
