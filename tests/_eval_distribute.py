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
from tests.eval_calls import calls, fields, models  # noqa: E402


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
