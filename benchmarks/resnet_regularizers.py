"""Training steps of every regularizer on ResNet-18 at 32x32x3, 10 classes.

One regularizer per process (so that the process's peak RSS is that regularizer's):
`keras_roll.models.resnet18(input_shape=(32, 32, 3), classes=10)`, random weights
(seed 0), a random batch in [0, 1] with random labels, SGD through Keras
`train_on_batch` of `keras_roll.wrap(model, ...)` (the plain model for "vanilla"),
the weights put back before every step.
Prints the first step (tracing included) and the median of `--steps` warm steps,
wall and CPU seconds (`time.process_time()`, every thread of the process), and the
peak RSS (`ru_maxrss`).

    python -m benchmarks.resnet_regularizers --regularizer=mmr --batch=2 --steps=1
    python -m benchmarks.resnet_regularizers --regularizer=roll_exact --memory_budget=268435456

Regularizers (`--regularizer`): vanilla, roll_exact (every input axis), roll_sampled
(`--samples` axes per example), input_gradient (l2), mmr (l_inf, `k_B=100`), ibp and
crown_ibp (eps 2/255 in the input's [0, 1] units).
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import resource  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
from benchmarks.roll_steps import weight_reset  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("regularizer", "vanilla", "One of " + ", ".join(
    ["vanilla", "roll_exact", "roll_sampled", "input_gradient", "mmr", "ibp", "crown_ibp"]))
flags.DEFINE_integer("batch", 4, "Examples per step.")
flags.DEFINE_integer("steps", 2, "Warm steps after the first (their median is reported).")
flags.DEFINE_integer("samples", 3, "Sampled axes of roll_sampled.")
flags.DEFINE_integer("memory_budget", 0, "ROLL only: bytes of tangents per chunk "
                     "(RollConfig.memory_budget); 0: the twin's default.")

EPS = 2 / 255


def wrap_kwargs(name: str) -> dict | None:
    """`keras_roll.wrap` arguments of a regularizer (None: the plain model)."""
    return {
        "vanilla": None,
        "roll_exact": dict(lam=1.0, C=1.0),
        "roll_sampled": dict(lam=1.0, C=1.0, samples=FLAGS.samples),
        "input_gradient": dict(regularizer=keras_roll.InputGradientConfig(p=2)),
        "mmr": dict(regularizer=keras_roll.MMRConfig(p="inf", k_B=100, gamma_B=EPS,
                                                     gamma_D=EPS)),
        "ibp": dict(regularizer=keras_roll.IBPConfig(eps=EPS, kappa=0.5)),
        "crown_ibp": dict(regularizer=keras_roll.CrownIBPConfig(eps=EPS, kappa=0.5, beta=1.0)),
    }[name]


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv) -> None:
    del argv
    keras.utils.set_random_seed(0)
    model = keras_roll.models.resnet18(input_shape=(32, 32, 3), classes=10)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (FLAGS.batch, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, FLAGS.batch)
    kw = wrap_kwargs(FLAGS.regularizer)
    if kw is not None and FLAGS.memory_budget and "regularizer" not in kw:
        kw = dict(kw, memory_budget=FLAGS.memory_budget)
    net = model if kw is None else keras_roll.wrap(model, **kw)
    net.compile(keras.optimizers.SGD(0.01),
                keras.losses.SparseCategoricalCrossentropy(from_logits=False))
    print(f"ResNet-18 32x32x3, batch {FLAGS.batch}, {FLAGS.regularizer}; model built: "
          f"{_peak_gib():.2f} GiB", flush=True)
    times, reset = [], weight_reset(model)
    for i in range(1 + FLAGS.steps):
        reset()  # every step from the same weights (the steps would train the model)
        wall, cpu = time.perf_counter(), time.process_time()
        loss = net.train_on_batch(x, y)
        times.append((time.perf_counter() - wall, time.process_time() - cpu))
        print(f"step {i} ({'first' if i == 0 else 'warm'}): {times[-1][0]:.2f} s wall, "
              f"{times[-1][1]:.2f} s CPU, loss {float(np.ravel(loss)[0]):.4g}, peak "
              f"{_peak_gib():.2f} GiB", flush=True)
    if FLAGS.steps:
        warm = np.median(np.array(times[1:]), axis=0)
        print(f"RESULT {FLAGS.regularizer}: first {times[0][0]:.1f} s wall / {times[0][1]:.1f} "
              f"s CPU; warm {warm[0]:.2f} s wall / {warm[1]:.2f} s CPU per step; peak RSS "
              f"{_peak_gib():.2f} GiB", flush=True)


if __name__ == "__main__":
    app.run(main)
