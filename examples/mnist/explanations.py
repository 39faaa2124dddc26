"""How faithful the models' explanations are: the exact integrated gradients of the
Table 1 models (vanilla and the selected ROLL models) on test images, scored by
Deletion, Insertion and MuFidelity (`keras_roll.faithfulness`), as a table
(`faithfulness.md` / `.json`) and a figure of the curves (`faithfulness.png`).

Example:

```python
md, figure = faithfulness_table(rows, summary, data, config, out, build)
```
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import keras_roll
from examples.common.selection import DROPS, model_label
from examples.common.tables import fmt, write_table

__all__ = ["STEP_SIZE", "faithfulness_table", "table1_models"]

# The fraction of the pixels changed per step of the Deletion and Insertion curves:
# about 8 pixels, fine enough to show where a 28 x 28 digit's curves bend.
STEP_SIZE = 0.01

COLUMNS = [("model", "Model", fmt), ("deletion", "Deletion area (lower: better)", fmt),
           ("insertion", "Insertion area (higher: better)", fmt),
           ("mufidelity", "MuFidelity (higher: better)", fmt),
           ("regions", "regions crossed (P50)", fmt), ("n", "images", fmt)]


def table1_models(rows: list[dict], summary: dict) -> list[tuple[str, dict]]:
    """`(label, row)` of the models Table 1 shows: vanilla, then the ROLL model selected
    at each accuracy (each once); every row when there is no vanilla model."""
    by_tag = {r["tag"]: r for r in rows}
    vanilla = next((r for r in rows if r.get("lam") is None), None)
    if vanilla is None:
        return [(model_label(r), r) for r in rows]
    out, seen = [("Vanilla", vanilla)], set()
    for _, key, what in DROPS:
        picked = summary.get(key)
        if picked and picked["tag"] not in seen:
            seen.add(picked["tag"])
            out.append((f"ROLL at {what}", by_tag[picked["tag"]]))
    return out


def faithfulness_table(rows, summary, data, config, out: Path, build):
    """Scores the exact integrated gradients of each Table 1 model on the first
    `config.faithfulness` test images (each model explains its predicted class from a
    black image); writes the table and the figure. Returns `(markdown, figure path)`,
    `(None, None)` with `config.faithfulness == 0`."""
    n = min(config.faithfulness, len(data.test[0]))
    if n == 0:
        return None, None
    x = data.test[0][:n]
    results, table = {}, []
    for label, row in table1_models(rows, summary):
        model = build()
        model.load_weights(out / "runs" / f"{row['tag']}.weights.h5")
        ig = keras_roll.integrated_gradients(model, x, verbose=False)
        res = keras_roll.faithfulness(model, x, ig.labels, ig.maps,
                                      step_size=STEP_SIZE, seed=config.seed, verbose=False)
        name = label if label == "Vanilla" else f"{label}: {model_label(row)}"
        results[label] = res
        table.append({"model": name, **res.mean(), "regions": float(np.median(ig.regions)),
                      "n": n})
    title = f"Faithfulness of exact integrated gradients: {data.name}"
    notes = [f"Exact integrated gradients of each model's predicted class on the first {n} "
             f"test images, from a black image; the score is the model's softmax output.",
             f"Deletion: pixels set to black in decreasing order of attribution, "
             f"{100 * STEP_SIZE:g} % at a time; Insertion: pixels of the image put into a "
             "black one in that order; areas under the curves over the fraction of pixels "
             "changed. MuFidelity: the "
             "correlation between the attributions summed over 128 random 20 % subsets and "
             "the output's drop when the subset is set to black.",
             "The same models as Table 1 (selected on validation)."]
    md = write_table(out, "faithfulness", title, COLUMNS, table, notes)
    figure = out / "faithfulness.png"
    keras_roll.plots.plot_faithfulness(results, title=title, path=figure)
    return md, figure
