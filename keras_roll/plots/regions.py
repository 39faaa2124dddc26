"""The paper's Figure 1: the linear regions of a model with a 2-D input."""

from __future__ import annotations

import numpy as np

from keras_roll.certification.region_map import RegionMap
from keras_roll.plots.canvas import finish, matplotlib_modules, new_figure

__all__ = ["plot_linear_regions"]


def plot_linear_regions(regions: RegionMap, x=None, y=None, margins=None, class_names=None,
                        title: str | None = None, path=None):
    """Linear regions of a model with a 2-D input (the paper's Figure 1).

    Draws the prediction as a heat map over the grid of `regions`, the
    boundaries between linear regions (grid cells whose activation pattern
    differs from a neighbour's) and, around each point of `x`, the circle of its
    certified l2 margin: the largest disc inside its linear region.

    Args:
        regions: a `keras_roll.RegionMap` (`keras_roll.region_map(model, ...)`).
        x: optional `[n, 2]` (training) points to show.
        y: optional `[n]` integer labels of `x` (colours the points).
        margins: optional l2 radii of `x`: a `keras_roll.Certificate` of `x`
            (its `margins[2]`) or an `[n]` array; a circle is drawn per finite one.
        class_names: optional names of the classes for the legend.
        title: figure title (default names the model and counts the regions).
        path: optional PNG path.

    Returns:
        The matplotlib `Figure`.

    Example:

    ```python
    grid = keras_roll.region_map(model, bounds=((-1.2, 1.2), (-1.2, 1.2)), resolution=300)
    cert = keras_roll.certify(model, x_train[:50], norms=(2,))
    fig = keras_roll.plots.plot_linear_regions(grid, x_train[:50], y_train[:50], cert,
                                               path="regions.png")
    ```
    """
    if not isinstance(regions, RegionMap):
        raise TypeError(f"regions must be a RegionMap (keras_roll.region_map(model, ...)), "
                        f"got {type(regions).__name__}.")
    pts, labels, radii = _points(x, y, margins)
    (x0, x1), (y0, y1) = regions.bounds
    fig = new_figure((7.0, float(np.clip(5.6 * (y1 - y0) / (x1 - x0) + 0.9, 3.0, 8.0))))
    ax = fig.add_subplot()
    extent = (x0, x1, y0, y1)
    heat, label, cmap, vmin, vmax, ticks = _prediction_map(regions)
    im = ax.imshow(heat, origin="lower", extent=extent, cmap=cmap, vmin=vmin, vmax=vmax,
                   alpha=0.55, aspect="auto", interpolation="nearest")
    cbar = fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03)
    cbar.set_label(label)
    if ticks is not None:
        cbar.set_ticks(ticks)
        if class_names is not None:
            cbar.set_ticklabels([str(class_names[int(t)]) for t in ticks])
    overlay = np.zeros((*regions.ids.shape, 4))
    overlay[regions.boundaries()] = (0.1, 0.1, 0.1, 0.8)
    ax.imshow(overlay, origin="lower", extent=extent, aspect="auto", interpolation="nearest")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="0.1", lw=1.5, label="region boundary")]
    if pts is not None:
        handles += _draw_points(ax, pts, labels, radii, class_names)
    ax.set_xlim(x0, x1)
    ax.set_ylim(y0, y1)
    ax.set_aspect("equal")
    ax.set_xlabel("input $x_1$")
    ax.set_ylabel("input $x_2$")
    ax.set_title(title or f"Linear regions of '{regions.model_name}' ({regions.regions} on "
                          f"the grid)")
    ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.85)
    return finish(fig, path)


def _points(x, y, margins):
    """`(points [n, 2], labels [n] or None, radii [n] or None)`, checked."""
    if x is None:
        if y is not None or margins is not None:
            raise ValueError("y and margins describe the points x; pass x too.")
        return None, None, None
    pts = np.asarray(x, np.float64)
    if pts.ndim != 2 or pts.shape[1] != 2:
        raise ValueError(f"x must have shape [n, 2], got {np.shape(x)}.")
    n = pts.shape[0]
    labels = None if y is None else np.asarray(y).reshape(-1)
    if labels is not None and labels.shape != (n,):
        raise ValueError(f"y must have shape [n] = ({n},), got {np.shape(y)}.")
    radii = None
    if margins is not None:
        radii = margins.margins[2] if hasattr(margins, "margins") else margins
        radii = np.asarray(radii, np.float64).reshape(-1)
        if radii.shape != (n,):
            raise ValueError(f"margins must hold one l2 radius per point of x ({n}), got "
                             f"{radii.shape[0]}; certify x itself.")
    return pts, labels, radii


def _draw_points(ax, pts, labels, radii, class_names):
    """Scatters the points by class and circles their radii; returns legend handles."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Circle

    _, _, mpl = matplotlib_modules()
    handles = []
    classes = np.unique(labels) if labels is not None else [None]
    colors = mpl.colormaps["tab10"]
    for k, c in enumerate(classes):
        sel = slice(None) if c is None else labels == c
        name = "data" if c is None else (
            f"class {class_names[int(c)]}" if class_names is not None else f"class {c}")
        handles.append(ax.scatter(pts[sel, 0], pts[sel, 1], s=18, color=colors(k % 10),
                                  edgecolors="white", linewidths=0.6, zorder=3, label=name))
    if radii is not None:
        for p, r in zip(pts, radii):
            if np.isfinite(r):
                ax.add_patch(Circle(tuple(p), r, fill=False, color="black", lw=0.9, zorder=4))
        handles.append(Line2D([], [], marker="o", ls="", markerfacecolor="none",
                              markeredgecolor="black", markersize=9,
                              label="certified l2 margin"))
    return handles


def _prediction_map(regions):
    """(values [H, W], colour-bar label, cmap, vmin, vmax, ticks) of the heat map."""
    logits = regions.logits
    n_logits = logits.shape[-1]
    if n_logits == 1:
        if regions.output_link == "sigmoid":
            return 1 / (1 + np.exp(-logits[..., 0])), "P(class 1)", "RdBu_r", 0.0, 1.0, None
        lim = float(np.max(np.abs(logits))) or 1.0
        return logits[..., 0], "model output", "RdBu_r", -lim, lim, None
    if n_logits == 2:
        z = logits - logits.max(axis=-1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
        return p[..., 1], "P(class 1)", "RdBu_r", 0.0, 1.0, None
    pred = logits.argmax(axis=-1)
    _, _, mpl = matplotlib_modules()
    cmap = mpl.colormaps["tab10"].resampled(n_logits) if n_logits <= 10 else "viridis"
    return (pred, "predicted class", cmap, -0.5, n_logits - 0.5,
            list(range(n_logits)) if n_logits <= 20 else None)
