"""Trains the toy models and draws Figure 1: `train_and_evaluate(config, workdir)`.

Example:

```python
from examples.toy2d import train
from examples.toy2d.configs import quick

result = train.train_and_evaluate(quick.get_config(), "/tmp/toy2d")
result.tables["table"], result.figures
```
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import keras

import keras_roll
from examples.common import app
from examples.common.margin_stats import PERCENTILES, exact_twin, margin_stats
from examples.common.selection import ratio
from examples.common.tables import fmt, percent, write_table
from examples.common.training import fit_best
from examples.toy2d.configs.default import Config
from examples.toy2d.distance import DistanceRegularizer
from keras_roll.data import make_toy2d

TITLES = {"vanilla": "Vanilla loss", "distance": "Distance regularizer (hinge on the l2 margin)",
          "roll": "Relaxed regularizer (ROLL)"}
SHORT = {"vanilla": "Vanilla", "distance": "Distance regularizer", "roll": "Relaxed ROLL"}
BOUNDS = ((-1.2, 1.2), (-1.2, 1.2))


def build_model(config: Config) -> keras.Model:
    """The paper's toy network: 2 -> `width` x `depth` ReLU -> 1 sigmoid."""
    return keras_roll.models.fc(input_shape=(2,), depth=config.depth, width=config.width,
                                classes=1, normalize=None, classifier_activation="sigmoid",
                                name="toy")


def fit_model_for(name: str, model: keras.Model, config: Config) -> keras.Model:
    """The model `fit` runs on: `model` itself, its distance regularizer, or ROLL."""
    if name == "vanilla":
        return model
    if name == "distance":
        inp = keras.Input((2,))
        return keras.Model(
            inp, DistanceRegularizer(model, lam=config.lam, C=config.C, name="distance")(inp))
    return keras_roll.wrap(model, lam=config.lam, C=config.C, gamma=100.0)


def train_one(name: str, data, config: Config, out: Path,
              logs: app.LogOptions = app.LogOptions()):
    """Trains one of vanilla / distance / roll; returns `(twin, row, certificate)`: the
    trained model's exact twin, its row and the certificate of the training points."""
    (x, y), (xv, yv) = data
    keras.utils.set_random_seed(config.seed)
    model = build_model(config)
    fit_model = fit_model_for(name, model, config)
    fit_model.compile(optimizer=keras.optimizers.Adam(config.lr), loss="binary_crossentropy",
                      metrics=["accuracy"])
    fit = fit_best(model, fit_model, (x, y.astype("float32")), (xv, yv.astype("float32")),
                   config.epochs, config.batch_size, verbose=0,
                   progress=None if logs.quiet else name, name=name, seed=config.seed,
                   warn_last_epoch=logs.warn_last_epoch)
    twin = exact_twin(model)
    row, cert = margin_stats(model, x, y, twin=twin, verbose=logs.certify_verbose)
    val, _ = margin_stats(model, xv, yv, prefix="val_", regions=False, twin=twin,
                          verbose=logs.certify_verbose)
    row.update(val)
    row.update({"tag": name, "model": TITLES[name], "best_epoch": fit.best.epoch,
                "val_loss": fit.best.best, "train_time_s": fit.seconds})
    model.save_weights(out / f"{name}.weights.h5")
    return twin, row, cert


def figure1(name: str, twin, row: dict, x, y, cert, config: Config, out: Path) -> Path:
    """Figure 1 of one model: the regions of its exact twin on the grid and the exact
    l2 margins of the training points `x` (`cert`, the table's)."""
    grid = keras_roll.region_map(twin, bounds=BOUNDS, resolution=config.resolution)
    path = out / f"figure1_{name}.png"
    keras_roll.plots.plot_linear_regions(
        grid, x, y, cert, path=path,
        title=f"{SHORT[name]}: accuracy {100 * row['acc']:.0f} %, median l2 margin "
              f"{row['l2_p50']:.2g}")
    return path


def train_and_evaluate(config: Config, workdir,
                       logs: app.LogOptions = app.LogOptions()) -> app.ExampleResult:
    """Trains every model of `config.models`, writes the table and Figure 1 panels to
    `workdir`; returns what it wrote. `logs`: how much it prints (quiet: one line per
    model)."""
    app.start_tensorflow(config.seed)
    out = app.output_dir(workdir)
    kind = config.kind.value
    data = (make_toy2d(n=config.n, seed=config.seed, kind=kind),
            make_toy2d(n=config.n, seed=config.seed + 1, kind=kind))
    x, y = data[0]
    rows, figures = [], []
    for name in config.models:
        logs.log(f"== {name}: {config.depth} x {config.width} ReLU, {config.n} points, "
                 f"{config.epochs} epochs")
        twin, row, cert = train_one(name, data, config, out, logs)
        if logs.quiet:
            app.log(f"  {row['model']}: training accuracy {percent(row['acc'])}, #CLR "
                    f"{row['clr']}, median l2 margin {fmt(row['l2_p50'])}, trained in "
                    f"{fmt(row['train_time_s'])} s")
        rows.append(row)
        figures.append(figure1(name, twin, row, x, y, cert, config, out))
    vanilla = next((r for r in rows if r["tag"] == "vanilla"), None)
    for r in rows:
        r["ratio"] = ratio(r["l2_p50"], vanilla["l2_p50"]) if vanilla else None
    columns = [("model", "Model", fmt), ("best_epoch", "epoch", fmt),
               ("acc", "train ACC", percent), ("val_acc", "val ACC", percent),
               ("clr", "#CLR", fmt)]
    columns += [(f"l2_p{q}", f"l2 P{q}", fmt) for q in PERCENTILES]
    columns += [("ratio", "P50 l2 / vanilla", fmt)]
    md = write_table(
        out, "table", f"Toy 2-D task ({kind}): {config.depth} x {config.width} ReLU network",
        columns, rows,
        notes=[f"#CLR and l2 margins over the {config.n} training points (the circles of "
               f"Figure 1); lam={config.lam:g}, C={config.C:g}; each model at its best "
               f"validation-loss epoch ({config.n} validation points)."])
    logs.log("\n" + md)
    for path in figures:
        logs.log(f"Figure 1: {path}")
    return app.ExampleResult({"table": md}, rows, figures,
                             {"config": dataclasses.asdict(config)}, out)
