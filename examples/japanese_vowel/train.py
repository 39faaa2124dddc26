"""Trains the Japanese Vowels models and writes Table 3 and Figure 3:
`train_and_evaluate(config, workdir)`.

Example:

```python
from examples.japanese_vowel import train
from examples.japanese_vowel.configs import quick

result = train.train_and_evaluate(quick.get_config(), "/tmp/jv")
print(result.tables["table3"])
```
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import keras
import numpy as np

import keras_roll
from examples.common import app
from examples.common.margin_stats import exact_twin
from examples.common.runs import (
    ModelSpec,
    data_fingerprint,
    evaluate_and_store,
    gather_stored,
    model_specs,
    result_row,
    stored_or_none,
)
from examples.common.selection import model_label, runs_table, selected_table
from examples.common.tables import fmt, percent, write_json
from examples.common.training import fit_best
from examples.japanese_vowel.configs.default import TRAINING_FIELDS, Config
from examples.japanese_vowel.input_pipeline import load_data, sequence_dataset


def build_model(config: Config) -> keras.Model:
    """The scoRNN classifier with the config's sizes, seeded by `--seed`."""
    keras.utils.set_random_seed(config.seed)
    return keras_roll.models.scornn_classifier(units=config.units,
                                               num_negative_ones=config.num_negative_ones)


def settings(config: Config, data) -> dict:
    """The settings a trained model depends on (a stored result is reused if they match):
    the training fields and the data's fingerprint (not its path)."""
    arrays = [a for split in data for a in split]
    return {**{k: getattr(config, k) for k in TRAINING_FIELDS},
            "data": data_fingerprint(*arrays)}


def train_one(spec: ModelSpec, data, config: Config, out: Path,
              logs: app.LogOptions = app.LogOptions()) -> dict:
    """Trains one model (best validation-loss epoch) and evaluates it on the test set."""
    (xtr, ytr, ltr), (xv, yv, lv), (xte, yte, _) = data
    runs = app.output_dir(out / "runs")
    model = build_model(config)
    if spec.is_roll:
        fit_model = keras_roll.wrap(model, lam=spec.lam, C=spec.C, gamma=spec.gamma,
                                    samples=spec.samples,
                                    seed=None if spec.samples is None else config.seed)
    else:
        fit_model = model
    fit_model.compile(optimizer=keras.optimizers.Adam(config.lr, amsgrad=True),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    logs.log(f"\n== {spec.tag}: scoRNN({config.units}), {len(xtr)} training sequences, "
             f"{config.epochs} epochs")
    fit = fit_best(
        model, fit_model, sequence_dataset(xtr, ytr, ltr, config.batch_size, seed=config.seed),
        sequence_dataset(xv, yv, lv, config.batch_size), config.epochs,
        weights_path=runs / f"{spec.tag}.weights.h5", name=spec.tag,
        verbose=logs.fit_verbose, warn_last_epoch=logs.warn_last_epoch)
    logs.log(f"   best validation loss {fit.best.best:.4f} at epoch {fit.best.epoch}")
    row = result_row(spec, fit, settings(config, data))
    return evaluate_and_store(model, row, (xv, yv), (xte, yte), runs,
                              verbose=logs.certify_verbose)


def train_or_load(spec: ModelSpec, data, config: Config, out: Path,
                  logs: app.LogOptions = app.LogOptions()) -> dict:
    """A stored result with the same settings (with `--resume`; re-certified with
    `--reevaluate`), else `train_one`."""
    _, (xv, yv, _), (xte, yte, _) = data
    row = stored_or_none(out / "runs" / f"{spec.tag}.json", settings(config, data),
                         config.resume,
                         config.reevaluate, lambda: build_model(config), (xv, yv), (xte, yte))
    return row if row is not None else train_one(spec, data, config, out, logs)


def shared_ylim(series, bounds, channel: int) -> tuple[float, float]:
    """One y range for the Figure 3 panels of every model: the channel `series` and the
    finite ends of every model's stability interval, with a 15 % margin.

    Example:

    ```python
    shared_ylim(x[0, :, 3], [sb_vanilla, sb_roll], channel=3)   # (bottom, top)
    ```
    """
    values = [np.asarray(series, np.float64)]
    for sb in bounds:
        for side in (sb.lower, sb.upper):
            end = values[0] + np.asarray(side, np.float64)[0, :, channel]
            values.append(end[np.isfinite(end)])
    finite = np.concatenate(values)
    span = float(finite.max() - finite.min()) or 1.0
    return float(finite.min() - 0.17 * span), float(finite.max() + 0.17 * span)


def figure3(rows: list[dict], summary: dict, data, config: Config, out: Path,
            logs: app.LogOptions = app.LogOptions()) -> list[Path]:
    """Figure 3: stability bounds of one channel of one test sequence, vanilla and the
    ROLL model selected at the same accuracy (else at 1 % less, else the first)."""
    _, _, (xte, _, lengths) = data
    i, ch = config.figure_example, config.figure_channel
    x = xte[i:i + 1, :lengths[i]]  # the valid frames only
    chosen = []
    vanilla = next((r for r in rows if r["lam"] is None), None)
    if vanilla is not None:
        chosen.append(("vanilla", vanilla))
    pick = next((summary.get(k) for k in ("same_acc", "acc_minus_1") if summary.get(k)), None)
    roll_row = next((r for r in rows if pick and r["tag"] == pick["tag"]),
                    next((r for r in rows if r["lam"] is not None), None))
    if roll_row is not None:
        chosen.append(("roll", roll_row))
    bounds = []
    for name, row in chosen:
        model = build_model(config)
        model.load_weights(out / "runs" / f"{row['tag']}.weights.h5")
        bounds.append((name, row, keras_roll.stability_bounds(
            exact_twin(model), x, rigor="float32", verbose=logs.certify_verbose)))
    ylim = shared_ylim(x[0, :, ch], [sb for _, _, sb in bounds], ch)
    paths, widths = [], {}
    for name, row, sb in bounds:
        widths[name] = float(np.median((sb.upper - sb.lower)[0, :, ch]))
        path = out / f"figure3_{name}.png"
        keras_roll.plots.plot_stability_bounds(
            x[0], sb, channel=ch, channel_name=f"LPC coefficient {ch + 1}",
            title=f"{model_label(row)}: stability bounds, test sequence {i}", path=path,
            ylim=ylim)
        paths.append(path)
    summary["figure3"] = {"example": i, "channel": ch, "median_width": widths}
    return paths


def one_line(row: dict) -> str:
    """A trained model in one line: test accuracy, #CLR, median l2 margin, time."""
    return (f"  {model_label(row)}: test accuracy {percent(row['acc'])}, #CLR {row['clr']}, "
            f"median l2 margin {fmt(row['l2_p50'])}, best epoch {row['best_epoch']} of "
            f"{row.get('epochs') or row['best_epoch']}, trained in {fmt(row['train_time_s'])} s")


def train_and_evaluate(config: Config, workdir,
                       logs: app.LogOptions = app.LogOptions()) -> app.ExampleResult:
    """Trains (or reuses) every model of `config`, writes Table 3, the table of every
    model and Figure 3 to `workdir`; returns what it wrote. `logs`: how much it prints
    (quiet: one line per model)."""
    app.start_tensorflow(config.seed)
    out = app.output_dir(workdir)
    data = load_data(config)
    n_test = len(data[2][1])
    if config.figure_example >= n_test:
        raise app.UsageError(f"--figure_example={config.figure_example}: the test set has "
                             f"{n_test} sequences; pass 0 to {n_test - 1}.")
    grid = ([(lam, c, g) for lam in config.lam for c in config.C for g in config.gamma]
            if config.roll else [])
    todo = model_specs(config.vanilla, grid, config.samples)
    rows = []
    for i, spec in enumerate(todo, start=1):
        logs.log(f"\n-- model {i} of {len(todo)}")
        rows.append(train_or_load(spec, data, config, out, logs))
        if logs.quiet:
            app.log(one_line(rows[-1]))
    rows = gather_stored(out / "runs", settings(config, data), rows)
    md, summary = selected_table(
        rows, out, "table3", f"Table 3: Japanese Vowels, scoRNN({config.units}) with LeakyReLU",
        notes=["Margins in the units of the LPC coefficients (the data are not normalised).",
               f"Validation: {len(data[1][1])} of the {len(data[0][1]) + len(data[1][1])} "
               f"training sequences (stratified by speaker)."], verbose=not logs.quiet)
    runs_md = runs_table(rows, out, "Japanese Vowels: every trained model")
    figures = figure3(rows, summary, data, config, out, logs)
    summary["config"] = dataclasses.asdict(config)
    write_json(out / "summary.json", summary)
    logs.log("\n" + runs_md + "\n" + md)
    for path in figures:
        logs.log(f"Figure 3: {path}")
    logs.log(f"Everything is in {out}/")
    return app.ExampleResult({"table3": md, "runs": runs_md}, rows, figures, summary, out)
