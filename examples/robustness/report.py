"""The robustness example's outputs: one table row per model, the Markdown table and the
figure of per-input [lower, upper] intervals.

Example:

```python
row = report.row("vanilla", rr, seconds, radii=(0.01, 0.03, 0.1))
md = report.table([row], out, config, "MNIST", 10)
```
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from examples.common.tables import fmt, percent, write_table
from keras_roll.summary import percentiles_of

LABELS = {2: "l2", np.inf: "linf"}


def row(label: str, rr, seconds: float, radii) -> dict:
    """The table row of one model's `RobustRadius`."""
    out = {"model": label, "acc": rr.certified_accuracy(0.0), "n": rr.n,
           "seconds_per_input": seconds / max(rr.n, 1)}
    ok = rr.correct
    for p, name in LABELS.items():
        lower, upper = rr.lower[p][ok], rr.upper[p][ok]
        out[f"{name}_lower_p50"] = percentiles_of(lower, (50,))[0]
        out[f"{name}_upper_p50"] = percentiles_of(upper[np.isfinite(upper)], (50,))[0]
        out[f"{name}_exact"] = float(np.mean(rr.exact[p][ok])) if ok.any() else None
        gap = rr.gap(p)[ok]
        p50, p90 = percentiles_of(gap[np.isfinite(upper)], (50, 90))
        out[f"{name}_gap"] = f"{fmt(p50)} / {fmt(p90)}"
        out[f"{name}_lower_from"] = _counts(rr.lower_method[p][ok])
    for eps in radii:
        out[f"cert_{eps:g}"] = rr.certified_accuracy(eps, np.inf)
    return out


def _counts(methods) -> str:
    names, counts = np.unique(np.asarray(methods), return_counts=True)
    return ", ".join(f"{n} {c}" for n, c in zip(names, counts))


def table(rows, out: Path, config, dataset: str, classes: int) -> str:
    """Writes `out/robustness.md` (and `.json`); returns the Markdown."""
    columns = [("model", "Model", str), ("acc", "ACC", percent)]
    for name in LABELS.values():
        columns += [(f"{name}_lower_p50", f"{name} lower P50", fmt),
                    (f"{name}_upper_p50", f"{name} upper P50", fmt),
                    (f"{name}_exact", f"{name} exact", percent),
                    (f"{name}_gap", f"{name} upper/lower P50 / P90", str)]
    columns += [(f"cert_{eps:g}", f"cert. acc. linf {eps:g}", percent) for eps in config.radii]
    columns += [("seconds_per_input", "s / input", fmt)]
    arch = f"784-{config.width}x{config.depth}-{classes} ReLU"
    notes = [f"Bounds on the minimal adversarial perturbation of the first {rows[0]['n']} "
             f"test images in [0, 1] pixel units (no clipping to [0, 1]), "
             f"keras_roll.robust_radius(method='{config.method.value}', "
             f"rigor='{config.rigor.value}'); percentiles over the correctly classified "
             f"ones; misclassified images count as radius 0 in the certified accuracy.",
             "Lower bounds from: " + "; ".join(
                 f"{r['model']}: l2 [{r['l2_lower_from']}], linf [{r['linf_lower_from']}]"
                 for r in rows)]
    return write_table(out, "robustness", f"Certified robustness radii: {dataset}, {arch}",
                       columns, rows, notes)


def save(rr, path: Path) -> None:
    """The bounds of one model as `.npz` (lower / upper / exact per norm, predicted)."""
    arrays = {"predicted": rr.predicted}
    for p, name in LABELS.items():
        arrays.update({f"{name}_lower": rr.lower[p], f"{name}_upper": rr.upper[p],
                       f"{name}_exact": rr.exact[p]})
    np.savez(path, **arrays)


def figure(results, path: Path) -> Path:
    """Writes `draw(results)` to `path` (PNG); returns the path."""
    draw(results).savefig(path, dpi=110)
    return path


def draw(results):
    """Per-input [lower, upper] intervals, one panel per norm, the models side by side,
    inputs sorted by the lower bound, black dots where the bounds meet (exact; in the
    legend only when there are some). `results`: `[(label, RobustRadius)]`; returns the
    matplotlib Figure (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    colors = ("tab:blue", "tab:orange", "tab:green")
    for ax, (p, name) in zip(axes, LABELS.items()):
        any_exact = False
        for k, (label, rr) in enumerate(results):
            ok = np.flatnonzero(rr.correct)
            order = ok[np.argsort(rr.lower[p][ok])]
            pos = np.arange(order.size) + 0.3 * k
            lo, up = rr.lower[p][order], rr.upper[p][order]
            top = np.where(np.isfinite(up), up, lo)
            ax.vlines(pos, lo, top, color=colors[k % 3], lw=1.2, label=label)
            ax.plot(pos, lo, "_", color=colors[k % 3], ms=4)
            exact = np.asarray(rr.exact[p][order], bool)
            if exact.any():  # a legend entry only for what is drawn
                ax.plot(pos[exact], lo[exact], ".", color="k", ms=3,
                        label=None if any_exact else "exact (lower = upper)")
                any_exact = True
        ax.set_yscale("log")
        ax.set_xlabel("test image (sorted by lower bound)")
        ax.set_ylabel(f"minimal {name} perturbation")
        ax.set_title(f"{name}: [lower, upper] per input")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
