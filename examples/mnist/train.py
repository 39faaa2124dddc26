"""Trains the MNIST models and writes Table 1, the faithfulness of their explanations
(and Figure 2 with `--sweep`): `train_and_evaluate(config, workdir)`.

Example:

```python
from examples.mnist import train
from examples.mnist.configs import quick

result = train.train_and_evaluate(quick.get_config(), "/tmp/mnist")
print(result.tables["table1"])
```
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import keras
import numpy as np

import keras_roll
from examples.common import app
from examples.common.data import Data
from examples.common.runs import (
    ModelSpec,
    evaluate_and_store,
    gather_stored,
    model_specs,
    result_row,
    stored_or_none,
)
from examples.common.search import search_rows
from examples.common.selection import runs_table, selected_table
from examples.common.tables import write_json
from examples.common.training import fit_best
from examples.mnist.configs.default import TRAINING_FIELDS, Config, Init
from examples.mnist.explanations import faithfulness_table
from examples.mnist.input_pipeline import load_data

SWEPT = (("lam", "lambda"), ("C", "C"), ("gamma", "gamma (%)"))


def build_model(config: Config, input_dim: int = 784, classes: int = 10,
                normalize=None) -> keras.Model:
    """The paper's network, `input_dim`-`width`x`depth`-`classes`, with `--init`
    weights seeded by `--seed` (every model starts from the same weights) and a
    Normalization layer `(mean, std)` unless `normalize` is None.

    Example:

    ```python
    model = build_model(config, 784, 10, normalize=(0.1307, 0.3081))
    ```
    """
    keras.utils.set_random_seed(config.seed)
    model = keras_roll.models.fc(input_shape=(input_dim,), depth=config.depth,
                                 width=config.width, classes=classes, normalize=normalize)
    if config.init == Init.torch:
        rng = np.random.default_rng(config.seed)
        for layer in model.layers:
            if isinstance(layer, keras.layers.Dense):
                kernel, bias = layer.get_weights()
                limit = 1.0 / np.sqrt(kernel.shape[0])
                layer.set_weights([rng.uniform(-limit, limit, kernel.shape).astype(kernel.dtype),
                                   rng.uniform(-limit, limit, bias.shape).astype(bias.dtype)])
    return model


def specs(config: Config) -> list[ModelSpec]:
    """The models to train: vanilla first, then the ROLL grid and the sweep."""
    grid = []
    if config.roll and not config.search:
        grid += [(lam, c, g) for lam in config.lam for c in config.C for g in config.gamma]
    if config.sweep:
        for i, name in enumerate(("lam", "C", "gamma")):
            for v in getattr(config, f"sweep_{name}"):
                point = list(config.sweep_base)
                point[i] = v
                grid.append(tuple(point))
    if config.search and not (grid or config.vanilla):
        return []  # --search --novanilla: the stored vanilla model, then the search
    return model_specs(config.vanilla, grid, config.samples)


def search(rows: list[dict], data: Data, config: Config, out: Path,
           logs: app.LogOptions = app.LogOptions()) -> list[dict]:
    """`--search`: the ROLL rows of the bisection on lam (`search.search_rows`) at each
    `--C` and `--gamma`, against the vanilla row among `rows`.

    Raises:
        UsageError: no vanilla model to compare with.
    """
    vanilla = next((r for r in rows if r.get("lam") is None), None)
    if vanilla is None:
        raise app.UsageError("--search compares with the vanilla model: pass --vanilla (or "
                             "keep its stored run in --out, trained with the same settings).")
    found = []
    for c in config.C:
        for gamma in config.gamma:
            found += search_rows(
                lambda lam, c=c, gamma=gamma: train_or_load(
                    ModelSpec.roll(lam, c, gamma, config.samples), data, config, out, logs),
                vanilla, start=config.lam[0], steps=config.search_steps)
    return found


def settings(config: Config, data: Data) -> dict:
    """The settings a trained model depends on (a stored result is reused if they match):
    the training fields and the data's fingerprint (not its path)."""
    return {**{k: getattr(config, k) for k in TRAINING_FIELDS}, "data": data.fingerprint}


def train_one(spec: ModelSpec, data: Data, config: Config, out: Path,
              logs: app.LogOptions = app.LogOptions()) -> dict:
    """Trains one model, restores its best validation-loss epoch and evaluates it.

    Returns its row; writes `runs/<tag>.json`, `.npz` (test margins) and `.weights.h5`.
    """
    runs = app.output_dir(out / "runs")
    (xtr, ytr), val, test = data.train, data.val, data.test
    model = build_model(config, xtr.shape[1], data.classes, data.normalize)
    if spec.is_roll:
        # evaluate() computes ROLL too: val_loss = cross entropy + lam * ROLL, the
        # training objective, whose best epoch BestValLoss keeps (as the paper's code).
        fit_model = keras_roll.wrap(model, wrt=config.wrt or None, lam=spec.lam, C=spec.C,
                                    gamma=spec.gamma, samples=spec.samples,
                                    seed=None if spec.samples is None else config.seed)
    else:
        fit_model = model
    fit_model.compile(
        optimizer=keras.optimizers.SGD(config.lr, momentum=config.momentum, nesterov=True),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    app.log(f"\n== {spec.tag}: {len(xtr)} training images, {config.epochs} epochs")
    fit = fit_best(model, fit_model, (xtr, ytr), val, config.epochs, config.batch_size,
                   runs / f"{spec.tag}.weights.h5", name=spec.tag, seed=config.seed,
                   warn_last_epoch=logs.warn_last_epoch)
    app.log(f"   best validation loss {fit.best.best:.4f} at epoch {fit.best.epoch}")
    row = result_row(spec, fit, settings(config, data))
    return evaluate_and_store(model, row, val, test, runs)


def train_or_load(spec: ModelSpec, data: Data, config: Config, out: Path,
                  logs: app.LogOptions = app.LogOptions()) -> dict:
    """A stored result with the same settings (with `--resume`; re-certified with
    `--reevaluate`), else `train_one`."""
    row = stored_or_none(
        out / "runs" / f"{spec.tag}.json", settings(config, data), config.resume,
        config.reevaluate,
        lambda: build_model(config, data.train[0].shape[1], data.classes, data.normalize),
        data.val, data.test)
    return row if row is not None else train_one(spec, data, config, out, logs)


def figure2(rows: list[dict], config: Config, name: str, out: Path) -> list[Path]:
    """Figure 2: test margin percentiles and accuracy against each swept hyperparameter."""
    base = dict(zip(("lam", "C", "gamma"), config.sweep_base))
    paths = []
    for key, label in SWEPT:
        pts = sorted((r for r in rows if r["lam"] is not None
                      and all(r[k] == base[k] for k in base if k != key)),
                     key=lambda r: r[key])
        if len(pts) < 2:
            continue
        margins = [np.load(out / "runs" / f"{r['tag']}.npz")["l2"] for r in pts]
        path = out / f"figure2_{key}.png"
        others = ", ".join(f"{k}={v:g}" for k, v in base.items() if k != key)
        keras_roll.plots.plot_margin_tradeoff(
            [r[key] for r in pts], margins, [r["acc"] for r in pts], hyperparameter=label,
            title=f"{name}: test l2 margin and accuracy against {label} ({others})", path=path)
        paths.append(path)
    return paths


def train_and_evaluate(config: Config, workdir,
                       logs: app.LogOptions = app.LogOptions()) -> app.ExampleResult:
    """Trains (or reuses) every model of `config`, writes Table 1, the table of every
    model, the faithfulness table and figure of Table 1's models and, with `--sweep`,
    Figure 2 to `workdir`; returns what it wrote."""
    app.start_tensorflow(config.seed)
    out = app.output_dir(workdir)
    data = load_data(config)
    todo = specs(config)
    rows = []
    for i, spec in enumerate(todo, start=1):
        app.log(f"\n-- model {i} of {len(todo)}")
        rows.append(train_or_load(spec, data, config, out, logs))
    rows = gather_stored(out / "runs", settings(config, data), rows)
    if config.search:
        have = {r["tag"] for r in rows}
        rows += [r for r in search(rows, data, config, out, logs) if r["tag"] not in have]
    dim = data.train[0].shape[1]
    arch = f"{dim}-{config.width}x{config.depth}-{data.classes} ReLU network"
    norm = ("no input normalisation" if data.normalize is None else
            f"the normalisation (x - {data.normalize[0]:.4g}) / {data.normalize[1]:.4g} "
            f"inside the model")
    md, summary = selected_table(
        rows, out, "table1", f"Table 1: {data.name}, {arch}",
        notes=[f"Margins in [0, 1] pixel units ({norm}; the paper's sigma x margin)."])
    runs_md = runs_table(rows, out, f"{data.name}: every trained model")
    figures = figure2(rows, config, data.name, out) if config.sweep else []
    tables = {"table1": md, "runs": runs_md}
    faith_md, faith_figure = faithfulness_table(
        rows, summary, data, config, out,
        lambda: build_model(config, dim, data.classes, data.normalize))
    app.log("\n" + runs_md + "\n" + md)
    for path in figures:
        app.log(f"Figure 2: {path}")
    if faith_md is not None:
        tables["faithfulness"] = faith_md
        figures.append(faith_figure)
        app.log("\n" + faith_md)
        app.log(f"Faithfulness curves: {faith_figure}")
    app.log(f"Everything is in {out}/")
    summary = {**summary, "dataset": data.name, "normalize": data.normalize,
               "config": dataclasses.asdict(config)}
    write_json(out / "summary.json", summary)
    return app.ExampleResult(tables, rows, figures, summary, out)
