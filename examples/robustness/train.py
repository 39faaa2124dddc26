"""Trains (or reuses) a vanilla and a ROLL MNIST network and bounds the minimal adversarial
perturbation of test images for each: `train_and_evaluate(config, workdir)`.

The models are the MNIST example's (`examples.mnist.train`: same code, same stored
runs, so models trained by `python -m examples.mnist --out=<this --out>` with the same
settings are reused); the bounds are `keras_roll.robust_radius`'s in l2 and l_inf.

Example:

```python
from examples.robustness import train
from examples.robustness.configs import quick

result = train.train_and_evaluate(quick.get_config(), "/tmp/robustness")
print(result.tables["robustness"])
```
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import keras_roll
from examples.common import app
from examples.common.tables import write_json
from examples.mnist import train as mnist_train
from examples.mnist.configs import default as mnist_default
from examples.mnist.input_pipeline import load_data
from examples.robustness import report
from examples.robustness.configs.default import Config

NORMS = (2, np.inf)


def mnist_config(config: Config) -> mnist_default.Config:
    """The MNIST example's config of the two models (vanilla, ROLL lam C gamma 100)."""
    return dataclasses.replace(
        mnist_default.get_config(), data_dir=config.data_dir, dataset=config.dataset,
        train_size=config.train_size, val_size=config.val_size, test_size=config.test_size,
        epochs=config.epochs, lr=config.lr, momentum=config.momentum, width=config.width,
        depth=config.depth, lam=(config.lam,), C=(config.C,), gamma=(100.0,),
        samples=config.samples, seed=config.seed, vanilla=True, roll=True, sweep=False,
        resume=config.resume)


def trained_models(config: Config, out, logs: app.LogOptions = app.LogOptions()):
    """`(data, [(spec, model, row)])`: each model trained, or reused from `out/runs`."""
    mc = mnist_config(config)
    data = load_data(mc)
    models = []
    for spec in mnist_train.specs(mc):
        row = mnist_train.train_or_load(spec, data, mc, out, logs)
        model = mnist_train.build_model(mc, data.train[0].shape[1], data.classes,
                                        data.normalize)
        model.load_weights(out / "runs" / f"{spec.tag}.weights.h5")
        models.append((spec, model, row))
    return data, models


def bound(model, x, y, config: Config):
    """`(RobustRadius, seconds)` of one model on the test images."""
    start = time.perf_counter()
    rr = keras_roll.robust_radius(model, x, y, norms=NORMS, method=config.method.value,
                                  rigor=config.rigor.value, max_regions=config.max_regions,
                                  bisect_tol=config.bisect_tol)
    return rr, time.perf_counter() - start


def train_and_evaluate(config: Config, workdir,
                       logs: app.LogOptions = app.LogOptions()) -> app.ExampleResult:
    """Trains (or reuses) both models, bounds their radii, writes the table, the figure
    and `summary.json` to `workdir`; returns what it wrote."""
    app.start_tensorflow(config.seed)
    out = app.output_dir(workdir)
    data, models = trained_models(config, out, logs)
    x, y = data.test
    rows, results = [], []
    for spec, model, _ in models:
        label = "vanilla" if not spec.is_roll else \
            f"ROLL (lam {spec.lam:g}, C {spec.C:g}, {spec.estimator})"
        app.log(f"\n== {label}: bounding {len(y)} test images (method "
                f"{config.method.value}, rigor {config.rigor.value})")
        rr, seconds = bound(model, x, y, config)
        rr.summary(print_fn=app.log)
        report.save(rr, out / f"radius_{spec.tag}.npz")
        rows.append(report.row(label, rr, seconds, config.radii))
        results.append((label, rr))
    md = report.table(rows, out, config, data.name, data.classes)
    figure = report.figure(results, out / "intervals.png")
    app.log("\n" + md)
    app.log(f"Figure: {figure}\nEverything is in {out}/")
    summary = {"rows": rows, "config": dataclasses.asdict(config), "dataset": data.name}
    write_json(out / "summary.json", summary)
    return app.ExampleResult({"robustness": md}, rows, [figure], summary, out)
