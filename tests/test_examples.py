"""The examples (toy2d, mnist, japanese_vowel, demo) and what they share.

Fast: the shared helpers against hand-computed values (Spearman, the selection and its
"none qualified" rows, the best-epoch keeper, the last-epoch warning, tables, the
config flags and `--quick`), the distance regularizer against `keras_roll.certify`
and finite differences, every flagfile and bad flag (absl refuses it while parsing),
one-line errors from the command line (subprocesses), and each example end to end at
tiny sizes: MNIST on another IDX data set (its name, classes and normalisation from
the data and the flags), Japanese Vowels and the toy task. Slow: the full toy task,
the MNIST sweep and timing, Japanese Vowels with ROLL and the demo.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import flags

import keras_roll
from examples.common import app, config_flags, search, selection, tables, training
from examples.common.margin_stats import spearman
from examples.common.runs import ModelSpec, data_fingerprint, gather_stored, model_specs
from examples.demo import main as demo
from examples.japanese_vowel import input_pipeline as jv_input
from examples.japanese_vowel import main as jv
from examples.mnist import main as mnist
from examples.mnist import train as mnist_train
from examples.mnist.configs import default as mnist_default
from examples.mnist.configs import quick as mnist_quick
from examples.toy2d import distance
from examples.toy2d import main as toy2d

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "configs"
# Real MNIST (mnist.npz), where the checkout has it beside it or $KERAS_ROLL_TEST_DATA says.
SHARED_DATA = Path(os.environ.get("KERAS_ROLL_TEST_DATA", REPO.parent / "shared" / "data"))
PNG = b"\x89PNG\r\n\x1a\n"
parse = config_flags.parse_flags


# ----------------------------------------------------------------------------- helpers


def _parse_markdown_tables(text):
    """[(header cells, rows of cells)] of every Markdown table in `text`; asserts that
    each has a separator row and rows as wide as the header."""
    found, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if block:
            head, rule, *rows = block
            assert all(set(c) <= set("-:") and c for c in rule), rule
            assert len(rule) == len(head)
            for r in rows:
                assert len(r) == len(head), (head, r)
            found.append((head, rows))
            block = []
    return found


def _check_table(out, name, n_rows=None):
    md = (out / f"{name}.md").read_text()
    parsed = _parse_markdown_tables(md)
    assert len(parsed) == 1
    head, rows = parsed[0]
    data = json.loads((out / f"{name}.json").read_text())
    assert [c["header"] for c in data["columns"]] == head
    assert len(data["rows"]) == len(rows)
    if n_rows is not None:
        assert len(rows) == n_rows
    return head, rows, data


def _is_png(path):
    return Path(path).is_file() and Path(path).read_bytes()[:8] == PNG


def _digits(n, classes, rng):
    """Digit-like random images: class k lights up row band k, so a net can learn it."""
    y = rng.integers(0, classes, n).astype(np.uint8)
    x = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
    for i, k in enumerate(y):
        x[i, 2 + 2 * k: 4 + 2 * k, 4:24] = 250
    return x, y


def _write_idx(file, array):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim)
    header += b"".join(struct.pack(">I", s) for s in array.shape)
    with gzip.open(file, "wb") as f:
        f.write(header + array.astype(">u1").tobytes())


@pytest.fixture(scope="module")
def idx_folder(tmp_path_factory):
    """Another IDX data set: 5 classes, 300 training and 40 test images of 28 x 28."""
    folder = tmp_path_factory.mktemp("data") / "bands5"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 300), ("t10k", 40)):
        x, y = _digits(n, 5, rng)
        _write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", x)
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", y)
    return folder


def _env():
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")


# ----------------------------------------------------------------------------- common


def test_spearman_hand_computed():
    assert spearman([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties: ranks of a are (0, 1.5, 1.5, 3), of b (0, 1, 2, 3); Pearson of the ranks
    # = 4.5 / sqrt(4.5 * 5) by hand.
    assert spearman([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(4.5 / np.sqrt(22.5))
    # Monotone transforms do not change it; inf pairs are dropped.
    a = np.array([0.3, 0.1, 0.7, 0.2, np.inf])
    assert spearman(a, np.exp(a)) == pytest.approx(1.0)
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))


def _row(tag, val_acc, val_l2, lam=2.0):
    return {"tag": tag, "lam": lam, "C": 1.0, "gamma": 100.0, "estimator": "exact",
            "val_acc": val_acc, "val_l2_p50": val_l2, "acc": val_acc, "l2_p50": val_l2,
            "n": 10, "spearman": 0.9, "best_epoch": 3, "epochs": 3}


def test_selection_whole_percent_and_why():
    vanilla = _row("vanilla", 0.9812, 1.0, lam=None)
    rows = [_row("a", 0.9760, 5.0),   # 98 %: same accuracy
            _row("b", 0.9790, 3.0),   # 98 %
            _row("c", 0.9720, 9.0),   # 97 %: 1 % less
            _row("d", 0.9500, 99.0)]  # 95 %: out
    same = selection.select(rows, vanilla, drop=0)
    assert same.row["tag"] == "a" and same.cutoff == 98
    assert selection.select(rows, vanilla, drop=1).row["tag"] == "c"
    none = selection.select(rows[3:], vanilla, drop=1)
    assert none.row is None and none.cutoff == 97
    assert "no ROLL model reaches validation accuracy 97 %" in none.reason
    assert "d 95 %" in none.reason


def test_selected_table_says_when_no_roll_model_qualifies(tmp_path, capsys):
    vanilla = _row("vanilla", 0.98, 1.0, lam=None)
    rows = [vanilla, _row("roll_a", 0.90, 4.0), _row("roll_b", 0.97, 2.0)]
    md, summary = selection.selected_table(rows, tmp_path, "t", "T")
    log = capsys.readouterr().out
    assert "ROLL at same accuracy: no ROLL model reaches validation accuracy 98 %" in log
    assert "roll_a 90 %, roll_b 97 %" in log
    _, shown, data = _check_table(tmp_path, "t", n_rows=3)
    assert shown[1][0].startswith("ROLL at same accuracy: none qualified (needs validation "
                                  "ACC >= 98 %")
    assert set(shown[1][1:]) == {"-"}  # no numbers in a row without a model
    assert shown[2][0] == "ROLL at 1 % less accuracy: ROLL (lam=2, C=1, gamma=100, exact)"
    assert summary["same_acc"] is None and summary["acc_minus_1"]["tag"] == "roll_b"
    assert summary["acc_minus_1"]["ratio_l2_p50"] == pytest.approx(2.0)
    runs_md = selection.runs_table(rows, tmp_path, "every model")
    head, runs, _ = _check_table(tmp_path, "runs", n_rows=3)
    for column in ("#CLR", "Spearman l1-l2", "P50 l2, float32 model", "certified > 0",
                   "l1 P100", "val P50 l2"):
        assert column in head
    assert runs[1][1] == "3 of 3" and "roll_a: the best validation loss is at its last" in runs_md


def test_best_val_loss_restores_the_best_epoch(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    best = training.BestValLoss(model, path=tmp_path / "best.weights.h5")
    best.set_model(model)
    saved = {}
    for epoch, loss in enumerate([0.9, 0.4, 0.7, float("nan"), 0.5]):
        model.set_weights([w + 1.0 for w in model.get_weights()])
        saved[epoch] = [w.copy() for w in model.get_weights()]
        best.on_epoch_end(epoch, {"val_loss": loss, "loss": 1.0})
    assert best.epoch == 2 and best.best == pytest.approx(0.4)
    best.restore()
    for w, ref in zip(model.get_weights(), saved[1]):
        np.testing.assert_array_equal(w, ref)
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    other.load_weights(tmp_path / "best.weights.h5")
    for w, ref in zip(other.get_weights(), saved[1]):
        np.testing.assert_array_equal(w, ref)
    with pytest.raises(KeyError, match="validation_data"):
        best.on_epoch_end(5, {"loss": 1.0})
    assert training.last_epoch_warning(2, 5, "m") is None
    assert "m: the best validation loss is at the last epoch (5 of 5)" in (
        training.last_epoch_warning(5, 5, "m"))


def test_array_dataset_batches_every_example_once_reshuffled_per_epoch():
    x = np.arange(10, dtype="float32")[:, None] * np.ones((1, 3), "float32")
    y = np.arange(10)
    ds = training.array_dataset(x, y, 4, seed=3)
    # No autotuning: with it, `fit` waited at epoch ends for its thread.
    assert ds.options().autotune.enabled is False
    epochs = [[(xb.numpy(), yb.numpy()) for xb, yb in ds] for _ in range(2)]
    for batches in epochs:
        assert [len(yb) for _, yb in batches] == [4, 4, 2]  # the last batch is short
        for xb, yb in batches:
            np.testing.assert_array_equal(xb[:, 0], yb)      # pairs stay together
        assert sorted(np.concatenate([yb for _, yb in batches])) == list(range(10))
    orders = [np.concatenate([yb for _, yb in b]) for b in epochs]
    assert not np.array_equal(orders[0], orders[1])          # reshuffled per epoch
    again = np.concatenate([yb.numpy() for _, yb in training.array_dataset(x, y, 4, seed=3)])
    np.testing.assert_array_equal(again, orders[0])          # the seed fixes the order
    kept = np.concatenate([yb.numpy() for _, yb in training.array_dataset(x, y, 4)])
    np.testing.assert_array_equal(kept, y)                   # no seed: the order kept
    with pytest.raises(ValueError, match="same number of examples; got 10 and 9"):
        training.array_dataset(x, y[:9], 4)
    with pytest.raises(ValueError, match="batch_size must be a positive integer; got 0"):
        training.array_dataset(x, y, 0)


def test_fit_best_on_arrays_is_seeded_and_keeps_the_best_epoch(recwarn):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 3)).astype("float32"), rng.integers(0, 2, 40)
    val = (x[:8], y[:8])

    def run(seed):
        keras.utils.set_random_seed(0)  # the same initial weights
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        fit = training.fit_best(model, model, (x, y), val, 3, 8, verbose=0, seed=seed)
        return model, fit

    model, fit = run(seed=1)
    assert len(fit.history["loss"]) == 3 and fit.seconds > 0
    # the dataset shuffles itself: Keras is not asked to (and does not warn)
    assert not [w for w in recwarn if "shuffle" in str(w.message)]
    assert fit.best.best == pytest.approx(min(fit.history["val_loss"]))
    # the restored weights are the best epoch's: evaluate gives its validation loss
    assert model.evaluate(*val, batch_size=8, verbose=0) == pytest.approx(fit.best.best,
                                                                          rel=1e-5)
    same, _ = run(seed=1)
    other, _ = run(seed=2)
    for a, b in zip(model.get_weights(), same.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b)
               for a, b in zip(model.get_weights(), other.get_weights()))
    with pytest.raises(ValueError, match="array data needs a batch_size; got None"):
        training.fit_best(model, model, (x, y), val, 1, None, verbose=0)


def test_log_lines_do_not_run_into_a_progress_bar(monkeypatch):
    """A terminal shows stdout and stderr on one screen: a line printed while a bar is
    drawn must start a line of its own (what the terminal shows after the last '\\r')."""
    from tqdm import tqdm

    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    bar = tqdm(total=10, desc="certify", file=sys.stderr, mininterval=0)
    bar.update(4)
    app.log("== a line")
    bar.update(6)
    bar.close()
    shown = [line.split("\r")[-1] for line in screen.getvalue().split("\n")]
    assert "== a line" in shown
    # and the examples never print() past app.log
    for path in (REPO / "examples").rglob("*.py"):
        tree = ast.parse(path.read_text())
        calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", None) == "print"]
        assert calls == [], f"{path}: print() at lines {calls}; use examples.common.app.log"


def test_tables_format_and_strict_json(tmp_path):
    assert tables.fmt(0.001234) == "1.23e-03" and tables.fmt(12345.6) == "12,346"
    assert tables.fmt(None) == "-" and tables.fmt(True) == "yes" and tables.fmt(7) == "7"
    assert tables.percent(0.98765) == "98.77 %"
    tables.write_json(tmp_path / "x.json", {"a": np.float32(np.inf), "b": (1, np.int64(2)),
                                            "c": mnist_default.Init.torch})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": None, "b": [1, 2],
                                                              "c": "torch"}


def test_model_specs():
    specs = model_specs(True, [(2.0, 1.0, 100.0), (2.0, 1.0, 100.0), (0.5, 1.0, 50.0)], 3)
    assert [s.tag for s in specs] == ["vanilla", "roll_lam2_C1_gamma100_s3",
                                      "roll_lam0.5_C1_gamma50_s3"]
    assert specs[1].estimator == "3 axes" and not specs[0].is_roll
    assert ModelSpec.roll(1.0, 0.25, 100.0).tag == "roll_lam1_C0.25_gamma100_exact"
    with pytest.raises(ValueError, match="Nothing to train"):
        model_specs(False, [], None)


def test_validation_loss_is_the_objective_in_normalised_units():
    """What the MNIST example selects epochs by: the wrapped model's evaluate loss is
    cross entropy + lam * ROLL, with ROLL w.r.t. the Normalization layer's output equal
    to ROLL of the network without the layer on normalised inputs (the paper's units)."""
    keras.utils.set_random_seed(1)
    model = keras_roll.models.fc(input_shape=(12,), depth=2, width=8, classes=3,
                                 normalize=(0.3, 0.2))
    body = keras_roll.models.fc(input_shape=(12,), depth=2, width=8, classes=3,
                                normalize=None)
    body.set_weights(model.get_weights())  # Normalization has no weights in the list
    x = np.random.default_rng(0).uniform(0, 1, (5, 12)).astype("float32")
    y = np.array([0, 1, 2, 1, 0])
    reference = keras_roll.roll_loss(body, (x - 0.3) / 0.2, C=1.0).numpy()
    raw = keras_roll.roll_loss(model, x, C=1.0).numpy()
    assert not np.allclose(raw, reference, rtol=1e-3)  # raw units differ (1 / 0.2^2)
    wrapped = keras_roll.wrap(model, wrt="normalize", lam=2.0, C=1.0)
    wrapped.compile(loss="sparse_categorical_crossentropy")
    ce = keras.losses.sparse_categorical_crossentropy(y, model(x)).numpy().mean()
    logs = wrapped.evaluate(x, y, batch_size=5, verbose=0, return_dict=True)
    assert logs["loss"] == pytest.approx(ce + 2.0 * reference.mean(), rel=1e-4)
    assert logs["roll_loss"] == pytest.approx(reference.mean(), rel=1e-4)


# ----------------------------------------------------------------------------- --search


def _falling(rate, noise=()):
    """A fake training: validation accuracy 0.9812 - rate * lam (plus fixed noise per
    call), recording the lams it was asked for."""
    calls = []

    def val_acc_of(lam):
        calls.append(lam)
        return 0.9812 - rate * lam + (noise[len(calls) - 1] if len(calls) <= len(noise) else 0)
    return val_acc_of, calls


@pytest.mark.parametrize("rate, start", [(0.004, 2.0), (0.03, 2.0), (0.0005, 2.0),
                                         (0.004, 0.1)])
def test_bisection_finds_the_largest_lam_that_meets_the_target(rate, start):
    """Accuracy falls linearly with lam; the target is 97 % (98 % minus 1). By hand,
    round(100 * (0.9812 - rate * lam)) >= 97 holds for lam <= (0.9812 - 0.965) / rate,
    so the answer lies in [lam, upper) around that edge: met below, missed above."""
    val_acc_of, calls = _falling(rate)
    edge = (0.9812 - 0.965) / rate
    result = search.bisect_lam(val_acc_of, cutoff=97, start=start, steps=8)
    assert len(calls) == len(set(calls)) <= 8
    assert result.lam is not None and result.lam <= edge
    assert search.meets(dict(result.tried)[result.lam], 97)
    assert result.upper is not None and result.upper > edge
    assert not search.meets(dict(result.tried)[result.upper], 97)
    assert result.upper / result.lam < 4 ** 0.25  # the x4 bracket halved (in log) twice


def test_bisection_goes_down_when_the_papers_lam_is_too_strong():
    """Fashion-MNIST-like: at the start lam every model is points below vanilla; the
    search lowers lam (a recipe that raises it goes the wrong way)."""
    val_acc_of, calls = _falling(0.025)  # lam 2: 93 %, 5 points below 98 %
    result = search.bisect_lam(val_acc_of, cutoff=98, start=2.0, steps=4)
    assert calls[0] == 2.0 and all(lam < 2.0 for lam in calls[1:])
    assert result.lam is not None and result.lam < 2.0 and result.upper <= 2.0
    assert round(100 * (0.9812 - 0.025 * result.lam)) >= 98


def test_bisection_reuses_known_models_and_reports_a_miss():
    known = {1.0: 0.90, 0.25: 0.91}  # both miss 98 %
    val_acc_of, calls = _falling(0.5)  # everything tried misses too
    result = search.bisect_lam(val_acc_of, cutoff=98, start=1.0, steps=2, known=known)
    assert calls == [0.0625, 0.0156] and result.lam is None and result.upper == 0.0156
    with pytest.raises(ValueError, match="start must be a positive lam"):
        search.bisect_lam(val_acc_of, cutoff=98, start=0.0, steps=2)


def test_search_rows_meet_each_table_row(capsys):
    """Both rows (same accuracy, 1 % less) get a lam whose row meets its target, and
    the selection picks exactly those models."""
    def train_roll(lam):
        acc = 0.9812 - 0.006 * lam
        return {"tag": f"roll_lam{lam:g}", "lam": lam, "val_acc": acc, "acc": acc,
                "val_l2_p50": lam, "l2_p50": lam}

    vanilla = {"tag": "vanilla", "lam": None, "val_acc": 0.9812, "acc": 0.9812}
    rows = search.search_rows(train_roll, vanilla, start=2.0, steps=5)
    same = selection.select(rows, vanilla, 0).row
    less = selection.select(rows, vanilla, 1).row
    assert round(100 * same["val_acc"]) >= 98 and round(100 * less["val_acc"]) >= 97
    assert less["lam"] > same["lam"]
    assert "--search, ROLL at same accuracy (validation accuracy >= 98 %): lam" in \
        capsys.readouterr().out


# ----------------------------------------------------------------------------- config flags


def test_quick_is_a_config_and_set_flags_win():
    def config(*argv):
        return mnist.get_config(parse(mnist.define_flags, list(argv)))

    paper = config(f"--flagfile={CONFIGS / 'mnist_roll.flags'}")
    assert paper == mnist_default.Config(dataset="MNIST", normalize="0.1307,0.3081")
    assert (paper.epochs, paper.batch_size, paper.lr, paper.momentum, paper.width) == (
        20, 64, 0.01, 0.5, 300)
    assert paper.lam == (2.0,) and paper.C == (0.25, 1.0) and paper.samples is None
    fast = config(f"--flagfile={CONFIGS / 'mnist_roll.flags'}", "--quick")
    assert fast == dataclasses.replace(mnist_quick.get_config(), dataset="MNIST",
                                       normalize="0.1307,0.3081")
    # a flag that is set wins over the quick config, even at the paper's value
    mine = config("--quick", "--lr=0.01", "--lam=2", "--init=TORCH")
    assert (mine.lr, mine.lam, mine.width) == (0.01, (2.0,), mnist_quick.get_config().width)
    assert mine.init == mnist_default.Init.torch


EXAMPLE_MAINS = ("mnist", "compare", "toy2d", "japanese_vowel", "robustness", "caltech256")


@pytest.mark.parametrize("name", EXAMPLE_MAINS)
def test_every_example_defines_its_flags_in_one_call(name):
    """`define_example_flags` gives every example `--quick`, `--out` (its own default),
    one flag per config field and, where it reads a path, the `--data_dir` check; no
    example repeats the preamble."""
    import importlib
    import inspect

    main = importlib.import_module(f"examples.{name}.main")
    default = importlib.import_module(f"examples.{name}.configs.default")
    source = inspect.getsource(main)
    assert "define_example_flags(" in source and "example_config(" in source
    for preamble in ("define_run_flags(", "define_config_flags(", "config_from_flags("):
        assert preamble not in source, preamble
    fv = flags.FlagValues()
    main.define_flags(fv)
    fields = {f.name for f in dataclasses.fields(default.get_config())}
    assert {"quick", "out"} | fields <= set(fv)
    assert fv["out"].default == f"runs/{name}"


def test_define_example_flags_checks_the_data_path(tmp_path):
    def define(fv):
        config_flags.define_example_flags(fv, mnist_default.get_config, out="runs/x",
                                          data_dir=config_flags.MNIST_PATH)

    assert parse(define, [f"--data_dir={tmp_path}"]).data_dir == str(tmp_path)
    with pytest.raises(flags.IllegalFlagValueError, match="does not exist; pass a Keras-layout"):
        parse(define, [f"--data_dir={tmp_path / 'nothing'}"])
    fv = parse(define, ["--quick", "--epochs=3"])
    config = config_flags.example_config(fv, mnist_default.get_config, mnist_quick.get_config)
    assert config == dataclasses.replace(mnist_quick.get_config(), epochs=3)


def test_data_lives_in_common():
    """`Data` is examples.common.data's, used by MNIST, the comparison and the radii."""
    from examples.common import data
    from examples.compare import measure
    from examples.compare import train as compare_train
    from examples.mnist import input_pipeline

    assert mnist_train.Data is data.Data and compare_train.Data is data.Data
    assert measure.Data is data.Data
    assert not hasattr(input_pipeline, "Data") or input_pipeline.Data is data.Data


@pytest.mark.parametrize("module, name", [
    (mnist, "mnist_vanilla"), (mnist, "mnist_roll"), (mnist, "mnist_exact"),
    (mnist, "mnist_lam_grid"), (toy2d, "toy2d"), (jv, "japanese_vowel_vanilla"),
    (jv, "japanese_vowel_roll"), (jv, "japanese_vowel_exact")])
def test_flagfiles_parse(module, name):
    fv = parse(module.define_flags, [f"--flagfile={CONFIGS / (name + '.flags')}"])
    assert fv.out.startswith("runs/")
    module.get_config(fv)


@pytest.mark.parametrize("module, argv, message", [
    (mnist, ["--epochs=0"], "--epochs=0: 0 is not a positive integer"),
    (mnist, ["--C=1,abc"], "takes comma-separated numbers, got 'abc'"),
    (mnist, ["--lam=-1"], "-1 is below the lower bound 0"),
    (mnist, ["--gamma=0"], "--gamma must be > 0"),
    (mnist, ["--init=xavier"], "value should be one of <torch|keras>"),
    (mnist, ["--normalize=0.5"], "--normalize takes 'mean,std'"),
    (mnist, ["--sweep_base=2,1"], "--sweep_base takes three numbers"),
    (mnist, ["--novanilla", "--noroll"], "Nothing to train"),
    (mnist, ["--data_dir=/no/such/folder"], "--data_dir does not exist"),
    (mnist, ["--wrt=nosuchlayer", "--depth=1"],
     "flag --wrt=nosuchlayer: the model has no layer 'nosuchlayer'; its layers are pixels, "
     "normalize, dense_1, relu_1, predictions"),
    (mnist, ["--normalize=none"], "flag --wrt=normalize: the model has no layer"),
    (toy2d, ["--kind=moons"], "value should be one of <circles|spirals|xor>"),
    (toy2d, ["--models=vanilla,foo"], "--models takes a comma-separated subset"),
    (toy2d, ["--C=0"], "--C must be > 0"),
    (jv, ["--val_fraction=0"], "--val_fraction must be > 0"),
    (jv, ["--figure_channel=12"], "is not an integer in the range [0, 11]"),
    (jv, ["--novanilla", "--noroll"], "Nothing to train"),
])
def test_bad_flags_are_refused_while_parsing(module, argv, message):
    with pytest.raises(flags.IllegalFlagValueError) as err:
        parse(module.define_flags, argv)
    assert message in str(err.value)


def test_command_line_errors_are_one_line(idx_folder, tmp_path):
    """Bad flags stop the example before any work, with one line and no traceback: a
    layer name the built model lacks (an absl validator; the Caltech-256 validators
    print the same way and are checked in-process in test_caltech256_example.py), and
    a problem `main` finds before its work (a `UsageError`). `app.run` (every
    `python -m examples.<name>`) has turned op determinism on before `main` (asked of
    a stand-in `tensorflow` module that records the call: loading TensorFlow would
    cost the child seconds); `train_and_evaluate` in Python leaves it to the caller."""
    usage = ("import sys, types\n"
             "calls = []\n"
             "experimental = types.SimpleNamespace(\n"
             "    enable_op_determinism=lambda: calls.append('determinism'))\n"
             "sys.modules['tensorflow'] = types.SimpleNamespace(\n"
             "    config=types.SimpleNamespace(experimental=experimental))\n"
             "from absl import flags\n"
             "from examples.common import app\n"
             "def define(fv):\n"
             "    app.define_run_flags(fv, out='x')\n"
             "def main(fv):\n"
             "    print('determinism', calls == ['determinism'])\n"
             "    raise app.UsageError('no data in ' + fv.out + '; pass --data_dir')\n"
             "app.run(define, main)\n")
    runs = [([sys.executable, "-m", "examples.mnist", f"--data_dir={idx_folder}",
              "--wrt=nosuchlayer"], "FATAL Flags parsing error: flag --wrt=nosuchlayer: "
                                    "the model has no layer 'nosuchlayer'"),
            ([sys.executable, "-c", usage, f"--out={tmp_path}"],
             f"FATAL Usage error: no data in {tmp_path}; pass --data_dir")]
    procs = [subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv, _ in runs]
    outs = []
    for proc, (_, expected) in zip(procs, runs):
        out, err = proc.communicate(timeout=300)
        outs.append(out)
        assert proc.returncode == 1, err[-2000:]
        assert "Traceback" not in err and expected in err, err[-2000:]
        assert len([line for line in err.splitlines() if line.startswith("FATAL")]) == 1
    assert "determinism True" in outs[1], outs[1]


# Runs an example's __main__ as `python -m` does and reports, on exit, whether
# TensorFlow was imported: flags and paths must be checked before it loads.
_PROBE = ("import atexit, runpy, sys\n"
          "atexit.register(lambda: sys.stderr.write("
          "f'tensorflow imported: {\"tensorflow\" in sys.modules}\\n'))\n"
          "sys.argv = sys.argv[1:]\n"
          "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n")
_EPOCHS = (["--epochs=0"], "flag --epochs=0: 0 is not a positive integer")
_NO_DATA = (["--data_dir=/no/such/folder"], "flag --data_dir=/no/such/folder: ")
# By default each example once (a missing --data_dir where it reads one) and the flags
# checked against other flags; the rest with `make test-all`.
_BEFORE_TF = [("toy2d", *_EPOCHS), ("demo", *_EPOCHS)] + [
    (name, *_NO_DATA) for name in ("mnist", "japanese_vowel", "caltech256", "robustness")] + [
    ("mnist", ["--quick", "--wrt=nosuchlayer"], "the model has no layer 'nosuchlayer'"),
    ("mnist", ["--normalize=0.5"], "--normalize takes 'mean,std'"),
    ("caltech256", ["--quick", "--lr_decay_epochs=2.5"], "--lr_decay_epochs takes whole"),
]
_BEFORE_TF_SLOW = [(name, *_EPOCHS)
                   for name in ("mnist", "japanese_vowel", "caltech256", "robustness")]


@pytest.mark.parametrize("cases", [_BEFORE_TF, pytest.param(_BEFORE_TF_SLOW,
                                                            marks=pytest.mark.slow)],
                         ids=["default", "more"])
def test_bad_flags_stop_before_tensorflow_loads(cases):
    """Every example (`python -m examples.<name>`) refuses a bad flag and a missing
    --data_dir with one FATAL line, exit status 1 and no traceback, before TensorFlow
    is imported (so in about a second, not after the 5-30 s of loading it)."""
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE, f"examples.{name}", *argv],
                              cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for name, argv, _ in cases]
    for proc, (name, argv, message) in zip(procs, cases):
        out, err = proc.communicate(timeout=120)
        case = f"{name} {argv}: {err[-2000:]}"
        assert proc.returncode == 1, case
        assert "Traceback" not in err and out == "", case
        fatal = [line for line in err.splitlines() if line.startswith("FATAL")]
        assert len(fatal) == 1 and message in fatal[0], case
        assert "tensorflow imported: False" in err, case


def test_mnist_layer_names_without_tensorflow_match_the_built_model():
    """`--wrt` is checked against layer names known without building the model; they
    are the names of the model `train.build_model` builds."""
    for argv in (["--depth=1"], ["--depth=3", "--normalize=none", "--wrt="], ["--quick"]):
        config = mnist.get_config(parse(mnist.define_flags, argv))
        normalize = None if mnist_default.parse_normalize(config.normalize) is None \
            else (0.5, 0.25)
        built = [layer.name for layer in mnist_train.build_model(config, 784, 10,
                                                                 normalize).layers]
        assert mnist_default.layer_names(config) == built


# ----------------------------------------------------------------------------- toy2d


def test_l2_margin_matches_certify_and_its_gradient_finite_differences():
    keras.utils.set_random_seed(3)
    model = keras_roll.models.fc(input_shape=(2,), depth=3, width=10, classes=1,
                                 normalize=None, classifier_activation="sigmoid",
                                 dtype="float64")
    lin = keras_roll.linearize(model)
    x = np.random.default_rng(0).uniform(-1, 1, (6, 2))
    eps = distance.l2_margin(lin, x).numpy()
    np.testing.assert_allclose(eps, keras_roll.certify(model, x, norms=(2,)).margins[2],
                               rtol=1e-10)
    # d loss / d w by the tape against central differences of the loss (small steps keep
    # the activation pattern and the binding neuron).
    var = model.get_layer("dense_2").kernel
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(distance.distance_loss(lin, x, C=5.0))
    grad = tape.gradient(loss, var).numpy()
    assert np.abs(grad).max() > 0
    w0 = var.numpy()
    h = 1e-6
    for idx in [(0, 0), (3, 1), (5, 7)]:
        vals = []
        for s in (h, -h):
            w = w0.copy()
            w[idx] += s
            var.assign(w)
            vals.append(float(tf.reduce_sum(distance.distance_loss(lin, x, C=5.0))))
        var.assign(w0)
        assert grad[idx] == pytest.approx((vals[0] - vals[1]) / (2 * h), rel=1e-5, abs=1e-9)
    with pytest.raises(ValueError, match="C must be > 0"):
        distance.distance_loss(lin, x, C=0.0)


def test_toy2d_vanilla(tmp_path):
    """One model through the whole pipeline: table and Figure 1."""
    out = tmp_path / "toy"
    result = toy2d.main(parse(toy2d.define_flags, [
        f"--flagfile={CONFIGS / 'toy2d.flags'}", "--quick", f"--out={out}", "--epochs=2",
        "--n=30", "--width=8", "--resolution=16", "--models=vanilla"]))
    _, _, data = _check_table(out, "table", n_rows=1)
    assert data["rows"][0]["tag"] == "vanilla" and data["rows"][0]["ratio"] == 1.0
    assert [p.name for p in result.figures] == ["figure1_vanilla.png"]
    assert _is_png(result.figures[0])


@pytest.mark.slow
def test_toy2d_three_models(tmp_path):
    out = tmp_path / "toy"
    result = toy2d.main(parse(toy2d.define_flags, [
        f"--flagfile={CONFIGS / 'toy2d.flags'}", "--quick", f"--out={out}", "--epochs=3",
        "--n=40", "--width=8", "--resolution=24"]))
    head, rows, data = _check_table(out, "table", n_rows=3)
    assert head[0] == "Model" and "#CLR" in head
    assert [r["tag"] for r in data["rows"]] == ["vanilla", "distance", "roll"]
    for r in data["rows"]:
        assert 0 <= r["acc"] <= 1 and r["l2_p50"] > 0 and 1 <= r["clr_lower"] <= 40
    assert data["rows"][0]["ratio"] == 1.0
    assert len(result.figures) == 3 and all(_is_png(p) for p in result.figures)


# ----------------------------------------------------------------------------- mnist


TINY = ["--epochs=1", "--val_size=30", "--width=16", "--depth=2", "--batch_size=32",
        "--test_size=30"]


def test_mnist_on_another_idx_data_set(idx_folder, tmp_path, capsys):
    """No MNIST in the titles: the data set's name (its folder's), its 5 classes and the
    normalisation of its training split; every model's full row; the last-epoch
    warning; the faithfulness table and figure of its explanations; a rerun reuses the
    stored result, also when the data moved."""
    out = tmp_path / "out"
    argv = [f"--data_dir={idx_folder}", f"--out={out}", "--quick", "--noroll", *TINY,
            "--faithfulness=10"]
    result = mnist.main(parse(mnist.define_flags, argv))
    log = capsys.readouterr().out
    head, shown, data = _check_table(out, "table1", n_rows=1)
    assert data["title"] == "Table 1: bands5, 784-16x2-5 ReLU network"
    for name in ("table1.md", "runs.md", "summary.json"):
        assert "MNIST" not in (out / name).read_text()
    (xtr, _), _, _ = keras_roll.data.mnist_splits(idx_folder, seed=0, val=30)
    mean, std = result.summary["normalize"]
    assert mean == pytest.approx(xtr.mean(), rel=1e-5) and std == pytest.approx(xtr.std(),
                                                                              rel=1e-5)
    assert f"(x - {mean:.4g}) / {std:.4g} inside the model" in (out / "table1.md").read_text()
    assert shown[0][0] == "Vanilla" and data["rows"][0]["n"] == 30
    model = mnist_train.build_model(mnist.get_config(parse(mnist.define_flags, argv)), 784, 5,
                                    (mean, std))
    model.load_weights(out / "runs" / "vanilla.weights.h5")  # 5 outputs, as the labels
    head, runs, runs_data = _check_table(out, "runs", n_rows=1)
    assert {"#CLR", "Spearman l1-l2", "P50 l2, float32 model", "certified > 0"} <= set(head)
    row = runs_data["rows"][0]
    assert row["best_epoch"] == 1 and row["settings"]["epochs"] == 1
    assert row["clr_lower"] <= row["clr_upper"] <= 30
    assert row["l1_p50"] >= row["l2_p50"] > 0  # ||v||_2 <= ||v||_1 => eps_1 >= eps_2
    assert "WARNING: vanilla: the best validation loss is at the last epoch (1 of 1)" in log
    # the faithfulness of the model's exact integrated gradients: table, figure, log
    head, faith, faith_data = _check_table(out, "faithfulness", n_rows=1)
    assert faith[0][0] == "Vanilla" and faith_data["rows"][0]["n"] == 10
    assert {"Deletion area (lower: better)", "Insertion area (higher: better)",
            "MuFidelity (higher: better)"} <= set(head)
    assert 0 <= faith_data["rows"][0]["deletion"] <= 1
    assert 0 <= faith_data["rows"][0]["insertion"] <= 1
    assert result.tables["faithfulness"] in log
    assert [p.name for p in result.figures] == ["faithfulness.png"]
    assert _is_png(result.figures[0]) and f"Faithfulness curves: {result.figures[0]}" in log
    # (the reruns skip the faithfulness table: the training is what they reuse)
    again = mnist.main(parse(mnist.define_flags, [*argv, "--faithfulness=0"]))
    assert again.rows[0]["train_time_s"] == row["train_time_s"]  # reused, not retrained
    # The data moved: the stored run names it by fingerprint, so it is still reused.
    moved = tmp_path / "elsewhere" / idx_folder.name
    shutil.copytree(idx_folder, moved)
    argv_moved = [f"--data_dir={moved}", *argv[1:], "--faithfulness=0"]
    capsys.readouterr()
    moved_run = mnist.main(parse(mnist.define_flags, argv_moved))
    assert moved_run.rows[0]["train_time_s"] == row["train_time_s"]
    assert "vanilla: reusing" in capsys.readouterr().out


@pytest.mark.slow  # a second model trained; the gathering: test_tables_gather_every_stored_...
def test_mnist_gathers_a_new_model_with_the_stored_one(idx_folder, tmp_path):
    """One more model in the same --out: the tables gather it with the stored vanilla."""
    argv = [f"--data_dir={idx_folder}", f"--out={tmp_path / 'out'}", "--quick", *TINY,
            "--faithfulness=0"]
    mnist.main(parse(mnist.define_flags, [*argv, "--noroll"]))
    roll = mnist.main(parse(mnist.define_flags, [*argv, "--novanilla", "--roll", "--lam=0.5",
                                                 "--C=1", "--samples=2"]))
    assert [r["tag"] for r in roll.rows] == ["vanilla", "roll_lam0.5_C1_gamma100_s2"]
    _, runs_shown, _ = _check_table(tmp_path / "out", "runs", n_rows=2)
    assert [r[0] for r in runs_shown] == ["Vanilla", "ROLL (lam=0.5, C=1, gamma=100, 2 axes)"]
    _, table_shown, _ = _check_table(tmp_path / "out", "table1", n_rows=3)
    assert table_shown[0][0] == "Vanilla"


def test_tables_gather_every_stored_model_with_the_same_settings(tmp_path, capsys):
    """Fake stored runs: those with the wanted settings join the rows (vanilla first,
    then the new rows, then the others by tag); one trained with other settings stays
    out, and the log says why."""
    runs = tmp_path / "runs"
    runs.mkdir()
    wanted = {"epochs": 20, "data": "abc"}
    stored = [("vanilla", None, wanted), ("roll_lam3_C1_gamma100_exact", 3.0, wanted),
              ("roll_lam1_C1_gamma100_exact", 1.0, wanted),
              ("roll_lam9_C1_gamma100_exact", 9.0, {"epochs": 5, "data": "abc"})]
    for tag, lam, settings in stored:
        (runs / f"{tag}.json").write_text(json.dumps({"tag": tag, "lam": lam,
                                                      "settings": settings}))
    (runs / "notes.json").write_text("[1, 2]")  # not a stored row: ignored
    new = [{"tag": "roll_lam2_C1_gamma100_exact", "lam": 2.0, "settings": wanted}]
    rows = gather_stored(runs, wanted, new)
    assert [r["tag"] for r in rows] == ["vanilla", "roll_lam2_C1_gamma100_exact",
                                        "roll_lam1_C1_gamma100_exact",
                                        "roll_lam3_C1_gamma100_exact"]
    log = capsys.readouterr().out
    assert "not in the tables:" in log and "roll_lam9_C1_gamma100_exact.json" in log
    assert "epochs=5 (now 20)" in log


def test_data_fingerprint_is_the_data_not_its_place():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.array([0, 1, 2])
    assert data_fingerprint(x, y) == data_fingerprint(x.copy(), y.copy())
    assert data_fingerprint(x, y) != data_fingerprint(x, y[::-1])
    assert data_fingerprint(x, y) != data_fingerprint(x.astype(np.float64), y)
    assert data_fingerprint(x, y) != data_fingerprint(x.reshape(4, 3), y)


@pytest.mark.slow
def test_mnist_search_end_to_end(idx_folder, tmp_path, capsys):
    """--search on a tiny data set: vanilla, then ROLL models at the lams the bisection
    asks for (no --lam grid); every lam it reports as meeting a row's target has a
    stored model whose validation accuracy meets it."""
    out = tmp_path / "search"
    result = mnist.main(parse(mnist.define_flags, [
        f"--data_dir={idx_folder}", f"--out={out}", *TINY, "--samples=2", "--search",
        "--search_steps=2", "--lam=1", "--C=1", "--faithfulness=0"]))
    log = capsys.readouterr().out
    vanilla = next(r for r in result.rows if r["lam"] is None)
    rolls = [r for r in result.rows if r["lam"] is not None]
    assert 1 <= len(rolls) <= 4 and rolls[0]["lam"] == 1.0
    val_acc = {r["lam"]: r["val_acc"] for r in rolls}
    for drop in (0, 1):
        cutoff = round(100 * vanilla["val_acc"]) - drop
        what = "same accuracy" if drop == 0 else "1 % less accuracy"
        line = next(x for x in log.splitlines() if x.startswith(f"--search, ROLL at {what}"))
        found = re.search(r"\): lam ([0-9.e+-]+)", line)
        missed = re.search(r"\(lam ([0-9.e+-]+) misses it\)", line)
        if found:  # the reported lam's stored model meets the row's target
            assert round(100 * val_acc[float(found.group(1))]) >= cutoff, line
        else:
            assert "no lam tried meets it" in line
        if missed:
            assert round(100 * val_acc[float(missed.group(1))]) < cutoff, line


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_DATA / "mnist.npz").is_file(), reason="real MNIST not present")
def test_mnist_quick_shows_roll_at_work(tmp_path):
    """The documented --quick command on real MNIST, run as documented (a command line:
    op determinism on, which the numbers depend on): Table 1 has a selected ROLL row
    with at least 5 x vanilla's median l2 margin within 2 points of its test accuracy;
    the faithfulness table has vanilla's row and each selected ROLL model's."""
    proc = subprocess.run([sys.executable, "-m", "examples.mnist",
                           f"--flagfile={CONFIGS / 'mnist_roll.flags'}", "--quick",
                           f"--data_dir={SHARED_DATA}", f"--out={tmp_path}"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    _, shown, _ = _check_table(tmp_path, "table1", n_rows=3)
    picked = [r for r in shown[1:] if "none qualified" not in r[0]]
    assert picked, shown
    assert summary["same_acc"] or summary["acc_minus_1"]
    shown_rows = [r for r in (summary["same_acc"], summary["acc_minus_1"]) if r]
    assert any(r["ratio_l2_p50"] >= 5 and abs(r["acc"] - summary["vanilla_acc"]) <= 0.02
               for r in shown_rows), shown_rows
    _, faith, _ = _check_table(tmp_path, "faithfulness", n_rows=1 + len(
        {r["tag"] for r in shown_rows}))
    assert faith[0][0] == "Vanilla" and faith[1][0].startswith("ROLL at ")
    assert _is_png(tmp_path / "faithfulness.png")


@pytest.mark.slow
def test_mnist_sweep_draws_figure2(idx_folder, tmp_path):
    out = tmp_path / "sweep"
    result = mnist.main(parse(mnist.define_flags, [
        f"--data_dir={idx_folder}", f"--out={out}", *TINY, "--samples=3", "--noroll",
        "--sweep", "--sweep_lam=0.5,2", "--sweep_C=1", "--sweep_gamma=50,100",
        "--sweep_base=2,1,100"]))
    _, _, runs = _check_table(out, "runs", n_rows=4)  # vanilla + (0.5|2, 1, 100), (2, 1, 50)
    assert sorted((r["lam"], r["gamma"]) for r in runs["rows"][1:]) == [
        (0.5, 100), (2, 50), (2, 100)]
    assert all(r["estimator"] == "3 axes" for r in runs["rows"][1:])
    assert sorted(p.name for p in result.figures) == [  # and the faithfulness curves
        "faithfulness.png", "figure2_gamma.png", "figure2_lam.png"]
    assert all(_is_png(p) for p in result.figures)


@pytest.mark.slow
def test_mnist_timing_table2(tmp_path):
    mnist.main(parse(mnist.define_flags, ["--timing", "--quick", "--batch_size=8",
                                          f"--out={tmp_path}"]))
    _, rows, data = _check_table(tmp_path, "table2", n_rows=5)
    methods = [r["method"] for r in data["rows"]]
    assert methods[0] == "vanilla" and "back-propagation" in methods[1]
    assert all(r["ms"] > 0 for r in data["rows"][:4])
    assert data["rows"][0]["ratio"] == 1.0


def test_mnist_missing_data_names_the_flag_and_source(tmp_path):
    with pytest.raises(app.UsageError) as err:
        mnist.main(parse(mnist.define_flags, [
            f"--flagfile={CONFIGS / 'mnist_vanilla.flags'}", f"--data_dir={tmp_path}",
            f"--out={tmp_path / 'out'}", "--quick"]))
    assert "--data_dir" in str(err.value) and "mnist.npz" in str(err.value)
    assert "https://" in str(err.value)


# ----------------------------------------------------------------------------- vowels


@pytest.mark.slow
def test_japanese_vowel_vanilla(tmp_path):
    """Vanilla only, the whole pipeline (Table 3, every model's row, Figure 3)."""
    out = tmp_path / "jv"
    result = jv.main(parse(jv.define_flags, [
        f"--flagfile={CONFIGS / 'japanese_vowel_vanilla.flags'}", "--quick", f"--out={out}",
        "--units=4", "--epochs=1", "--val_fraction=0.05", "--test_size=12",
        "--figure_example=11"]))
    _, _, data = _check_table(out, "table3", n_rows=1)
    assert data["rows"][0]["n"] == 12 and 0 <= data["rows"][0]["acc"] <= 1
    _check_table(out, "runs", n_rows=1)
    assert [Path(p).name for p in result.figures] == ["figure3_vanilla.png"]
    assert _is_png(result.figures[0])


def test_japanese_vowel_figure_example_is_checked_before_training(tmp_path):
    with pytest.raises(app.UsageError, match="--figure_example=12: the test set has 12"):
        jv.main(parse(jv.define_flags, ["--quick", f"--out={tmp_path}", "--test_size=12",
                                        "--figure_example=12"]))
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_japanese_vowel_roll(tmp_path):
    out = tmp_path / "jv"
    result = jv.main(parse(jv.define_flags, [
        f"--flagfile={CONFIGS / 'japanese_vowel_roll.flags'}", "--quick", f"--out={out}",
        "--units=8", "--epochs=2", "--lam=1"]))
    _, _, data = _check_table(out, "table3", n_rows=3)
    assert data["rows"][0]["model"] == "Vanilla" and data["rows"][0]["n"] == 370
    _, _, runs = _check_table(out, "runs", n_rows=2)
    assert runs["rows"][1]["estimator"] == "exact"
    assert runs["rows"][1]["settings"]["units"] == 8
    assert [Path(p).name for p in result.figures] == ["figure3_vanilla.png",
                                                      "figure3_roll.png"]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["figure3"]["median_width"]) == {"vanilla", "roll"}


def test_figure3_panels_share_one_y_range():
    """The y range of both panels covers the series and the finite ends of both models'
    intervals (by hand), and the plot keeps it."""
    from examples.japanese_vowel.train import shared_ylim

    series = np.array([0.0, 1.0, 0.5])
    a = type("SB", (), {"lower": -np.full((1, 3, 2), 0.1), "upper": np.full((1, 3, 2), 0.1)})
    b = type("SB", (), {"lower": np.array([[[-2.0, 0], [-np.inf, 0], [-0.2, 0]]]),
                        "upper": np.array([[[0.3, 0], [0.4, 0], [np.inf, 0]]])})
    bottom, top = shared_ylim(series, [a, b], channel=0)
    lo, hi = -2.0, 1.4  # 0 - 2 and 1 + 0.4: the finite ends of both
    assert (bottom, top) == pytest.approx((lo - 0.17 * (hi - lo), hi + 0.17 * (hi - lo)))
    x = np.stack([series, series], axis=1)
    for sb in (a, b):
        fig = keras_roll.plots.plot_stability_bounds(x, (sb.lower[0], sb.upper[0]),
                                                     channel=0, ylim=(bottom, top))
        assert fig.axes[0].get_ylim() == pytest.approx((bottom, top))
    with pytest.raises(ValueError, match="ylim must be"):
        keras_roll.plots.plot_stability_bounds(x, (a.lower[0], a.upper[0]), ylim=(1, 0))


def test_japanese_vowel_split_is_stratified_and_disjoint():
    config = jv.get_config(parse(jv.define_flags, ["--val_fraction=0.2"]))
    (xtr, ytr, ltr), (xv, yv, lv), (xte, yte, _) = jv_input.load_data(config)
    assert len(yv) == 54 and len(ytr) == 216 and len(yte) == 370
    np.testing.assert_array_equal(np.bincount(yv), [6] * 9)
    full, _, _ = keras_roll.data.load_japanese_vowels(split="train")
    rows = {r.tobytes() for r in full}
    assert {r.tobytes() for r in xtr}.isdisjoint({r.tobytes() for r in xv})
    assert {r.tobytes() for r in xtr} | {r.tobytes() for r in xv} == rows
    # Batches of similar length, each padded to its own longest sequence; one epoch
    # holds every training sequence once.
    seen = []
    ds = jv_input.sequence_dataset(xtr, ytr, ltr, 32, seed=0)
    # No autotuning: with it, `fit` waited at every epoch's end for its thread.
    assert ds.options().autotune.enabled is False
    for xb, _ in ds:
        valid = np.abs(xb.numpy()).sum(axis=2) > 0
        assert xb.shape[0] <= 32 and valid[:, -1].any()
        seen += [r[v].tobytes() for r, v in zip(xb.numpy(), valid)]
    assert sorted(seen) == sorted(r[:n].tobytes() for r, n in zip(xtr, ltr))


# ----------------------------------------------------------------------------- demo


@pytest.mark.slow
def test_demo_runs(tmp_path, capsys):
    result = demo.main(parse(demo.define_flags, [
        f"--out={tmp_path}", "--units=8", "--epochs=2", "--toy_epochs=3", "--toy_points=30"]))
    text = capsys.readouterr().out
    assert "vanilla" in text and "ROLL / vanilla" in text and "Figure 3" in text
    # One line per model, no per-epoch logs or progress bars; last-epoch warnings only
    # about the epochs set here (test_last_epoch_warning_only_where_asked: none else).
    lines = text.splitlines()
    per_model = [line for line in lines if line.startswith("  ") and "trained in" in line]
    assert len(per_model) == 4, text
    assert not any(w in text for w in ("Epoch 1/", "val_loss:", "certifying", "ex/s"))
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert all("(3 of 3)" in w or "(2 of 2)" in w for w in warnings), warnings
    assert len(lines) < 45, text
    figures = result["toy2d"].figures + result["japanese_vowel"].figures
    assert len(figures) == 4 and all(_is_png(p) for p in figures)
    for p in figures:
        assert str(p) in text


def test_last_epoch_warning_only_where_asked(capsys):
    """A model whose best validation loss is at its last epoch (the loss still falls)
    is warned about with `warn_last_epoch` (the user chose the epochs), else not."""
    x = np.linspace(-1, 1, 32, dtype="float32")[:, None]
    y = (x[:, 0] > 0).astype("int64")
    for warn in (True, False):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        fit = training.fit_best(model, model, (x, y), (x, y), 2, 8, verbose=0, name="m",
                                warn_last_epoch=warn)
        assert fit.best.epoch == 2  # separable, small steps: still improving
        said = "WARNING: m: the best validation loss is at the last epoch" in \
            capsys.readouterr().out
        assert said is warn
    assert app.LogOptions(quiet=True).fit_verbose == 0
    assert app.LogOptions(quiet=True).certify_verbose is False
    assert app.LogOptions().certify_verbose == "auto"
