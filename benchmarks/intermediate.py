"""The intermediate bounds of `robust_radius`'s relaxation: CROWN at every layer against
intervals (CROWN-IBP), and what `intermediate="auto"` chooses.

Trains a network briefly on MNIST (`--model=mlp`: 784-100-100-10, `--model=cnn`:
CNN-S; as `benchmarks.robust_search`), then bounds `--num_examples` test images with
`robust_radius(method="relaxation", norms=(np.inf,))` once per choice and prints the
median radius of each, the median ratio CROWN / CROWN-IBP per image, the CPU seconds
and the seconds per bound pass and input; then AUTO's choice and its reason, its
estimate of CROWN's seconds per pass against the measured one, and AUTO's choice on
the randomly initialised CNN-L of `benchmarks.cnn_models` (the probe alone: no pass).

    python -m benchmarks.intermediate --data=/path/to/mnist.npz [--model=cnn]
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
from benchmarks.cnn_models import cnn_l  # noqa: E402
from benchmarks.robust_search import trained_model  # noqa: E402
from keras_roll.data import mnist_splits  # noqa: E402
from keras_roll.robust.bounds import intermediate_choice  # noqa: E402

FLAGS = flags.FLAGS
# --data, --model, --num_examples, --epochs, --train_size: benchmarks.robust_search's flags
flags.DEFINE_bool("cnn_l", True, "Also print AUTO's choice on CNN-L (random weights).")


def bound(model, x, y, choice):
    keras_roll.robust_radius(model, x[:1], y[:1], norms=(np.inf,), method="relaxation",
                             intermediate=choice, verbose=False)  # tracing
    cpu, wall = time.process_time(), time.perf_counter()
    rr = keras_roll.robust_radius(model, x, y, norms=(np.inf,), method="relaxation",
                                  intermediate=choice, verbose=False)
    return rr, time.process_time() - cpu, time.perf_counter() - wall


def main(argv):
    del argv
    data = mnist_splits(FLAGS.data, val=5000)
    model = trained_model(data, FLAGS.model, FLAGS.epochs, FLAGS.train_size)
    x, y = data[2][0][:FLAGS.num_examples], data[2][1][:FLAGS.num_examples]
    print(f"machine: {os.cpu_count()} CPU cores (shared), TensorFlow {tf.__version__}")
    print(f"network: {FLAGS.model}, {FLAGS.epochs} epoch(s) on {FLAGS.train_size} images; "
          f"{len(x)} test images, l_inf, method='relaxation'")
    res = {}
    for choice in ("crown", "intervals"):
        rr, cpu, wall = bound(model, x, y, choice)
        ok = rr.correct & (rr.bound_passes[np.inf] > 0)
        passes = int(rr.bound_passes[np.inf][ok].sum())
        res[choice] = rr
        print(f"{choice}: median lower {np.median(rr.lower[np.inf][ok]):.4g}, {cpu:.1f} CPU s "
              f"({wall:.1f} s wall), {wall / max(passes, 1):.3g} s per pass and input "
              f"({passes} passes)")
    ok = res["crown"].correct & (res["intervals"].lower[np.inf] > 0)
    ratio = res["crown"].lower[np.inf][ok] / res["intervals"].lower[np.inf][ok]
    print(f"CROWN / CROWN-IBP radius per image: median {np.median(ratio):.3g}, "
          f"min {np.min(ratio):.3g}, max {np.max(ratio):.3g} ({int(ok.sum())} images)")
    twin = keras_roll.linearize(model).at_dtype("float64")
    start = time.perf_counter()
    choice = intermediate_choice(twin, x.astype(np.float64), "auto")
    print(f"auto ({time.perf_counter() - start:.2f} s to choose): {choice.reason}")
    if FLAGS.cnn_l:
        big = keras_roll.linearize(cnn_l()).at_dtype("float64")
        start = time.perf_counter()
        choice = intermediate_choice(big, np.zeros((1, 28, 28, 1)), "auto")
        print(f"CNN-L auto ({time.perf_counter() - start:.1f} s to choose, with the probe): "
              f"{choice.reason}")


if __name__ == "__main__":
    app.run(main)
