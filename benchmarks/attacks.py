"""The minimal-norm attack against the region walk: upper bounds of `robust_radius` on
CNN-S.

Trains CNN-S (`benchmarks.cnn_models.cnn_s`: Rescaling(1/255), conv 16 4x4 stride 2,
conv 32 4x4 stride 2, dense 100, dense 10, ReLU) for `--epochs` on MNIST (0-255
pixels; `--data` is an mnist.npz or a folder of the IDX files), or loads the weights
and images of an earlier `--save` (`--load`), then on `--num_examples` correctly
classified test images, per norm (`--norms`):

* the walk's upper bound (`robust_radius(method="walk")`);
* the attack started from the walk's points (as `method="best"` runs it;
  `keras_roll.robust.minimal_norm_attack(start=...)`);
* the attack from `x` inside the pixel domain [0, 255] (`domain=`);

and prints the median and the worst ratio of each attack's upper bound to the
walk's, the share of images where it is at most the walk's, and CPU seconds per image
(`time.process_time`). Only ratios measured in one run mean anything on a shared machine.

    python -m benchmarks.attacks --data=/path/to/mnist.npz [--num_examples=20] [--save=f.npz]

The seconds include the first call's tracing of each compiled function.
`benchmarks/attacks_foolbox.py` compares the saved bounds with foolbox's FMN, DDN and
PGD on the same weights (in a separate environment with PyTorch and foolbox).
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
from benchmarks.cnn_models import cnn_s  # noqa: E402
from keras_roll.data import mnist_splits  # noqa: E402
from keras_roll.robust import AttackOptions, minimal_norm_attack  # noqa: E402
from keras_roll.robust.adversarial import clearly_other, lp_norm, model_outputs  # noqa: E402
from keras_roll.robust.attack_loop import shrunk  # noqa: E402
from keras_roll.robust.attack_points import checked_points  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("data", None, "mnist.npz, or a folder with it or the IDX files "
                    "(default: the Keras cache).")
flags.DEFINE_string("load", None, "Optional .npz of an earlier --save: its weights and "
                    "images (no training).")
flags.DEFINE_integer("num_examples", 20, "Correctly classified test images attacked.")
flags.DEFINE_integer("epochs", 1, "Training epochs.")
flags.DEFINE_integer("steps", AttackOptions().steps, "Attack steps per run.")
flags.DEFINE_integer("restarts", AttackOptions().restarts, "Attack runs per image.")
flags.DEFINE_integer("polish", AttackOptions().polish, "Runs from the best point after the "
                     "restarts.")
flags.DEFINE_integer("scout_steps", AttackOptions().scout_steps, "Steps of the short targeted "
                     "runs after the first two.")
flags.DEFINE_integer("probe_budget", AttackOptions().probe_budget, "Steps of the probes at "
                     "fixed radii per image.")
flags.DEFINE_float("hop", AttackOptions().hop, "Noise around the best point at the start of "
                   "the polishing runs but the last, as a share of its distance.")
flags.DEFINE_integer("refine", AttackOptions().refine, "Rounds of first-order steps along the "
                     "decision boundary from the best point, after the polishing runs.")
flags.DEFINE_list("norms", ["linf", "l2", "l1"], "Norms attacked.")
flags.DEFINE_integer("image_offset", 0, "Skip this many correctly classified test images "
                     "(a held-out set: the images after those a schedule was tuned on); "
                     "with --load, its weights and --data's images.")
flags.DEFINE_string("foolbox", None, "Optional --out of benchmarks/attacks_foolbox.py on the "
                    "same weights and images: checks foolbox's points in the Keras model "
                    "and compares at the same flip criterion.")
flags.DEFINE_list("variants", [], "Optional extra schedules, each 'name:field=value/...' "
                  "of AttackOptions fields (e.g. 'strong:steps=150/restarts=5'), run "
                  "after the flags' schedule from the walk's point.")
flags.DEFINE_bool("box", True, "Also attack from x inside the pixel domain [0, 255].")
flags.DEFINE_string("save", None, "Optional .npz: the weights, images, labels and upper "
                    "bounds, for a comparison with other attack libraries on the same "
                    "weights.")

NORMS = {"linf": np.inf, "l2": 2, "l1": 1}


def timed(fn, *args, **kwargs):
    """`(out, CPU seconds)` (`time.process_time`: less distorted by other jobs)."""
    start = time.process_time()
    out = fn(*args, **kwargs)
    return out, time.process_time() - start


def trained():
    """`(model, x, y, note)`: CNN-S and the first correctly classified test images."""
    model = cnn_s()
    if FLAGS.load:
        d = np.load(FLAGS.load)
        model.set_weights([d[f"weight_{i}"] for i in range(len(model.get_weights()))])
        if not FLAGS.image_offset:
            x, y = d["x"][:FLAGS.num_examples], d["y"][:FLAGS.num_examples]
            return model, x, y, f"weights and images of {FLAGS.load}"
    (xtr, ytr), _, (xte, yte) = mnist_splits(FLAGS.data, val=5000, flatten=False,
                                             normalize=False)
    xtr = xtr.reshape(-1, 28, 28, 1).astype(np.float32)
    xte = xte.reshape(-1, 28, 28, 1).astype(np.float32)
    note = f"weights of {FLAGS.load}"
    if not FLAGS.load:
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        model.fit(xtr, ytr, epochs=FLAGS.epochs, batch_size=128, verbose=0)
        note = f"{FLAGS.epochs} epoch(s)"
    first = FLAGS.image_offset
    pred = np.argmax(model.predict(xte[:1000], verbose=0), axis=1)
    acc = float(np.mean(pred == yte[:1000]))
    keep = np.flatnonzero(pred == yte[:1000])[first:first + FLAGS.num_examples]
    return (model, xte[keep], yte[keep], f"{note}, test accuracy {acc:.1%} (first 1000), "
            f"correctly classified test images {first}-{first + len(keep) - 1}")


def report(name, up, walk, seconds, n):
    r = up / walk
    print(f"  {name:30s}: attack / walk median {np.nanmedian(r):.3f}, max "
          f"{np.nanmax(r):.3f}, <= walk on {np.mean(r <= 1 + 1e-9):.0%}, found "
          f"{np.mean(np.isfinite(up)):.0%}; {seconds / n:.2f} s/image", flush=True)


def plain_flip(model, x, delta, y, p, halvings=24):
    """`x + shrunk(delta, t)` at the smallest `t` found by bisection whose float32
    prediction differs from `y` by argmax alone (foolbox's criterion: no gap)."""
    lo, hi = np.zeros(len(x)), np.ones(len(x))
    for _ in range(halvings):
        mid = 0.5 * (lo + hi)
        out = model_outputs(model, (x + shrunk(delta, mid, p).numpy()).astype(np.float32))
        flip = np.argmax(out, axis=1) != y
        hi, lo = np.where(flip, mid, hi), np.where(flip, lo, mid)
    return (x + shrunk(delta, hi, p).numpy()).astype(np.float32).astype(np.float64)


def share(a, b):
    return f"{np.mean(a <= b):.0%} ({np.mean(a <= b * (1 + 1e-4)):.0%})"


def against_foolbox(model, x, y, p, label, ours):
    """Checks foolbox's best points (`--foolbox`) in the Keras model and compares
    `ours` (a `NormBounds`) with them at both flip criteria."""
    fb = np.load(FLAGS.foolbox)
    if f"points_none_{label}" not in fb:
        return
    x64 = x.astype(np.float64)
    pts = np.nan_to_num(fb[f"points_none_{label}"], nan=0.0).astype(np.float32)
    pts = pts.astype(np.float64)
    raw = np.where(np.isfinite(fb[f"best_none_{label}"]), lp_norm(pts - x64, p), np.inf)
    out = model_outputs(model, pts.astype(np.float32))
    flips, clear = np.argmax(out, axis=1) != y, clearly_other(out, y)
    wide = np.full(x.shape[1:], np.inf)
    # a point short of the gap is pushed out to it (never credited with a shrinking)
    pushed = lp_norm(checked_points(model, x64, pts - x64, y, p, -wide, wide) - x64, p)
    gapped = np.where(clear, raw, np.fmax(pushed, raw))
    gapped = np.where(np.isfinite(gapped) & np.isfinite(raw), gapped, np.inf)
    ours0 = lp_norm(plain_flip(model, x64, ours.adversarial - x64, y, p) - x64, p)
    up = ours.upper
    print(f"  foolbox's points in the Keras model (float32): flip {np.mean(flips):.0%}, "
          f"clear keras_roll's gap {np.mean(clear):.0%}; moved to keras_roll's criterion: "
          f"median {np.median(gapped / raw):.6f} x, max {np.max(gapped / raw):.6f} x")
    print(f"  ours <= foolbox's (within 1e-4): as measured {share(up, raw)}; both at "
          f"keras_roll's criterion {share(up, gapped)}; both at foolbox's (argmax only) "
          f"{share(ours0, raw)}; worst ours / foolbox at keras_roll's criterion "
          f"{np.max(up / gapped):.6f}", flush=True)


def variant(spec, base):
    """`(name, AttackOptions)` of a `--variants` entry."""
    name, _, fields = spec.partition(":")
    values = dict(f.split("=") for f in fields.split("/") if f)
    return name, base._replace(**{k: type(getattr(base, k))(v) for k, v in values.items()})


def main(argv):
    del argv
    model, x, y, note = trained()
    n = x.shape[0]
    opts = AttackOptions(steps=FLAGS.steps, restarts=FLAGS.restarts, polish=FLAGS.polish,
                         scout_steps=FLAGS.scout_steps, probe_budget=FLAGS.probe_budget,
                         hop=FLAGS.hop, refine=FLAGS.refine)
    print(f"machine: {os.cpu_count()} CPU cores (shared), TensorFlow {tf.__version__}")
    print(f"network: CNN-S, {note}; {n} images; attack {opts.steps} steps x "
          f"{opts.restarts} runs (scouts: {opts.scout_steps} steps) + {opts.polish} "
          f"polishing runs + {opts.refine} rounds of refinement")
    saved = {"x": x, "y": y}
    for i, w in enumerate(model.get_weights()):
        saved[f"weight_{i}"] = w
    for label in FLAGS.norms:
        p = NORMS[label]
        walk, t_walk = timed(keras_roll.robust_radius, model, x, y, norms=(p,),
                             method="walk", verbose=False)
        from_walk, t_fw = timed(minimal_norm_attack, model, x, p, pred=y,
                                start=walk.adversarial[p], options=opts)
        w = walk.upper[p]
        saved[f"walk_{label}"], saved[f"attack_{label}"] = w, from_walk.upper
        print(f"{label}: walk median upper {np.median(w) / 255:.4g} ([0, 1] units), "
              f"{t_walk / n:.2f} s/image")
        report("attack from the walk's point", from_walk.upper, w, t_fw, n)
        if FLAGS.box:
            boxed, t_box = timed(minimal_norm_attack, model, x, p, pred=y,
                                 domain=(0.0, 255.0), options=opts)
            saved[f"attack_box_{label}"] = boxed.upper
            report("attack from x in [0, 255]", boxed.upper, w, t_box, n)
        if FLAGS.foolbox:
            against_foolbox(model, x, y, p, label, from_walk)
        for name, o in (variant(v, opts) for v in FLAGS.variants):
            nb, t_v = timed(minimal_norm_attack, model, x, p, pred=y,
                            start=walk.adversarial[p], options=o)
            saved[f"attack_{name}_{label}"] = nb.upper
            report(f"{name}, from the walk's point", nb.upper, w, t_v, n)
            if FLAGS.foolbox:
                against_foolbox(model, x, y, p, label, nb)
        if FLAGS.save:
            np.savez(FLAGS.save, **saved)


if __name__ == "__main__":
    app.run(main)
