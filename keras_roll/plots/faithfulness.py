"""Deletion and Insertion curves of several attributions or models, side by side."""

from __future__ import annotations

import numpy as np

from keras_roll.plots.canvas import finish, new_figure

__all__ = ["plot_faithfulness"]

_TITLES = {"deletion": "Deletion (lower area is better)",
           "insertion": "Insertion (higher area is better)"}


def plot_faithfulness(results: dict, metrics=("deletion", "insertion"), band=(25, 75),
                      title: str | None = None, path=None):
    """The mean Deletion / Insertion curve of each result, with a percentile band.

    Args:
        results: `{name: keras_roll.Faithfulness}` (e.g. vanilla and ROLL models, or
            several attribution methods of one model), computed by the caller.
        metrics: the curves to draw, one panel each ("deletion", "insertion").
        band: the percentiles over examples shaded around each mean curve, or None.
        title: figure title.
        path: optional PNG path.

    Returns:
        The matplotlib `Figure`.

    Raises:
        ValueError: for an empty `results`, or a metric some result has no curve of.

    Example:

    ```python
    f = {name: keras_roll.faithfulness(m, x, None, keras_roll.integrated_gradients(
        m, x).maps) for name, m in models.items()}
    keras_roll.plots.plot_faithfulness(f, path="faithfulness.png")
    ```
    """
    metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    if not results:
        raise ValueError("results must hold at least one {name: Faithfulness}.")
    for name, res in results.items():
        missing = [m for m in metrics if m not in getattr(res, "curves", {})]
        if missing:
            raise ValueError(f"results[{name!r}] has no {', '.join(missing)} curve; compute "
                             f"it with keras_roll.faithfulness(..., metrics={metrics!r}).")
    fig = new_figure((4.2 * len(metrics), 3.6))
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    score = next(iter(results.values())).score_kind
    for ax, metric in zip(axes, metrics):
        for k, (name, res) in enumerate(results.items()):
            curves = np.asarray(res.curves[metric], np.float64)
            frac = 100 * np.asarray(res.fractions, np.float64)
            color = f"C{k}"
            ax.plot(frac, curves.mean(axis=0), color=color,
                    label=f"{name} (area {np.mean(res.scores[metric]):.3g})")
            if band is not None and curves.shape[0] > 1:
                low, high = np.percentile(curves, band, axis=0)
                ax.fill_between(frac, low, high, color=color, alpha=0.15, lw=0)
        ax.set_title(_TITLES.get(metric, metric), fontsize=10)
        ax.set_xlabel("features changed (%)")
        ax.set_ylabel("model output" if score == "model" else "logit")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=11)
    return finish(fig, path)
