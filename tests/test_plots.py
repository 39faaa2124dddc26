"""The figures draw the result objects they are given, and only those, as readable
PNGs (title, labelled axes, legend or colour bar) on the Agg canvas, with a clear
error without matplotlib; the region map of a 2-D model against the ReLU sign
patterns computed with numpy."""

from __future__ import annotations

import sys
import types

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll import plots
from keras_roll.attribution import postprocess_saliency
from keras_roll.certification.region_map import RegionMap, region_map

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


def test_region_map_partitions_the_grid_by_relu_signs():
    """A one-layer ReLU net: the pattern of a point is the sign vector of W x + b, so
    two grid points share an id exactly when numpy gives them the same signs."""
    inp = keras.Input((2,))
    hidden = keras.layers.Dense(3, activation="relu")
    model = keras.Model(inp, keras.layers.Dense(2)(hidden(inp)))
    w = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, -1.0]], "float32")
    b = np.array([0.113, -0.217, 0.061], "float32")  # no grid point on a breakpoint
    hidden.set_weights([w, b])
    grid = region_map(model, bounds=((-1, 1), (-0.5, 1.5)), resolution=41)
    assert grid.ids.shape == (41, 41) and grid.logits.shape == (41, 41, 2)
    np.testing.assert_allclose(grid.xs, np.linspace(-1, 1, 41))
    np.testing.assert_allclose(grid.ys, np.linspace(-0.5, 1.5, 41))
    pts = np.stack(np.meshgrid(grid.xs, grid.ys), axis=-1)
    signs = (pts @ w + b > 0).astype(int) @ np.array([1, 2, 4])  # [H, W] sign code
    pairs = set(zip(signs.ravel().tolist(), grid.ids.ravel().tolist()))
    assert len(pairs) == len(set(signs.ravel())) == len(set(grid.ids.ravel()))  # a bijection
    assert grid.regions == len(set(signs.ravel()))
    edge = np.zeros(signs.shape, bool)
    edge[:, 1:] |= signs[:, 1:] != signs[:, :-1]
    edge[1:, :] |= signs[1:, :] != signs[:-1, :]
    np.testing.assert_array_equal(grid.boundaries(), edge)
    np.testing.assert_allclose(grid.logits, model.predict(pts.reshape(-1, 2), verbose=0)
                               .reshape(41, 41, 2), rtol=1e-5, atol=1e-6)
    # without bounds, the grid covers the points `around` with a margin, else [-1, 1]^2
    around = np.array([[-3.0, 0.5], [2.0, 4.0]])
    (x0, x1), (y0, y1) = region_map(model, resolution=2, around=around).bounds
    assert x0 < -3.0 and x1 > 2.0 and y0 < 0.5 and y1 > 4.0
    assert region_map(model, resolution=2).bounds == ((-1.0, 1.0), (-1.0, 1.0))
    with pytest.raises(ValueError, match="2-D input"):
        region_map(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="resolution must be an integer >= 2"):
        region_map(model, resolution=1)
    with pytest.raises(ValueError, match="min < max"):
        region_map(model, bounds=((1, 0), (0, 1)))


def _quadrants(logits_per_point=2):
    """A RegionMap by hand: four regions (the quadrants), logits growing with x1."""
    xs, ys = np.linspace(-1, 1, 41), np.linspace(-0.5, 1.5, 41)
    gx, gy = np.meshgrid(xs, ys)
    ids = (gx > 0.013).astype(int) + 2 * (gy > 0.017).astype(int)
    logits = np.stack([gx * k for k in range(logits_per_point)], axis=-1)
    return RegionMap(xs, ys, ids, logits, "softmax", "hand")


def test_linear_regions(tmp_path):
    grid = _quadrants()
    x = np.array([[-0.5, 0.0], [0.5, 1.0], [0.3, -0.2]])
    y = np.array([0, 1, 1])
    radii = np.array([0.1, 0.25, np.inf])  # no circle for an unbounded margin
    fig = plots.plot_linear_regions(grid, x, y, radii, path=tmp_path / "f1.png")
    _check_png(tmp_path / "f1.png")
    _check_labels(fig, legend=True, colorbar=True)
    main = fig.axes[0]
    assert sorted(p.radius for p in main.patches) == [0.1, 0.25]
    assert [tuple(p.center) for p in main.patches] == [(-0.5, 0.0), (0.5, 1.0)]
    assert main.get_title() == "Linear regions of 'hand' (4 on the grid)"
    overlay = main.get_images()[1].get_array()
    np.testing.assert_array_equal(overlay[..., 3] > 0, grid.boundaries())
    assert (main.get_xlim(), main.get_ylim()) == ((-1.0, 1.0), (-0.5, 1.5))
    # the heat map is P(class 1) of the two logits
    heat = main.get_images()[0].get_array()
    np.testing.assert_allclose(heat, 1 / (1 + np.exp(-grid.logits[..., 1] + grid.logits[..., 0])))
    # a Certificate gives its l2 margins; several classes give the predicted class
    cert = types.SimpleNamespace(margins={2: radii})
    fig = plots.plot_linear_regions(_quadrants(4), x, y, cert, class_names="abcd",
                                    path=tmp_path / "sub" / "f1b.png")
    _check_png(tmp_path / "sub" / "f1b.png", min_bytes=2_000)
    assert fig.axes[0].get_images()[0].get_array().max() == 3  # argmax of k * x1
    with pytest.raises(TypeError, match="RegionMap"):
        plots.plot_linear_regions(keras.Sequential([keras.Input((2,))]))
    with pytest.raises(ValueError, match="one l2 radius per point"):
        plots.plot_linear_regions(grid, x, y, radii[:2])
    with pytest.raises(ValueError, match="pass x too"):
        plots.plot_linear_regions(grid, y=y)


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
    x = np.random.default_rng(0).normal(size=(2, 12, 3))
    lower, upper = -np.full(x.shape, 0.1), np.full(x.shape, 0.3)
    bounds = types.SimpleNamespace(lower=lower, upper=upper)  # a StabilityBounds' fields
    fig = plots.plot_stability_bounds(x, bounds, channel=2, example=1,
                                      path=tmp_path / "f3.png")
    _check_png(tmp_path / "f3.png")
    _check_labels(fig)
    band = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]
    np.testing.assert_allclose([band.min(), band.max()],
                               [(x[1, :, 2] - 0.1).min(), (x[1, :, 2] + 0.3).max()])
    np.testing.assert_allclose(fig.axes[0].get_lines()[0].get_ydata(), x[1, :, 2])
    # infinite sides are drawn to the plot edge and marked
    lower = np.full((12, 1), -np.inf)
    upper = np.full((12, 1), 0.2)
    fig = plots.plot_stability_bounds(np.zeros((12, 1)), (lower, upper),
                                      path=tmp_path / "f3b.png")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "unbounded lower side" in labels
    with pytest.raises(ValueError, match="channel must be"):
        plots.plot_stability_bounds(x[0], (bounds.lower[0], bounds.upper[0]), channel=3)


def test_attribution_grids(tmp_path):
    def cnn(seed):
        keras.utils.set_random_seed(seed)
        inp = keras.Input((8, 8, 1))
        h = keras.layers.Conv2D(3, 3, activation="relu", bias_initializer=_bias())(inp)
        h = keras.layers.Dense(8, activation="relu",
                               bias_initializer=_bias())(keras.layers.Flatten()(h))
        return keras.Model(inp, keras.layers.Dense(3)(h))

    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (2, 8, 8, 1)).astype("float32")
    y = np.array([0, 2])
    nearby = np.clip(x + rng.uniform(-0.03, 0.03, x.shape), 0, 1).astype("float32")
    model = cnn(0)
    one = plots.GradientMaps(
        keras_roll.saliency(model, x, y), keras_roll.saliency(model, nearby, y),
        keras_roll.integrated_gradients(model, x, y, steps=4, verbose=False))
    maps = {"vanilla": one, "ROLL": one._replace(worst=one.gradient)}
    fig = plots.plot_gradient_comparison(x, maps, eps=0.03, path=tmp_path / "f4.png")
    _check_png(tmp_path / "f4.png")
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert titles[:4] == ["original", "vanilla\ngradient", "vanilla\nadv. gradient",
                          "vanilla\nintegrated grad."]
    assert len(titles) == 7 and "eps=0.03" in fig.get_suptitle()
    assert fig.axes[0].get_ylabel().startswith("example 0")
    assert any(a.get_ylabel().startswith("attribution") for a in fig.axes)  # colour bar
    # The drawn maps are the Appendix K post-processing of the given gradients.
    drawn = fig.axes[2].get_images()[0].get_array()
    np.testing.assert_allclose(drawn, postprocess_saliency(maps["vanilla"].worst.gradient)[0])
    # the low-level grid with flat inputs, raw maps and result objects
    flat = x.reshape(2, -1)
    fig = plots.plot_attribution_grid(flat, {"gradient": rng.normal(size=(2, 64)),
                                             "IG": maps["ROLL"].integrated},
                                      image_shape=(8, 8), row_labels=["a", "b"],
                                      path=tmp_path / "f5.png")
    _check_png(tmp_path / "f5.png", min_bytes=4_000)
    with pytest.raises(ValueError, match="maps for 2 images"):
        plots.plot_attribution_grid(x, {"g": np.zeros((3, 8, 8))})
    with pytest.raises(TypeError, match="GradientMaps"):
        plots.plot_gradient_comparison(x, {"vanilla": cnn(0)})


def test_a_clear_error_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plots.plot_margin_tradeoff([1.0], [np.ones(3)], [0.5])
