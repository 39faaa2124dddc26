"""Helper for tests/test_multiworker.py: one worker of a two-process ROLL fit step.

Run as a script with `TF_CONFIG` set (`python tests/_roll_multiworker.py
OUT.json`): it creates a `MultiWorkerMirroredStrategy` (one CPU replica per
process), builds and compiles the wrapped model inside its scope and runs one
`fit` step of SGD on the global batch, which Keras auto-shards: each worker
computes on its half and the gradients are all-reduced over gRPC. It writes

* the weights after the step, the logged `loss` / `roll_loss` and the number
  of examples its replica computed ROLL on (half the batch), for the exact
  loss in several chunks (the custom gradient inside `tf.cond`);
* the axes that its replica drew for the same examples with `seed=None` after
  the same global seed on both workers (identical graphs, so identical op
  seeds: only the replica id folded into the seed tells the workers apart),
  read back from a probe model as in `tests/_roll_distribute.py`.

Importing it has no side effect: `fit_step(None)` is the single-process
reference the test computes in its own interpreter.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_roll  # noqa: E402
from keras_roll.roll import loss as roll  # noqa: E402
from tests import model_zoo  # noqa: E402

GLOBAL_BATCH = 16
LR, LAM = 0.5, 2.0
BUDGET = 4096  # bytes: several chunks per replica
PROBE_D = 16


build = model_zoo.roll_mlp


def data():
    return model_zoo.roll_batch(GLOBAL_BATCH)


def fit_step(strategy):
    """One SGD step of the wrapped model on the global batch: weights, logs and the
    examples each of this process's replicas trained on."""

    def make():
        model = build()
        wrapped = keras_roll.wrap(model, lam=LAM, gamma=50.0, memory_budget=BUDGET)
        # Counts the examples every replica's train_step sees (ON_READ: per replica).
        seen = tf.Variable(0, trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.SUM)

        class Counting(keras_roll.RollModel):
            def train_step(self, data):
                seen.assign_add(tf.shape(tf.nest.flatten(data)[0])[0])
                return super().train_step(data)

        counting = Counting(wrapped.inputs, wrapped.outputs)
        counting.compile(keras.optimizers.SGD(LR), "sparse_categorical_crossentropy")
        return model, counting, seen

    if strategy is None:
        model, wrapped, seen = make()
    else:
        with strategy.scope():
            model, wrapped, seen = make()
    x, y = data()
    hist = wrapped.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    logs = {k: float(v[-1]) for k, v in hist.history.items()}
    local = [seen] if strategy is None else strategy.experimental_local_results(seen)
    logs["local_examples"] = [int(v.numpy()) for v in local]
    return [v.numpy().tolist() for v in model.trainable_variables], logs


def probe_draws(strategy):
    """Per-example sampled losses `D * (axis + 1)^2` of this worker's replica, seed=None."""
    keras.utils.set_random_seed(1)  # the same global seed, graph and op seeds everywhere
    with strategy.scope():
        inp = keras.Input((PROBE_D,))
        kernel = np.arange(1, PROBE_D + 1, dtype="float32")[:, None]
        z = keras.layers.Dense(1, use_bias=False,
                               kernel_initializer=keras.initializers.Constant(kernel))(inp)
        model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.ReLU()(z)))
    lin = keras_roll.linearize(model)
    rows = np.ones((GLOBAL_BATCH, PROBE_D), "float32")  # the same examples on every worker
    dataset = tf.data.Dataset.from_tensor_slices(rows).batch(GLOBAL_BATCH)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    step = tf.function(lambda xb: strategy.run(
        lambda xr: roll.roll_loss(lin, xr, samples=1, C=0.0), args=(xb,)), autograph=False)
    local = strategy.experimental_local_results(step(batch))
    return [t.numpy().tolist() for t in local]


def main(out_path):
    # The strategy must exist before any other TensorFlow op runs.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    weights, logs = fit_step(strategy)
    result = {
        "task": json.loads(os.environ["TF_CONFIG"])["task"]["index"],
        "replicas": strategy.num_replicas_in_sync,
        "weights": weights,
        "logs": logs,
        "probe": probe_draws(strategy),
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # skip the collective executor's shutdown, which can wait on the peer
