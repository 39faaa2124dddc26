"""The paper's Figures 4-6: image grids of attribution maps, and the comparison of
gradients, worst-case gradients and integrated gradients of models side by side."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from keras_roll.attribution.integrated import IntegratedGradients
from keras_roll.attribution.saliency import Saliency, postprocess_saliency
from keras_roll.plots.canvas import finish, new_figure

__all__ = ["GradientMaps", "plot_attribution_grid", "plot_gradient_comparison"]


def plot_attribution_grid(images, columns: dict, row_labels=None, image_shape=None,
                          title: str | None = None, path=None, cmap: str = "inferno"):
    """An image grid: the original images, then one column per attribution map.

    Args:
        images: `[n, H, W]`, `[n, H, W, C]` (C = 1 or 3), or flat `[n, D]` with
            `image_shape`.
        columns: `{column title: maps}` in display order; the maps are `[n, ...]`
            arrays, a `keras_roll.Saliency` (its `gradient`) or a
            `keras_roll.IntegratedGradients` (its `attributions`). Each map is
            post-processed as in the paper's Appendix K (`postprocess_saliency`)
            unless it already lies in [0, 1] with the image's height and width.
        row_labels: optional `n` labels for the rows.
        image_shape: `(H, W)` or `(H, W, C)` to reshape flat inputs.
        title: figure title.
        path: optional PNG path.
        cmap: colour map of the attribution maps.

    Returns:
        The matplotlib `Figure`: a row per image, the image and then its maps.

    Example:

    ```python
    plot_attribution_grid(x[:4], {"gradient": sal.maps, "IG": ig.maps},
                          path="grid.png")
    ```
    """
    imgs = _as_images(images, image_shape, "images")
    n = imgs.shape[0]
    if not isinstance(columns, dict) or not columns:
        raise ValueError("columns must be a non-empty dict {title: maps}.")
    maps = {}
    for name, m in columns.items():
        m = _maps_of(m)
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
    fig = new_figure((1.9 * cols + 0.9, 1.9 * n + 0.7))
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
    return finish(fig, path)


class GradientMaps(NamedTuple):
    """The maps of one model in `plot_gradient_comparison`.

    Attributes:
        gradient: `keras_roll.saliency(model, x, labels)`.
        worst: `keras_roll.saliency(model, distortion.points, labels)` at the
            worst-case points of `keras_roll.gradient_distortion(mode="max")`.
        integrated: `keras_roll.integrated_gradients(model, x, labels)`.
        worst_integrated: optional integrated gradients at the worst-case points.
    """

    gradient: Saliency
    worst: Saliency
    integrated: IntegratedGradients
    worst_integrated: IntegratedGradients | None = None


def plot_gradient_comparison(x, models: dict, eps: float | None = None, row_labels=None,
                             image_shape=None, title: str | None = None, path=None):
    """Gradients, worst-case gradients and integrated gradients of models side by side
    (the paper's Figures 4-6).

    For each model: its saliency map at `x`, its saliency map at the worst-case
    point of the gradient distortion search (the "adversarial gradient") and its
    integrated gradients, every map post-processed as in Appendix K; one row per
    example.

    Args:
        x: `[n, *input_shape]` images.
        models: `{name: GradientMaps}` in display order, usually two (e.g.
            "vanilla" and "ROLL").
        eps: the l_inf radius of the distortion search (for the title).
        row_labels: optional `n` labels for the rows.
        image_shape: `(H, W[, C])` for flat inputs.
        title: figure title.
        path: optional PNG path.

    Returns:
        The matplotlib `Figure`: a row per example, the maps of each model side
        by side.

    Example:

    ```python
    maps = {}
    for name, model in {"vanilla": m0, "ROLL": m1}.items():
        worst = keras_roll.gradient_distortion(model, x, y, eps=8 / 256, mode="max")
        maps[name] = GradientMaps(keras_roll.saliency(model, x, y),
                                  keras_roll.saliency(model, worst.points, y),
                                  keras_roll.integrated_gradients(model, x, y))
    plot_gradient_comparison(x, maps, eps=8 / 256, path="figure4.png")
    ```
    """
    if not isinstance(models, dict) or not models:
        raise ValueError("models must be a non-empty dict {name: GradientMaps}.")
    columns = {}
    for name, maps in models.items():
        if not isinstance(maps, GradientMaps):
            raise TypeError(f"models[{name!r}] must be a GradientMaps, got "
                            f"{type(maps).__name__}.")
        columns[f"{name}\ngradient"] = maps.gradient.gradient
        columns[f"{name}\nadv. gradient"] = maps.worst.gradient
        columns[f"{name}\nintegrated grad."] = maps.integrated.maps
        if maps.worst_integrated is not None:
            columns[f"{name}\nadv. integrated grad."] = maps.worst_integrated.maps
    columns = {k: postprocess_saliency(_shaped(v, image_shape)) for k, v in columns.items()}
    at = "" if eps is None else f" (eps={eps:g})"
    return plot_attribution_grid(
        _shaped(np.asarray(x), image_shape), columns, row_labels=row_labels,
        title=title or f"Gradient, worst-case gradient{at} and integrated gradients",
        path=path)


def _maps_of(result) -> np.ndarray:
    """The `[n, ...]` maps of a `Saliency`, an `IntegratedGradients` or an array."""
    if isinstance(result, Saliency):
        return np.asarray(result.gradient, np.float64)
    if isinstance(result, IntegratedGradients):
        return np.asarray(result.maps, np.float64)
    return np.asarray(result, np.float64)


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
