"""The trained models of an example: what to train (`ModelSpec`), and each model's
stored result in `<out>/runs/<tag>.*`, reused by a rerun with the same settings.

A stored result is `<tag>.json` (the row: settings, history, statistics),
`<tag>.weights.h5` (the best validation-loss epoch) and `<tag>.npz` (test margins).

Example:

```python
specs = model_specs(vanilla=True, grid=[(2.0, 1.0, 100.0)], samples=None)
row = load_stored(out / "runs" / f"{specs[0].tag}.json", settings, resume=True)
```
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from examples.common.app import log
from examples.common.margin_stats import exact_twin, margin_stats
from examples.common.tables import jsonable, write_json
from keras_roll.roll.config import RollConfig

__all__ = ["ModelSpec", "evaluate_and_store", "load_stored", "model_specs", "result_row",
           "stored_or_none"]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model to train: vanilla (`lam` None) or ROLL with its hyperparameters.

    Example:

    ```python
    ModelSpec.roll(2.0, 1.0, 100.0).tag   # 'roll_lam2_C1_gamma100_exact'
    ```
    """

    tag: str
    lam: float | None = None
    C: float | None = None
    gamma: float | None = None
    samples: int | None = None

    @classmethod
    def vanilla(cls) -> ModelSpec:
        return cls("vanilla")

    @classmethod
    def roll(cls, lam: float, C: float, gamma: float, samples: int | None = None) -> ModelSpec:
        """A ROLL model, its hyperparameters checked by `keras_roll`'s `RollConfig`."""
        RollConfig(lam=lam, C=C, gamma=gamma, samples=samples)
        est = "exact" if samples is None else f"s{samples}"
        return cls(f"roll_lam{lam:g}_C{C:g}_gamma{gamma:g}_{est}", lam, C, gamma, samples)

    @property
    def is_roll(self) -> bool:
        return self.lam is not None

    @property
    def estimator(self) -> str:
        """'-' (vanilla), 'exact' or 'k axes' (sampled ROLL)."""
        if not self.is_roll:
            return "-"
        return "exact" if self.samples is None else f"{self.samples} axes"


def model_specs(vanilla: bool, grid, samples: int | None) -> list[ModelSpec]:
    """Vanilla first (if asked), then one ROLL model per distinct `(lam, C, gamma)` of
    `grid`, in order. Raises ValueError when there is nothing to train."""
    specs = [ModelSpec.vanilla()] if vanilla else []
    seen = set()
    for point in grid:
        if tuple(point) not in seen:
            seen.add(tuple(point))
            specs.append(ModelSpec.roll(*point, samples=samples))
    if not specs:
        raise ValueError("Nothing to train: pass --vanilla and/or --roll.")
    return specs


def result_row(spec: ModelSpec, fit, settings: dict) -> dict:
    """The stored row of the model `spec` whose `training.fit_best` returned `fit`.

    Example:

    ```python
    row = result_row(spec, fit_best(model, wrapped, train, val, 20), settings)
    ```
    """
    best = fit.best
    return {
        **dataclasses.asdict(spec), "estimator": spec.estimator,
        "best_epoch": best.epoch, "epochs": len(fit.history.get("loss", [])),
        "val_loss": best.best, "val_roll_loss": best.logs.get("val_roll_loss"),
        "train_time_s": fit.seconds, "settings": settings, "history": fit.history,
    }


def evaluate_and_store(model, row: dict, val, test, runs: Path, verbose="auto") -> dict:
    """Adds the validation (`val_*`) and test statistics of `margin_stats` to `row`,
    writes `runs/<tag>.json` and the test margins to `runs/<tag>.npz`; returns the row.

    Example:

    ```python
    row = evaluate_and_store(model, row, (xv, yv), (xt, yt), out / "runs")
    ```
    """
    if verbose:
        log(f"   certifying {len(val[1])} validation and {len(test[1])} test points")
    twin = exact_twin(model)
    val_row, _ = margin_stats(model, *val, prefix="val_", regions=False, twin=twin,
                              verbose=verbose)
    test_row, cert = margin_stats(model, *test, guarded=True, twin=twin, verbose=verbose)
    row = {**row, **test_row, **val_row}
    np.savez(runs / f"{row['tag']}.npz", l1=cert.margins[1], l2=cert.margins[2])
    write_json(runs / f"{row['tag']}.json", row)
    return row


def stored_or_none(path: Path, wanted: dict, resume: bool, reevaluate: bool, build, val,
                   test):
    """The row stored at `path` (see `load_stored`), re-certified from its stored
    weights with `reevaluate` (`build()` makes the model to load them into); None when
    there is no usable stored row."""
    row = load_stored(path, wanted, resume)
    if row is None or not reevaluate:
        return row
    model = build()
    model.load_weights(path.with_suffix(".weights.h5"))
    return evaluate_and_store(model, row, val, test, path.parent)


def load_stored(path: Path, wanted: dict, resume: bool):
    """The row stored at `path` when `resume` and its `settings` equal `wanted`, else None."""
    if not (resume and path.is_file()):
        return None
    row = json.loads(path.read_text())
    if row.get("settings") != jsonable(wanted):
        return None
    log(f"== {row.get('tag')}: reusing {path}")
    return row
