"""Helper for tests/test_distribute.py: ROLL under a two-replica MirroredStrategy.

Run as a script (`python tests/_roll_distribute.py OUT.json [--replicas-only]`):
it splits the CPU into two logical devices *before* TensorFlow initialises, then

* (`replica_draws`, also alone with `--replicas-only`, the fast check) gives
  both replicas the *same* examples and reads back the sampled axis every
  example drew: a probe model whose single neuron has the weight `a + 1` on
  input axis `a` turns the sampled loss with `samples=1, C=0` into
  `D * (a + 1)^2`, so the axis is `sqrt(loss / D) - 1`. It does so for
  `roll_loss` with `seed=None` and with an int seed, and for the
  regularizer's per-step seeds (`RollRegularizer.step_seed`, int seed and
  None) over several steps, and for its fixed evaluation seed;

and compares, for one global batch,

* `roll_loss` per example and its weight gradient computed per replica with
  `strategy.run` (summed over replicas) against one device;
* one `fit` step of the wrapped model with SGD (the weight update is -lr times
  the all-reduced gradient) against the same step without a strategy, for the
  exact loss in several chunks (custom gradient inside `tf.cond`) and for the
  seeded sampled loss (in one chunk);
* the `loss` and `roll_loss` that `fit` reports.

It writes the maximum absolute differences (and a few reference magnitudes)
as JSON; the test asserts on them.
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
from keras_roll.roll import loss as roll  # noqa: E402
from keras_roll.roll.config import RollConfig  # noqa: E402
from tests import model_zoo  # noqa: E402

GLOBAL_BATCH = 16
LR, LAM = 0.5, 2.0


build = model_zoo.roll_mlp


def data():
    return model_zoo.roll_batch(GLOBAL_BATCH)


def max_diff(a, b):
    return float(max(np.max(np.abs(np.asarray(u) - np.asarray(v))) for u, v in zip(a, b)))


def direct(strategy, x):
    """roll_loss and d mean(roll_loss) / dW, one device vs. per replica."""
    model = build()
    lin = keras_roll.linearize(model, memory_budget=4096)  # several chunks per replica
    with tf.GradientTape() as tape:
        ref_loss = roll.roll_loss(lin, x, gamma=50.0)
        ref_mean = tf.reduce_mean(ref_loss)
    ref_grads = tape.gradient(ref_mean, model.trainable_variables)
    ref_grads = [tf.zeros_like(v) if g is None else g
                 for g, v in zip(ref_grads, model.trainable_variables)]

    with strategy.scope():
        model_d = build()
    lin_d = keras_roll.linearize(model_d, memory_budget=4096)
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL_BATCH)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))

    @tf.function
    def step(xb):
        def replica_fn(xr):
            with tf.GradientTape() as tape:
                per = roll.roll_loss(lin_d, xr, gamma=50.0)
                scaled = tf.reduce_sum(per) / GLOBAL_BATCH
            grads = tape.gradient(scaled, model_d.trainable_variables)
            grads = [tf.zeros_like(v) if g is None else g
                     for g, v in zip(grads, model_d.trainable_variables)]
            return per, grads

        per, grads = strategy.run(replica_fn, args=(xb,))
        grads = [strategy.reduce("SUM", g, axis=None) for g in grads]
        return per, grads

    per, grads = step(batch)
    per = tf.concat(strategy.experimental_local_results(per), axis=0)
    return {
        "direct_loss_diff": max_diff([ref_loss], [per]),
        "direct_loss_scale": float(np.max(np.abs(ref_loss))),
        "direct_grad_diff": max_diff(ref_grads, grads),
        "direct_grad_scale": float(max(np.max(np.abs(g)) for g in ref_grads)),
    }


def fit_step(strategy, x, y, budget, lam=LAM, **kwargs):
    """One SGD step of the wrapped model; returns new weights and the logs."""

    def make():
        model = build()
        wrapped = keras_roll.wrap(model, lam=lam, memory_budget=budget, **kwargs)
        wrapped.compile(keras.optimizers.SGD(LR), "sparse_categorical_crossentropy")
        return model, wrapped

    if strategy is None:
        model, wrapped = make()
    else:
        with strategy.scope():
            model, wrapped = make()
    hist = wrapped.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    logs = {k: float(v[-1]) for k, v in hist.history.items()}
    return [v.numpy() for v in model.trainable_variables], logs


PROBE_D = 16
STEPS = 4


def probe_model():
    """One neuron z = sum_a (a + 1) x_a (ReLU, so valid on either side of 0)."""
    inp = keras.Input((PROBE_D,))
    z = keras.layers.Dense(1, use_bias=False, name="probe",
                           kernel_initializer=keras.initializers.Constant(
                               np.arange(1, PROBE_D + 1, dtype="float32")[:, None]))(inp)
    h = keras.layers.ReLU()(z)
    return keras.Model(inp, keras.layers.Dense(2, name="head")(h))


def replica_draws(strategy):
    """Per-example sampled losses per replica (`[replicas][steps][examples]` lists) for the
    same examples on every replica; `tests/test_distribute.py` decodes the axes."""
    per_replica = 8
    rows = np.random.default_rng(1).normal(size=(1, PROBE_D)).astype("float32")
    x = np.repeat(rows, per_replica * strategy.num_replicas_in_sync, axis=0)
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(len(x))
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    with strategy.scope():
        model = probe_model()
        seeded = keras_roll.RollRegularizer(model, samples=1, C=0.0, seed=3)
        unseeded = keras_roll.RollRegularizer(model, samples=1, C=0.0)
    lin = keras_roll.linearize(model)
    config = RollConfig(samples=1, C=0.0)
    cases = {
        "roll_loss_seed_none": lambda xr: roll.roll_loss(lin, xr, samples=1, C=0.0),
        "roll_loss_seed5": lambda xr: roll.roll_loss(lin, xr, samples=1, C=0.0, seed=5),
        # what RollRegularizer.call computes in training and in evaluation
        "layer_seed3": lambda xr: roll.loss_from_config(lin, xr, config, seeded.step_seed(True)),
        "layer_seed_none": lambda xr: roll.loss_from_config(lin, xr, config,
                                                            unseeded.step_seed(True)),
        "eval_seed": lambda xr: roll.loss_from_config(lin, xr, config, seeded.step_seed(False)),
    }
    draws = {"exact_probe": roll.roll_loss(lin, x[:1], C=0.0).numpy().tolist()}
    # every case in one function: one trace instead of five
    step = tf.function(lambda xb: strategy.run(
        lambda xr: {name: fn(xr) for name, fn in cases.items()}, args=(xb,)), autograph=False)
    outs = [step(batch) for _ in range(STEPS)]
    for name in cases:
        losses = [[t.numpy().tolist() for t in strategy.experimental_local_results(out[name])]
                  for out in outs]
        draws[name] = [[s[r] for s in losses] for r in range(strategy.num_replicas_in_sync)]
    return draws


def main(out_path, replicas_only=False):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    result = {"replicas": strategy.num_replicas_in_sync}
    result["draws"] = replica_draws(strategy)
    if replicas_only:
        with open(out_path, "w") as f:
            json.dump(result, f)
        return
    x, y = data()
    result.update(direct(strategy, x))
    # "chunked": the exact loss in several chunks (custom gradient inside tf.cond);
    # "sampled": all D = 5 axes drawn per example (so exact, in one chunk) with a seed,
    # which runs the per-step, per-replica seed counter.
    variants = [("chunked", 4096, {"gamma": 50.0}), ("sampled", None, {"samples": 5, "seed": 1})]
    # How much the regularizer moves the weights in one step (lr * lam * max |grad|):
    # an add_loss that Keras did not scale by 1 / replicas would double it.
    result["roll_update"] = LR * LAM * result["direct_grad_scale"]
    for name, budget, kwargs in variants:
        w1, logs1 = fit_step(None, x, y, budget, **kwargs)
        w2, logs2 = fit_step(strategy, x, y, budget, **kwargs)
        result[f"{name}_weight_diff"] = max_diff(w1, w2)
        result[f"{name}_loss"] = [logs1["loss"], logs2["loss"]]
        result[f"{name}_roll"] = [logs1["roll_loss"], logs2["roll_loss"]]
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], replicas_only="--replicas-only" in sys.argv[2:])
