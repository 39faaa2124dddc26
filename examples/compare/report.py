"""The comparison's table and figure: one row per model (a model chosen at both
operating points is one row), the leader of each column, and margin against accuracy
with one point per model.

What the report claims depends on the run (`Ranking`): a `--quick` run prints no
leaders and says that its numbers cannot rank the methods; epochs too short to time
(`MIN_EPOCH_S`) drop the time column.

Example:

```python
rows = table_rows(vanilla, points, measures, labels)
md = write_report(rows, out, "MNIST, 784-300x4-10", (0.1, 0.3), notes,
                  Ranking(rank=False, timed=False))
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

__all__ = ["MIN_EPOCH_S", "Column", "Ranking", "columns", "leaders", "table_rows",
           "write_report"]

POINT_NAMES = {drop: what for drop, _, what in DROPS}
FIXED = "fixed (--fixed)"
# Epochs shorter than this (vanilla's median, in seconds) are not timed against each
# other: scheduling noise on a shared CPU is then as large as the differences.
MIN_EPOCH_S = 5.0


class Ranking(NamedTuple):
    """What the report may claim.

    Attributes:
        rank: whether the run is large enough to name each column's leaders (False
            under `--quick`: the report says its numbers cannot rank the methods).
        timed: whether the time column is shown (epochs long enough to time).
        why: the sentence that says why not, when either is False.
    """

    rank: bool = True
    timed: bool = True
    why: tuple = ()


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


def columns(certified_eps, timed: bool = True) -> list[Column]:
    """The table's columns, with one certified-accuracy column per radius (beside the
    clean accuracy on the same images), and the time column when `timed`."""
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
    cols += [Column("robust_acc", "acc. (radius images)", percent, 0)]
    cols += [Column(f"cert_{eps:g}", f"cert. acc. l_inf {eps:g}", percent, +1)
             for eps in certified_eps]
    cols += [Column("expected_p50", "distortion P50 (expected)", fmt, -1),
             Column("worst_p50", "distortion P50 (worst)", fmt, -1),
             Column("clr", "#CLR", _text), Column("clr_lower", "#CLR lower", fmt, -1)]
    if timed:
        cols.append(Column("time_ratio", "time / epoch (x vanilla)", fmt, -1))
    return cols


def _row(label: str, point: str, knob: str, val_acc, m: Measures, epoch_s, vanilla_s,
         tag: str) -> dict:
    row = {"label": label, "point": point, "knob": knob, "val_acc": val_acc, "tag": tag,
           "test_acc": m.test_acc, "robust_acc": m.robust_acc,
           "expected_p50": m.expected_p50, "worst_p50": m.worst_p50,
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
    met is a row that says so); a model chosen at several points (or also trained by
    `--fixed`) is one row that names them all ("same accuracy, 1 % less accuracy").

    Args:
        vanilla: vanilla's training row.
        points: the `OperatingPoint`s of the tuned methods.
        measures: `{tag: Measures}` of every chosen model and vanilla.
        labels: `{method name: label}`.
    """
    rows = [_row("vanilla", "reference", "-", vanilla["val_acc"], measures[vanilla["tag"]],
                 vanilla["epoch_s"], vanilla["epoch_s"], vanilla["tag"])]
    for point in points:
        what = POINT_NAMES.get(point.drop, FIXED)
        if point.row is None:
            unmet = next((row for row in rows if row["label"] == labels[point.method]
                          and row.get("tag") is None), None)
            if unmet is not None:  # one row for the method's points that none met
                unmet["point"] += f", {what}"
            else:
                rows.append({"label": labels[point.method], "point": what,
                             "knob": "none met the target"})
            continue
        r = point.row
        same = next((row for row in rows if row.get("tag") == r["tag"]), None)
        if same is not None:  # the same model at another point: one row
            same["point"] += f", {what}"
            continue
        rows.append(_row(labels[point.method], what, f"{r['knob']}={r['value']:g}",
                         r["val_acc"], measures[r["tag"]], r["epoch_s"], vanilla["epoch_s"],
                         r["tag"]))
    return rows


def points_of(row: dict) -> list[str]:
    """The operating points a table row stands for ("reference", "same accuracy",
    "1 % less accuracy", "fixed (--fixed)")."""
    return row["point"].split(", ")


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


def _at_target(row: dict) -> bool:
    """Whether the row's model meets an accuracy target (vanilla, or an operating
    point; not only `--fixed`)."""
    return any(p in ("reference", *POINT_NAMES.values()) for p in points_of(row))


def write_report(rows: list[dict], out: Path, title: str, certified_eps,
                 notes=(), ranking: Ranking = Ranking()) -> str:
    """Writes `out/compare.md` / `.json` (the table, its notes and, when `ranking.rank`,
    each column's leaders at each operating point) and `out/compare.png` (the figure);
    returns the Markdown."""
    cols = columns(certified_eps, ranking.timed)
    same = POINT_NAMES[DROPS[0][0]]
    targets = [r for r in rows if _at_target(r)]
    at_same = [r for r in targets if {"reference", same} & set(points_of(r))]
    if ranking.rank:
        lead = [f"Leads at vanilla's accuracy (vanilla and the {same} rows): "
                + "; ".join(leaders(at_same, cols)) + ".",
                "Leads within one point of it (vanilla and every operating point): "
                + "; ".join(leaders(targets, cols)) + "."]
        if len(targets) < len(rows):
            lead.append("The --fixed rows meet no accuracy target and lead nothing here.")
    else:
        lead = []
    md = write_table(out, "compare", title, [(c.key, c.header, c.cell) for c in cols], rows,
                     notes=[*notes, *ranking.why, *lead])
    figure(rows, out / "compare.png", title, certified_eps[0] if certified_eps else None)
    return md


MARKERS = {"reference": "*", "same accuracy": "o", "1 % less accuracy": "s", FIXED: "x"}


def _limits(values, log: bool = False) -> tuple[float, float] | None:
    """Axis limits that hold `values` with a margin (None: no finite value): a factor
    1.5 on a log axis, else 8 % of the range and at least 1 on each side, within
    [0, 100] (percentages)."""
    values = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or not log)]
    if not values:
        return None
    lo, hi = min(values), max(values)
    if log:
        return lo / 1.5, hi * 1.5
    pad = max(0.08 * (hi - lo), 1.0)
    return max(lo - pad, -1.0), min(hi + pad, 101.0)


def figure(rows: list[dict], path: Path, title: str, eps=None):
    """Median l2 region margin against test accuracy and, with `eps`, certified
    accuracy at l_inf `eps` against the clean accuracy on the same images: one point
    per model, a colour per method, a marker per operating point (a cross for the
    `--fixed` models). The axes hold the models that meet an operating point; a
    `--fixed` model outside them is counted in the panel's corner."""
    panels = [("test_acc", "test accuracy (%)", "l2_p50", "median l2 region margin (pixels)",
               True)]
    if eps is not None:
        panels.append(("robust_acc", "accuracy on the radius images (%)", f"cert_{eps:g}",
                       f"certified accuracy at l_inf {eps:g} (%)", False))
    fig = new_figure((5.0 * len(panels) + 1.6, 4.2))
    shown = [r for r in rows if r.get("test_acc") is not None]
    framed = [r for r in shown if _at_target(r)] or shown
    labels = list(dict.fromkeys(r["label"] for r in shown))
    colours = {label: f"C{i}" for i, label in enumerate(labels)}
    for i, (xkey, xlabel, ykey, ylabel, log) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        scale = 1.0 if log else 100.0  # accuracies in percent
        for r in shown:
            if r.get(xkey) is None or r.get(ykey) is None:
                continue
            ax.scatter(100 * r[xkey], scale * r[ykey],
                       s=55 if r["point"] == "reference" else 30, c=colours[r["label"]],
                       marker=MARKERS.get(points_of(r)[0], "x"))
        use_log = log and all(r[ykey] > 0 for r in framed)
        if use_log:
            ax.set_yscale("log")
        xlim = _limits([100 * r.get(xkey) for r in framed if r.get(xkey) is not None])
        ylim = _limits([scale * r[ykey] for r in framed if r.get(ykey) is not None], use_log)
        if xlim and ylim:
            ax.set_xlim(*xlim)
            ax.set_ylim(*ylim)
            outside = sum(1 for r in shown if r.get(xkey) is not None
                          and r.get(ykey) is not None
                          and not (xlim[0] <= 100 * r[xkey] <= xlim[1]
                                   and ylim[0] <= scale * r[ykey] <= ylim[1]))
            if outside:
                ax.text(0.02, 0.02, f"{outside} --fixed model(s) outside the axes",
                        transform=ax.transAxes, fontsize=7, color="grey")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles = [ax.scatter([], [], c=colours[label], marker="o", label=label) for label in labels]
    handles += [ax.scatter([], [], c="grey", marker=m, label=point)
                for point, m in MARKERS.items()
                if any(points_of(r)[0] == point for r in shown)]
    fig.legend(handles=handles, loc="outside right center", fontsize=8)
    fig.suptitle(title, fontsize=9)
    return finish(fig, path)
