"""Helper for tests/test_regularizers.py and tests/test_certified_training.py: the
regularizers beside ROLL under a two-replica MirroredStrategy.

Run as a script (`python tests/_regularizers_distribute.py OUT.json NAME...`, names
from `CONFIGS`): it splits the CPU into two logical devices *before* TensorFlow
initialises, then, for each named regularizer, runs one SGD `fit` step of the wrapped
model on one global batch with and without the strategy (and once more without it at
`lam=0`, to size the regularizer's own share of the update), with an `EpsilonRamp`
setting `eps` for the certified-training terms, and writes the weight differences and
the logged `loss`, term and (where logged) certified accuracy as JSON; the tests
assert on them.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_roll  # noqa: E402
from tests import model_zoo  # noqa: E402

GLOBAL_BATCH = 16
LR = 0.5
CONFIGS = {
    "mmr": keras_roll.MMRConfig(lam=2.0, k_B=4, k_D=2, gamma_B=2.0, gamma_D=2.0),
    "input_gradient": keras_roll.InputGradientConfig(lam=2.0, p="inf"),
    "ibp": keras_roll.IBPConfig(eps=0.3, kappa=0.5),
    "crown_ibp": keras_roll.CrownIBPConfig(eps=0.3, kappa=0.2, beta=0.5),
}


def fit_step(strategy, x, y, config):
    """One SGD step of the wrapped model; returns the new weights and the logs."""

    def make():
        model = model_zoo.roll_mlp()
        wrapped = keras_roll.wrap(model, regularizer=config)
        wrapped.compile(keras.optimizers.SGD(LR), "sparse_categorical_crossentropy")
        return model, wrapped

    if strategy is None:
        model, wrapped = make()
    else:
        with strategy.scope():
            model, wrapped = make()
    ramps = [keras_roll.callbacks.EpsilonRamp(config.eps, length=4, start=0.2)] \
        if hasattr(config, "eps") else []
    hist = wrapped.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
                       callbacks=ramps)
    logs = {k: float(v[-1]) for k, v in hist.history.items()}
    return [v.numpy() for v in model.trainable_variables], logs


def max_diff(a, b):
    return float(max(np.max(np.abs(u - v)) for u, v in zip(a, b)))


def main(out_path, names):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = model_zoo.roll_batch(GLOBAL_BATCH)
    result = {"replicas": strategy.num_replicas_in_sync}
    for name in names:
        config = CONFIGS[name]
        w1, logs1 = fit_step(None, x, y, config)
        w2, logs2 = fit_step(strategy, x, y, config)
        w0, _ = fit_step(None, x, y, config.__class__(**{**config.to_config(), "lam": 0.0}))
        result[name] = {
            "weight_diff": max_diff(w1, w2),
            "reg_update": max_diff(w1, w0),
            "loss": [logs1["loss"], logs2["loss"]],
            "term": [logs1[config.log_name], logs2[config.log_name]],
        }
        if "certified_accuracy" in logs1:
            result[name]["certified"] = [logs1["certified_accuracy"],
                                         logs2["certified_accuracy"]]
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
