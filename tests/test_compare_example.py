"""The side-by-side example (`python -m examples.compare`): its flags, the search of
each method's operating points, the table's leaders, the measurements against
independent bounds, and a whole run on a small generated data set."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import keras
import numpy as np
import pytest
from absl import flags

import keras_roll
from examples.common.config_flags import parse_flags
from examples.compare import main as compare
from examples.compare import methods, report, train
from examples.compare.configs import default, quick
from examples.compare.measure import Measures, measure

REPO = Path(__file__).resolve().parents[1]
FLAGFILE = REPO / "examples" / "configs" / "compare_mnist.flags"
PNG = b"\x89PNG\r\n\x1a\n"


def _digits(n, rng, classes=4):
    """Digit-like images: class k lights up row band k, so a small net learns it."""
    y = rng.integers(0, classes, n).astype(np.uint8)
    x = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
    for i, k in enumerate(y):
        x[i, 4 + 5 * k: 7 + 5 * k, 4:24] = 250
    return x, y


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "bands.npz"
    rng = np.random.default_rng(0)
    (xtr, ytr), (xte, yte) = _digits(400, rng), _digits(60, rng)
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    return path


def tiny(npz, **changes):
    """A run of seconds: 784-16x1-4, 2 epochs, a handful of images per measurement."""
    base = dict(data_dir=str(npz), dataset="bands", train_size=300, val_size=100,
                depth=1, width=16, epochs=2, batch_size=50, eval_size=40, robust_size=6,
                distortion_size=4, worst_size=2, distortion_samples=50,
                worst_population=16, worst_generations=1, search_steps=1,
                certified_eps=(0.01, 0.3), roll_samples=4, mmr_examples=10,
                ibp_eps=0.02, crown_ibp_eps=0.02, fixed=())
    base.update(changes)
    return dataclasses.replace(default.get_config(), **base)


# ----------------------------------------------------------------------------- flags


def test_flagfile_and_quick_parse():
    fv = parse_flags(compare.define_flags, [f"--flagfile={FLAGFILE}", "--quick"])
    config = compare.get_config(fv)
    assert config.fixed == ()                          # quick's: no papers' eps in 3 epochs
    assert config.train_size == quick.get_config().train_size       # the rest is quick's
    assert fv.out == "runs/compare"
    full = compare.get_config(parse_flags(compare.define_flags, [f"--flagfile={FLAGFILE}"]))
    assert full.fixed == ("ibp:0.1", "ibp:0.3", "crown_ibp:0.1")
    mine = parse_flags(compare.define_flags, [f"--flagfile={FLAGFILE}", "--quick",
                                              "--fixed=ibp:0.3"])
    assert compare.get_config(mine).fixed == ("ibp:0.3",)          # a set flag wins
    cnn_flags = FLAGFILE.with_name("compare_cnn.flags")
    cnn = parse_flags(compare.define_flags, [f"--flagfile={cnn_flags}"])
    assert compare.get_config(cnn).arch == default.Arch.cnn and cnn.out == "runs/compare_cnn"
    assert compare.get_config(cnn).train_size == default.get_config().train_size == 10000


@pytest.mark.parametrize("argv, message", [
    (["--methods=vanilla,dropout"], "--methods takes a comma-separated subset"),
    (["--mmr_p=3"], "--mmr_p is 1, 2 or inf"),
    (["--input_gradient_p=l7"], "--input_gradient_p is 1, 2 or inf"),
    (["--arch=resnet"], "value should be one of <mlp|cnn>"),
    (["--ramp=1.5"], "1.5 is not a number in the range [0.0, 1.0]"),
    (["--data_dir=/no/such/folder"], "--data_dir does not exist"),
    (["--fixed=ibp:0.1,ibp:zero"], "--fixed takes method:value items"),
    (["--fixed=vanilla:1"], "got 'vanilla:1'"),
])
def test_bad_flags_are_refused_while_parsing(argv, message):
    with pytest.raises(flags.IllegalFlagValueError) as err:
        parse_flags(compare.define_flags, argv)
    assert message in str(err.value)


# ----------------------------------------------------------------------------- search


def test_search_keeps_the_largest_knob_that_meets_each_point(monkeypatch, tmp_path):
    """Validation accuracy falls with the knob: each point gets the largest value tried
    that keeps vanilla's accuracy (minus the point's drop), the next one tried misses."""
    def fake(method, value, data, config, out):
        return {"tag": f"{method.name}{value:g}", "value": value, "knob": method.knob,
                "val_acc": 0.95 - 0.004 * value}
    monkeypatch.setattr(train, "train_or_load", fake)
    config = tiny("unused", search_steps=4, ibp_eps=1.0)
    points = train.search(methods.METHODS["ibp"], {"val_acc": 0.95}, None, config, tmp_path)
    assert [p.drop for p in points] == [0, 1]
    for p in points:
        cutoff = 95 - p.drop
        assert round(100 * p.row["val_acc"]) >= cutoff
        tried = [float(t.split(":")[0]) for t in p.note.split(": ", 1)[1].split(", ")]
        larger = [v for v in tried if v > p.row["value"]]
        assert all(round(100 * (0.95 - 0.004 * v)) < cutoff for v in larger)
    assert points[1].row["value"] > points[0].row["value"]


def test_leaders_rank_each_column_and_say_ties():
    cols = report.columns((0.1,))
    rows = [{"label": "a", "point": "p", "test_acc": 0.9, "l2_p50": 0.1, "cert_0.1": 0.0,
             "worst_p50": 3.0},
            {"label": "b", "point": "q", "test_acc": 0.8, "l2_p50": 0.3, "cert_0.1": 0.0,
             "worst_p50": 1.0}]
    lines = report.leaders(rows, cols)
    assert "test acc.: a (p) (90.00 %)" in lines
    assert "l2 P50: b (q) (0.3)" in lines
    assert "distortion P50 (worst): b (q) (1)" in lines          # smaller is better
    assert "cert. acc. l_inf 0.1: all equal (0.00 %)" in lines


def test_measures_round_trip_through_json():
    m = Measures(0.9, 1, 2, 3, 4, 5, 6, 7, 8, {"l2": (0.1, 0.2), "linf": (0.01, 0.02)},
                 {"l2": 0.5, "linf": 0.25}, {0.1: 0.5, 0.3: 0.0}, 1.0, 2.0, 10, 5, 5, 1, 3.0,
                 robust_acc=0.8)
    again = Measures.from_json(json.loads(json.dumps(m.to_json())))
    assert again == m


# ----------------------------------------------------------------------------- measures


@pytest.mark.slow
def test_measures_agree_with_independent_bounds(npz):
    """On a small trained net: the certified accuracy is at least the share that interval
    bounds certify (an independent pass) and at most the accuracy; the radius's lower
    median is below its upper; each certified l2 margin keeps 200 random points of the
    ball inside the region (same activation pattern)."""
    config = tiny(npz)
    data = train.load(config)
    model = train.build_model(config, 784, data.classes)
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(*data.train, epochs=3, batch_size=50, verbose=0)
    m = measure(model, data, config)
    xr, yr = data.test[0][:config.robust_size], data.test[1][:config.robust_size]
    pred = np.argmax(model.predict(xr, verbose=0), -1)
    for eps, acc in m.certified.items():
        worst = keras_roll.worst_case_logits(model, xr, yr, eps)
        assert np.mean(worst.certified.numpy()) <= acc + 1e-9
        assert acc <= np.mean(pred == yr) + 1e-9
    for lower, upper in m.robust.values():
        assert lower <= upper
    cert = keras_roll.certify(model, data.test[0][:8], norms=(2,))
    hidden = keras.Model(model.input, model.get_layer("dense_1").output)
    rng = np.random.default_rng(1)
    for x, r in zip(data.test[0][:8], cert.margins[2]):
        u = rng.normal(size=(200, 784))
        u *= 0.999 * r * rng.random((200, 1)) / np.linalg.norm(u, axis=1, keepdims=True)
        pattern = hidden(x[None]).numpy() > 0
        assert ((hidden(x + u).numpy() > 0) == pattern).all()
    assert m.test_acc == pytest.approx(np.mean(
        np.argmax(model.predict(data.test[0], verbose=0), -1) == data.test[1]))


@pytest.mark.parametrize("epochs, steps", [(1, 6), (2, 6), (10, 157)])
def test_ramps_end_by_the_last_step(epochs, steps):
    """eps reaches the knob, kappa and beta their final values, by the last step (after
    a first epoch at eps = 0 when there is more than one)."""
    config = tiny("unused", epochs=epochs, ramp=0.5)
    ramps = methods.METHODS["crown_ibp"].ramps(config, 0.05, steps)
    assert [type(r).__name__ for r in ramps] == ["EpsilonRamp", "KappaRamp", "BetaRamp"]
    for ramp, start, end in zip(ramps, (0.0, 1.0, 1.0), (0.05, config.crown_ibp_kappa, 0.0)):
        assert (ramp.start, ramp.end) == (start, end)
        assert ramp.begin == (steps if epochs > 1 else 0)
        assert ramp.begin + ramp.length <= epochs * steps - 1
    assert methods.METHODS["roll"].ramps(config, 1.0, steps) == []


@pytest.mark.slow
def test_certified_training_ramps_reach_the_knob(npz, tmp_path):
    """CROWN-IBP trains with eps ramped to the knob and kappa, beta to their final values."""
    config = tiny(npz, epochs=2, ramp=0.5)
    data = train.load(config)
    model = train.build_model(config, 784, data.classes)
    method = methods.METHODS["crown_ibp"]
    fit_model = method.wrap(model, config, 0.05)
    fit_model.compile("adam", "sparse_categorical_crossentropy")
    steps = int(np.ceil(300 / 50))
    fit_model.fit(*data.train, batch_size=50, epochs=2, verbose=0,
                  callbacks=method.ramps(config, 0.05, steps))
    term = keras_roll.regularizers.certified_terms(fit_model)[0]
    assert float(term.eps.numpy()) == pytest.approx(0.05)
    assert float(term.kappa.numpy()) == pytest.approx(config.crown_ibp_kappa)
    assert float(term.beta.numpy()) == pytest.approx(0.0)


# ----------------------------------------------------------------------------- whole run


@pytest.mark.slow
def test_whole_comparison_runs_and_resumes(npz, tmp_path, capsys):
    from examples.compare import experiment

    config = tiny(npz, fixed=("ibp:0.3",))
    result = experiment.run(config, tmp_path)
    md = (tmp_path / "compare.md").read_text()
    table = json.loads((tmp_path / "compare.json").read_text())
    labels = [(r["label"], p) for r in table["rows"] for p in report.points_of(r)]
    assert labels[0] == ("vanilla", "reference")
    for label in ("ROLL", "MMR", "input gradient", "IBP", "CROWN-IBP"):
        assert (label, "same accuracy") in labels and (label, "1 % less accuracy") in labels
    assert ("IBP", "fixed (--fixed)") in labels
    tags = [r["tag"] for r in table["rows"] if r.get("tag")]
    assert len(tags) == len(set(tags))                 # one row per model
    assert (tmp_path / "compare.png").read_bytes().startswith(PNG)
    assert "Leads at vanilla's accuracy" in md and "Leads within one point" in md
    assert "--fixed rows meet no accuracy target" in md
    vanilla = next(r for r in result.rows if r["method"] == "vanilla")
    for row in table["rows"][1:]:
        if row.get("time_ratio") is not None:
            trained = next(r for r in result.rows if f"{r['knob']}={r['value']:g}" ==
                           row["knob"] and methods.METHODS[r["method"]].label == row["label"])
            assert row["time_ratio"] == pytest.approx(trained["epoch_s"] / vanilla["epoch_s"])
    capsys.readouterr()
    experiment.run(config, tmp_path)                     # everything stored: no training
    log = capsys.readouterr().out
    assert "training images" not in log and "== measuring" not in log
    assert "reusing" in log


def test_fixed_models_parse():
    assert default.parse_fixed(["ibp:0.1", "roll:4"]) == [("ibp", 0.1), ("roll", 4.0)]


def test_quick_config_is_small():
    q = quick.get_config()
    assert q.train_size <= 2000 and q.epochs <= 3 and q.search_steps == 1
    assert q.fixed == () and default.get_config().fixed       # the papers' eps: full runs


# ----------------------------------------------------------------------------- report


def _measures(test_acc=0.9, l2=0.01, cert=0.5, robust_acc=0.8):
    return Measures(test_acc, 1, 2, 3, l2, 5, 6, 7, 8, {"l2": (0.1, 0.2), "linf": (0.01, 0.02)},
                    {"l2": 0.5, "linf": 0.25}, {0.1: cert}, 1.0, 2.0, 10, 5, 5, 1, 3.0,
                    robust_acc=robust_acc)


def _train_row(tag, method, knob, value, val_acc=0.9, epoch_s=1.0):
    return {"tag": tag, "method": method, "knob": knob, "value": value, "val_acc": val_acc,
            "epoch_s": epoch_s}


LABELS = {n: m.label for n, m in methods.METHODS.items()}


def test_a_model_chosen_at_both_points_is_one_row():
    """Two operating points that chose the same model give one row naming both; a
    method that met neither gets one "none met the target" row; --fixed stays apart."""
    vanilla = _train_row("vanilla", "vanilla", "", 0.0)
    roll = _train_row("roll_lam1", "roll", "lam", 1.0)
    ibp = _train_row("ibp_eps0.1", "ibp", "eps", 0.1, val_acc=0.3)
    points = [train.OperatingPoint("roll", 0, roll, ""), train.OperatingPoint("roll", 1, roll, ""),
              train.OperatingPoint("mmr", 0, None, ""), train.OperatingPoint("mmr", 1, None, ""),
              train.OperatingPoint("ibp", None, ibp, "fixed")]
    measures = {t: _measures() for t in ("vanilla", "roll_lam1", "ibp_eps0.1")}
    rows = report.table_rows(vanilla, points, measures, LABELS)
    assert [(r["label"], r["point"]) for r in rows] == [
        ("vanilla", "reference"), ("ROLL", "same accuracy, 1 % less accuracy"),
        ("MMR", "same accuracy, 1 % less accuracy"), ("IBP", "fixed (--fixed)")]
    assert rows[2]["knob"] == "none met the target"
    assert rows[1]["robust_acc"] == 0.8                # beside the certified accuracy


@pytest.mark.parametrize("epoch_s, quick, rank, timed", [
    (0.3, True, False, False), (12.0, False, True, True), (0.3, False, True, False)])
def test_what_the_report_may_claim(epoch_s, quick, rank, timed):
    from examples.compare import experiment

    claims = experiment.ranking(tiny("unused"), epoch_s, quick)
    assert (claims.rank, claims.timed) == (rank, timed)
    text = " ".join(claims.why)
    assert ("cannot rank the methods" in text) == quick
    assert ("too short to time" in text) == (not timed)


def _report(tmp_path, ranking):
    vanilla = _train_row("vanilla", "vanilla", "", 0.0)
    roll = _train_row("roll_lam1", "roll", "lam", 1.0, epoch_s=3.0)
    measures = {"vanilla": _measures(0.9, 0.01), "roll_lam1": _measures(0.88, 0.05)}
    rows = report.table_rows(vanilla, [train.OperatingPoint("roll", 0, roll, "")], measures,
                             LABELS)
    return report.write_report(rows, tmp_path, "t", (0.1,), ["a note"], ranking)


def test_quick_report_names_no_leaders_and_drops_the_time_column(tmp_path):
    why = ("quick: these numbers cannot rank the methods",)
    md = _report(tmp_path, report.Ranking(rank=False, timed=False, why=why))
    assert "Leads" not in md and "cannot rank the methods" in md
    assert "time / epoch" not in md
    full = _report(tmp_path, report.Ranking())
    assert "Leads at vanilla's accuracy" in full and "time / epoch (x vanilla)" in full
    assert "| 3 |" in full                              # ROLL's epochs: 3 x vanilla's


def test_figure_is_framed_by_the_models_at_an_operating_point(tmp_path, monkeypatch):
    """A --fixed model far off (10 % accuracy) stays outside the axes; the certified
    accuracy is drawn against the accuracy on the same images."""
    figures = []
    monkeypatch.setattr(report, "finish", lambda fig, path: figures.append(fig))
    rows = [{"label": "vanilla", "point": "reference", "test_acc": 0.90, "l2_p50": 0.01,
             "robust_acc": 0.8, "cert_0.1": 0.1},
            {"label": "ROLL", "point": "same accuracy", "test_acc": 0.89, "l2_p50": 0.05,
             "robust_acc": 0.7, "cert_0.1": 0.3},
            {"label": "IBP", "point": "fixed (--fixed)", "test_acc": 0.10, "l2_p50": 0.5,
             "robust_acc": 0.2, "cert_0.1": 0.2}]
    report.figure(rows, tmp_path / "f.png", "t", eps=0.1)
    margin, cert = figures[0].axes[:2]
    lo, hi = margin.get_xlim()
    assert lo <= 89 and hi >= 90 and lo > 80                # 10 % is not on the axis
    assert cert.get_xlabel().startswith("accuracy on the radius images")
    lo, hi = cert.get_xlim()
    assert lo <= 70 and hi >= 80 and lo > 20
    assert any("outside the axes" in t.get_text() for t in margin.texts)


def test_each_method_carries_its_fields_and_ramps():
    config = default.get_config()
    for method in methods.METHODS.values():
        assert set(method.fields) <= {f.name for f in dataclasses.fields(config)}
        assert set(train.settings(method, config, _FakeData()).keys()) == {
            *default.TRAINING_FIELDS, *method.fields, "data"}
        ramps = method.ramps(config, 0.1, steps_per_epoch=10)
        assert bool(ramps) == (method.name in ("ibp", "crown_ibp"))
    assert methods.METHODS["vanilla"].wrap("the model", config, 0.0) == "the model"


class _FakeData:
    fingerprint = "f"
