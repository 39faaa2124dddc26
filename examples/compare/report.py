"""The comparison's table and figure: one row per method and operating point, the
leader of each column, and margin against accuracy with one point per model.

Example:

```python
rows = table_rows(vanilla, points, measures, labels)
md = write_report(rows, out, "MNIST, 784-300x4-10", notes)
```
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from examples.common.selection import DROPS
from examples.common.tables import fmt, percent, write_table
from examples.compare.measure import Measures
from examples.compare.train import OperatingPoint
from keras_roll.plots.canvas import finish, new_figure

__all__ = ["Column", "columns", "leaders", "table_rows", "write_report"]

POINT_NAMES = {drop: what for drop, _, what in DROPS}


class Column(NamedTuple):
    """One column: its row key, header, cell formatter and which way is better
    (+1: larger, -1: smaller, 0: not ranked)."""

    key: str
    header: str
    cell: object
    better: int = 0


def _text(value) -> str:
    return "-" if value is None else str(value)


def _bracket(pair) -> str:
    if pair is None:
        return "-"
    lower, upper = pair
    return f"[{fmt(lower)}, {fmt(upper)}]"


def columns(certified_eps) -> list[Column]:
    """The table's columns, with one certified-accuracy column per radius."""
    cols = [Column("label", "method", _text), Column("point", "operating point", _text),
            Column("knob", "knob", _text), Column("val_acc", "val. acc.", percent, 0),
            Column("test_acc", "test acc.", percent, +1)]
    for name, head in (("l1", "l1"), ("l2", "l2"), ("linf", "l_inf")):
        cols += [Column(f"{name}_p25", f"{head} P25", fmt, +1),
                 Column(f"{name}_p50", f"{head} P50", fmt, +1)]
    cols += [Column("robust_l2_lower", "radius l2 lower", fmt, +1),
             Column("robust_l2", "radius l2 [lower, upper]", _bracket),
             Column("robust_linf_lower", "radius l_inf lower", fmt, +1),
             Column("robust_linf", "radius l_inf [lower, upper]", _bracket)]
    cols += [Column(f"cert_{eps:g}", f"cert. acc. l_inf {eps:g}", percent, +1)
             for eps in certified_eps]
    cols += [Column("expected_p50", "distortion P50 (expected)", fmt, -1),
             Column("worst_p50", "distortion P50 (worst)", fmt, -1),
             Column("clr", "#CLR", _text), Column("clr_lower", "#CLR lower", fmt, -1),
             Column("time_ratio", "time / epoch (x vanilla)", fmt, -1)]
    return cols


def _row(label: str, point: str, knob: str, val_acc, m: Measures, epoch_s, vanilla_s) -> dict:
    row = {"label": label, "point": point, "knob": knob, "val_acc": val_acc,
           "test_acc": m.test_acc, "expected_p50": m.expected_p50, "worst_p50": m.worst_p50,
           "clr_lower": m.clr_lower, "clr": f"[{m.clr_lower:,}, {m.clr_upper:,}]",
           "time_ratio": epoch_s / vanilla_s if vanilla_s else None}
    for name in ("l1", "l2", "linf"):
        for q in (25, 50):
            row[f"{name}_p{q}"] = getattr(m, f"{name}_p{q}")
        row[f"robust_{name}"] = m.robust.get(name)
        if name in m.robust:
            row[f"robust_{name}_lower"] = m.robust[name][0]
    for eps, acc in m.certified.items():
        row[f"cert_{eps:g}"] = acc
    return row


def table_rows(vanilla: dict, points: list[OperatingPoint], measures: dict,
               labels: dict) -> list[dict]:
    """The table's rows: vanilla, then each method's operating points (a point no model
    met is a row that says so).

    Args:
        vanilla: vanilla's training row.
        points: the `OperatingPoint`s of the tuned methods.
        measures: `{tag: Measures}` of every chosen model and vanilla.
        labels: `{method name: label}`.
    """
    rows = [_row("vanilla", "reference", "-", vanilla["val_acc"], measures[vanilla["tag"]],
                 vanilla["epoch_s"], vanilla["epoch_s"])]
    for point in points:
        what = POINT_NAMES.get(point.drop, "fixed (--fixed)")
        if point.row is None:
            rows.append({"label": labels[point.method], "point": what,
                         "knob": "none met the target"})
            continue
        r = point.row
        rows.append(_row(labels[point.method], what, f"{r['knob']}={r['value']:g}",
                         r["val_acc"], measures[r["tag"]], r["epoch_s"], vanilla["epoch_s"]))
    return rows


def leaders(rows: list[dict], cols: list[Column]) -> list[str]:
    """For each ranked column, the rows that lead it (ties share), as sentences."""
    lines = []
    for col in cols:
        if not col.better:
            continue
        vals = [(r[col.key], r) for r in rows
                if isinstance(r.get(col.key), (int, float)) and not math.isnan(r[col.key])]
        if not vals:
            continue
        best = max(v * col.better for v, _ in vals)
        if len(vals) > 1 and all(v * col.better == best for v, _ in vals):
            lines.append(f"{col.header}: all equal ({col.cell(best * col.better)})")
            continue
        who = [f"{r['label']} ({r['point']})" for v, r in vals if v * col.better == best]
        lines.append(f"{col.header}: {', '.join(who)} ({col.cell(best * col.better)})")
    return lines


def write_report(rows: list[dict], out: Path, title: str, certified_eps,
                 notes=()) -> str:
    """Writes `out/compare.md` / `.json` (the table, its notes and each column's
    leaders at each operating point) and `out/compare.png` (the figure); returns the
    Markdown."""
    cols = columns(certified_eps)
    same = POINT_NAMES[DROPS[0][0]]
    targets = [r for r in rows if r["point"] in ("reference", *POINT_NAMES.values())]
    at_same = [r for r in targets if r["point"] in ("reference", same)]
    lead = [f"Leads at vanilla's accuracy (vanilla and the {same} rows): "
            + "; ".join(leaders(at_same, cols)) + ".",
            "Leads within one point of it (vanilla and every operating point): "
            + "; ".join(leaders(targets, cols)) + "."]
    if len(targets) < len(rows):
        lead.append("The --fixed rows meet no accuracy target and lead nothing here.")
    md = write_table(out, "compare", title, [(c.key, c.header, c.cell) for c in cols], rows,
                     notes=[*notes, *lead])
    figure(rows, out / "compare.png", title, certified_eps[0] if certified_eps else None)
    return md


MARKERS = {"reference": "*", "same accuracy": "o", "1 % less accuracy": "s"}


def figure(rows: list[dict], path: Path, title: str, eps=None):
    """Median l2 region margin (and, with `eps`, certified accuracy at l_inf `eps`)
    against test accuracy, one point per model: a colour per method, a marker per
    operating point (a cross for the `--fixed` models)."""
    panels = [("l2_p50", "median l2 region margin (pixels)", True)]
    if eps is not None:
        panels.append((f"cert_{eps:g}", f"certified accuracy at l_inf {eps:g}", False))
    fig = new_figure((5.0 * len(panels) + 1.6, 4.2))
    shown = [r for r in rows if r.get("test_acc") is not None]
    labels = list(dict.fromkeys(r["label"] for r in shown))
    colours = {label: f"C{i}" for i, label in enumerate(labels)}
    for i, (key, ylabel, log) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for r in shown:
            ax.scatter(100 * r["test_acc"], r[key], s=55 if r["point"] == "reference" else 30,
                       c=colours[r["label"]], marker=MARKERS.get(r["point"], "x"))
        if log and all(r[key] > 0 for r in shown):
            ax.set_yscale("log")
        ax.set_xlabel("test accuracy (%)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles = [ax.scatter([], [], c=colours[label], marker="o", label=label) for label in labels]
    handles += [ax.scatter([], [], c="grey", marker=m, label=point)
                for point, m in [*MARKERS.items(), ("fixed (--fixed)", "x")]
                if any(r["point"] == point for r in shown)]
    fig.legend(handles=handles, loc="outside right center", fontsize=8)
    fig.suptitle(title, fontsize=9)
    return finish(fig, path)
