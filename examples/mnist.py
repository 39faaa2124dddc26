"""MNIST: Table 1, Figure 2 and Table 2 of Lee, Alvarez-Melis & Jaakkola (ICLR 2019).

Trains the paper's 784-300x4-10 ReLU network (`keras_roll.models.fc`, normalisation
inside the model) on the paper's split (55,000 / 5,000 / 10,000, seeded), vanilla
and with ROLL, with the paper's settings: SGD, learning rate 0.01, Nesterov momentum
0.5, batch 64, 20 epochs, the weights of the best validation-loss epoch; ROLL with
lam 2, gamma 100, C in {0.25, 1}, exact by default (`--samples=k` for Eq. 10).
ROLL's gradients are taken with respect to the normalised input (`--wrt=normalize`),
the units of the paper's hyperparameters; margins are in [0, 1] pixel units (the
paper's sigma x margin).

Writes to `--out`: `table1.md` / `.json` (ACC, #CLR bounds, P25 / P50 / P75 / P100
of the l1 and l2 margins over the test points, for vanilla and for ROLL selected as
the paper does: the largest validation P50 l2 margin at the same and at 1 % lower
validation accuracy, in whole percent), `runs.md` / `.json` (every trained model),
`summary.json` (vanilla accuracy, margin ratios, Spearman l1 / l2), `runs/<tag>.*`
(per-model results, margins and weights; reused by a rerun with the same settings
unless `--noresume`); with `--sweep`, Figure 2 as `figure2_<hyperparameter>.png`;
with `--timing`, Table 2 as `table2.md` / `.json`.

    python -m examples.mnist --flagfile=examples/configs/mnist_roll.flags \\
        --data_dir=../shared/data
    python -m examples.mnist --flagfile=examples/configs/mnist_roll.flags --sweep
    python -m examples.mnist --timing
    python -m examples.mnist --flagfile=examples/configs/mnist_roll.flags --quick
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

import keras_roll  # noqa: E402
from examples import common  # noqa: E402
from keras_roll.data import mnist_splits  # noqa: E402

QUICK = {"train_size": 2000, "val_size": 500, "test_size": 1000, "epochs": 2}
SETTINGS = ("epochs", "batch_size", "lr", "momentum", "depth", "width", "train_size",
            "val_size", "test_size", "seed", "wrt", "init")


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the MNIST example's flags on `fv`."""
    common.define_common_flags(
        fv, out="runs/mnist",
        data_help="MNIST: a Keras-layout mnist.npz or a folder holding it or the four IDX "
                  "files (e.g. ../shared/data). Default: the Keras cache, then a prepared "
                  "tensorflow-datasets copy.")
    flags.DEFINE_integer("epochs", 20, "Training epochs.", flag_values=fv)
    flags.DEFINE_integer("batch_size", 64, "Batch size.", flag_values=fv)
    flags.DEFINE_float("lr", 0.01, "SGD learning rate.", flag_values=fv)
    flags.DEFINE_float("momentum", 0.5, "Nesterov momentum.", flag_values=fv)
    flags.DEFINE_enum("init", "torch", ["torch", "keras"], "Initial weights: 'torch' draws "
                      "kernels and biases from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), PyTorch's "
                      "nn.Linear default used by the paper's released code; 'keras': Glorot "
                      "uniform kernels, zero biases.", flag_values=fv)
    flags.DEFINE_integer("depth", 4, "Hidden layers.", flag_values=fv)
    flags.DEFINE_integer("width", 300, "Units per hidden layer.", flag_values=fv)
    flags.DEFINE_integer("val_size", 5000, "Validation images held out of the 60,000 "
                         "training images.", flag_values=fv)
    flags.DEFINE_integer("train_size", 0, "Use only the first N training images (0: all).",
                         flag_values=fv)
    flags.DEFINE_integer("test_size", 0, "Use only the first N test images (0: all).",
                         flag_values=fv)
    flags.DEFINE_bool("vanilla", True, "Train the vanilla model (the reference row).",
                      flag_values=fv)
    flags.DEFINE_bool("roll", True, "Train the ROLL models of --lam x --C x --gamma.",
                      flag_values=fv)
    flags.DEFINE_list("lam", ["2"], "ROLL weights lambda.", flag_values=fv)
    flags.DEFINE_list("C", ["0.25", "1"], "ROLL hinge weights C.", flag_values=fv)
    flags.DEFINE_list("gamma", ["100"], "ROLL percentages of neurons kept.", flag_values=fv)
    flags.DEFINE_integer("samples", None, "Sampled ROLL (Eq. 10) with this many input axes "
                         "per example; unset: exact ROLL (Eq. 9).", flag_values=fv)
    flags.DEFINE_string("wrt", "normalize", "Take ROLL's gradients with respect to the output "
                        "of this leading layer (the model's Normalization: the paper's "
                        "normalised units); empty: with respect to the [0, 1] pixels.",
                        flag_values=fv)
    flags.DEFINE_bool("sweep", False, "Also train the one-at-a-time grid --sweep_lam, "
                      "--sweep_C, --sweep_gamma around --sweep_base and draw Figure 2.",
                      flag_values=fv)
    flags.DEFINE_list("sweep_lam", ["0.25", "0.5", "1", "2", "4", "8"], "lambda values of "
                      "the sweep.", flag_values=fv)
    flags.DEFINE_list("sweep_C", ["0.25", "0.5", "1", "2", "4"], "C values of the sweep.",
                      flag_values=fv)
    flags.DEFINE_list("sweep_gamma", ["25", "50", "75", "100"], "gamma values of the sweep.",
                      flag_values=fv)
    flags.DEFINE_list("sweep_base", ["2", "1", "100"], "lambda, C, gamma held fixed while "
                      "the sweep varies one of them.", flag_values=fv)
    flags.DEFINE_bool("timing", False, "Only time one train step of each method (Table 2) "
                      "on random data.", flag_values=fv)
    flags.DEFINE_integer("timing_repeats", 20, "Interleaved repetitions of the fast steps "
                         "in --timing (the exact steps run a quarter as many).",
                         flag_values=fv)
    flags.DEFINE_bool("resume", True, "Reuse the results in --out/runs of a model trained "
                      "with the same settings.", flag_values=fv)
    flags.DEFINE_bool("reevaluate", False, "With --resume, certify the stored models again "
                      "(from their weights) instead of reusing their numbers.", flag_values=fv)


# ----------------------------------------------------------------------------- configs


def _tag(lam, C, gamma, samples) -> str:
    if lam is None:
        return "vanilla"
    est = "exact" if samples is None else f"s{samples}"
    return f"roll_lam{lam:g}_C{C:g}_gamma{gamma:g}_{est}"


def configs(fv) -> list[dict]:
    """The models to train: vanilla first, then the ROLL grid (and the sweep)."""
    out = []
    if fv.vanilla:
        out.append({"tag": "vanilla", "lam": None, "C": None, "gamma": None, "samples": None})
    grid = []
    if fv.roll:
        grid += [(lam, c, g) for lam in common.float_list(fv, "lam")
                 for c in common.float_list(fv, "C") for g in common.float_list(fv, "gamma")]
    if fv.sweep:
        base = common.float_list(fv, "sweep_base")
        if len(base) != 3:
            raise ValueError(f"--sweep_base takes lambda,C,gamma, got {fv.sweep_base!r}.")
        for i, name in enumerate(("lam", "C", "gamma")):
            for v in common.float_list(fv, f"sweep_{name}"):
                point = list(base)
                point[i] = v
                grid.append(tuple(point))
    seen = set()
    for lam, c, g in grid:
        if (lam, c, g) in seen:
            continue
        seen.add((lam, c, g))
        keras_roll.roll.loss.RollConfig(lam=lam, C=c, gamma=g, samples=fv.samples)  # validates
        out.append({"tag": _tag(lam, c, g, fv.samples), "lam": lam, "C": c, "gamma": g,
                    "samples": fv.samples})
    if not out:
        raise ValueError("Nothing to train: pass --vanilla and/or --roll (or --sweep).")
    return out


def settings(fv) -> dict:
    """The flags a trained model depends on (a stored result is reused only if they match)."""
    return {k: getattr(fv, k) for k in SETTINGS}


def load_data(fv):
    """The paper's split, cut to `--train_size` / `--val_size` / `--test_size`."""
    (xtr, ytr), (xv, yv), (xte, yte) = mnist_splits(fv.data_dir, seed=fv.seed,
                                                    val=fv.val_size)
    if fv.train_size:
        xtr, ytr = xtr[:fv.train_size], ytr[:fv.train_size]
    if fv.test_size:
        xte, yte = xte[:fv.test_size], yte[:fv.test_size]
    return (xtr, ytr), (xv, yv), (xte, yte)


# ----------------------------------------------------------------------------- training


def build_model(fv) -> keras.Model:
    """The paper's network with `--depth` x `--width` hidden units and `--init` weights
    (seeded with `--seed`, so every model starts from the same weights)."""
    keras.utils.set_random_seed(fv.seed)
    model = keras_roll.models.fc(depth=fv.depth, width=fv.width)
    if fv.init == "torch":
        rng = np.random.default_rng(fv.seed)
        for layer in model.layers:
            if isinstance(layer, keras.layers.Dense):
                kernel, bias = layer.get_weights()
                limit = 1.0 / np.sqrt(kernel.shape[0])
                layer.set_weights([rng.uniform(-limit, limit, kernel.shape).astype(kernel.dtype),
                                   rng.uniform(-limit, limit, bias.shape).astype(bias.dtype)])
    return model


def train_one(cfg: dict, data, fv, out: Path) -> dict:
    """Trains one model, restores its best validation-loss epoch and evaluates it.

    Returns its row; writes `runs/<tag>.json`, `.npz` (test margins) and `.weights.h5`.
    """
    (xtr, ytr), (xv, yv), (xte, yte) = data
    runs = common.output_dir(out / "runs")
    model = build_model(fv)
    if cfg["lam"] is None:
        fit_model = model
    else:
        # evaluate() computes ROLL too: val_loss = cross entropy + lam * ROLL, the
        # training objective, whose best epoch BestValLoss keeps (as the paper's code).
        fit_model = keras_roll.wrap(model, wrt=fv.wrt or None, lam=cfg["lam"], C=cfg["C"],
                                    gamma=cfg["gamma"], samples=cfg["samples"],
                                    seed=None if cfg["samples"] is None else fv.seed)
    fit_model.compile(
        optimizer=keras.optimizers.SGD(fv.lr, momentum=fv.momentum, nesterov=True),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    print(f"\n== {cfg['tag']}: {len(xtr)} training images, {fv.epochs} epochs", flush=True)
    best, history, seconds = common.fit_best(model, fit_model, (xtr, ytr), (xv, yv),
                                             fv.epochs, fv.batch_size,
                                             runs / f"{cfg['tag']}.weights.h5")
    print(f"   best validation loss {best.best:.4f} at epoch {best.epoch}", flush=True)
    row = common.result_row(cfg, best, history, seconds, settings(fv))
    return common.evaluate_and_store(model, row, (xv, yv), (xte, yte), runs)


def train_or_load(cfg: dict, data, fv, out: Path) -> dict:
    """A stored result with the same settings (with `--resume`; re-certified with
    `--reevaluate`), else `train_one`."""
    _, val, test = data
    row = common.stored_or_none(
        out / "runs" / f"{cfg['tag']}.json", settings(fv), fv.resume, fv.reevaluate,
        lambda: build_model(fv), val, test)
    return row if row is not None else train_one(cfg, data, fv, out)


# ----------------------------------------------------------------------------- tables


def figure2(rows: list[dict], fv, out: Path) -> list[Path]:
    """Figure 2: test margin percentiles and accuracy against each swept hyperparameter."""
    base = dict(zip(("lam", "C", "gamma"), common.float_list(fv, "sweep_base")))
    paths = []
    for name, label in (("lam", "lambda"), ("C", "C"), ("gamma", "gamma (%)")):
        pts = [r for r in rows if r["lam"] is not None
               and all(r[k] == base[k] for k in base if k != name)]
        pts.sort(key=lambda r: r[name])
        if len(pts) < 2:
            continue
        margins = [np.load(out / "runs" / f"{r['tag']}.npz")["l2"] for r in pts]
        path = out / f"figure2_{name}.png"
        others = ", ".join(f"{k}={v:g}" for k, v in base.items() if k != name)
        keras_roll.plots.plot_margin_tradeoff(
            [r[name] for r in pts], margins, [r["acc"] for r in pts], hyperparameter=label,
            title=f"MNIST: test l2 margin and accuracy against {label} ({others})", path=path)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- Table 2


def timing(fv, out: Path) -> str:
    """Table 2: one train step of vanilla, exact ROLL by back-propagation and by
    perturbation, and sampled ROLL with 3 axes, timed in one run (interleaved medians)."""
    import tensorflow as tf

    from benchmarks import roll_steps
    from benchmarks._util import interleaved_medians

    b = fv.batch_size
    model = roll_steps.build()
    lin = keras_roll.linearize(model)
    rng = np.random.default_rng(fv.seed)
    x = tf.constant(rng.uniform(0, 1, size=(b, roll_steps.D)).astype("float32"))
    y = tf.constant(rng.integers(0, roll_steps.L, size=b).astype("int32"))
    fast = {"vanilla": roll_steps.vanilla_step(model),
            "ROLL, 3 sampled axes (Eq. 10)": roll_steps.roll_step(model, lin, samples=3)}
    slow = {"exact ROLL, back-propagation (tf.GradientTape.batch_jacobian)":
            roll_steps.autodiff_step(model),
            "exact ROLL, perturbation (keras_roll)": roll_steps.roll_step(model, lin)}
    reps = 3 if fv.quick else fv.timing_repeats
    times = interleaved_medians(
        {k: (lambda s=roll_steps.compile_step(s, b): s(x, y).numpy()) for k, s in fast.items()},
        repeats=reps)
    times.update(interleaved_medians(
        {k: (lambda s=roll_steps.compile_step(s, b): s(x, y).numpy()) for k, s in slow.items()},
        repeats=max(1, reps // 4), warmup=1))
    order = ["vanilla", *slow, "ROLL, 3 sampled axes (Eq. 10)"]
    base = times["vanilla"]
    rows = [{"method": k, "ms": 1e3 * times[k], "ratio": times[k] / base} for k in order]
    rows.append({"method": "back-propagation / perturbation", "ms": None,
                 "ratio": times[order[1]] / times[order[2]]})
    notes = [f"784-300x4-10 ReLU, batch {b}, SGD, lam={roll_steps.LAM:g}, C={roll_steps.C:g}, "
             f"gamma=100; median of interleaved repetitions in one run; {os.cpu_count()} CPU "
             f"cores, TensorFlow {tf.__version__}, {len(tf.config.list_physical_devices('GPU'))}"
             f" GPU(s). Steps from benchmarks/roll_steps.py (as benchmarks/step_time.py)."]
    return common.write_table(out, "table2", "Table 2: time of one training step",
                              [("method", "Method", common.fmt), ("ms", "ms / step", common.fmt),
                               ("ratio", "x vanilla", common.fmt)], rows, notes)


# ----------------------------------------------------------------------------- main


def run(fv) -> dict:
    """Runs the example with the parsed flags `fv`; returns what it wrote.

    Example:

    ```python
    fv = common.parse_flags(define_flags, ["--quick", "--data_dir=../shared/data"])
    result = run(fv)       # {"table1": markdown, "summary": {...}, "rows": [...], ...}
    ```
    """
    common.quiet_tensorflow()
    out = common.output_dir(fv.out)
    if fv.timing:
        md = timing(fv, out)
        print(md)
        return {"table2": md, "out": out}
    common.apply_quick(fv, QUICK)
    data = load_data(fv)
    todo = configs(fv)
    rows = [train_or_load(cfg, data, fv, out)
            for cfg in tqdm(todo, desc="models", unit="model", file=sys.stderr)]
    md, summary = common.selected_table(
        rows, out, "table1", "Table 1: MNIST, 784-300x4-10 ReLU network",
        notes=["Margins in [0, 1] pixel units (the paper's sigma x margin)."])
    runs_md = common.runs_table(rows, out, "MNIST: every trained model")
    figures = figure2(rows, fv, out) if fv.sweep else []
    print("\n" + runs_md + "\n" + md)
    for path in figures:
        print(f"Figure 2: {path}")
    print(f"Everything is in {out}/")
    return {"table1": md, "runs": runs_md, "summary": summary, "rows": rows,
            "figures": figures, "out": out}


if __name__ == "__main__":
    common.run_app(define_flags, run)
