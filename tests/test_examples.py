"""The examples (toy2d, mnist, japanese_vowel, demo) run end to end on tiny data.

Every example is run in-process through its `run(flag_values)` with its flagfile and
`--quick` (plus smaller sizes for the generated data), and the files it writes are
checked: the Markdown tables parse, the JSON has the rows, the PNGs are PNGs. The
helpers of examples/common.py are checked against hand-computed values, and the
distance regularizer of examples/toy2d.py against `keras_roll.certify` and finite
differences.
"""

import gzip
import json
import struct
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from examples import common, demo, japanese_vowel, mnist, toy2d

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "examples" / "configs"
PNG = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- helpers


def _parse_markdown_tables(text):
    """[(header cells, rows of cells)] of every Markdown table in `text`; asserts that
    each has a separator row and rows as wide as the header."""
    tables, block = [], []
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
            tables.append((head, rows))
            block = []
    return tables


def _check_table(out, name, n_rows=None):
    md = (out / f"{name}.md").read_text()
    tables = _parse_markdown_tables(md)
    assert len(tables) == 1
    head, rows = tables[0]
    data = json.loads((out / f"{name}.json").read_text())
    assert [c["header"] for c in data["columns"]] == head
    assert len(data["rows"]) == len(rows)
    if n_rows is not None:
        assert len(rows) == n_rows
    return head, rows, data


def _is_png(path):
    return Path(path).is_file() and Path(path).read_bytes()[:8] == PNG


def _tiny_mnist(n_train=240, n_test=60, seed=0):
    """Digit-like random images: class k lights up row band k, so a net can learn it."""
    rng = np.random.default_rng(seed)

    def make(n):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, k in enumerate(y):
            x[i, 2 + 2 * k: 4 + 2 * k, 4:24] = 250
        return x, y

    (xtr, ytr), (xte, yte) = make(n_train), make(n_test)
    return {"x_train": xtr, "y_train": ytr, "x_test": xte, "y_test": yte}


def _write_idx(file, array, code):
    header = struct.pack(">BBBB", 0, 0, code, array.ndim)
    header += b"".join(struct.pack(">I", s) for s in array.shape)
    with gzip.open(file, "wb") as f:
        f.write(header + array.astype(">u1").tobytes())


# Tiny models and data for every example run: (flags) appended after the flagfile.
MNIST_TINY = ["--quick", "--epochs=1", "--val_size=40", "--width=16", "--depth=2",
              "--batch_size=32"]


# ----------------------------------------------------------------------------- common


def test_spearman_hand_computed():
    assert common.spearman([1, 2, 3], [10, 30, 20]) == pytest.approx(0.5)
    assert common.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties: ranks of a are (0, 1.5, 1.5, 3), of b (0, 1, 2, 3); Pearson of the ranks
    # = 4.5 / sqrt(4.5 * 5) by hand.
    assert common.spearman([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(4.5 / np.sqrt(22.5))
    # Monotone transforms do not change it; inf pairs are dropped.
    a = np.array([0.3, 0.1, 0.7, 0.2, np.inf])
    assert common.spearman(a, np.exp(a)) == pytest.approx(1.0)
    assert np.isnan(common.spearman([1, 1, 1], [1, 2, 3]))


def test_select_models_whole_percent():
    vanilla = {"val_acc": 0.9812}
    rows = [{"tag": "a", "val_acc": 0.9760, "val_l2_p50": 5.0},   # 98 %: same accuracy
            {"tag": "b", "val_acc": 0.9790, "val_l2_p50": 3.0},   # 98 %
            {"tag": "c", "val_acc": 0.9720, "val_l2_p50": 9.0},   # 97 %: 1 % less
            {"tag": "d", "val_acc": 0.9500, "val_l2_p50": 99.0}]  # 95 %: out
    assert common.select_models(rows, vanilla, drop=0)["tag"] == "a"
    assert common.select_models(rows, vanilla, drop=1)["tag"] == "c"
    assert common.select_models(rows[3:], vanilla, drop=1) is None


def test_best_val_loss_restores_the_best_epoch(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    best = common.BestValLoss(model, path=tmp_path / "best.weights.h5")
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


# ----------------------------------------------------------------------------- toy2d


def test_l2_margin_matches_certify_and_its_gradient_finite_differences():
    keras.utils.set_random_seed(3)
    model = keras_roll.models.fc(input_shape=(2,), depth=3, width=10, classes=1,
                                 normalize=None, classifier_activation="sigmoid",
                                 dtype="float64")
    lin = keras_roll.linearize(model)
    x = np.random.default_rng(0).uniform(-1, 1, (6, 2))
    eps = toy2d.l2_margin(lin, x).numpy()
    np.testing.assert_allclose(eps, keras_roll.certify(model, x, norms=(2,)).margins[2],
                               rtol=1e-10)
    # d loss / d w by the tape against central differences of the loss (small steps keep
    # the activation pattern and the binding neuron).
    var = model.get_layer("dense_2").kernel
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(toy2d.distance_loss(lin, x, C=5.0))
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
            vals.append(float(tf.reduce_sum(toy2d.distance_loss(lin, x, C=5.0))))
        var.assign(w0)
        assert grad[idx] == pytest.approx((vals[0] - vals[1]) / (2 * h), rel=1e-5, abs=1e-9)
    with pytest.raises(ValueError, match="C must be > 0"):
        toy2d.distance_loss(lin, x, C=0.0)


@pytest.mark.slow
def test_toy2d_quick(tmp_path):
    out = tmp_path / "toy"
    fv = common.parse_flags(toy2d.define_flags, [
        f"--flagfile={CONFIGS / 'toy2d.flags'}", "--quick", f"--out={out}", "--epochs=3",
        "--n=40", "--width=8", "--resolution=24"])
    assert fv.epochs == 3 and fv.n == 40
    result = toy2d.run(fv)
    head, rows, data = _check_table(out, "table", n_rows=3)
    assert head[0] == "Model" and "#CLR" in head
    assert [r["tag"] for r in data["rows"]] == ["vanilla", "distance", "roll"]
    for r in data["rows"]:
        assert 0 <= r["acc"] <= 1 and r["l2_p50"] > 0 and 1 <= r["clr_lower"] <= 40
    assert data["rows"][0]["ratio"] == 1.0
    assert len(result["figures"]) == 3 and all(_is_png(p) for p in result["figures"])


def test_toy2d_quick_vanilla(tmp_path):
    """The fast variant: one model, the whole pipeline (table, Figure 1)."""
    out = tmp_path / "toy"
    result = toy2d.run(common.parse_flags(toy2d.define_flags, [
        f"--flagfile={CONFIGS / 'toy2d.flags'}", "--quick", f"--out={out}", "--epochs=2",
        "--n=30", "--width=8", "--resolution=16", "--models=vanilla"]))
    _, _, data = _check_table(out, "table", n_rows=1)
    assert data["rows"][0]["tag"] == "vanilla" and data["rows"][0]["ratio"] == 1.0
    assert [p.name for p in result["figures"]] == ["figure1_vanilla.png"]
    assert _is_png(result["figures"][0])


def test_quick_caps_flagfile_values(tmp_path):
    fv = common.parse_flags(toy2d.define_flags, [
        f"--flagfile={CONFIGS / 'toy2d.flags'}", "--quick", "--epochs=7"])
    common.apply_quick(fv, toy2d.QUICK)
    assert fv.epochs == 7 and fv.n == toy2d.QUICK["n"]  # flagfile's 200 capped
    fv = common.parse_flags(toy2d.define_flags, [f"--flagfile={CONFIGS / 'toy2d.flags'}"])
    common.apply_quick(fv, toy2d.QUICK)
    assert fv.epochs == 300 and fv.n == 200


# ----------------------------------------------------------------------------- mnist


@pytest.fixture(scope="module")
def mnist_npz(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mnist_npz")
    np.savez(folder / "mnist.npz", **_tiny_mnist())
    return folder


@pytest.mark.slow
def test_mnist_quick_npz(mnist_npz, tmp_path):
    out = tmp_path / "mnist"
    fv = common.parse_flags(mnist.define_flags, [
        f"--flagfile={CONFIGS / 'mnist_roll.flags'}", f"--data_dir={mnist_npz}",
        f"--out={out}", *MNIST_TINY])
    result = mnist.run(fv)
    head, rows, data = _check_table(out, "table1")
    assert head[:4] == ["Model", "epoch", "val ACC", "ACC"]
    assert "l2 P50" in head and "l1 P100" in head and "#CLR" in head
    assert rows[0][0] == "Vanilla" and data["rows"][0]["n"] == 60
    _, runs, runs_data = _check_table(out, "runs", n_rows=3)  # vanilla, C = 0.25 and 1
    tags = [r["tag"] for r in runs_data["rows"]]
    assert tags == ["vanilla", "roll_lam2_C0.25_gamma100_exact", "roll_lam2_C1_gamma100_exact"]
    for r in runs_data["rows"]:
        assert r["best_epoch"] == 1 and r["settings"]["epochs"] == 1
        assert r["clr_lower"] <= r["clr_upper"] <= 60
        assert r["l1_p50"] >= r["l2_p50"] > 0  # ||v||_2 <= ||v||_1 => eps_1 >= eps_2
        assert (out / "runs" / f"{r['tag']}.weights.h5").is_file()
    roll_rows = runs_data["rows"][1:]
    assert all(r["val_roll_loss"] is not None and r["val_roll_loss"] > 0 for r in roll_rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["vanilla_acc"] == pytest.approx(data["rows"][0]["acc"])
    assert set(summary["spearman_l1_l2"]) == set(tags)
    assert result["figures"] == []
    # A second run reuses the stored results instead of training again.
    again = mnist.run(common.parse_flags(mnist.define_flags, [
        f"--flagfile={CONFIGS / 'mnist_roll.flags'}", f"--data_dir={mnist_npz}",
        f"--out={out}", *MNIST_TINY]))
    assert [r["train_time_s"] for r in again["rows"]] == [r["train_time_s"]
                                                         for r in runs_data["rows"]]


def test_mnist_quick_idx_vanilla(tmp_path):
    arrays = _tiny_mnist(seed=1)
    folder = tmp_path / "idx"
    folder.mkdir()
    for split, prefix in (("train", "train"), ("test", "t10k")):
        _write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", arrays[f"x_{split}"], 0x08)
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", arrays[f"y_{split}"], 0x08)
    out = tmp_path / "out"
    fv = common.parse_flags(mnist.define_flags, [
        f"--flagfile={CONFIGS / 'mnist_vanilla.flags'}", f"--data_dir={folder}",
        f"--out={out}", *MNIST_TINY])
    mnist.run(fv)
    _, rows, data = _check_table(out, "table1", n_rows=1)
    assert data["rows"][0]["tag"] == "vanilla" and data["rows"][0]["n"] == 60


@pytest.mark.slow
def test_mnist_sweep_draws_figure2(mnist_npz, tmp_path):
    out = tmp_path / "sweep"
    fv = common.parse_flags(mnist.define_flags, [
        f"--flagfile={CONFIGS / 'mnist_roll.flags'}", f"--data_dir={mnist_npz}",
        f"--out={out}", *MNIST_TINY, "--samples=3", "--noroll", "--sweep",
        "--sweep_lam=0.5,2", "--sweep_C=1", "--sweep_gamma=50,100", "--sweep_base=2,1,100"])
    result = mnist.run(fv)
    _, _, runs = _check_table(out, "runs", n_rows=4)  # vanilla + (0.5|2, 1, 100), (2, 1, 50)
    assert sorted((r["lam"], r["gamma"]) for r in runs["rows"][1:]) == [
        (0.5, 100), (2, 50), (2, 100)]
    assert all(r["estimator"] == "3 axes" for r in runs["rows"][1:])
    names = sorted(p.name for p in result["figures"])
    assert names == ["figure2_gamma.png", "figure2_lam.png"]
    assert all(_is_png(p) for p in result["figures"])


def test_mnist_missing_data_names_the_flag_and_source(tmp_path):
    fv = common.parse_flags(mnist.define_flags, [
        f"--flagfile={CONFIGS / 'mnist_vanilla.flags'}", f"--data_dir={tmp_path / 'nothing'}",
        f"--out={tmp_path / 'out'}", "--quick"])
    with pytest.raises(FileNotFoundError) as err:
        mnist.run(fv)
    assert "--data_dir" in str(err.value) and "mnist.npz" in str(err.value)
    assert "https://" in str(err.value)


def test_mnist_bad_flags(mnist_npz, tmp_path):
    fv = common.parse_flags(mnist.define_flags, [f"--data_dir={mnist_npz}", "--C=abc",
                                                 f"--out={tmp_path}"])
    with pytest.raises(ValueError, match="--C takes comma-separated numbers"):
        mnist.configs(fv)
    fv = common.parse_flags(mnist.define_flags, ["--lam=-1"])
    with pytest.raises(ValueError, match="lam"):
        mnist.configs(fv)
    fv = common.parse_flags(mnist.define_flags, ["--novanilla", "--noroll"])
    with pytest.raises(ValueError, match="Nothing to train"):
        mnist.configs(fv)


@pytest.mark.slow
def test_mnist_timing_table2(tmp_path):
    fv = common.parse_flags(mnist.define_flags, ["--timing", "--quick", "--batch_size=8",
                                                 f"--out={tmp_path}"])
    mnist.run(fv)
    _, rows, data = _check_table(tmp_path, "table2", n_rows=5)
    methods = [r["method"] for r in data["rows"]]
    assert methods[0] == "vanilla" and "back-propagation" in methods[1]
    assert all(r["ms"] > 0 for r in data["rows"][:4])
    assert data["rows"][0]["ratio"] == 1.0


# ----------------------------------------------------------------------------- vowels


@pytest.mark.slow
def test_japanese_vowel_quick(tmp_path):
    out = tmp_path / "jv"
    fv = common.parse_flags(japanese_vowel.define_flags, [
        f"--flagfile={CONFIGS / 'japanese_vowel_roll.flags'}", "--quick", f"--out={out}",
        "--units=8", "--epochs=2", "--lam=1"])
    result = japanese_vowel.run(fv)
    _, _, data = _check_table(out, "table3")
    assert data["rows"][0]["model"] == "Vanilla" and data["rows"][0]["n"] == 370
    _, _, runs = _check_table(out, "runs", n_rows=2)
    assert runs["rows"][1]["estimator"] == "exact"
    assert runs["rows"][1]["settings"]["units"] == 8
    names = [Path(p).name for p in result["figures"]]
    assert names == ["figure3_vanilla.png", "figure3_roll.png"]
    assert all(_is_png(p) for p in result["figures"])
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["figure3"]["median_width"]) == {"vanilla", "roll"}


def test_japanese_vowel_quick_vanilla(tmp_path):
    """The fast variant: vanilla only, the whole pipeline (Table 3, Figure 3)."""
    out = tmp_path / "jv"
    result = japanese_vowel.run(common.parse_flags(japanese_vowel.define_flags, [
        f"--flagfile={CONFIGS / 'japanese_vowel_vanilla.flags'}", "--quick", f"--out={out}",
        "--units=4", "--epochs=1"]))
    _, _, data = _check_table(out, "table3", n_rows=1)
    assert data["rows"][0]["n"] == 370 and 0 <= data["rows"][0]["acc"] <= 1
    assert [Path(p).name for p in result["figures"]] == ["figure3_vanilla.png"]
    assert _is_png(result["figures"][0])


def test_japanese_vowel_split_is_stratified_and_disjoint():
    fv = common.parse_flags(japanese_vowel.define_flags, ["--val_fraction=0.2"])
    (xtr, ytr, ltr), (xv, yv, lv), (xte, yte, _) = japanese_vowel.load_data(fv)
    assert len(yv) == 54 and len(ytr) == 216 and len(yte) == 370
    np.testing.assert_array_equal(np.bincount(yv), [6] * 9)
    full, _, _ = keras_roll.data.load_japanese_vowels(split="train")
    rows = {r.tobytes() for r in full}
    assert {r.tobytes() for r in xtr}.isdisjoint({r.tobytes() for r in xv})
    assert {r.tobytes() for r in xtr} | {r.tobytes() for r in xv} == rows
    # Batches of similar length, each padded to its own longest sequence; one epoch
    # holds every training sequence once.
    seen = []
    for xb, _ in japanese_vowel.sequence_dataset(xtr, ytr, ltr, 32, seed=0):
        valid = np.abs(xb.numpy()).sum(axis=2) > 0
        assert xb.shape[0] <= 32 and valid[:, -1].any()
        seen += [r[v].tobytes() for r, v in zip(xb.numpy(), valid)]
    assert sorted(seen) == sorted(r[:n].tobytes() for r, n in zip(xtr, ltr))


def test_japanese_vowel_missing_data(tmp_path):
    fv = common.parse_flags(japanese_vowel.define_flags, [f"--data_dir={tmp_path / 'none'}"])
    with pytest.raises(FileNotFoundError) as err:
        japanese_vowel.load_data(fv)
    assert "--data_dir" in str(err.value) and "archive.ics.uci.edu" in str(err.value)


# ----------------------------------------------------------------------------- flagfiles, demo


@pytest.mark.parametrize("name, module", [
    ("mnist_vanilla", mnist), ("mnist_roll", mnist), ("toy2d", toy2d),
    ("japanese_vowel_vanilla", japanese_vowel), ("japanese_vowel_roll", japanese_vowel)])
def test_flagfiles_parse(name, module):
    fv = common.parse_flags(module.define_flags, [f"--flagfile={CONFIGS / (name + '.flags')}"])
    assert fv.out.startswith("runs/")


def test_paper_settings_in_flagfiles():
    fv = common.parse_flags(mnist.define_flags, [f"--flagfile={CONFIGS / 'mnist_roll.flags'}"])
    assert (fv.epochs, fv.batch_size, fv.lr, fv.momentum, fv.val_size) == (20, 64, 0.01, 0.5,
                                                                           5000)
    assert mnist.configs(fv)[1:] and all(c["gamma"] == 100 and c["samples"] is None
                                         for c in mnist.configs(fv)[1:])
    assert sorted(c["C"] for c in mnist.configs(fv)[1:]) == [0.25, 1.0]
    fv = common.parse_flags(japanese_vowel.define_flags,
                            [f"--flagfile={CONFIGS / 'japanese_vowel_roll.flags'}"])
    assert (fv.units, fv.batch_size, fv.lr) == (512, 32, 0.001)


@pytest.mark.slow
def test_demo_runs(tmp_path, capsys):
    fv = common.parse_flags(demo.define_flags, [f"--out={tmp_path}", "--units=8", "--epochs=2",
                                                "--toy_epochs=3", "--toy_points=30"])
    result = demo.run(fv)
    text = capsys.readouterr().out
    assert "vanilla" in text and "ROLL / vanilla" in text and "Figure 3" in text
    figures = result["toy2d"]["figures"] + result["japanese_vowel"]["figures"]
    assert len(figures) == 4 and all(_is_png(p) for p in figures)
    for p in figures:
        assert str(p) in text
