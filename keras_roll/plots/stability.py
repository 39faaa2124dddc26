"""The paper's Figure 3: per-coordinate stability bounds of a time series."""

from __future__ import annotations

import numpy as np

from keras_roll.plots.canvas import finish, new_figure

__all__ = ["plot_stability_bounds"]


def plot_stability_bounds(x, bounds, channel: int = 0, example: int = 0,
                          channel_name: str | None = None, title: str | None = None,
                          path=None, ylim=None):
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
        ylim: `(bottom, top)` of the y axis, e.g. the same for the panels of two models
            that are compared; bounds beyond it are cut there (unbounded sides are
            marked on its edges). Default: the series and its finite bounds, with a
            15 % margin.

    Returns:
        The matplotlib `Figure`: the series and its band on one axis.

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
    shown = (bottom - 0.02 * span, top + 0.02 * span)
    if ylim is not None:
        bottom, top = shown = tuple(float(v) for v in ylim)
        if not (np.isfinite(bottom) and np.isfinite(top) and bottom < top):
            raise ValueError(f"ylim must be (bottom, top) with finite bottom < top; got "
                             f"{ylim!r}.")
    low_d, high_d = np.maximum(low, bottom), np.minimum(high, top)

    fig = new_figure((7.2, 3.8))
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
    ax.set_ylim(*shown)
    ax.set_xlim(t[0] - 0.5, t[-1] + 0.5)
    ax.set_xlabel("time step")
    ax.set_ylabel(f"value of {name}")
    ax.grid(alpha=0.3)
    ax.set_title(title or f"Per-coordinate stability bounds ({name})")
    ax.legend(loc="best", fontsize=8)
    return finish(fig, path)
