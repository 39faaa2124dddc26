"""Optimized relaxations (alpha-CROWN) against CROWN: certified radii and time.

Trains a network briefly on MNIST (`--model=mlp`: 784-100-100-10, `--model=cnn`: CNN-S,
conv 16 4x4 s2, conv 32 4x4 s2, dense 100, dense 10; as `benchmarks.robust_search`),
then bounds `--num_examples` correctly classified test images with
`robust_radius(method="relaxation")` and `method="alpha_crown"` (`--steps`, `--lr`;
the final bound's slopes alone, and with `SlopeOptions(intermediate=True)`) in l_inf and
l2, and prints per norm the median and range of the lower bounds' ratio (alpha-CROWN /
CROWN) and the CPU seconds per image of each (`time.process_time`, the fairer measure
on a shared machine).

    python -m benchmarks.alpha_crown --data=/path/to/mnist.npz [--model=cnn]
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
from benchmarks.robust_search import trained_model  # noqa: E402
from keras_roll.data import mnist_splits  # noqa: E402

# --data, --model, --num_examples, --epochs, --train_size: benchmarks.robust_search's
FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 20, "Adam steps of the slopes per bound pass.")
flags.DEFINE_float("lr", 0.1, "Adam's step size.")
flags.DEFINE_string("rigor", "float64", "robust_radius's rigor.")

NORMS = (np.inf, 2)


def _run(model, x, method, **kw):
    start = time.process_time()
    rr = keras_roll.robust_radius(model, x, norms=NORMS, method=method, rigor=FLAGS.rigor,
                                  verbose=False, **kw)
    return rr, (time.process_time() - start) / len(x)


def main(_):
    data = mnist_splits(FLAGS.data, flatten=True)
    model = trained_model(data, FLAGS.model, FLAGS.epochs, FLAGS.train_size)
    _, _, (xt, yt) = data
    pred = np.argmax(model.predict(xt[:200], verbose=0), -1)
    x = xt[:200][pred == yt[:200]][:FLAGS.num_examples]
    crown, t_crown = _run(model, x, "relaxation")
    print(f"{FLAGS.model}, {len(x)} images, {FLAGS.epochs} epoch(s), rigor {FLAGS.rigor}, "
          f"{FLAGS.steps} steps, lr {FLAGS.lr}; CROWN {t_crown:.1f} CPU s per image "
          f"(both norms), median radius " + ", ".join(
              f"l{p} {np.median(crown.lower[p]):.4g}" for p in NORMS), flush=True)
    for intermediate in (False, True):
        slopes = keras_roll.robust.SlopeOptions(steps=FLAGS.steps, lr=FLAGS.lr,
                                                intermediate=intermediate)
        alpha, t_alpha = _run(model, x, "alpha_crown", slopes=slopes)
        print(f"  alpha-CROWN, intermediate={intermediate}: {t_alpha:.1f} CPU s per image")
        for p in NORMS:
            ratio = alpha.lower[p] / crown.lower[p]
            print(f"    l{p}: alpha / CROWN median {np.median(ratio):.3f} (min "
                  f"{ratio.min():.3f}, max {ratio.max():.3f})", flush=True)


if __name__ == "__main__":
    app.run(main)
