"""The minimal-norm attack against the region walk: upper bounds of `robust_radius` on
a small CNN.

Trains CNN-S (Rescaling(1/255), conv 16 4x4 stride 2, conv 32 4x4 stride 2, dense
100, dense 10, ReLU) for `--epochs` on MNIST (0-255 pixels; `--data` is an
mnist.npz or a folder of the IDX files), then on `--num_examples` correctly
classified test images, per norm (l_inf, l2):

* the walk's upper bound (`robust_radius(method="walk")`);
* the attack started from the walk's points (as `method="best"` runs it;
  `keras_roll.robust.minimal_norm_attack(start=...)`);
* the attack alone, from `x` (`method="attack"`), and from `x` inside the pixel
  domain [0, 255] (`domain=`);

and prints the median and the worst ratio of each attack's upper bound to the
walk's, the share of images where it is at most the walk's, and seconds per image
(wall time). Only ratios measured in one run mean anything on a shared machine.

    python -m benchmarks.attacks --data=/path/to/mnist.npz [--num_examples=20] [--save=f.npz]

The seconds include the first call's tracing of each compiled function.
`benchmarks/attacks_foolbox.py` compares the saved bounds with foolbox's FMN and DDN
on the same weights (in a separate environment with PyTorch and foolbox).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
from keras_roll.data import mnist_splits  # noqa: E402
from keras_roll.robust import AttackOptions, minimal_norm_attack  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("data", None, "mnist.npz, or a folder with it or the IDX files "
                    "(default: the Keras cache).")
flags.DEFINE_integer("num_examples", 20, "Correctly classified test images attacked.")
flags.DEFINE_integer("epochs", 1, "Training epochs.")
flags.DEFINE_integer("steps", 100, "Attack steps per run.")
flags.DEFINE_integer("restarts", 3, "Attack runs per image.")
flags.DEFINE_string("save", None, "Optional .npz: the weights, images, labels and upper "
                    "bounds, for a comparison with other attack libraries on the same "
                    "weights.")

NORMS = (np.inf, 2)


def cnn_s() -> keras.Model:
    """CNN-S: Rescaling(1/255), conv 16 4x4 / 2, conv 32 4x4 / 2, dense 100, dense 10."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((28, 28, 1))
    h = keras.layers.Rescaling(1 / 255, name="rescaling")(inp)
    h = keras.layers.Conv2D(16, 4, strides=2, padding="same", activation="relu")(h)
    h = keras.layers.Conv2D(32, 4, strides=2, padding="same", activation="relu")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(100, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h), name="cnn_s")


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def main(argv):
    del argv
    (xtr, ytr), _, (xte, yte) = mnist_splits(FLAGS.data, val=5000, flatten=False,
                                             normalize=False)
    xtr = xtr.reshape(-1, 28, 28, 1).astype(np.float32)
    xte = xte.reshape(-1, 28, 28, 1).astype(np.float32)
    model = cnn_s()
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(xtr, ytr, epochs=FLAGS.epochs, batch_size=128, verbose=0)
    pred = np.argmax(model.predict(xte[:1000], verbose=0), axis=1)
    acc = float(np.mean(pred == yte[:1000]))
    keep = np.flatnonzero(pred == yte[:1000])[:FLAGS.num_examples]
    x, y = xte[keep], yte[keep]
    n = x.shape[0]
    opts = AttackOptions(steps=FLAGS.steps, restarts=FLAGS.restarts)
    print(f"machine: {os.cpu_count()} CPU cores (shared), TensorFlow {tf.__version__}")
    print(f"network: CNN-S, {FLAGS.epochs} epoch(s), test accuracy {acc:.1%} (first 1000); "
          f"{n} images; attack {opts.steps} steps x {opts.restarts} runs")
    saved = {"x": x, "y": y}
    for i, w in enumerate(model.get_weights()):
        saved[f"weight_{i}"] = w
    for p in NORMS:
        label = "linf" if p == np.inf else "l2"
        walk, t_walk = timed(keras_roll.robust_radius, model, x, y, norms=(p,),
                             method="walk", verbose=False)
        from_walk, t_fw = timed(minimal_norm_attack, model, x, p, pred=y,
                                start=walk.adversarial[p], options=opts)
        alone, t_alone = timed(keras_roll.robust_radius, model, x, y, norms=(p,),
                               method="attack", attack=opts, verbose=False)
        boxed, t_box = timed(minimal_norm_attack, model, x, p, pred=y, domain=(0.0, 255.0),
                             options=opts)
        w = walk.upper[p]
        saved[f"walk_{label}"], saved[f"attack_{label}"] = w, from_walk.upper
        saved[f"attack_box_{label}"] = boxed.upper
        print(f"{label}: walk median upper {np.median(w) / 255:.4g} ([0, 1] units), "
              f"{t_walk / n:.2f} s/image")
        for name, up, t in (("attack from the walk's point", from_walk.upper, t_fw),
                            ("attack from x", alone.upper[p], t_alone),
                            ("attack from x in [0, 255]", boxed.upper, t_box)):
            r = up / w
            print(f"  {name:30s}: attack / walk median {np.nanmedian(r):.3f}, max "
                  f"{np.nanmax(r):.3f}, <= walk on {np.mean(r <= 1 + 1e-9):.0%}, found "
                  f"{np.mean(np.isfinite(up)):.0%}; {t / n:.2f} s/image")
    if FLAGS.save:
        np.savez(FLAGS.save, **saved)


if __name__ == "__main__":
    app.run(main)
