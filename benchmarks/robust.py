"""robust_radius on the paper's 784-300x4-10 MNIST network: method 1's throughput and the
linear relaxation against interval bounds.

Trains the network briefly on MNIST (Adam, `--epochs` over `--train_size` images;
`--data` is an mnist.npz or a folder of the IDX files), then

* times `robust_radius(method="region")` (method 1: the region margin and the
  decision hyperplanes of the affine map) on `--num_examples` test images in l2 and
  l_inf, interleaved with `certify` on the same images and norms (its main cost), and
  prints examples/s of each (wall time, and per CPU second of the process: on a
  shared machine the wall time also counts the other jobs' turns) and their ratio
  (medians of `--repeats`);
* bounds `--relax_examples` test images with `method="relaxation"` and
  `method="interval"` and prints the median certified radius of each, their ratio
  (target: relaxation >= 5 x intervals at the median) and seconds per input.

Only ratios measured in one run mean anything on a shared machine.

    python -m benchmarks.robust --data=/path/to/mnist.npz [--num_examples=200]
"""

from __future__ import annotations

import os
import time

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

import keras_roll
from benchmarks._util import define_mnist_flags, interleaved_medians
from keras_roll.data import mnist_splits

FLAGS = flags.FLAGS
define_mnist_flags(200, "Test images timed with method 1.", epochs=2)
flags.DEFINE_integer("relax_examples", 20, "Test images bounded by relaxation and intervals.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions (the median is reported).")
flags.DEFINE_integer("train_size", 20000, "Training images.")
flags.DEFINE_string("rigor", "float64", "Rounding guard: float64, strict or float32.")

NORMS = (2, np.inf)


def trained_model(data, epochs: int, train_size: int) -> keras.Model:
    (x, y), _, _ = data
    keras.utils.set_random_seed(0)
    model = keras_roll.models.fc()
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model.fit(x[:train_size], y[:train_size], epochs=epochs, batch_size=128, verbose=0)
    return model


def method1(model, x, repeats: int, rigor: str):
    """Interleaved medians of method 1 and of certify on the same inputs and norms:
    `(wall seconds, CPU seconds of this process)` per variant."""
    lin = keras_roll.linearize(model)
    keras_roll.robust_radius(lin, x[:8], norms=NORMS, method="region", rigor=rigor,
                             verbose=False)  # tracing
    cpu = {"region": [], "certify": []}

    def cpu_timed(name, fn):
        def timed():
            start = time.process_time()
            fn()
            cpu[name].append(time.process_time() - start)
        return timed

    wall = interleaved_medians({
        "region": cpu_timed("region", lambda: keras_roll.robust_radius(
            lin, x, norms=NORMS, method="region", rigor=rigor, verbose=False)),
        "certify": cpu_timed("certify", lambda: keras_roll.certify(
            lin, x, norms=NORMS, rigor=rigor, verbose=0)),
    }, repeats, warmup=1)
    return wall, {name: float(np.median(t[-repeats:])) for name, t in cpu.items()}


def relaxation_vs_intervals(model, x, y, rigor: str):
    out = {}
    for method in ("relaxation", "interval"):
        start = time.perf_counter()
        rr = keras_roll.robust_radius(model, x, y, norms=NORMS, method=method, rigor=rigor,
                                      verbose=False)
        out[method] = (rr, time.perf_counter() - start)
    return out


def main(argv):
    del argv
    data = mnist_splits(FLAGS.data, val=5000)
    model = trained_model(data, FLAGS.epochs, FLAGS.train_size)
    xte, yte = data[2]
    acc = float(np.mean(np.argmax(model.predict(xte, verbose=0), -1) == yte))
    n, k = FLAGS.num_examples, FLAGS.relax_examples
    times, cpu = method1(model, xte[:n], FLAGS.repeats, FLAGS.rigor)
    bounds = relaxation_vs_intervals(model, xte[:k], yte[:k], FLAGS.rigor)
    print(f"machine: {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}; "
          f"rigor {FLAGS.rigor}")
    print(f"network: 784-300x4-10 ReLU, {FLAGS.epochs} epochs on {FLAGS.train_size} "
          f"images, test accuracy {acc:.1%}")
    for name, t in times.items():
        print(f"{name:>8} (l2 + l_inf, {n} inputs): {t:8.2f} s -> {n / t:8.1f} examples/s; "
              f"CPU {cpu[name]:8.2f} s -> {n / cpu[name]:8.1f} examples per CPU second")
    print(f"method 1 / certify time: {times['region'] / times['certify']:.2f}")
    rr_r, t_r = bounds["relaxation"]
    rr_i, t_i = bounds["interval"]
    for p in NORMS:
        ok = rr_r.correct
        med_r, med_i = np.median(rr_r.lower[p][ok]), np.median(rr_i.lower[p][ok])
        label = "l2" if p == 2 else "linf"
        print(f"{label}: median certified radius, relaxation {med_r:.4g}, intervals "
              f"{med_i:.4g}: ratio {med_r / med_i:.1f} (target >= 5)")
    print(f"seconds per input (both norms): relaxation {t_r / k:.2f}, intervals {t_i / k:.2f}")


if __name__ == "__main__":
    app.run(main)
