"""Japanese Vowels: Table 3 and Figure 3 of Lee, Alvarez-Melis & Jaakkola (ICLR 2019).

Trains the paper's recurrent classifier (`keras_roll.models.scornn_classifier`:
Masking + scoRNN with LeakyReLU, 512 hidden units + Dense(9)) on the UCI Japanese
Vowels data embedded in keras_roll (270 training / 370 test sequences of 7-29 frames
of 12 LPC cepstrum coefficients, 9 speakers), vanilla and with exact ROLL, with
AMSGrad (learning rate 0.001) and batch 32. A stratified `--val_fraction` of the
training sequences is held out for validation: each model keeps its best
validation-loss epoch, and ROLL models are selected on validation as for MNIST.
The data are used as loaded (no normalisation), so ROLL and the margins are in
the units of the LPC coefficients.

Writes to `--out`: `table3.md` / `.json` (ACC, #CLR bounds, P25 / P50 / P75 / P100 of
the l1 and l2 margins over the 370 test sequences, ratios to vanilla), `runs.md` /
`.json`, `summary.json`, `figure3_vanilla.png` and `figure3_roll.png` (Figure 3: the
per-coordinate stability bounds of one channel of one test sequence over time) and
`runs/<tag>.*`.

    python -m examples.japanese_vowel --flagfile=examples/configs/japanese_vowel_roll.flags
    python -m examples.japanese_vowel --flagfile=examples/configs/japanese_vowel_roll.flags \\
        --quick
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from tqdm import tqdm  # noqa: E402

import keras_roll  # noqa: E402
from examples import common  # noqa: E402
from keras_roll.data import load_japanese_vowels  # noqa: E402

QUICK = {"units": 64, "epochs": 30}
# Batches are drawn from buckets of similar length and padded to their own longest
# sequence (masked steps create no neurons, so each example's loss is unchanged): exact
# ROLL costs about the square of the padded length, so this is 4-6x faster than padding
# every batch to 26 frames.
BUCKETS = (11, 14, 17, 20, 23)
SETTINGS = ("epochs", "batch_size", "lr", "units", "num_negative_ones", "val_fraction",
            "seed", "data_dir")
WHERE_TO_GET = (
    "The Japanese Vowels data ship with keras_roll (keras_roll/data/japanese_vowels/); "
    "leave --data_dir unset to use them. Otherwise pass --data_dir pointing at a folder "
    "with JapaneseVowels_TRAIN.ts / JapaneseVowels_TEST.ts (sktime/aeon format, "
    "https://timeseriesclassification.com/description.php?Dataset=JapaneseVowels) or the "
    "UCI files ae.train / ae.test (https://archive.ics.uci.edu/dataset/128/japanese+vowels)."
)


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the Japanese Vowels example's flags on `fv`."""
    common.define_common_flags(
        fv, out="runs/japanese_vowel",
        data_help="Folder with JapaneseVowels_TRAIN.ts / _TEST.ts or the UCI ae.train / "
                  "ae.test files; default: the copy embedded in keras_roll.")
    flags.DEFINE_integer("units", 512, "scoRNN hidden units.", flag_values=fv)
    flags.DEFINE_integer("num_negative_ones", None, "-1 entries of the scoRNN's diagonal D "
                         "(rho); unset: units // 10.", flag_values=fv)
    flags.DEFINE_integer("epochs", 80, "Training epochs.", flag_values=fv)
    flags.DEFINE_integer("batch_size", 32, "Batch size.", flag_values=fv)
    flags.DEFINE_float("lr", 1e-3, "AMSGrad learning rate.", flag_values=fv)
    flags.DEFINE_float("val_fraction", 0.2, "Fraction of each speaker's training sequences "
                       "held out for validation.", flag_values=fv)
    flags.DEFINE_bool("vanilla", True, "Train the vanilla model.", flag_values=fv)
    flags.DEFINE_bool("roll", True, "Train the ROLL models of --lam x --C x --gamma.",
                      flag_values=fv)
    flags.DEFINE_list("lam", ["1"], "ROLL weights lambda.", flag_values=fv)
    flags.DEFINE_list("C", ["1"], "ROLL hinge weights C.", flag_values=fv)
    flags.DEFINE_list("gamma", ["100"], "ROLL percentages of neurons kept.", flag_values=fv)
    flags.DEFINE_integer("samples", None, "Sampled ROLL with this many axes per example; "
                         "unset: exact ROLL (the paper's setting here).", flag_values=fv)
    flags.DEFINE_integer("figure_example", 0, "Test sequence drawn in Figure 3.",
                         flag_values=fv)
    flags.DEFINE_integer("figure_channel", 0, "Channel (LPC coefficient) drawn in Figure 3.",
                         flag_values=fv)
    flags.DEFINE_bool("resume", True, "Reuse the results in --out/runs of a model trained "
                      "with the same settings.", flag_values=fv)
    flags.DEFINE_bool("reevaluate", False, "With --resume, certify the stored models again "
                      "(from their weights) instead of reusing their numbers.", flag_values=fv)


def settings(fv) -> dict:
    """The flags a trained model depends on."""
    return {k: getattr(fv, k) for k in SETTINGS}


def load_data(fv):
    """`(train, val, test)` as `(x, y, lengths)` triples; validation is a stratified,
    seeded `--val_fraction` of the training sequences."""
    try:
        x, y, lengths = load_japanese_vowels(fv.data_dir, split="train")
        test = load_japanese_vowels(fv.data_dir, split="test")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e} {WHERE_TO_GET}") from e
    if not 0 <= fv.val_fraction < 1:
        raise ValueError(f"--val_fraction must be in [0, 1), got {fv.val_fraction}.")
    rng = np.random.default_rng(fv.seed)
    held = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        held.extend(idx[:int(round(fv.val_fraction * len(idx)))])
    held = np.sort(np.asarray(held, np.int64))
    kept = np.setdiff1d(np.arange(len(y)), held)
    if len(held) == 0:
        raise ValueError(f"--val_fraction={fv.val_fraction} holds out no sequence; the "
                         f"examples select on validation, use e.g. 0.2.")
    return (x[kept], y[kept], lengths[kept]), (x[held], y[held], lengths[held]), test


def sequence_dataset(x, y, lengths, batch_size: int, seed=None):
    """Batches of sequences of similar length, each padded to its longest sequence
    (`tf.data` `bucket_by_sequence_length`); shuffled every epoch when `seed` is given.

    Example:

    ```python
    train = sequence_dataset(x, y, lengths, 32, seed=0)
    model.fit(train, epochs=10)
    ```
    """
    import tensorflow as tf

    # Keras cannot know the number of bucketed batches in advance, and says so.
    warnings.filterwarnings("ignore", message=".*ran out of data.*")
    warnings.filterwarnings("ignore", message=".*shuffle=True.*tf.data.Dataset.*")
    ds = tf.data.Dataset.from_tensor_slices((x, y, lengths))
    if seed is not None:
        ds = ds.shuffle(len(y), seed=seed, reshuffle_each_iteration=True)
    ds = ds.map(lambda a, b, n: (a[:n], b))
    ds = ds.bucket_by_sequence_length(lambda a, b: tf.shape(a)[0], list(BUCKETS),
                                      [batch_size] * (len(BUCKETS) + 1))
    return ds.prefetch(2)


def configs(fv) -> list[dict]:
    """Vanilla first, then the ROLL grid."""
    out = []
    if fv.vanilla:
        out.append({"tag": "vanilla", "lam": None, "C": None, "gamma": None, "samples": None})
    if fv.roll:
        for lam in common.float_list(fv, "lam"):
            for c in common.float_list(fv, "C"):
                for g in common.float_list(fv, "gamma"):
                    keras_roll.roll.loss.RollConfig(lam=lam, C=c, gamma=g, samples=fv.samples)
                    est = "exact" if fv.samples is None else f"s{fv.samples}"
                    out.append({"tag": f"roll_lam{lam:g}_C{c:g}_gamma{g:g}_{est}", "lam": lam,
                                "C": c, "gamma": g, "samples": fv.samples})
    if not out:
        raise ValueError("Nothing to train: pass --vanilla and/or --roll.")
    return out


def build_model(fv) -> keras.Model:
    """The scoRNN classifier with the flags' sizes."""
    return keras_roll.models.scornn_classifier(units=fv.units,
                                               num_negative_ones=fv.num_negative_ones)


def train_one(cfg: dict, data, fv, out: Path) -> dict:
    """Trains one model (best validation-loss epoch) and evaluates it on the test set."""
    (xtr, ytr, ltr), (xv, yv, lv), (xte, yte, _) = data
    runs = common.output_dir(out / "runs")
    keras.utils.set_random_seed(fv.seed)
    model = build_model(fv)
    if cfg["lam"] is None:
        fit_model = model
    else:
        fit_model = keras_roll.wrap(model, lam=cfg["lam"], C=cfg["C"], gamma=cfg["gamma"],
                                    samples=cfg["samples"],
                                    seed=None if cfg["samples"] is None else fv.seed)
    fit_model.compile(optimizer=keras.optimizers.Adam(fv.lr, amsgrad=True),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    print(f"\n== {cfg['tag']}: scoRNN({fv.units}), {len(xtr)} training sequences, "
          f"{fv.epochs} epochs", flush=True)
    best, history, seconds = common.fit_best(
        model, fit_model, sequence_dataset(xtr, ytr, ltr, fv.batch_size, seed=fv.seed),
        sequence_dataset(xv, yv, lv, fv.batch_size), fv.epochs,
        weights_path=runs / f"{cfg['tag']}.weights.h5")
    print(f"   best validation loss {best.best:.4f} at epoch {best.epoch}", flush=True)
    row = common.result_row(cfg, best, history, seconds, settings(fv))
    return common.evaluate_and_store(model, row, (xv, yv), (xte, yte), runs)


def train_or_load(cfg: dict, data, fv, out: Path) -> dict:
    """A stored result with the same settings (with `--resume`; re-certified with
    `--reevaluate`), else `train_one`."""
    _, (xv, yv, _), (xte, yte, _) = data
    row = common.stored_or_none(out / "runs" / f"{cfg['tag']}.json", settings(fv), fv.resume,
                                fv.reevaluate, lambda: build_model(fv), (xv, yv), (xte, yte))
    return row if row is not None else train_one(cfg, data, fv, out)


def figure3(rows: list[dict], summary: dict, data, fv, out: Path) -> list[Path]:
    """Figure 3: stability bounds of one channel of one test sequence, vanilla and the
    ROLL model selected at the same accuracy (else at 1 % less, else the first)."""
    _, _, (xte, _, lengths) = data
    i, ch = fv.figure_example, fv.figure_channel
    if not 0 <= i < len(xte):
        raise ValueError(f"--figure_example must be in [0, {len(xte)}), got {i}.")
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
    paths, widths = [], {}
    for name, row in chosen:
        keras.utils.set_random_seed(fv.seed)
        model = build_model(fv)
        model.load_weights(out / "runs" / f"{row['tag']}.weights.h5")
        sb = keras_roll.stability_bounds(common.exact_twin(model), x, verbose=False,
                                         rigor="float32")
        width = (sb.upper - sb.lower)[0, :, ch]
        widths[name] = float(np.median(width))
        path = out / f"figure3_{name}.png"
        keras_roll.plots.plot_stability_bounds(
            x[0], sb, channel=ch, channel_name=f"LPC coefficient {ch + 1}",
            title=f"{common.model_label(row)}: stability bounds, test sequence {i}", path=path)
        paths.append(path)
    summary["figure3"] = {"example": i, "channel": ch, "median_width": widths}
    common.write_json(out / "summary.json", summary)
    return paths


def run(fv) -> dict:
    """Runs the example with the parsed flags `fv`; returns what it wrote.

    Example:

    ```python
    fv = common.parse_flags(define_flags, ["--quick", "--out=/tmp/jv"])
    result = run(fv)    # {"table3": markdown, "summary": {...}, "figures": [...], ...}
    ```
    """
    common.quiet_tensorflow()
    out = common.output_dir(fv.out)
    common.apply_quick(fv, QUICK)
    data = load_data(fv)
    rows = [train_or_load(cfg, data, fv, out)
            for cfg in tqdm(configs(fv), desc="models", unit="model", file=sys.stderr)]
    md, summary = common.selected_table(
        rows, out, "table3", f"Table 3: Japanese Vowels, scoRNN({fv.units}) with LeakyReLU",
        notes=["Margins in the units of the LPC coefficients (the data are not normalised).",
               f"Validation: {len(data[1][1])} of the 270 training sequences "
               f"(stratified by speaker)."])
    runs_md = common.runs_table(rows, out, "Japanese Vowels: every trained model")
    figures = figure3(rows, summary, data, fv, out)
    print("\n" + runs_md + "\n" + md)
    for path in figures:
        print(f"Figure 3: {path}")
    print(f"Everything is in {out}/")
    return {"table3": md, "runs": runs_md, "summary": summary, "rows": rows,
            "figures": figures, "out": out}


if __name__ == "__main__":
    common.run_app(define_flags, run)
