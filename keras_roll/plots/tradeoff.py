"""The paper's Figure 2: margin percentiles and accuracy against a hyperparameter."""

from __future__ import annotations

import numpy as np

from keras_roll.plots.canvas import finish, matplotlib_modules, new_figure

__all__ = ["plot_margin_tradeoff"]


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
        The matplotlib `Figure`: margin percentiles on the left axis, accuracy on
        the right one.

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

    fig = new_figure((6.4, 4.2))
    ax = fig.add_subplot()
    _, _, mpl = matplotlib_modules()
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
    return finish(fig, path)


def _norm_tex(norm):
    return {"l1": "$\\ell_1$", "l2": "$\\ell_2$", "linf": "$\\ell_\\infty$"}[norm]
