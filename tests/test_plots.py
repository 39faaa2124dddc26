"""The figures render from small inputs to readable PNGs (title, labelled axes,
legend or colour bar), on the Agg canvas, with a clear error without matplotlib."""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll import plots

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def _check_png(path, min_bytes=8_000):
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > min_bytes


def _check_labels(fig, legend=True, colorbar=False):
    axes = fig.axes
    assert fig.canvas.__class__.__name__ == "FigureCanvasAgg"
    titled = [a.get_title() for a in axes if a.get_title()] + [fig.get_suptitle()]
    titled = [t for t in titled if t]
    assert titled, "no title"
    main = axes[0]
    assert main.get_xlabel() and main.get_ylabel()
    if legend:
        assert any(a.get_legend() is not None for a in axes) or fig.legends
    if colorbar:  # a colour bar is an extra axes with a label
        assert any(a.get_ylabel() and a is not main for a in axes)


def _bias():
    return keras.initializers.RandomNormal(stddev=0.5)


def test_linear_regions(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((2,))
    h = keras.layers.Dense(8, activation="relu", bias_initializer=_bias())(inp)
    h = keras.layers.Dense(8, activation="relu", bias_initializer=_bias())(h)
    model = keras.Model(inp, keras.layers.Dense(2, activation="softmax")(h), name="toy")
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (12, 2)).astype("float32")
    y = (x[:, 0] > 0).astype(int)
    x0 = x.copy()
    fig = plots.plot_linear_regions(model, x, y, resolution=120, path=tmp_path / "f1.png")
    _check_png(tmp_path / "f1.png")
    _check_labels(fig, legend=True, colorbar=True)
    main = fig.axes[0]
    radii = keras_roll.certify(model, x, norms=(2,), verbose=False).margins[2]
    circles = sorted(p.radius for p in main.patches)
    np.testing.assert_allclose(circles, np.sort(radii[np.isfinite(radii)]), rtol=1e-6)
    assert "regions" in main.get_title()
    np.testing.assert_array_equal(x, x0)
    # multi-class heat map, no data points
    inp = keras.Input((2,))
    h = keras.layers.Dense(6, activation="relu", bias_initializer=_bias())(inp)
    multi = keras.Model(inp, keras.layers.Dense(4)(h))
    fig = plots.plot_linear_regions(multi, resolution=60, bounds=((-2, 2), (-1, 1)),
                                    path=tmp_path / "sub" / "f1b.png")
    _check_png(tmp_path / "sub" / "f1b.png", min_bytes=2_000)
    with pytest.raises(ValueError, match="2-D input"):
        plots.plot_linear_regions(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))


def test_margin_tradeoff(tmp_path):
    rng = np.random.default_rng(0)
    lams = [0.0, 0.01, 0.1, 1.0]
    margins = [rng.exponential(s, 50) for s in (0.01, 0.03, 0.08, 0.2)]
    fig = plots.plot_margin_tradeoff(lams, margins, [0.99, 0.98, 0.96, 0.9],
                                     hyperparameter="lambda", path=tmp_path / "f2.png")
    _check_png(tmp_path / "f2.png")
    _check_labels(fig)
    assert fig.axes[1].get_ylabel() == "accuracy (%)"
    lines = fig.axes[0].get_lines()
    np.testing.assert_allclose(lines[1].get_ydata(), [np.percentile(m, 50) for m in margins])
    with pytest.raises(ValueError, match="same non-zero length"):
        plots.plot_margin_tradeoff(lams, margins[:2], [0.9] * 4)


def test_stability_bounds(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((12, 3))
    h = keras.layers.SimpleRNN(8, activation="relu")(inp)
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    x = np.random.default_rng(0).normal(size=(2, 12, 3)).astype("float32")
    sb = keras_roll.stability_bounds(model, x, verbose=False)
    fig = plots.plot_stability_bounds(x, sb, channel=2, example=1, path=tmp_path / "f3.png")
    _check_png(tmp_path / "f3.png")
    _check_labels(fig)
    # infinite sides are drawn to the plot edge and marked
    lower = np.full((12, 1), -np.inf)
    upper = np.full((12, 1), 0.2)
    fig = plots.plot_stability_bounds(np.zeros((12, 1)), (lower, upper),
                                      path=tmp_path / "f3b.png")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "unbounded lower side" in labels
    with pytest.raises(ValueError, match="channel must be"):
        plots.plot_stability_bounds(x[0], (sb.lower[0], sb.upper[0]), channel=3)


def test_attribution_grids(tmp_path):
    def cnn(seed):
        keras.utils.set_random_seed(seed)
        inp = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(3, 3, activation="relu", bias_initializer=_bias())(inp)
        h = keras.layers.Dense(8, activation="relu",
                               bias_initializer=_bias())(keras.layers.Flatten()(h))
        return keras.Model(inp, keras.layers.Dense(3)(h))

    x = np.random.default_rng(0).uniform(0, 1, (2, 8, 8, 1)).astype("float32")
    x0 = x.copy()
    fig = plots.plot_gradient_comparison({"vanilla": cnn(0), "ROLL": cnn(1)}, x,
                                         np.array([0, 2]), population=30, generations=2,
                                         verbose=False, path=tmp_path / "f4.png")
    _check_png(tmp_path / "f4.png")
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert titles[:4] == ["original", "vanilla\ngradient", "vanilla\nadv. gradient",
                          "vanilla\nintegrated grad."]
    assert len(titles) == 7 and fig.get_suptitle()
    assert fig.axes[0].get_ylabel().startswith("example 0")
    assert any(a.get_ylabel().startswith("attribution") for a in fig.axes)  # colour bar
    np.testing.assert_array_equal(x, x0)
    # the low-level grid with flat inputs and raw maps
    flat = x.reshape(2, -1)
    fig = plots.plot_attribution_grid(flat, {"gradient": np.random.default_rng(1).normal(
        size=(2, 64))}, image_shape=(8, 8), row_labels=["a", "b"], path=tmp_path / "f5.png")
    _check_png(tmp_path / "f5.png", min_bytes=4_000)
    with pytest.raises(ValueError, match="maps for 2 images"):
        plots.plot_attribution_grid(x, {"g": np.zeros((3, 8, 8))})


def test_a_clear_error_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plots.plot_margin_tradeoff([1.0], [np.ones(3)], [0.5])
