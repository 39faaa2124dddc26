"""The paper's model selection and the tables built on it: the paper-style table
(vanilla, then ROLL at the same and at 1 % less validation accuracy, each row saying
why when no ROLL model qualifies) and the table of every trained model.

Accuracies are compared in whole percent, as the paper's released code does (its
`parse_log.py` groups models by validation accuracy printed as `{:.0f}%`); among the
models that qualify, the largest validation P50 l2 margin wins.

Example:

```python
md, summary = selected_table(rows, out, "table1", "Table 1: MNIST")
runs_md = runs_table(rows, out, "MNIST: every trained model")
```
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from examples.common.app import log
from examples.common.margin_stats import NORMS, PERCENTILES
from examples.common.tables import fmt, percent, write_json, write_table

__all__ = ["DROPS", "GUARDED_COLUMNS", "Selection", "margin_columns", "model_label", "ratio",
           "runs_table", "select", "selected_table"]

# (drop in whole percent, summary key, what the row is called)
DROPS = ((0, "same_acc", "same accuracy"), (1, "acc_minus_1", "1 % less accuracy"))


class Selection(NamedTuple):
    """The outcome of `select`: the chosen row (None when no row qualifies), the
    validation accuracy cut-off in whole percent, and why, in words."""

    row: dict | None
    cutoff: int
    reason: str


def select(rows, vanilla: dict, drop: int, acc_key: str = "val_acc",
           margin_key: str = "val_l2_p50") -> Selection:
    """The largest `margin_key` among `rows` whose `acc_key`, in whole percent, is at
    least vanilla's minus `drop`.

    Example:

    ```python
    same = select(roll_rows, vanilla_row, drop=0).row   # "at the same accuracy"
    ```
    """
    cutoff = round(100 * vanilla[acc_key]) - drop
    cands = [r for r in rows if round(100 * r[acc_key]) >= cutoff
             and r.get(margin_key) is not None]
    accs = ", ".join(f"{r['tag']} {round(100 * r[acc_key])} %" for r in rows) or "none trained"
    if not cands:
        return Selection(None, cutoff, f"no ROLL model reaches validation accuracy {cutoff} % "
                                       f"(vanilla {round(100 * vanilla[acc_key])} % minus "
                                       f"{drop}); ROLL models: {accs}")
    best = max(cands, key=lambda r: r[margin_key])
    return Selection(best, cutoff, f"{best['tag']}: the largest validation P50 l2 margin "
                                   f"among those at >= {cutoff} % ({accs})")


def ratio(a, b):
    """`a / b`, or None when either is missing or `b` is 0."""
    if a is None or b is None or b == 0:
        return None
    return float(a) / float(b)


def model_label(row) -> str:
    """'Vanilla' or 'ROLL (lam=.., C=.., gamma=.., estimator)' for a result row."""
    if row.get("lam") is None:
        return "Vanilla"
    return (f"ROLL (lam={row['lam']:g}, C={row['C']:g}, gamma={row['gamma']:g}, "
            f"{row['estimator']})")


def margin_columns(prefix: str = ""):
    """Table columns `(key, header, formatter)` of the accuracy, #CLR and margins."""
    cols = [(f"{prefix}acc", "ACC", percent), (f"{prefix}clr", "#CLR", fmt)]
    for name in NORMS:
        cols += [(f"{prefix}{name}_p{q}", f"{name} P{q}", fmt) for q in PERCENTILES]
    return cols


GUARDED_COLUMNS = [("spearman", "Spearman l1-l2", fmt),
                   ("guarded_l2_p50", "P50 l2, float32 model", fmt),
                   ("guarded_frac", "certified > 0", percent)]


def selected_table(rows, out: Path, name: str, title: str, notes=(), verbose: bool = True):
    """The paper-style table: vanilla, then ROLL selected on validation at the same and
    at 1 % lower accuracy, with the ratio of P50 l2 margins. A selection no ROLL model
    qualifies for stays in the table as a row saying so, and the log says why (the
    cut-off and every ROLL model's validation accuracy). Without a vanilla row every
    ROLL row is shown; without ROLL rows, vanilla alone.

    Writes `out/name.md` / `.json` and `out/summary.json` (vanilla accuracy, the
    selected models and their ratios, the Spearman l1-l2 correlation of every model).
    Returns `(markdown, summary)`. `verbose=False`: the log does not say why.

    Example:

    ```python
    md, summary = selected_table(rows, out, "table1", "Table 1: MNIST")
    summary["same_acc"]["ratio_l2_p50"]
    ```
    """
    vanilla = next((r for r in rows if r.get("lam") is None), None)
    rolls = [r for r in rows if r.get("lam") is not None]
    shown, summary = [], {}
    if vanilla is None:
        shown += [{**r, "model": model_label(r), "ratio": None} for r in rolls]
    else:
        shown.append({**vanilla, "model": "Vanilla", "ratio": 1.0})
        summary.update(vanilla_acc=vanilla["acc"], vanilla_val_acc=vanilla["val_acc"])
        for drop, key, what in DROPS if rolls else ():
            sel = select(rolls, vanilla, drop)
            if verbose:
                log(f"ROLL at {what}: {sel.reason}.")
            if sel.row is None:
                summary[key] = None
                shown.append({"model": f"ROLL at {what}: none qualified (needs validation "
                                       f"ACC >= {sel.cutoff} %; see runs.md)"})
                continue
            r = ratio(sel.row["l2_p50"], vanilla["l2_p50"])
            summary[key] = {"tag": sel.row["tag"], "acc": sel.row["acc"],
                            "val_acc": sel.row["val_acc"], "l2_p50": sel.row["l2_p50"],
                            "ratio_l2_p50": r}
            shown.append({**sel.row, "model": f"ROLL at {what}: {model_label(sel.row)}",
                          "ratio": r})
    summary["spearman_l1_l2"] = {r["tag"]: r["spearman"] for r in rows}
    columns = ([("model", "Model", fmt), ("best_epoch", "epoch", fmt),
                ("val_acc", "val ACC", percent)] + margin_columns()
               + [("ratio", "P50 l2 / vanilla", fmt)] + GUARDED_COLUMNS)
    n = rows[0]["n"] if rows else 0
    notes = [f"ACC, #CLR (distinct Jacobians - distinct activation patterns, Lemma 7) and "
             f"margin percentiles over the {n:,} test points.",
             "Each model at its best validation-loss epoch (ROLL: cross entropy + lam * ROLL "
             "on the validation set). ROLL rows selected on validation: the largest "
             "validation P50 l2 margin among models whose validation accuracy, in whole "
             "percent, is at least vanilla's (same accuracy) or vanilla's minus 1.",
             "Margins: the network in exact arithmetic (the float64 twin, no rounding "
             "guard). 'P50 l2, float32 model' and 'certified > 0': what "
             "keras_roll.certify's default rigor='float64' certifies for the model as "
             "Keras evaluates it in float32 (radii shrunk by its rounding guard).",
             *notes]
    md = write_table(out, name, title, columns, shown, notes)
    write_json(out / "summary.json", summary)
    return md, summary


def runs_table(rows, out: Path, title: str) -> str:
    """Every trained model's full row (`out/runs.md` / `.json`): the validation numbers
    the selection saw, then every test column of the paper-style table."""
    rows = [{**r, "model": model_label(r),
             "epoch": f"{r['best_epoch']} of {r.get('epochs') or r['best_epoch']}"}
            for r in rows]
    columns = ([("model", "Model", fmt), ("epoch", "best epoch", fmt),
                ("val_loss", "val loss", fmt), ("val_acc", "val ACC", percent),
                ("val_l2_p50", "val P50 l2", fmt)] + margin_columns() + GUARDED_COLUMNS
               + [("train_time_s", "train s", fmt)])
    notes = ["ACC, #CLR and margins over the test points, as in the paper-style table; "
             "the validation columns are what the selection compares."]
    notes += [f"{r['tag']}: the best validation loss is at its last epoch; training may be "
              f"too short (more --epochs)." for r in rows
              if r.get("epochs") and r["best_epoch"] == r["epochs"]]
    return write_table(out, "runs", title, columns, rows, notes)
