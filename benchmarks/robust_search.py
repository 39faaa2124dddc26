"""The relaxation's radius search: bound passes per radius, and the default rigor's lower
bounds near a decision boundary.

Trains a network briefly on MNIST (`--model=mlp`: 784-100-100-10, `--model=cnn`: CNN-S,
conv 16 4x4 s2, conv 32 4x4 s2, dense 100, dense 10; Adam, `--epochs` over
`--train_size` images; `--data` is an mnist.npz or a folder of the IDX files), then

* **passes**: bounds `--num_examples` test images with `robust_radius(method=
  "relaxation")` in l_inf and l2, once with the search as it runs (the root of each
  pass's linear bound steers it and certifies the radius it gives) and once with the
  roots withheld (the bracketing search alone: what the search did before), and prints
  the bound passes per radius (`RobustRadius.bound_passes`), the seconds, and the ratio
  of the lower bounds (with roots / without: never below `1 / (1 + bisect_tol)` up to
  the search's path);
* **near the boundary** (`--near_examples`): points 1 % of the way back from
  `robust_radius`'s adversarial point of a test image (no labels: from the predicted
  class) toward the image, bounded in l_inf
  and l2 under the default rigor, under "float32" and under the default with the
  relaxation's worst-case guard (what the default did before), and prints the share of
  points whose default lower bound reaches half the float32 one.

Only ratios measured in one run mean anything on a shared machine.

    python -m benchmarks.robust_search --data=/path/to/mnist.npz [--model=mlp]
"""

from __future__ import annotations

import contextlib
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
import keras_roll.robust.api as robust_api  # noqa: E402
from keras_roll.data import mnist_splits  # noqa: E402
from keras_roll.options import Rigor  # noqa: E402
from keras_roll.robust.bounds import RelaxedMargins  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("data", None, "mnist.npz, or a folder with it or the IDX files "
                    "(default: the Keras cache).")
flags.DEFINE_enum("model", "mlp", ["mlp", "cnn"], "784-100-100-10 MLP or CNN-S.")
flags.DEFINE_integer("num_examples", 10, "Test images for the passes per radius.")
flags.DEFINE_integer("near_examples", 20, "Near-boundary points for the guard share.")
flags.DEFINE_integer("epochs", 1, "Training epochs (0: the random initialisation).")
flags.DEFINE_integer("train_size", 20000, "Training images.")

NORMS = (np.inf, 2)


def trained_model(data, kind: str, epochs: int, train_size: int) -> keras.Model:
    (x, y), _, _ = data
    keras.utils.set_random_seed(0)
    if kind == "mlp":
        inp = keras.Input((784,))
        h = keras.layers.Dense(100, activation="relu")(inp)
        h = keras.layers.Dense(100, activation="relu")(h)
    else:
        inp = keras.Input((784,))
        h = keras.layers.Reshape((28, 28, 1))(inp)
        h = keras.layers.Conv2D(16, 4, strides=2, activation="relu")(h)
        h = keras.layers.Conv2D(32, 4, strides=2, activation="relu")(h)
        h = keras.layers.Flatten()(h)
        h = keras.layers.Dense(100, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    if epochs:
        model.fit(x[:train_size], y[:train_size], epochs=epochs, batch_size=128, verbose=0)
    return model


@contextlib.contextmanager
def patched_passes(roots: bool = True, worst_case_default: bool = False):
    """The relaxation's passes as `robust_radius` calls them, with the roots withheld
    (the search then brackets alone, without the affine map's root either) or the
    default rigor's probabilistic guard of the margins replaced by the worst case
    (both as before)."""
    original = robust_api.relaxed_margins

    def passes(twin, x, pred, eps, p, method="relaxation", guard=True, memory_budget=None,
               **kwargs):
        if worst_case_default and guard is Rigor.FLOAT64:
            guard = Rigor.STRICT
        out = original(twin, x, pred, eps, p, method, guard, memory_budget, **kwargs)
        if not roots:
            nan = np.full_like(out.offset, np.nan)
            out = RelaxedMargins(out.lower, nan, nan)
        return out

    search = robust_api.search_certified

    def bracketing(*args, root_at_zero=None, value_at_zero=None, **kwargs):
        return search(*args, **kwargs)

    robust_api.relaxed_margins = passes
    if not roots:
        robust_api.search_certified = bracketing
    try:
        yield
    finally:
        robust_api.relaxed_margins, robust_api.search_certified = original, search


def passes_per_radius(model, x, y):
    out = {}
    keras_roll.robust_radius(model, x[:1], y[:1], norms=NORMS, method="relaxation",
                             verbose=False)  # tracing
    for name, roots in (("roots", True), ("bracketing", False)):
        with patched_passes(roots=roots):
            start = time.perf_counter()
            rr = keras_roll.robust_radius(model, x, y, norms=NORMS, method="relaxation",
                                          verbose=False)
            out[name] = (rr, time.perf_counter() - start)
    return out


def near_boundary(model, x):
    rr = keras_roll.robust_radius(model, x, norms=(np.inf,), verbose=False)
    adv = rr.adversarial[np.inf]
    ok = np.all(np.isfinite(adv.reshape(len(x), -1)), axis=1)
    near = (adv[ok] + 0.01 * (x[ok] - adv[ok])).astype(np.float32)
    res = {}
    for name, rigor, worst in (("default", "float64", False), ("float32", "float32", False),
                               ("default, worst-case relaxation", "float64", True)):
        with patched_passes(worst_case_default=worst):
            res[name] = keras_roll.robust_radius(model, near, norms=NORMS, rigor=rigor,
                                                 verbose=False)
    return res


def main(argv):
    del argv
    data = mnist_splits(FLAGS.data, val=5000)
    model = trained_model(data, FLAGS.model, FLAGS.epochs, FLAGS.train_size)
    xte, yte = data[2]
    acc = float(np.mean(np.argmax(model.predict(xte, verbose=0), -1) == yte))
    print(f"machine: {os.cpu_count()} CPU cores (shared), TensorFlow {tf.__version__}")
    print(f"network: {FLAGS.model}, {FLAGS.epochs} epoch(s) on {FLAGS.train_size} images, "
          f"test accuracy {acc:.1%}")
    n = FLAGS.num_examples
    if n:
        out = passes_per_radius(model, xte[:n], yte[:n])
        (new, t_new), (old, t_old) = out["roots"], out["bracketing"]
        for p in NORMS:
            ran = old.bound_passes[p] > 0
            label = "l2" if p == 2 else "linf"
            ratio = new.lower[p][ran] / old.lower[p][ran]
            print(f"{label}: bound passes per radius, roots {np.mean(new.bound_passes[p][ran]):.1f}"
                  f", bracketing alone {np.mean(old.bound_passes[p][ran]):.1f} "
                  f"({int(ran.sum())} radii searched); lower bounds roots / bracketing: "
                  f"median {np.median(ratio):.5f}, min {np.min(ratio):.5f}")
        print(f"seconds ({n} inputs, l_inf + l2): roots {t_new:.1f}, bracketing alone "
              f"{t_old:.1f}, ratio {t_new / t_old:.2f}")
    k = FLAGS.near_examples
    if k:
        res = near_boundary(model, xte[:k])
        f32 = res["float32"]
        for p in NORMS:
            label = "l2" if p == 2 else "linf"
            ref = f32.lower[p]
            for name in ("default", "default, worst-case relaxation"):
                low = res[name].lower[p]
                share = np.mean(low >= 0.5 * ref)
                print(f"near boundary, {label}, {name}: lower >= float32 / 2 for "
                      f"{share:.0%} of {len(ref)} points (median lower / float32 "
                      f"{np.median(low / ref):.3f}); from relaxation: "
                      f"{np.mean(res[name].lower_method[p] == 'relaxation'):.0%}")


if __name__ == "__main__":
    app.run(main)
