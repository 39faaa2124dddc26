"""Helper for tests/test_distribute_eval.py: the evaluation calls on two replicas.

Run as a script (`python tests/_eval_distribute.py OUT.npz [--full]`): it splits the CPU
into two logical devices *before* TensorFlow initialises, then runs `certify`,
`robust_radius`, `saliency`, `integrated_gradients` (exact and Riemann) and
`gradient_distortion` (expected and worst case) on a tiny MLP (and, with `--full`,
a tiny CNN), once on one device (no strategy) and once under a two-replica
`MirroredStrategy` (passed as `strategy=`, and once taken from the scope), with
an odd number of examples and several batches, so that the replicas get slices
of different sizes. Without `--full` only the MLP runs (the CNN costs about 25 s
of CPU, 13 s of them in its first compiled float64 certificate), and
`robust_radius` by its region method (the default "best" with `--full`). Compiled
functions run as graphs here (not eagerly as in the default suite). It writes every per-example
array of every result to OUT.npz as `call/model/run/field`; the test compares the runs.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import numpy as np  # noqa: E402

import keras_roll  # noqa: E402
from keras_roll.distribute import Replicas  # noqa: E402
from tests import model_zoo  # noqa: E402

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


def main(out: str, full: bool = False) -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert Replicas.of(strategy).count == 2
    arrays = {}
    for name, (model, x, domain) in models(full).items():
        runs = {"one": calls(model, x, domain, full),
                "two": calls(model, x, domain, full, strategy=strategy)}
        with strategy.scope():  # the strategy in scope is the default
            runs["scope"] = {"certify": fields(
                keras_roll.certify(model, x, batch_size=3, verbose=False),
                ["margins", "binding_index", "logits"])}
        for run, results in runs.items():
            for call, values in results.items():
                for field, value in values.items():
                    arrays[f"{call}/{name}/{run}/{field}"] = value
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], "--full" in sys.argv[2:])
