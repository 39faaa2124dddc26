"""Evaluates a trained Caltech-256 model: P@1 / P@5 on the test split, the expected and
worst-case l1 gradient distortion at eps = 8/256 on `--num_eval` test images, and the
Figure 4-style grid (image, gradient, worst-case gradient, integrated gradients).

Example:

```python
result = evaluate(config, data, folder, folder.best, train_summary)
result.summary["distortion"]["max"]["P50"]
```
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import keras
import numpy as np

import keras_roll
from examples.caltech256 import input_pipeline, report
from examples.caltech256.configs.default import (
    RUN_FIELDS,
    Architecture,
    Config,
    Normalize,
    StemPool,
)
from examples.caltech256.models import build_model, load_weights
from examples.common import app
from examples.common.tables import jsonable
from keras_roll.plots import GradientMaps

__all__ = ["eval_only_weights", "evaluate"]

PERCENTILES = (25, 50, 75, 100)


def eval_only_weights(config: Config, folder, record: dict) -> Path:
    """The weights `--eval_only` evaluates (`--weights`, else the run's best), checked."""
    weights = Path(os.path.expanduser(config.weights or folder.best))
    if not weights.is_file():
        raise app.UsageError(f"--eval_only: no weights at {weights}; train first (the same "
                             "command without --eval_only) or pass --weights.")
    if not config.weights and folder.run_config.exists():
        folder.check_run(record)
    return weights


def evaluation_model(config: Config, classes: int, path):
    """A float32 plain model (no strategy) with the weights of `path`, and a note."""
    keras.mixed_precision.set_global_policy("float32")
    model = build_model(config, classes)
    return model, load_weights(model, path)


def test_accuracy(model, data) -> dict:
    """P@1 and P@k (k = min(5, classes)) on the test split."""
    k = min(5, len(data.class_names))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="p1"),
                           keras.metrics.SparseTopKCategoricalAccuracy(k, name="pk")])
    test = model.evaluate(data.test, return_dict=True, verbose=0)
    n_test = len(data.index.files["test"])
    app.log(f"Test split ({n_test} images): P@1 {test['p1']:.4f}, P@{k} {test['pk']:.4f}")
    return dict(images=n_test, k=k, p_at_1=test["p1"], p_at_k=test["pk"], loss=test["loss"])


def evaluate(config: Config, data, folder, weights, train_summary=None) -> app.ExampleResult:
    """P@1 / P@5, gradient distortion and the figure; writes results.md / .json."""
    classes = len(data.class_names)
    model, note = evaluation_model(config, classes, weights)
    app.log(f"Evaluating {note}")
    results = dict(
        model=model.name, roll=config.roll, weights=str(weights),
        settings=jsonable({k: getattr(config, k) for k in RUN_FIELDS}),
        data=dict(root=str(data.index.root), classes=classes, **data.index.counts()),
        test=test_accuracy(model, data), training=train_summary, distortion=None,
        figure=None)
    figures = []
    if config.num_eval:
        rng = np.random.default_rng(config.seed)
        n_test = results["test"]["images"]
        pick = np.sort(rng.choice(n_test, min(config.num_eval, n_test), replace=False))
        files = [data.index.files["test"][i] for i in pick]
        x, y = input_pipeline.numpy_images(config, files, data.index.labels["test"][pick])
        lin = keras_roll.linearize(model, memory_budget=config.memory_budget)
        results["distortion"], worst = distortion(config, lin, x, y, files)
        results["figure"] = figure(config, folder.out, lin, x, y, worst, data.class_names)
        figures.append(folder.out / results["figure"]["path"])
    md = report.write_results(folder.out, results)
    app.log(md)
    return app.ExampleResult({"results": md}, [], figures, results, folder.out)


def distortion(config: Config, lin, x, y, files):
    """The expected and worst-case l1 gradient distortion of `x`: `(results, worst)`."""
    app.log(f"Gradient distortion on {len(x)} test images, eps={config.eps:g}:")
    expected = keras_roll.gradient_distortion(
        lin, x, y, eps=config.eps, domain=(0.0, 1.0), mode="expected",
        samples=config.distortion_samples, seed=config.seed)
    worst = keras_roll.gradient_distortion(
        lin, x, y, eps=config.eps, domain=(0.0, 1.0), mode="max", population=config.population,
        generations=config.generations, seed=config.seed)
    expected.summary(print_fn=app.log)
    worst.summary(print_fn=app.log)
    return dict(
        eps=config.eps, images=len(x), files=files, labels=y,
        expected=dict(samples=config.distortion_samples, **_pcts(expected.distortion)),
        max=dict(population=config.population, generations=config.generations,
                 evaluations=worst.evaluations, **_pcts(worst.distortion)),
        changed=int(worst.changed.sum()),
        per_image=dict(expected=expected.distortion, max=worst.distortion,
                       changed=worst.changed)), worst


def _pcts(values) -> dict:
    v = np.asarray(values, np.float64)
    return {**{f"P{q}": float(np.percentile(v, q)) for q in PERCENTILES}, "mean": float(v.mean())}


def gradient_maps(model, x, y, points, steps) -> GradientMaps:
    """Saliency at `x` and at the worst-case `points`, integrated gradients at both."""
    return GradientMaps(keras_roll.saliency(model, x, y), keras_roll.saliency(model, points, y),
                        keras_roll.integrated_gradients(model, x, y, steps=steps),
                        keras_roll.integrated_gradients(model, points, y, steps=steps))


def figure(config: Config, out: Path, lin, x, y, worst, class_names) -> dict:
    """Figure 4: the test images at `--figure_percentiles` of the worst-case distortion,
    with this model's maps (and `--compare_with`'s beside them)."""
    d = worst.distortion
    order = np.argsort(d, kind="stable")
    qs = list(config.figure_percentiles)
    ranks = [max(0, math.ceil(q / 100 * len(d)) - 1) for q in qs]  # nearest rank
    qs = [q for i, q in enumerate(qs) if ranks[i] not in ranks[:i]]
    picks = [int(order[r]) for r in dict.fromkeys(ranks)]
    steps = config.ig_steps or None
    name = "ROLL" if config.roll else "vanilla"
    models = {name: gradient_maps(lin, x[picks], y[picks], worst.points[picks], steps)}
    if config.compare_with:
        other, other_roll = compare_model(config, len(class_names))
        w2 = keras_roll.gradient_distortion(
            other, x[picks], y[picks], eps=config.eps, domain=(0.0, 1.0), mode="max",
            population=config.population, generations=config.generations, seed=config.seed)
        other_name = "ROLL" if other_roll else "vanilla"
        other_name += " (compared)" if other_name in models else ""
        models[other_name] = gradient_maps(other, x[picks], y[picks], w2.points, steps)
    labels = [f"P{q:g}: {class_names[y[i]]}\nmax l1 {d[i]:.4g}" for q, i in zip(qs, picks)]
    path = out / "figure4.png"
    keras_roll.plots.plot_gradient_comparison(
        x[picks], models, eps=config.eps, row_labels=labels, path=path,
        title=f"Gradients and worst-case gradients (eps={config.eps:g}) at the P"
              f"{'/P'.join(f'{q:g}' for q in qs)} worst-case distortion")
    app.log(f"Figure: {path}")
    return dict(path=path.name, percentiles=qs, images=picks,
                ig="exact" if steps is None else f"Riemann, {steps} points", models=list(models))


def compare_model(config: Config, classes: int):
    """`(twin, trained with ROLL)` of the best model of the run in `--compare_with`."""
    other = Path(os.path.expanduser(config.compare_with))
    record = json.loads((other / "run_config.json").read_text())
    for key, value in (("image_size", config.image_size), ("classes", classes)):
        if record.get(key) != value:
            raise app.UsageError(f"--compare_with={config.compare_with} was trained with "
                                 f"{key}={record.get(key)}, this run has {value}.")
    theirs = dataclasses.replace(
        config, stem_pool=StemPool(record["stem_pool"]),
        normalize=Normalize(record["normalize"]),
        model=Architecture(record.get("model", Architecture.resnet18.value)))
    model, _ = evaluation_model(theirs, classes, other / "best.weights.h5")
    return keras_roll.linearize(model, memory_budget=config.memory_budget), record.get("roll")
