"""Branch and bound on the MNIST MLP: the bracket `robust_radius` gives with and without
`branch=`.

Trains the 784-100-100-10 MLP (`--model=cnn`: CNN-S) briefly on MNIST (as
`benchmarks.robust_search`: Adam,
`--epochs` over `--train_size` images, no robust training: "vanilla"; with
`--roll_lam`, then as many epochs more with the ROLL regularizer), then bounds
`--num_examples` test images in `--norm` with `robust_radius` (method "best"): without
branch and bound, and with `BranchOptions(max_seconds=s)` for each `s` of `--seconds`. Prints per
image the bracket (upper / lower) and whether it is exact, then the median and P90 of
upper / lower, the share exact, and the seconds per image (wall and this process's CPU
time; on a shared machine only the CPU time means much).

    python -m benchmarks.branch_bound --data=/path/to/mnist.npz --num_examples=10
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
from benchmarks.robust_search import trained_model  # noqa: E402
from keras_roll.data import mnist_splits  # noqa: E402
from keras_roll.options import parse_norm  # noqa: E402
from keras_roll.robust import BranchOptions  # noqa: E402

FLAGS = flags.FLAGS
# --data, --num_examples, --epochs, --train_size, --model: benchmarks.robust_search's
# flags.
flags.DEFINE_string("norm", "linf", "The norm: l1, l2 or linf.")
flags.DEFINE_list("seconds", ["10", "30"], "BranchOptions.max_seconds per image (one "
                  "run per value).")
flags.DEFINE_bool("alpha", True, "BranchOptions.alpha.")
flags.DEFINE_integer("candidates", 3, "BranchOptions.candidates (1: BaBSR alone).")
flags.DEFINE_integer("batch", 64, "BranchOptions.batch.")
flags.DEFINE_integer("beta_steps", 8, "BranchOptions.beta_steps.")
flags.DEFINE_integer("layer_steps", 8, "BranchOptions.layer_steps (0: CROWN's layer bounds).")
flags.DEFINE_bool("refine", True, "BranchOptions.refine (False: the ball's layer bounds, cut "
                  "by each leaf's splits).")
flags.DEFINE_string("rigor", "float64", "The rounding guard.")
flags.DEFINE_enum("clock", "wall", ["wall", "cpu"], "BranchOptions.clock: what --seconds "
                  "counts (cpu: this process's CPU time, the fair budget on a shared "
                  "machine).")
flags.DEFINE_float("roll_lam", 0.0, "Then fine-tune --epochs more with ROLL (keras_roll.wrap, "
                   "this lam, C=1, gamma=100, 16 sampled axes); 0: vanilla.")


def _roll_tuned(model, data):
    """`model` trained `--epochs` more with the ROLL regularizer (sampled, 16 axes)."""
    (x, y), _, _ = data
    wrapped = keras_roll.wrap(model, lam=FLAGS.roll_lam, C=1.0, gamma=100.0, samples=16,
                              seed=0)
    wrapped.compile(keras.optimizers.Adam(1e-3),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    n = FLAGS.train_size
    wrapped.fit(x[:n].reshape(n, -1), y[:n], epochs=FLAGS.epochs, batch_size=128, verbose=0)
    return keras_roll.unwrap(wrapped)


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _row(name, rr, p, wall, cpu, n):
    # a misclassified input has the bracket [0, 0]: exact, its ratio 1
    upper, lower = np.asarray(rr.upper[p], float), np.asarray(rr.lower[p], float)
    ratio = np.divide(upper, lower, out=np.ones_like(upper), where=upper != lower)
    return (f"| {name} | {np.median(ratio):.3f} | {np.percentile(ratio, 90):.3f} | "
            f"{100 * np.mean(rr.exact[p]):.0f} % | {wall / n:.1f} | {cpu / n:.1f} | "
            f"{np.mean(rr.bound_passes[p]):.0f} |")


def main(_):
    data = mnist_splits(FLAGS.data)
    model = trained_model(data, FLAGS.model, FLAGS.epochs, FLAGS.train_size)
    if FLAGS.roll_lam:
        model = _roll_tuned(model, data)
    _, _, (xt, yt) = data
    p = parse_norm(FLAGS.norm)
    x, y = xt[:FLAGS.num_examples].reshape(-1, 784), yt[:FLAGS.num_examples]
    run = dict(norms=(p,), rigor=FLAGS.rigor, verbose=False)
    keras_roll.robust_radius(model, x[:1], y[:1], **run)  # compiles
    warm = BranchOptions(max_seconds=3.0, batch=FLAGS.batch, beta_steps=FLAGS.beta_steps,
                         alpha=FLAGS.alpha, candidates=FLAGS.candidates,
                         layer_steps=FLAGS.layer_steps, refine=FLAGS.refine,
                         clock=FLAGS.clock)
    keras_roll.robust_radius(model, x[-1:], y[-1:], branch=warm, **run)  # compiles its passes
    plain, w0, c0 = _timed(lambda: keras_roll.robust_radius(model, x, y, **run))
    n = len(x)
    rows = [_row("without branch", plain, p, w0, c0, n)]
    for seconds in map(float, FLAGS.seconds):
        options = BranchOptions(max_seconds=seconds, batch=FLAGS.batch,
                                beta_steps=FLAGS.beta_steps, alpha=FLAGS.alpha,
                                candidates=FLAGS.candidates, layer_steps=FLAGS.layer_steps,
                                refine=FLAGS.refine, clock=FLAGS.clock)
        bab, w1, c1 = _timed(
            lambda o=options: keras_roll.robust_radius(model, x, y, branch=o, **run))
        for i in range(n):
            print(f"{seconds:g} s, image {i}: without {plain.lower[p][i]:.5f} .. "
                  f"{plain.upper[p][i]:.5f}, with {bab.lower[p][i]:.5f} .. "
                  f"{bab.upper[p][i]:.5f} ({bab.lower_method[p][i]} / "
                  f"{bab.upper_method[p][i]}, exact {bool(bab.exact[p][i])})", flush=True)
        rows.append(_row(f"branch=BranchOptions(max_seconds={seconds:g}, "
                         f"alpha={FLAGS.alpha}, candidates={FLAGS.candidates}, "
                         f"layer_steps={FLAGS.layer_steps}, batch={FLAGS.batch}, "
                         f"beta_steps={FLAGS.beta_steps}, refine={FLAGS.refine}, "
                         f"clock={FLAGS.clock!r})",
                         bab, p, w1, c1, n))
    print("| robust_radius | upper / lower, median | P90 | exact | s / image (wall) | "
          "s / image (CPU) | bound passes / image |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    app.run(main)
