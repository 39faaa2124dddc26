"""The evaluation calls that tests/test_distribute_eval.py runs on one device and on
two replicas: `certify`, `robust_radius`, `saliency`, `integrated_gradients` (exact and
Riemann) and `gradient_distortion` (expected and worst case) on a tiny MLP (and a tiny
CNN), as `{call: {field: per-example array}}`.

Imported by the in-process test (two replicas as two threads on one device) and by
`tests/_eval_distribute.py` (two logical devices in a fresh interpreter).

Example:

```python
model, x, domain = models()["mlp"]
arrays = calls(model, x, domain)
```
"""

from __future__ import annotations

import numpy as np

import keras_roll
from tests import model_zoo

N = 5  # odd: batches of 3 and 2 examples; the replicas get 2 and 1, then 1 and 1


def models(full=False):
    rng = np.random.default_rng(0)
    mlp = model_zoo.mlp(fused=True, in_dim=6, widths=(8, 7), out=3)
    x_mlp = rng.uniform(0.0, 1.0, (N, 6)).astype("float32")
    if not full:
        return {"mlp": (mlp, x_mlp, (0.0, 1.0))}
    cnn = model_zoo.cnn()
    x_cnn = rng.uniform(0.0, 4.0, (N, 8, 8, 2)).astype("float32")
    return {"mlp": (mlp, x_mlp, (0.0, 1.0)), "cnn": (cnn, x_cnn, (0.0, 4.0))}


def fields(result, names):
    out = {}
    for name in names:
        value = getattr(result, name)
        if isinstance(value, dict):
            for p, v in value.items():
                out[f"{name}[{p}]"] = np.asarray(v)
        elif value is not None:
            out[name] = np.asarray(value)
    return out


def calls(model, x, domain, full=False, **run):
    """`{call: {field: array}}` of the five calls with the run options `run`."""
    y = np.arange(len(x)) % 3
    out = {}
    cert = keras_roll.certify(model, x, batch_size=3, verbose=False, **run)
    out["certify"] = fields(cert, ["margins", "binding_index", "logits"])
    sal = keras_roll.saliency(model, x, radius=True, verbose=False, batch_size=3, **run)
    out["saliency"] = fields(sal, ["maps", "logits", "labels", "radius"])
    igr = keras_roll.integrated_gradients(model, x, y, steps=6, verbose=False, **run)
    out["integrated_riemann"] = fields(igr, ["maps", "delta"])
    dist = keras_roll.gradient_distortion(model, x, y, eps=0.1, domain=domain, samples=5,
                                          seed=3, verbose=False, **run)
    out["distortion_expected"] = fields(dist, ["distortion", "changed_fraction"])
    method = "best" if full else "region"  # the same batch loop; "best" takes longer
    rr = keras_roll.robust_radius(model, x, y, batch_size=3, method=method, verbose=False,
                                  **run)
    out["robust_radius"] = fields(rr, ["lower", "upper", "exact", "predicted"])
    # (not `delta`: the exact integral's completeness gap is rounding noise, ~1e-10)
    ig = keras_roll.integrated_gradients(model, x, y, verbose=False, **run)
    out["integrated_exact"] = fields(ig, ["maps", "regions", "f_x"])
    worst = keras_roll.gradient_distortion(model, x, y, eps=0.1, domain=domain, mode="max",
                                           population=6, generations=2, seed=4,
                                           verbose=False, **run)
    out["distortion_max"] = fields(worst, ["distortion", "points", "changed"])
    return out
