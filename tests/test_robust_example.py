"""examples.robustness end to end at tiny sizes: it trains (then reuses) a vanilla and a
ROLL network on a generated MNIST-layout data set, bounds their radii, and writes the
table, the figure and the stored bounds, which agree with each other."""

import json

import numpy as np
import pytest

from examples.common.config_flags import parse_flags
from examples.robustness import main, report, train

TINY = ["--train_size=240", "--val_size=60", "--epochs=1", "--width=12", "--depth=2",
        "--samples=3", "--test_size=5", "--max_regions=20", "--radii=0.01,0.1"]


@pytest.fixture(scope="module")
def npz(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("data") / "mnist.npz"
    protos = rng.uniform(0, 255, size=(10, 28, 28))
    def draw(n):
        y = rng.integers(0, 10, n)
        x = np.clip(protos[y] + rng.normal(0, 60, size=(n, 28, 28)), 0, 255)
        return x.astype(np.uint8), y.astype(np.uint8)
    (xtr, ytr), (xte, yte) = draw(300), draw(20)
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    return path


@pytest.mark.slow  # two trainings and four robust_radius runs (about a minute)
def test_example_writes_consistent_results_and_reuses_models(npz, tmp_path):
    out = tmp_path / "out"
    fv = parse_flags(main.define_flags, [f"--data_dir={npz}", f"--out={out}", *TINY])
    result = main.main(fv)
    md = result.tables["robustness"]
    assert "l2 lower P50" in md and "cert. acc. linf 0.1" in md and "ROLL" in md
    assert (out / "intervals.png").stat().st_size > 0
    table = json.loads((out / "robustness.json").read_text())
    assert [r["model"] for r in table["rows"]] == ["vanilla", "ROLL (lam 2, C 1, 3 axes)"]
    for r in table["rows"]:
        assert r["cert_0.1"] <= r["cert_0.01"] <= r["acc"]
    stored = np.load(out / "radius_vanilla.npz")
    ok = np.isfinite(stored["linf_upper"])
    assert np.all(stored["linf_lower"][ok] <= stored["linf_upper"][ok])
    # a second run reuses the stored models (same settings) and gives the same bounds
    again = main.main(parse_flags(main.define_flags, [f"--data_dir={npz}", f"--out={out}",
                                                      *TINY]))
    np.testing.assert_allclose(again.rows[0]["l2_lower_p50"], result.rows[0]["l2_lower_p50"])


def test_quick_config_and_bad_flags():
    fv = parse_flags(main.define_flags, ["--quick", "--test_size=7"])
    config = main.get_config(fv)
    assert config.test_size == 7 and config.width == 100 and config.samples == 16
    named = main.get_config(parse_flags(main.define_flags, ["--dataset=Fashion-MNIST"]))
    assert train.mnist_config(named).dataset == "Fashion-MNIST"
    # the name comes from the flag (default MNIST), never from the data folder's name
    assert train.mnist_config(config).dataset == "MNIST"
    with pytest.raises(Exception, match="method"):
        parse_flags(main.define_flags, ["--method=exact"])


class _Bounds:
    """The fields of a RobustRadius that the figure reads, for 4 inputs."""

    def __init__(self, exact):
        self.correct = np.array([True, True, False, True])
        self.lower = {p: np.array([0.1, 0.2, 0.0, 0.3]) for p in report.LABELS}
        self.upper = {p: np.array([0.2, 0.2, 0.0, np.inf]) for p in report.LABELS}
        self.exact = {p: np.array(exact) for p in report.LABELS}


def test_figure_legend_names_only_what_it_draws():
    """The exact marker is in each panel's legend where some bound is exact, and
    nowhere (neither legend nor title) when none is."""
    def labels(results):
        fig = report.draw(results)
        return [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes], \
            [ax.get_title() for ax in fig.axes]

    legends, titles = labels([("vanilla", _Bounds([False] * 4))])
    assert legends == [["vanilla"], ["vanilla"]]
    assert not any("exact" in t for t in titles)
    legends, _ = labels([("vanilla", _Bounds([False] * 4)),
                         ("ROLL", _Bounds([False, True, False, False]))])
    assert legends == [["vanilla", "ROLL", "exact (lower = upper)"]] * 2
