"""Helpers shared by the examples (`examples/toy2d.py`, `mnist.py`, `japanese_vowel.py`, `demo.py`).

* flags: `define_common_flags` (`--quick`, `--out`, `--data_dir`, `--seed`) and
  `parse_flags`, which parses a fresh `absl.flags.FlagValues` so an example can run
  in-process (the tests and `examples/demo.py` call `run(flag_values)` directly);
* output: `output_dir`, `write_table` (a Markdown and a JSON file per table),
  `fmt` / `percent` for table cells;
* training: `fit_best` and `BestValLoss` (the best validation-loss epoch, restored
  at the end of `fit`, as in the paper), `EpochProgress`, `fit_verbosity`;
* evaluation: `margin_stats` (accuracy, #CLR bounds, P25 / P50 / P75 / P100 of the
  l1 and l2 margins, their Spearman correlation), `spearman`, `select_models` (the
  paper's model selection on validation accuracy).

Example:

```python
from examples import common

fv = common.parse_flags(my_example.define_flags, ["--quick", "--out=/tmp/x"])
row, cert = common.margin_stats(model, x_test, y_test)
common.write_table(out, "table1", "Table 1", COLUMNS, [row])
```
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
from absl import app, flags

import keras_roll
from keras_roll.certification.certificates import percentiles_of

PERCENTILES = (25, 50, 75, 100)
NORMS = {"l1": 1, "l2": 2}


# ----------------------------------------------------------------------------- flags


def define_common_flags(fv: flags.FlagValues, out: str, data_help: str) -> None:
    """Defines `--quick`, `--out`, `--data_dir` and `--seed` on `fv`.

    Example:

    ```python
    fv = flags.FlagValues()
    define_common_flags(fv, out="runs/mnist", data_help="Folder holding mnist.npz.")
    ```
    """
    flags.DEFINE_bool("quick", False, "A short run that finishes in a few minutes on 2 CPU "
                      "cores: caps the data sizes, epochs and model size (smaller values "
                      "given as flags stay).", flag_values=fv)
    flags.DEFINE_string("out", out, "Folder for everything the example writes (tables as "
                        "Markdown and JSON, PNG figures, weights).", flag_values=fv)
    flags.DEFINE_string("data_dir", None, data_help, flag_values=fv)
    flags.DEFINE_integer("seed", 0, "Random seed (data split, initialisation, sampling).",
                         flag_values=fv)


def parse_flags(define, argv=()) -> flags.FlagValues:
    """A fresh `FlagValues` with the flags of `define(fv)`, parsed from `argv`.

    `argv` holds only the flags (no program name); `--flagfile=...` works.

    Example:

    ```python
    fv = parse_flags(toy2d.define_flags, ["--quick", "--out=/tmp/toy"])
    toy2d.run(fv)
    ```
    """
    fv = flags.FlagValues()
    define(fv)
    fv(["example", *argv])
    return fv


def run_app(define, run) -> None:
    """The `__main__` of an example: `define()` its flags, then `absl.app.run` a main
    that refuses stray arguments and calls `run(flags.FLAGS)`; a missing data set
    (`FileNotFoundError`) exits with its message, not a traceback.

    Example:

    ```python
    if __name__ == "__main__":
        common.run_app(define_flags, run)
    ```
    """

    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
        try:
            run(flags.FLAGS)
        except FileNotFoundError as e:
            sys.exit(f"error: {e}")
        sys.stdout.flush()

    define()
    app.run(main)


def apply_quick(fv: flags.FlagValues, caps: dict) -> None:
    """Under `--quick`, caps each flag of `caps` at its value (0 counts as "all", so it
    becomes the cap). Smaller values, from a flagfile or the command line, stay.

    Example:

    ```python
    apply_quick(fv, {"epochs": 2, "train_size": 2000})   # --quick: at most 2 epochs
    ```
    """
    if not fv.quick:
        return
    for name, cap in caps.items():
        value = getattr(fv, name)
        setattr(fv, name, cap if value in (0, None) else min(value, cap))


def float_list(fv: flags.FlagValues, name: str) -> list[float]:
    """The comma-separated list flag `--name` as floats (a clear error otherwise)."""
    out = []
    for item in getattr(fv, name) or []:
        try:
            out.append(float(item))
        except ValueError:
            raise ValueError(f"--{name} takes comma-separated numbers, got {item!r} in "
                             f"{','.join(getattr(fv, name))!r}.") from None
    return out


# ----------------------------------------------------------------------------- output


def quiet_tensorflow() -> None:
    """Silences TensorFlow's Python warnings (e.g. retracing notes when certifying
    arrays of several sizes); errors still show."""
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")


def output_dir(path) -> Path:
    """Creates (if needed) and returns the output folder `path`."""
    out = Path(os.path.expanduser(os.fspath(path)))
    out.mkdir(parents=True, exist_ok=True)
    return out


def fit_verbosity() -> int:
    """Keras `fit` verbosity: the progress bar (1) on a terminal, one line per epoch (2)
    in a log file."""
    return 1 if sys.stdout.isatty() else 2


def fmt(value, digits: int = 3) -> str:
    """A table cell: numbers in 3 significant digits (scientific when small), '-' for None."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    v = float(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v != 0 and abs(v) < 1e-2:
        return f"{v:.{digits - 1}e}"
    text = f"{v:.{digits}g}"
    return f"{v:,.0f}" if "e" in text else text


def percent(value) -> str:
    """An accuracy in [0, 1] as a percentage cell."""
    return "-" if value is None else f"{100 * float(value):.2f} %"


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else None  # strict JSON has no inf / nan
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    return value


def markdown_table(columns, rows) -> str:
    """A Markdown table: `columns` is a list of `(key, header, formatter)`.

    Example:

    ```python
    markdown_table([("acc", "ACC", percent)], [{"acc": 0.98}])
    ```
    """
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(f(row.get(k)) for k, _, f in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def write_table(out: Path, name: str, title: str, columns, rows, notes=()) -> str:
    """Writes `out/name.md` (Markdown) and `out/name.json` and returns the Markdown.

    The JSON holds `title`, `columns` (keys and headers), `rows` (every key of every
    row, raw values; inf / nan become null) and `notes`.

    Example:

    ```python
    md = write_table(out, "table1", "Table 1: MNIST", COLUMNS, rows, notes=["..."])
    print(md)
    ```
    """
    md = f"### {title}\n\n{markdown_table(columns, rows)}\n"
    if notes:
        md += "\n" + "\n".join(f"* {n}" for n in notes) + "\n"
    (out / f"{name}.md").write_text(md, encoding="utf-8")
    data = {"title": title, "columns": [{"key": k, "header": h} for k, h, _ in columns],
            "rows": rows, "notes": list(notes)}
    (out / f"{name}.json").write_text(json.dumps(_jsonable(data), indent=1) + "\n",
                                      encoding="utf-8")
    return md


def write_json(path: Path, data) -> None:
    """Writes `data` as strict JSON (inf / nan become null)."""
    Path(path).write_text(json.dumps(_jsonable(data), indent=1) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- training


def fit_best(model: keras.Model, fit_model: keras.Model, train, val, epochs: int,
             batch_size: int | None = None, weights_path=None, verbose=None,
             progress: str | None = None):
    """`fit_model.fit` on `train` with `val` as validation data, then the weights of the
    best validation-loss epoch put back into `model` (which `fit_model` wraps or is).

    `train` and `val` are `(x, y)` pairs (batched by `batch_size`) or batched
    `tf.data.Dataset`s.

    `verbose` is Keras' (default: `fit_verbosity()`); `progress` adds a tqdm bar over
    the epochs with that description (for many short epochs, with `verbose=0`).

    Returns `(best, history, seconds)`: the `BestValLoss` callback, the History dict
    and the training time.

    Example:

    ```python
    best, history, seconds = fit_best(model, wrapped, (x, y), (xv, yv), 20, 64)
    ```
    """
    best = BestValLoss(model, path=weights_path)
    callbacks = [best]
    if progress is not None:
        callbacks.append(EpochProgress(epochs, progress))
    if isinstance(train, tuple):
        train_args, val = dict(x=train[0], y=train[1], batch_size=batch_size), tuple(val)
    else:
        train_args = dict(x=train)
    start = time.perf_counter()
    history = fit_model.fit(**train_args, validation_data=val, epochs=epochs,
                            verbose=fit_verbosity() if verbose is None else verbose,
                            callbacks=callbacks)
    seconds = time.perf_counter() - start
    for cb in callbacks:
        getattr(cb, "close", lambda: None)()
    best.restore()
    hist = {k: [float(v) for v in vals] for k, vals in history.history.items()}
    return best, hist, seconds


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
                               f"(did the training diverge?).")
        self.target.set_weights(self.weights)


# ----------------------------------------------------------------------------- evaluation


def _rank(v: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties given their average rank."""
    order = np.argsort(v, kind="mergesort")
    ranks = np.empty(v.size, np.float64)
    ranks[order] = np.arange(v.size, dtype=np.float64)
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse.reshape(-1), weights=ranks)
    return sums[inverse.reshape(-1)] / counts[inverse.reshape(-1)]


def spearman(a, b) -> float:
    """Spearman's rank correlation of `a` and `b` over the pairs where both are finite.

    Ties get their average rank; NaN when fewer than two pairs remain or a side is
    constant.

    Example:

    ```python
    spearman([1, 2, 3], [10, 30, 20])   # 0.5
    ```
    """
    a = np.asarray(a, np.float64).reshape(-1)
    b = np.asarray(b, np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"spearman needs arrays of one shape, got {a.shape} and {b.shape}.")
    keep = np.isfinite(a) & np.isfinite(b)
    if keep.sum() < 2:
        return float("nan")
    ra, rb = _rank(a[keep]), _rank(b[keep])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = math.sqrt(float(np.dot(ra, ra)) * float(np.dot(rb, rb)))
    return float(np.dot(ra, rb) / denom) if denom > 0 else float("nan")


def predictions(logits: np.ndarray) -> np.ndarray:
    """Class predictions from logits (one logit: its sign, the sigmoid case)."""
    logits = np.asarray(logits)
    if logits.ndim == 1 or logits.shape[-1] == 1:
        return (logits.reshape(len(logits)) > 0).astype(np.int64)
    return logits.argmax(axis=-1)


def exact_twin(model) -> keras_roll.Linearized:
    """The float64 twin of `model`, used for the tables with `rigor="float32"`.

    The tables report the margins of the network as a function of real numbers (the
    paper's Prop. 6 evaluated in float64 from the float32 weights, which float64
    represents exactly), not the smaller radii that `rigor="float64"` (keras_roll's
    default) certifies for the model *evaluated in float32*: that guard subtracts a
    bound on float32 rounding from every neuron's distance, which on these trained
    networks exceeds the distance of the closest neuron for nearly every input.

    Example:

    ```python
    cert = keras_roll.certify(exact_twin(model), x, rigor="float32")
    ```
    """
    return keras_roll.linearize(model).at_dtype("float64")


def margin_stats(model, x, y, prefix: str = "", regions: bool = True, verbose=False,
                 guarded: bool = False):
    """Accuracy, #CLR bounds and margin percentiles of `model` on `(x, y)`.

    Margins and regions are those of the float64 twin (`exact_twin`). With `guarded`,
    also `{prefix}guarded_l2_p50` and `{prefix}guarded_frac`: the median l2 radius that
    `keras_roll.certify`'s default `rigor="float64"` certifies for the model as Keras
    evaluates it (float32 rounding included), and the fraction of points with a
    radius > 0. Returns a dict
    with `{prefix}acc`, `{prefix}clr_lower` / `{prefix}clr_upper` (distinct Jacobians
    <= #CLR <= distinct patterns, Lemma 7), `{prefix}clr` (the two as a cell) and
    `{prefix}on_boundary` (with `regions`), `{prefix}l1_p25` ... `{prefix}l2_p100`,
    `{prefix}spearman` (l1 vs l2 margins), and the `keras_roll.Certificate`.

    Example:

    ```python
    row, cert = margin_stats(model, x_test, y_test)
    row["l2_p50"], row["acc"]
    ```
    """
    twin = exact_twin(model)
    # rigor="float32": compute in the twin's own dtype (float64 here), no rounding guard.
    cert = keras_roll.certify(twin, x, norms=(1, 2), verbose=verbose, rigor="float32")
    y = np.asarray(y).reshape(-1)
    row = {f"{prefix}acc": float(np.mean(predictions(cert.logits) == y)), f"{prefix}n": len(y)}
    if regions:
        rc = keras_roll.count_regions(twin, x, verbose=verbose, rigor="float32")
        row.update({f"{prefix}clr_lower": rc.jacobians, f"{prefix}clr_upper": rc.patterns,
                    f"{prefix}on_boundary": rc.on_boundary})
        row[f"{prefix}clr"] = clr_cell(row, prefix)
    for name, p in NORMS.items():
        for q, v in zip(PERCENTILES, percentiles_of(cert.margins[p], PERCENTILES)):
            row[f"{prefix}{name}_p{q}"] = v
    row[f"{prefix}spearman"] = spearman(cert.margins[1], cert.margins[2])
    if guarded:
        own = keras_roll.certify(model, x, norms=(2,), verbose=verbose).margins[2]
        row[f"{prefix}guarded_l2_p50"] = percentiles_of(own, (50,))[0]
        row[f"{prefix}guarded_frac"] = float(np.mean(own > 0))
    return row, cert


def result_row(cfg: dict, best, history, seconds: float, settings: dict) -> dict:
    """The stored row of a model trained with `cfg` (`tag`, `lam`, `C`, `gamma`,
    `samples`) whose `fit_best` returned `best`, `history` and `seconds`.

    Example:

    ```python
    row = result_row(cfg, best, history, seconds, settings(fv))
    ```
    """
    return {
        "tag": cfg["tag"], "lam": cfg["lam"], "C": cfg["C"], "gamma": cfg["gamma"],
        "samples": cfg["samples"],
        "estimator": "-" if cfg["lam"] is None else (
            "exact" if cfg["samples"] is None else f"{cfg['samples']} axes"),
        "best_epoch": best.epoch, "val_loss": best.best,
        "val_roll_loss": best.logs.get("val_roll_loss"),
        "train_time_s": seconds, "settings": settings, "history": history,
    }


def evaluate_and_store(model, row: dict, val, test, runs: Path) -> dict:
    """Adds the validation (`val_*`) and test statistics of `margin_stats` to `row`,
    writes `runs/<tag>.json` and the test margins to `runs/<tag>.npz`; returns the row.

    Example:

    ```python
    row = evaluate_and_store(model, {"tag": "vanilla", "lam": None}, (xv, yv), (xt, yt), runs)
    ```
    """
    print(f"   certifying {len(val[1])} validation and {len(test[1])} test points", flush=True)
    val_row, _ = margin_stats(model, *val, prefix="val_", regions=False)
    test_row, cert = margin_stats(model, *test, guarded=True)
    row = {**row, **test_row, **val_row}
    np.savez(runs / f"{row['tag']}.npz", l1=cert.margins[1], l2=cert.margins[2])
    write_json(runs / f"{row['tag']}.json", row)
    return row


def stored_or_none(path: Path, wanted: dict, resume: bool, reevaluate: bool, build, val,
                   test):
    """The row stored at `path` (see `load_stored`), re-certified from its stored
    weights with `reevaluate` (`build()` makes the model to load them into); None when
    there is no usable stored row."""
    row = load_stored(path, wanted, resume)
    if row is None or not reevaluate:
        return row
    model = build()
    model.load_weights(path.with_suffix(".weights.h5"))
    return evaluate_and_store(model, row, val, test, path.parent)


def select_models(rows, vanilla, drop: int, acc_key: str = "val_acc",
                  margin_key: str = "val_l2_p50"):
    """The paper's model selection: the largest `margin_key` among `rows` whose
    `acc_key`, in whole percent, is at least vanilla's minus `drop`.

    Accuracies are compared in whole percent, as the paper's released code does
    (its `parse_log.py` groups models by validation accuracy printed as `{:.0f}%`).
    Returns the selected row, or None when no row qualifies.

    Example:

    ```python
    same = select_models(roll_rows, vanilla_row, drop=0)   # "at the same accuracy"
    less = select_models(roll_rows, vanilla_row, drop=1)   # "at 1 % less accuracy"
    ```
    """
    target = round(100 * vanilla[acc_key]) - drop
    cands = [r for r in rows if round(100 * r[acc_key]) >= target
             and r.get(margin_key) is not None]
    if not cands:
        return None
    return max(cands, key=lambda r: r[margin_key])


def ratio(a, b):
    """`a / b`, or None when either is missing or `b` is 0."""
    if a is None or b is None or b == 0:
        return None
    return float(a) / float(b)


def margin_columns(prefix: str = ""):
    """Table columns `(key, header, formatter)` of the accuracy, #CLR and margins."""
    cols = [(f"{prefix}acc", "ACC", percent), (f"{prefix}clr", "#CLR", fmt)]
    for name in NORMS:
        cols += [(f"{prefix}{name}_p{q}", f"{name} P{q}", fmt) for q in PERCENTILES]
    return cols


def clr_cell(row, prefix: str = "") -> str:
    """'lower - upper' bounds of #CLR (one number when they agree)."""
    lo, up = row.get(f"{prefix}clr_lower"), row.get(f"{prefix}clr_upper")
    if lo is None or up is None:
        return "-"
    return f"{lo:,}" if lo == up else f"{lo:,} - {up:,}"


# ----------------------------------------------------------------------------- tables


def model_label(row) -> str:
    """'Vanilla' or 'ROLL (lam=.., C=.., gamma=.., estimator)' for a result row."""
    if row.get("lam") is None:
        return "Vanilla"
    return (f"ROLL (lam={row['lam']:g}, C={row['C']:g}, gamma={row['gamma']:g}, "
            f"{row['estimator']})")


def selected_table(rows, out: Path, name: str, title: str, notes=()):
    """The paper-style table: vanilla, then ROLL selected on validation at the same and
    at 1 % lower accuracy (`select_models`), with the ratio of P50 l2 margins.

    Writes `out/name.md` / `.json` and `out/summary.json` (vanilla accuracy, the
    selected models and their ratios, the Spearman l1-l2 correlation of every model).
    Returns `(markdown, summary)`. Without a vanilla row every ROLL row is shown.

    Example:

    ```python
    md, summary = selected_table(rows, out, "table1", "Table 1: MNIST")
    summary["same_acc"]["ratio_l2_p50"]
    ```
    """
    vanilla = next((r for r in rows if r.get("lam") is None), None)
    rolls = [r for r in rows if r.get("lam") is not None]
    shown, summary = [], {}
    if vanilla is not None:
        shown.append({**vanilla, "model": "Vanilla", "ratio": 1.0})
        summary["vanilla_acc"] = vanilla["acc"]
        summary["vanilla_val_acc"] = vanilla["val_acc"]
        for drop, key in ((0, "same_acc"), (1, "acc_minus_1")):
            sel = select_models(rolls, vanilla, drop)
            if sel is None:
                summary[key] = None
                continue
            r = ratio(sel["l2_p50"], vanilla["l2_p50"])
            summary[key] = {"tag": sel["tag"], "acc": sel["acc"], "val_acc": sel["val_acc"],
                            "l2_p50": sel["l2_p50"], "ratio_l2_p50": r}
            what = "same accuracy" if drop == 0 else "1 % less accuracy"
            shown.append({**sel, "model": f"ROLL at {what}: {model_label(sel)}", "ratio": r})
    else:
        shown += [{**r, "model": model_label(r), "ratio": None} for r in rolls]
    summary["spearman_l1_l2"] = {r["tag"]: r["spearman"] for r in rows}
    columns = ([("model", "Model", fmt), ("best_epoch", "epoch", fmt),
                ("val_acc", "val ACC", percent)]
               + margin_columns()
               + [("ratio", "P50 l2 / vanilla", fmt), ("spearman", "Spearman l1-l2", fmt),
                  ("guarded_l2_p50", "P50 l2, float32 model", fmt),
                  ("guarded_frac", "certified > 0", percent)])
    n = shown[0]["n"] if shown else 0
    notes = [f"ACC, #CLR (distinct Jacobians - distinct activation patterns, Lemma 7) and "
             f"margin percentiles over the {n:,} test points.",
             "Each model at its best validation-loss epoch (ROLL: cross entropy + lam * ROLL "
             "on the validation set). ROLL rows selected on validation: the largest "
             "validation P50 l2 margin among models whose validation accuracy, in whole "
             "percent, is at least vanilla's (same accuracy) or vanilla's minus 1.",
             "Margins: the network in exact arithmetic (the float64 twin, no rounding "
             "guard). 'P50 l2, float32 model' and 'certified > 0': what "
             "keras_roll.certify's default rigor='float64' certifies for the model as "
             "Keras evaluates it in float32 (radii shrunk by its rounding guard).",
             *notes]
    md = write_table(out, name, title, columns, shown, notes)
    write_json(out / "summary.json", summary)
    return md, summary


def runs_table(rows, out: Path, title: str) -> str:
    """Every trained model with the validation numbers the selection saw (`out/runs.md`)."""
    rows = [{**r, "model": model_label(r)} for r in rows]
    columns = [("model", "Model", fmt), ("best_epoch", "epoch", fmt),
               ("val_loss", "val loss", fmt), ("val_acc", "val ACC", percent),
               ("val_l2_p50", "val P50 l2", fmt), ("acc", "test ACC", percent),
               ("l2_p50", "test P50 l2", fmt), ("train_time_s", "train s", fmt)]
    return write_table(out, "runs", title, columns, rows)


def load_stored(path: Path, wanted: dict, resume: bool):
    """The row stored at `path` when `resume` and its `settings` equal `wanted`, else None."""
    if not (resume and path.is_file()):
        return None
    row = json.loads(path.read_text())
    if row.get("settings") != wanted:
        return None
    print(f"== {row.get('tag')}: reusing {path}", flush=True)
    return row
