"""Vanilla and ROLL side by side (`--with_vanilla`, on under `--quick`): the same data,
settings and seed, trained one after the other into `<out>/vanilla` and `<out>/roll`
(Figure 4 of the ROLL run draws the vanilla model beside it), then `comparison.md` /
`.json`: test accuracy and the expected and worst-case l1 gradient distortion of both
models on the same test images.

Example:

```python
from examples.caltech256 import pair
from examples.caltech256.configs import quick

result = pair.train_and_compare(quick.get_config(), "/tmp/caltech")
print(result.tables["comparison"])
```
"""

from __future__ import annotations

import dataclasses

from examples.caltech256 import input_pipeline, train
from examples.caltech256.configs.default import Config, Strategy
from examples.common import app
from examples.common.tables import fmt, percent, write_table

__all__ = ["comparison_rows", "train_and_compare", "wanted"]


def wanted(config: Config) -> bool:
    """Whether `config` asks for the pair: `--with_vanilla` on a ROLL training in one
    process (not `--eval_only`, `--compare_with` or `--strategy=multiworker`)."""
    return (config.with_vanilla and config.roll and not config.eval_only
            and config.compare_with is None and config.strategy != Strategy.multiworker)


def comparison_rows(results: dict) -> list[dict]:
    """One row per model (`{"vanilla": summary, "ROLL": summary}`, the `results.json` of
    each run): test P@1 / P@k and the P50 / P100 of both distortions (None without
    `--num_eval`)."""
    rows = []
    for name, res in results.items():
        dist = res.get("distortion") or {}
        expected, worst = dist.get("expected", {}), dist.get("max", {})
        rows.append(dict(model=name, p_at_1=res["test"]["p_at_1"], p_at_k=res["test"]["p_at_k"],
                         expected_p50=expected.get("P50"), expected_p100=expected.get("P100"),
                         max_p50=worst.get("P50"), max_p100=worst.get("P100"),
                         changed=dist.get("changed"), images=dist.get("images")))
    return rows


def train_and_compare(config: Config, workdir, callbacks=()) -> app.ExampleResult:
    """Trains the vanilla model, then the ROLL model of `config` (each resumable, in its
    own folder), and writes `comparison.md` / `.json` to `workdir`; returns what it wrote.

    Raises:
        UsageError: as `train.train_and_evaluate`.
    """
    out = app.output_dir(workdir)
    data_dir = str(config.data_dir or input_pipeline.generated_tree(out))
    both = dataclasses.replace(config, data_dir=data_dir, with_vanilla=False)
    app.log(f"== 1/2  vanilla, in {out / 'vanilla'}")
    vanilla = train.train_and_evaluate(dataclasses.replace(both, roll=False),
                                       out / "vanilla", callbacks)
    app.log(f"\n== 2/2  ROLL, in {out / 'roll'}")
    roll = train.train_and_evaluate(dataclasses.replace(
        both, compare_with=str(out / "vanilla")), out / "roll", callbacks)
    rows = comparison_rows({"vanilla": vanilla.summary, "ROLL": roll.summary})
    k = vanilla.summary["test"]["k"]
    columns = [("model", "Model", str), ("p_at_1", "P@1", percent),
               ("p_at_k", f"P@{k}", percent),
               ("expected_p50", "expected distortion P50", fmt),
               ("expected_p100", "expected distortion P100", fmt),
               ("max_p50", "worst-case distortion P50", fmt),
               ("max_p100", "worst-case distortion P100", fmt),
               ("changed", "predictions changed", fmt)]
    n_test = vanilla.summary["test"]["images"]
    notes = [f"P@1 and P@{k} on the {n_test} test images; the l1 gradient distortion "
             f"(lower: more stable gradients) at eps = {config.eps:g} on the same "
             f"{rows[0]['images'] or 0} test images for both models (--num_eval).",
             f"Each run's own results: {out / 'vanilla'}/results.md, "
             f"{out / 'roll'}/results.md; Figure 4 with both models: "
             f"{out / 'roll'}/figure4.png."]
    md = write_table(out, "comparison", f"Caltech-256, {roll.summary['model']}: vanilla "
                     f"and ROLL", columns, rows, notes)
    app.log("\n" + md)
    summary = {"vanilla": vanilla.summary, "roll": roll.summary, "rows": rows}
    return app.ExampleResult({"comparison": md, "vanilla": vanilla.tables["results"],
                              "roll": roll.tables["results"]}, rows, roll.figures, summary, out)
