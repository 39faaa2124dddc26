"""The comparison from start to end: vanilla, each method's search, the measurements of
every chosen model, the table and the figure.

Example:

```python
from examples.compare import experiment
from examples.compare.configs import quick

result = experiment.run(quick.get_config(), "/tmp/compare")
print(result.tables["compare"])
```
"""

from __future__ import annotations

import json
from pathlib import Path

from examples.common import app
from examples.common.tables import write_json
from examples.compare.configs.default import Config, parse_fixed
from examples.compare.measure import Measures, measure
from examples.compare.methods import METHODS
from examples.compare.report import MIN_EPOCH_S, Ranking, table_rows, write_report
from examples.compare.train import OperatingPoint, build_model, load, search, train_or_load

__all__ = ["measured", "ranking", "run"]

# Stored measurements of another version are measured again (2: the accuracy on the
# radius images).
MEASURES_VERSION = 2


def measured(row: dict, data, config: Config, out: Path) -> Measures:
    """The measurements of the model of `row`, stored beside it (`runs/<tag>.measures.json`,
    reused while the model and the measurement settings are the same)."""
    path = Path(out) / "runs" / f"{row['tag']}.measures.json"
    wanted = {k: getattr(config, k) for k in (
        "test_size", "eval_size", "robust_size", "distortion_size", "worst_size",
        "distortion_eps", "distortion_samples", "worst_population", "worst_generations",
        "certified_eps")}
    wanted = json.loads(json.dumps({**wanted, "model": row["settings"], "value": row["value"],
                                    "measures": MEASURES_VERSION}, default=list))
    if config.resume and path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("settings") == wanted:
            return Measures.from_json(stored["measures"])
    model = build_model(config, data.train[0].shape[1], data.classes)
    model.load_weights(Path(out) / "runs" / row["weights"])
    app.log(f"\n== measuring {row['tag']}")
    result = measure(model, data, config)
    app.log(f"   test accuracy {100 * result.test_acc:.2f} %, median l2 margin "
            f"{result.l2_p50:.3g}, {result.seconds:.0f} s")
    write_json(path, {"settings": wanted, "measures": result.to_json()})
    return result


def ranking(config: Config, vanilla_epoch_s: float, quick: bool) -> Ranking:
    """What the report may claim: no leaders under `--quick`, no time column when
    vanilla's epochs take under `MIN_EPOCH_S` seconds."""
    why = []
    if quick:
        why.append(f"--quick: {config.epochs} epochs on {config.train_size or 'all'} "
                   f"images, {config.search_steps} search step(s) per point and a few "
                   f"measured images show that the pipeline runs; these numbers cannot "
                   f"rank the methods, so no leaders are named (run without --quick).")
    timed = vanilla_epoch_s >= MIN_EPOCH_S
    if not timed:
        why.append(f"No time column: vanilla's epochs took {vanilla_epoch_s:.2g} s, under "
                   f"{MIN_EPOCH_S:g} s, too short to time the methods against each other.")
    return Ranking(rank=not quick, timed=timed, why=tuple(why))


def run(config: Config, workdir, quick: bool = False) -> app.ExampleResult:
    """Trains (or reuses) vanilla and every method of `--methods` at its two operating
    points, measures the chosen models and writes `compare.md` / `.json` / `.png`
    (`quick`: the run is `--quick`, whose report ranks nothing)."""
    app.start_tensorflow(config.seed)
    out = app.output_dir(workdir)
    data = load(config)
    vanilla = train_or_load(METHODS["vanilla"], 0.0, data, config, out)
    points = []
    for name in config.methods:
        if name != "vanilla":
            points += search(METHODS[name], vanilla, data, config, out)
    for name, value in parse_fixed(config.fixed):
        row = train_or_load(METHODS[name], value, data, config, out)
        points.append(OperatingPoint(name, None, row, "fixed by --fixed"))
    chosen = {vanilla["tag"]: vanilla, **{p.row["tag"]: p.row for p in points if p.row}}
    measures = {tag: measured(row, data, config, out) for tag, row in chosen.items()}
    rows = table_rows(vanilla, points, measures, {n: m.label for n, m in METHODS.items()})
    arch = (f"{data.train[0].shape[1]}-{config.width}x{config.depth}-{data.classes} MLP"
            if config.arch.value == "mlp" else "small CNN")
    m = measures[vanilla["tag"]]
    notes = [
        f"{len(data.train[0]):,} training, {len(data.val[0]):,} validation images; "
        f"{config.epochs} epochs of Adam (lr {config.lr:g}, batch {config.batch_size}), "
        f"the weights after the last epoch; every method from the same initial weights.",
        "Operating points: the largest knob whose validation accuracy (whole percent) "
        "keeps vanilla's, and the largest within one point of it "
        f"(bisection, at most {config.search_steps} new trainings per point).",
        f"Distances in [0, 1] pixel units. Test accuracy on {len(data.test[0]):,} images; "
        f"region margins (`certify`) and #CLR on {m.n_eval}; robustness radius "
        f"(`robust_radius`, medians), certified accuracy and the clean accuracy it "
        f"bounds (acc. (radius images)) on the same {m.n_robust}; gradient "
        f"distortion at l_inf {config.distortion_eps:g} on {m.n_distortion} (expected, "
        f"{config.distortion_samples} draws) and {m.n_worst} (worst case, population "
        f"{config.worst_population}, {config.worst_generations} generations).",
    ]
    claims = ranking(config, vanilla["epoch_s"], quick)
    if claims.timed:
        notes.append("Time / epoch: the median training time of the epochs after the first, "
                     "as a ratio to vanilla's (same process unless a model was reused from "
                     "--out).")
    md = write_report(rows, out, f"{data.name}, {arch}: ROLL among its rivals",
                      config.certified_eps, notes, claims)
    app.log("\n" + md)
    summary = {"rows": rows}
    write_json(out / "summary.json", summary)
    app.log(f"Wrote {out / 'compare.md'} (and compare.json), the figure {out / 'compare.png'}, "
            f"{out / 'summary.json'}; each model and its measurements in {out / 'runs'}/")
    return app.ExampleResult({"compare": md}, list(chosen.values()), [out / "compare.png"],
                             summary, out)
