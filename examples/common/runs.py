"""The trained models of an example: what to train (`ModelSpec`), and each model's
stored result in `<out>/runs/<tag>.*`, reused by a rerun with the same settings.

A stored result is `<tag>.json` (the row: settings, history, statistics),
`<tag>.weights.h5` (the best validation-loss epoch) and `<tag>.npz` (test margins).
The settings name the data by a fingerprint of its arrays (`data_fingerprint`), not by
its path, so a data folder that moves does not force retraining; the tables gather
every stored model trained with the same settings (`gather_stored`), not only the
models of the last command.

Example:

```python
specs = model_specs(vanilla=True, grid=[(2.0, 1.0, 100.0)], samples=None)
row = load_stored(out / "runs" / f"{specs[0].tag}.json", settings, resume=True)
```
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from examples.common.app import log
from examples.common.margin_stats import exact_twin, margin_stats
from examples.common.tables import jsonable, write_json
from keras_roll import RollConfig

__all__ = ["ModelSpec", "data_fingerprint", "evaluate_and_store", "gather_stored",
           "load_stored", "model_specs", "result_row", "stored_or_none"]


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


def data_fingerprint(*arrays) -> str:
    """A short hash of the arrays' shapes, dtypes and values: the data's name in the
    stored settings (the same data anywhere on disk, in any file format, gives the same
    fingerprint).

    Example:

    ```python
    data_fingerprint(x_train, y_train, x_val, y_val)   # 'b2f0c1d93a6e4f57'
    ```
    """
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.shape}{a.dtype.str}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def gather_stored(runs: Path, wanted: dict, rows: list[dict]) -> list[dict]:
    """`rows` and every other stored row in `runs/` (`<tag>.json`) trained with the
    settings `wanted`, vanilla first, then in the order of their tags; says in the log
    which stored rows stay out (other settings) and why.

    Example:

    ```python
    rows = gather_stored(out / "runs", settings, rows)   # the tables show them all
    ```
    """
    have = {r["tag"] for r in rows}
    wanted = jsonable(wanted)
    extra = []
    for path in sorted(Path(runs).glob("*.json")):
        if path.stem in have:
            continue
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(row, dict) or "tag" not in row:
            continue
        theirs = row.get("settings") or {}
        if theirs == wanted:
            extra.append(row)
            continue
        diff = ", ".join(f"{k}={theirs.get(k)!r} (now {v!r})" for k, v in wanted.items()
                         if theirs.get(k) != v) or "settings of an older version"
        log(f"   not in the tables: {path} (trained with {diff})")
    if extra:
        log(f"   the tables also show {len(extra)} stored model(s) with the same settings: "
            f"{', '.join(r['tag'] for r in extra)}")
    gathered = rows + sorted(extra, key=lambda r: r["tag"])
    return sorted(gathered, key=lambda r: r.get("lam") is not None)  # stable: vanilla first
