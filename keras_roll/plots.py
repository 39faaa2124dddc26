"""Figures in the style of Lee, Alvarez-Melis & Jaakkola (ICLR 2019), Figures 1-6.

* `plot_linear_regions`: the linear regions of a model with a 2-D input, its
  prediction heat map and the certified l2 margin around training points (Fig. 1).
* `plot_margin_tradeoff`: margin percentiles against a hyperparameter, accuracy on
  a second axis (Fig. 2).
* `plot_stability_bounds`: per-coordinate stability bounds of a time series (Fig. 3).
* `plot_attribution_grid` / `plot_gradient_comparison`: image grids of the original,
  its gradient, the gradient at the worst-case point of the distortion search and
  integrated gradients, for two models side by side (Figs. 4-6).

matplotlib is imported only when a figure is drawn (it is in the `test` and
`examples` extras). Figures are drawn on the Agg canvas without touching pyplot's
global state; every function returns the `matplotlib.figure.Figure` and saves a
PNG when given `path`.
"""

from __future__ import annotations

import os

import numpy as np

from keras_roll.certification.margins import certify
from keras_roll.evaluate.distortion import gradient_distortion
from keras_roll.evaluate.gradients import LogitGradients, check_inputs
from keras_roll.evaluate.integrated import integrated_gradients
from keras_roll.evaluate.saliency import postprocess_saliency, saliency

__all__ = [
    "plot_attribution_grid",
    "plot_gradient_comparison",
    "plot_linear_regions",
    "plot_margin_tradeoff",
    "plot_stability_bounds",
]

_DPI = 120


def _matplotlib():
    """`(Figure, FigureCanvasAgg, matplotlib)`, imported on first use."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "keras_roll.plots needs matplotlib, which is not installed: "
            "pip install matplotlib (or pip install 'keras_roll[examples]')."
        ) from e
    return Figure, FigureCanvasAgg, matplotlib


def _figure(figsize):
    Figure, FigureCanvasAgg, _ = _matplotlib()
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas: PNG output, no GUI, no global backend change
    return fig


def _finish(fig, path):
    if path is not None:
        path = os.fspath(path)
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        fig.savefig(path, format="png", dpi=_DPI)
    return fig


# ---------------------------------------------------------------------- Figure 1


def plot_linear_regions(model, x=None, y=None, bounds=None, resolution: int = 400,
                        margins: bool = True, class_names=None, title: str | None = None,
                        path=None, memory_budget: int | None = None):
    """Linear regions of a model with a 2-D input (the paper's Figure 1).

    Draws the prediction as a heat map over a grid, the boundaries between
    linear regions (grid cells whose activation pattern differs from a
    neighbour's) and, around each point of `x`, the circle of its certified l2
    margin (`keras_roll.certify`): the largest disc inside its linear region.

    Args:
        model: a Keras model or `Linearized` with input shape `(2,)`.
        x: optional `[n, 2]` (training) points to show.
        y: optional `[n]` integer labels of `x` (colours the points).
        bounds: `((x_min, x_max), (y_min, y_max))`; default: the range of `x`
            padded by 10 % (or [-1, 1]^2 without `x`).
        resolution: grid points per axis.
        margins: draw the l2 margin circles around `x`.
        class_names: optional names of the classes for the legend.
        title: figure title (default names the model).
        path: optional PNG path.
        memory_budget: bytes of tangents per chunk for `certify`.

    Returns:
        The matplotlib `Figure`.

    Example:

    ```python
    fig = keras_roll.plots.plot_linear_regions(model, x_train[:50], y_train[:50],
                                               path="regions.png")
    ```
    """
    engine = LogitGradients.of(model)
    lin = engine.lin
    if tuple(lin.input_shape) != (2,):
        raise ValueError(f"plot_linear_regions needs a model with a 2-D input, got input "
                         f"shape {lin.input_shape}.")
    if not (isinstance(resolution, int) and resolution >= 2):
        raise ValueError(f"resolution must be an integer >= 2, got {resolution!r}.")
    pts = None if x is None else check_inputs(lin, x, "x")
    labels = None
    if y is not None:
        if pts is None:
            raise ValueError("y was given without x.")
        labels = np.asarray(y).reshape(-1)
        if labels.shape != (pts.shape[0],):
            raise ValueError(f"y must have shape [n] = ({pts.shape[0]},), got "
                             f"{np.shape(y)}.")
    (x0, x1), (y0, y1) = _bounds(bounds, pts)
    gx = np.linspace(x0, x1, resolution)
    gy = np.linspace(y0, y1, resolution)
    grid = np.stack(np.meshgrid(gx, gy), axis=-1).reshape(-1, 2).astype(lin.dtype)
    ids, logits = _pattern_ids(lin, grid)
    ids = ids.reshape(resolution, resolution)
    edge = np.zeros_like(ids, bool)
    edge[:, 1:] |= ids[:, 1:] != ids[:, :-1]
    edge[1:, :] |= ids[1:, :] != ids[:-1, :]

    ratio = (y1 - y0) / (x1 - x0)
    fig = _figure((7.0, float(np.clip(5.6 * ratio + 0.9, 3.0, 8.0))))
    ax = fig.add_subplot()
    extent = (x0, x1, y0, y1)
    heat, label, cmap, vmin, vmax, ticks = _prediction_map(lin, logits)
    im = ax.imshow(heat.reshape(resolution, resolution), origin="lower", extent=extent,
                   cmap=cmap, vmin=vmin, vmax=vmax, alpha=0.55, aspect="auto",
                   interpolation="nearest")
    cbar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    cbar.set_label(label)
    if ticks is not None:
        cbar.set_ticks(ticks)
        if class_names is not None:
            cbar.set_ticklabels([str(class_names[int(t)]) for t in ticks])
    overlay = np.zeros((resolution, resolution, 4))
    overlay[edge] = (0.1, 0.1, 0.1, 0.8)
    ax.imshow(overlay, origin="lower", extent=extent, aspect="auto", interpolation="nearest")

    _, _, mpl = _matplotlib()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Circle

    handles = [Line2D([], [], color="0.1", lw=1.5, label="region boundary")]
    if pts is not None:
        classes = np.unique(labels) if labels is not None else [None]
        colors = mpl.colormaps["tab10"]
        for k, c in enumerate(classes):
            sel = slice(None) if c is None else labels == c
            name = "data" if c is None else (
                f"class {class_names[int(c)]}" if class_names is not None else f"class {c}")
            h = ax.scatter(pts[sel, 0], pts[sel, 1], s=18, color=colors(k % 10),
                           edgecolors="white", linewidths=0.6, zorder=3, label=name)
            handles.append(h)
        if margins:
            radius = certify(lin, pts, norms=(2,), memory_budget=memory_budget,
                             verbose=False).margins[2]
            for p, r in zip(pts, radius):
                if np.isfinite(r):
                    ax.add_patch(Circle(tuple(p), r, fill=False, color="black", lw=0.9,
                                        zorder=4))
            handles.append(Line2D([], [], marker="o", ls="", markerfacecolor="none",
                                  markeredgecolor="black", markersize=9,
                                  label="certified l2 margin"))
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_aspect("equal")
    ax.set_xlabel("input $x_1$")
    ax.set_ylabel("input $x_2$")
    n_regions = len(np.unique(ids))
    ax.set_title(title or f"Linear regions of '{lin.model.name}' ({n_regions} on the grid)")
    ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.85)
    return _finish(fig, path)


def _bounds(bounds, pts):
    if bounds is not None:
        try:
            (x0, x1), (y0, y1) = bounds
            x0, x1, y0, y1 = (float(v) for v in (x0, x1, y0, y1))
        except (TypeError, ValueError):
            raise ValueError(f"bounds must be ((x_min, x_max), (y_min, y_max)), got "
                             f"{bounds!r}.") from None
        if not (x0 < x1 and y0 < y1):
            raise ValueError(f"bounds must have min < max on both axes, got {bounds!r}.")
        return (x0, x1), (y0, y1)
    if pts is None or pts.shape[0] == 0:
        return (-1.0, 1.0), (-1.0, 1.0)
    lo, hi = pts.min(axis=0).astype(float), pts.max(axis=0).astype(float)
    pad = np.maximum(0.1 * (hi - lo), 1e-3)
    return (lo[0] - pad[0], hi[0] + pad[0]), (lo[1] - pad[1], hi[1] + pad[1])


def _pattern_ids(lin, grid, chunk: int = 4096):
    """An integer id per distinct activation pattern on the grid, and the logits."""
    ids = np.empty(grid.shape[0], np.int64)
    table: dict = {}
    logits = []
    for i in range(0, grid.shape[0], chunk):
        fwd = lin.forward(grid[i:i + chunk])
        n = fwd.neurons
        key = np.where(n.valid.numpy(), n.piece.numpy(), -1).astype(np.int32)
        key = np.ascontiguousarray(key)
        rows = key.view(np.dtype((np.void, key.dtype.itemsize * key.shape[1]))).ravel()
        uniq, inverse = np.unique(rows, return_inverse=True)
        local = np.array([table.setdefault(u.tobytes(), len(table)) for u in uniq], np.int64)
        ids[i:i + chunk] = local[inverse.reshape(-1)]
        logits.append(fwd.logits.numpy().reshape(key.shape[0], -1))
    return ids, np.concatenate(logits).astype(np.float64)


def _prediction_map(lin, logits):
    """(values, colour-bar label, cmap, vmin, vmax, ticks) of the prediction heat map."""
    n_logits = logits.shape[1]
    if n_logits == 1:
        if lin.output_link == "sigmoid":
            return 1 / (1 + np.exp(-logits[:, 0])), "P(class 1)", "RdBu_r", 0.0, 1.0, None
        lim = float(np.max(np.abs(logits))) or 1.0
        return logits[:, 0], "model output", "RdBu_r", -lim, lim, None
    if n_logits == 2:
        z = logits - logits.max(axis=1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        return p[:, 1], "P(class 1)", "RdBu_r", 0.0, 1.0, None
    pred = logits.argmax(axis=1)
    _, _, mpl = _matplotlib()
    cmap = mpl.colormaps["tab10"].resampled(n_logits) if n_logits <= 10 else "viridis"
    return (pred, "predicted class", cmap, -0.5, n_logits - 0.5,
            list(range(n_logits)) if n_logits <= 20 else None)


# ---------------------------------------------------------------------- Figure 2


def plot_margin_tradeoff(values, margins, accuracy, percentiles=(25, 50, 75),
                         hyperparameter: str = "lambda", norm: str = "l2",
                         log_x="auto", title: str | None = None, path=None):
    """Margin percentiles against a hyperparameter, accuracy on a twin axis (Figure 2).

    Args:
        values: `[H]` hyperparameter values (e.g. the ROLL weight lambda).
        margins: `H` arrays of certified margins (one per value), or `H`
            `keras_roll.Certificate`s (their `norm` margins are used).
        accuracy: `[H]` accuracies in [0, 1] (plotted in percent).
        percentiles: the margin percentiles to draw.
        hyperparameter: x-axis label.
        norm: "l1", "l2" or "linf": which margin (for certificates and labels).
        log_x: "auto" (log scale when positive values span over two decades), True
            or False.
        title: figure title.
        path: optional PNG path.

    Returns:
        The matplotlib `Figure`.

    Example:

    ```python
    fig = plot_margin_tradeoff([0, 0.5, 1, 2], [c.margins[2] for c in certs],
                               [0.98, 0.97, 0.96, 0.94], hyperparameter="lambda")
    ```
    """
    vals = np.asarray(values, np.float64).reshape(-1)
    acc = np.asarray(accuracy, np.float64).reshape(-1)
    p = {"l1": 1, "l2": 2, "linf": np.inf}.get(norm)
    if p is None:
        raise ValueError(f"norm must be 'l1', 'l2' or 'linf', got {norm!r}.")
    arrays = []
    for m in margins:
        m = m.margins[p] if hasattr(m, "margins") else m
        arrays.append(np.asarray(m, np.float64).reshape(-1))
    if not (len(arrays) == vals.size == acc.size) or vals.size == 0:
        raise ValueError(f"values, margins and accuracy must have the same non-zero length, "
                         f"got {vals.size}, {len(arrays)} and {acc.size}.")
    if np.any(~np.isfinite(vals)):
        raise ValueError("values must be finite.")
    order = np.argsort(vals, kind="stable")
    vals, acc = vals[order], acc[order]
    arrays = [arrays[i] for i in order]
    pct = np.array([[np.percentile(a, q) if a.size else np.nan for q in percentiles]
                    for a in arrays])

    fig = _figure((6.4, 4.2))
    ax = fig.add_subplot()
    _, _, mpl = _matplotlib()
    blues = mpl.colormaps["Blues"]
    handles = []
    for k, q in enumerate(percentiles):
        shade = blues(0.45 + 0.5 * k / max(1, len(percentiles) - 1))
        (h,) = ax.plot(vals, pct[:, k], marker="o", color=shade,
                       label=f"P{q:g} {_norm_tex(norm)} margin")
        handles.append(h)
    ax2 = ax.twinx()
    (h,) = ax2.plot(vals, 100 * acc, marker="s", ls="--", color="tab:red", label="accuracy")
    handles.append(h)
    if log_x is True or (log_x == "auto" and np.all(vals > 0)
                         and vals.max() / vals.min() > 100):
        ax.set_xscale("log")
    ax.set_xlabel(hyperparameter)
    ax.set_ylabel(f"{_norm_tex(norm)} margin (percentile)")
    ax2.set_ylabel("accuracy (%)", color="tab:red")
    ax2.tick_params(axis="y", colors="tab:red")
    ax.grid(alpha=0.3)
    ax.set_title(title or f"Margin and accuracy against {hyperparameter}")
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    return _finish(fig, path)


def _norm_tex(norm):
    return {"l1": "$\\ell_1$", "l2": "$\\ell_2$", "linf": "$\\ell_\\infty$"}[norm]


# ---------------------------------------------------------------------- Figure 3


def plot_stability_bounds(x, bounds, channel: int = 0, example: int = 0,
                          channel_name: str | None = None, title: str | None = None,
                          path=None):
    """Per-coordinate stability bounds of a time series (Figure 3).

    Draws one channel of the series over time and, as a band, the interval
    `[x_t + lower_t, x_t + upper_t]` in which each coordinate alone can move
    without leaving the linear region (`keras_roll.stability_bounds`).
    Unbounded sides are drawn to the edge of the plot and marked with triangles.

    Args:
        x: `[T, C]` (one series) or `[B, T, C]` inputs; `[T]` for one channel.
        bounds: a `keras_roll.StabilityBounds` or a `(lower, upper)` pair shaped
            like `x`.
        channel: the channel to draw.
        example: the example to draw when `x` has a batch axis.
        channel_name: legend / axis name of the channel.
        title: figure title.
        path: optional PNG path.

    Returns:
        The matplotlib `Figure`.

    Example:

    ```python
    sb = keras_roll.stability_bounds(model, x[:1])
    plot_stability_bounds(x[0], sb, channel=3, path="bounds.png")
    ```
    """
    lower, upper = (bounds.lower, bounds.upper) if hasattr(bounds, "lower") else bounds
    xs, lo, up = (np.asarray(a, np.float64) for a in (x, lower, upper))
    if xs.ndim == 1:
        xs = xs[:, None]
    if lo.ndim == xs.ndim + 1 or up.ndim == xs.ndim + 1:  # bounds of a batch, x one series
        xs = xs[None]
    if xs.ndim == 2:
        xs = xs[None]
    if lo.ndim == 1:
        lo, up = lo[:, None], up[:, None]
    if lo.ndim == 2:
        lo, up = lo[None], up[None]
    if xs.ndim != 3 or lo.shape[1:] != xs.shape[1:] or up.shape != lo.shape:
        raise ValueError(f"x must be [T, C] or [B, T, C] with bounds of the same shape; got "
                         f"x {np.shape(x)}, lower {np.shape(lower)}, upper {np.shape(upper)}.")
    if not 0 <= example < xs.shape[0] or not 0 <= example < lo.shape[0]:
        raise ValueError(f"example must be in [0, {min(xs.shape[0], lo.shape[0])}), got "
                         f"{example}.")
    if not 0 <= channel < xs.shape[2]:
        raise ValueError(f"channel must be in [0, {xs.shape[2]}), got {channel}.")
    series = xs[example, :, channel]
    low = series + lo[example, :, channel]
    high = series + up[example, :, channel]
    t = np.arange(series.size)
    finite = np.concatenate([series, low[np.isfinite(low)], high[np.isfinite(high)]])
    span = float(finite.max() - finite.min()) or 1.0
    bottom, top = finite.min() - 0.15 * span, finite.max() + 0.15 * span
    low_d, high_d = np.maximum(low, bottom), np.minimum(high, top)

    fig = _figure((7.2, 3.8))
    ax = fig.add_subplot()
    name = channel_name or f"channel {channel}"
    ax.fill_between(t, low_d, high_d, color="tab:orange", alpha=0.35, step="mid",
                    label="stability interval $[x + \\ell, x + u]$")
    ax.plot(t, series, color="tab:blue", lw=1.6, marker=".", label=name)
    for side, vals, y, marker in (("lower", low, bottom, "v"), ("upper", high, top, "^")):
        inf = ~np.isfinite(vals)
        if inf.any():
            ax.scatter(t[inf], np.full(inf.sum(), y), marker=marker, color="tab:orange",
                       s=22, label=f"unbounded {side} side", zorder=3)
    ax.set_ylim(bottom - 0.02 * span, top + 0.02 * span)
    ax.set_xlim(t[0] - 0.5, t[-1] + 0.5)
    ax.set_xlabel("time step")
    ax.set_ylabel(f"value of {name}")
    ax.grid(alpha=0.3)
    ax.set_title(title or f"Per-coordinate stability bounds ({name})")
    ax.legend(loc="best", fontsize=8)
    return _finish(fig, path)


# ---------------------------------------------------------------------- Figures 4-6


def plot_attribution_grid(images, columns: dict, row_labels=None, image_shape=None,
                          title: str | None = None, path=None, cmap: str = "inferno"):
    """An image grid: the original images, then one column per attribution map.

    Args:
        images: `[n, H, W]`, `[n, H, W, C]` (C = 1 or 3), or flat `[n, D]` with
            `image_shape`.
        columns: `{column title: [n, ...] maps}` in display order; each map is
            post-processed as in the paper's Appendix K (`postprocess_saliency`)
            unless it already lies in [0, 1] with the image's height and width.
        row_labels: optional `n` labels for the rows.
        image_shape: `(H, W)` or `(H, W, C)` to reshape flat inputs.
        title: figure title.
        path: optional PNG path.
        cmap: colour map of the attribution maps.

    Returns:
        The matplotlib `Figure`.

    Example:

    ```python
    plot_attribution_grid(x[:4], {"gradient": sal.maps, "IG": ig.attributions},
                          path="grid.png")
    ```
    """
    imgs = _as_images(images, image_shape, "images")
    n = imgs.shape[0]
    if not isinstance(columns, dict) or not columns:
        raise ValueError("columns must be a non-empty dict {title: maps}.")
    maps = {}
    for name, m in columns.items():
        m = np.asarray(m, np.float64)
        if m.shape[0] != n:
            raise ValueError(f"column '{name}' has {m.shape[0]} maps for {n} images.")
        if m.ndim == 2 and image_shape is not None:
            m = m.reshape(n, *image_shape)
        if not (m.ndim == 3 and m.shape[1:] == imgs.shape[1:3] and m.min() >= 0
                and m.max() <= 1):
            m = postprocess_saliency(m)
        if m.shape[1:] != imgs.shape[1:3]:
            raise ValueError(f"column '{name}' maps have shape {m.shape[1:]} after "
                             f"post-processing; expected {imgs.shape[1:3]}.")
        maps[name] = m
    cols = 1 + len(maps)
    fig = _figure((1.9 * cols + 0.9, 1.9 * n + 0.7))
    axes = fig.subplots(n, cols, squeeze=False)
    im = None
    for r in range(n):
        img = imgs[r]
        axes[r, 0].imshow(img[..., 0] if img.shape[-1] == 1 else img,
                          cmap="gray" if img.shape[-1] == 1 else None,
                          interpolation="nearest")
        for c, m in enumerate(maps.values(), start=1):
            im = axes[r, c].imshow(m[r], cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
        for c in range(cols):
            ax = axes[r, c]
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title("original" if c == 0 else list(maps)[c - 1], fontsize=9)
            if r == n - 1:
                ax.set_xlabel("width (px)", fontsize=7)
        label = row_labels[r] if row_labels is not None else f"example {r}"
        axes[r, 0].set_ylabel(f"{label}\nheight (px)", fontsize=8)
    cbar = fig.colorbar(im, ax=axes[:, 1:].ravel().tolist(), shrink=0.8, pad=0.02)
    cbar.set_label("attribution (normalised |sum over channels|)", fontsize=8)
    fig.suptitle(title or "Attributions", fontsize=11)
    return _finish(fig, path)


def plot_gradient_comparison(models: dict, x, y=None, eps: float = 8 / 256,
                             domain=(0.0, 1.0), population: int = 4800,
                             generations: int = 30, ig_steps: int | None = None,
                             seed: int | None = 0, image_shape=None,
                             title: str | None = None, path=None, verbose="auto"):
    """Gradients, worst-case gradients and integrated gradients of two models (Figs. 4-6).

    For each model: the saliency map at `x`, the saliency map at the worst-case
    point of `keras_roll.gradient_distortion(mode="max")` (the "adversarial
    gradient"), and integrated gradients (exact with `ig_steps=None`), every map
    post-processed as in Appendix K; one row per example, the models side by side.

    Args:
        models: `{name: model}`, usually two (e.g. "vanilla" and "ROLL").
        x: `[n, *input_shape]` images.
        y: `[n]` labels (None: each model's prediction).
        eps, domain, population, generations, seed: of the distortion search.
        ig_steps: None (exact integrated gradients) or Riemann points.
        image_shape: `(H, W[, C])` for flat inputs.
        title: figure title.
        path: optional PNG path.
        verbose: progress bars of the searches.

    Returns:
        The matplotlib `Figure`.

    Example:

    ```python
    plot_gradient_comparison({"vanilla": m0, "ROLL": m1}, x_test[:4], y_test[:4],
                             eps=8 / 256, path="figure4.png")
    ```
    """
    if not isinstance(models, dict) or not models:
        raise ValueError("models must be a non-empty dict {name: model}.")
    columns = {}
    for name, model in models.items():
        grad = saliency(model, x, y)
        labels = grad.labels
        worst = gradient_distortion(model, x, labels, eps=eps, domain=domain, mode="max",
                                    population=population, generations=generations,
                                    seed=seed, verbose=verbose)
        adv = saliency(model, worst.points, labels)
        ig = integrated_gradients(model, x, labels, steps=ig_steps, verbose=verbose)
        columns[f"{name}\ngradient"] = _shaped(grad.gradient, image_shape)
        columns[f"{name}\nadv. gradient"] = _shaped(adv.gradient, image_shape)
        columns[f"{name}\nintegrated grad."] = _shaped(ig.attributions, image_shape)
    columns = {k: postprocess_saliency(v) for k, v in columns.items()}
    return plot_attribution_grid(
        _shaped(np.asarray(x), image_shape), columns, image_shape=None,
        title=title or (f"Gradient, worst-case gradient (eps={eps:g}) and integrated "
                        f"gradients"), path=path)


def _shaped(a, image_shape):
    a = np.asarray(a)
    return a if image_shape is None else a.reshape(a.shape[0], *image_shape)


def _as_images(images, image_shape, name):
    imgs = np.asarray(images, np.float64)
    if image_shape is not None:
        imgs = imgs.reshape(imgs.shape[0], *image_shape)
    if imgs.ndim == 3:
        imgs = imgs[..., None]
    if imgs.ndim != 4 or imgs.shape[-1] not in (1, 3):
        raise ValueError(f"{name} must be [n, H, W], [n, H, W, 1 or 3], or flat with "
                         f"image_shape; got shape {np.shape(images)}.")
    lo = imgs.min(axis=(1, 2, 3), keepdims=True)
    hi = imgs.max(axis=(1, 2, 3), keepdims=True)
    if imgs.min() < 0 or imgs.max() > 1:  # show any range: rescale each image to [0, 1]
        imgs = (imgs - lo) / np.where(hi > lo, hi - lo, 1.0)
    return imgs

