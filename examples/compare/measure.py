"""The measurements of one trained model, all with keras_roll's sound tools on test
images in [0, 1] pixel units: accuracy; the region margins `certify` certifies (P25 /
P50 in l1, l2, l_inf); the robustness radius's lower and upper medians (l2, l_inf) and
the certified accuracy at the `--certified_eps` radii; the expected and worst-case
gradient distortion (P50); bounds on the number of complete linear regions.

Example:

```python
result = measure(model, data, config)
result.l2_p50, result.certified[0.1], result.worst_p50
```
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import keras_roll
from examples.common import app
from examples.common.data import Data
from examples.compare.configs.default import Config

__all__ = ["Measures", "measure"]

INF = float("inf")


@dataclasses.dataclass(frozen=True)
class Measures:
    """What `measure` finds for one model (distances in [0, 1] pixel units).

    Attributes:
        test_acc: accuracy on the test images.
        l1_p25 ... linf_p50: percentiles of the certified region margins.
        clr_lower, clr_upper: distinct Jacobians <= #CLR <= distinct patterns.
        robust: `{"l2" | "linf": (median lower, median upper)}` robustness radius.
        exact_share: `{"l2" | "linf": share of the images whose radius is exact}`.
        certified: `{eps: certified accuracy at l_inf radius eps}`.
        robust_acc: the accuracy on the images of the radius and the certified
            accuracy (the first `n_robust` test images), which bounds it.
        expected_p50, worst_p50: P50 of the l1 gradient distortion (NaN: not run).
        n_eval, n_robust, n_distortion, n_worst: the images each measure used.
        seconds: the time the measurements took.
    """

    test_acc: float
    l1_p25: float
    l1_p50: float
    l2_p25: float
    l2_p50: float
    linf_p25: float
    linf_p50: float
    clr_lower: int
    clr_upper: int
    robust: dict
    exact_share: dict
    certified: dict
    expected_p50: float
    worst_p50: float
    n_eval: int
    n_robust: int
    n_distortion: int
    n_worst: int
    seconds: float
    robust_acc: float = float("nan")

    def to_json(self) -> dict:
        """The fields as JSON values (the certified radii as strings)."""
        out = dataclasses.asdict(self)
        out["certified"] = {f"{eps:g}": acc for eps, acc in self.certified.items()}
        return out

    @classmethod
    def from_json(cls, data: dict) -> Measures:
        """The inverse of `to_json`."""
        data = dict(data)
        data["certified"] = {float(eps): acc for eps, acc in data["certified"].items()}
        data["robust"] = {k: tuple(v) for k, v in data["robust"].items()}
        return cls(**data)


def _median(values) -> float:
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    return float(np.median(values)) if values.size else float("nan")


def measure(model, data: Data, config: Config, verbose=False) -> Measures:
    """Every measurement of the comparison for `model` (see the module docstring)."""
    start = time.perf_counter()
    xt, yt = data.test
    pred = np.argmax(model.predict(xt, batch_size=1000, verbose=0), axis=-1)
    test_acc = float(np.mean(pred == yt))
    n = min(config.eval_size, len(xt))
    cert = keras_roll.certify(model, xt[:n], verbose=verbose)
    margins = {}
    for name, p in (("l1", 1), ("l2", 2), ("linf", INF)):
        q25, q50 = np.percentile(cert.margins[p], (25, 50))
        margins[f"{name}_p25"], margins[f"{name}_p50"] = float(q25), float(q50)
    regions = keras_roll.count_regions(model, xt[:n], verbose=verbose)

    nr = min(config.robust_size, len(xt))
    app.log(f"   robustness radius of {nr} test images (l2, l_inf)")
    rr = keras_roll.robust_radius(model, xt[:nr], yt[:nr], norms=(2, INF), verbose=verbose)
    robust = {name: (_median(rr.lower[p]), _median(rr.upper[p]))
              for name, p in (("l2", 2), ("linf", INF))}
    exact = {name: float(np.mean(rr.exact[p])) for name, p in (("l2", 2), ("linf", INF))}
    certified = {float(eps): float(rr.certified_accuracy(eps, INF))
                 for eps in config.certified_eps}
    robust_acc = float(np.mean(pred[:nr] == yt[:nr]))

    nd = min(config.distortion_size, len(xt))
    app.log(f"   gradient distortion (eps {config.distortion_eps:g}): expected on {nd} images"
            + (f", worst case on {min(config.worst_size, len(xt))}" if config.worst_size
               else ""))
    expected = keras_roll.gradient_distortion(
        model, xt[:nd], yt[:nd], eps=config.distortion_eps, mode="expected",
        samples=config.distortion_samples, seed=config.seed, verbose=verbose)
    nw = min(config.worst_size, len(xt))
    worst = float("nan")
    if nw:
        worst = _median(keras_roll.gradient_distortion(
            model, xt[:nw], yt[:nw], eps=config.distortion_eps, mode="max",
            population=config.worst_population, generations=config.worst_generations,
            seed=config.seed, verbose=verbose).distortion)
    return Measures(test_acc, **margins, clr_lower=int(regions.jacobians),
                    clr_upper=int(regions.patterns), robust=robust, exact_share=exact,
                    certified=certified, expected_p50=_median(expected.distortion),
                    worst_p50=worst, n_eval=n, n_robust=nr, n_distortion=nd, n_worst=nw,
                    seconds=time.perf_counter() - start, robust_acc=robust_acc)
