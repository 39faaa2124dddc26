"""`results.md` (the tables a reader wants) and `results.json` (everything) of a
Caltech-256 evaluation.

Example:

```python
md = write_results(out, results)
```
"""

from __future__ import annotations

from pathlib import Path

from examples.common.tables import fmt, markdown_table, percent, write_json

__all__ = ["write_results"]

PERCENTILES = (25, 50, 75, 100)


def write_results(out: Path, results: dict) -> str:
    """Writes `results.json` and `results.md`; returns the Markdown."""
    lines = header(results)
    t = results["test"]
    lines += ["", "## Test accuracy", "",
              markdown_table([("images", "test images", fmt), ("p_at_1", "P@1", percent),
                              ("p_at_k", f"P@{t['k']}", percent)], [t])]
    dist = results.get("distortion")
    if dist:
        cols = [("name", "l1 gradient distortion", str)] + [
            (f"P{q}", f"P{q}", fmt) for q in PERCENTILES] + [("mean", "mean", fmt)]
        rows = [dict(dist["expected"], name=f"expected ({dist['expected']['samples']} "
                                           "uniform draws)"),
                dict(dist["max"], name=f"worst case (GA: population {dist['max']['population']}"
                                       f", {dist['max']['generations']} generations)")]
        lines += ["", f"## Gradient distortion (eps = {dist['eps']:g}, l_inf ball, "
                      f"{dist['images']} test images)", "", markdown_table(cols, rows),
                  "", f"Predictions changed at the worst-case point: {dist['changed']} of "
                      f"{dist['images']}."]
    fig = results.get("figure")
    if fig:
        lines += ["", "## Figure 4", "",
                  f"Rows: the test images at P{', P'.join(f'{q:g}' for q in fig['percentiles'])}"
                  f" of the worst-case distortion; integrated gradients: {fig['ig']}.", "",
                  f"![Figure 4]({fig['path']})"]
    md = "\n".join(lines) + "\n"
    (out / "results.md").write_text(md, encoding="utf-8")
    write_json(out / "results.json", results)
    return md


def header(results: dict) -> list[str]:
    """The title and the run's settings, data, weights and training, in words."""
    s = results["settings"]
    lines = [f"# Caltech-256, {results['model']} {'ROLL' if results['roll'] else 'vanilla'}",
             ""]
    if results["roll"]:
        per = " per channel" if s["samples"] and s["strata"] == "channel" else ""
        lines.append(f"ROLL: lam={s['lam']:g}, C={s['C']:g}, gamma={s['gamma']:g}, "
                     f"samples={s['samples'] or 'exact'}{per}, "
                     f"wrt={s['roll_wrt'] or 'pixels'}.")
    decay = ", ".join(f"{e:g}" for e in s["lr_decay_epochs"])
    lines.append(f"{s['image_size']}x{s['image_size']} images, batch {s['batch_size']}, "
                 f"{s['epochs']} epochs, lr {s['lr']:g} (x{s['lr_decay_factor']:g} after "
                 f"epochs {decay}), SGD momentum {s['momentum']:g}"
                 f"{' (Nesterov)' if s['nesterov'] else ''}.")
    dd = results["data"]
    lines += [f"Data: {dd['root']}: {dd['classes']} classes, {dd['train']} train / "
              f"{dd['val']} val / {dd['test']} test images ({dd['skipped']} files skipped).",
              f"Weights: {results['weights']}."]
    tr = results.get("training")
    if tr:
        step = "-" if tr["step_time_ms"] is None else f"{tr['step_time_ms']:,.0f}"
        lines.append(f"Training: {tr['epochs_trained']} epochs of {tr['steps_per_epoch']} "
                     f"steps on {tr['replicas']} replica(s), median step time {step} ms; "
                     f"best validation loss {fmt(tr['best_val_loss'])} at epoch "
                     f"{tr['best_epoch']}.")
    return lines
