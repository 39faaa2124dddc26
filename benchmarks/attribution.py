"""Attribution speed, as ratios measured side by side in one run (interleaved
repetitions, medians):

1. exact integrated gradients (`integrated_gradients(steps=None)`) against the
   region-by-region walk keras_roll used before (kept below as `previous_exact_ig`:
   one probe per region with its own forward pass, JVP and margins), on float64
   models, checking that both give the same attributions (to 1e-12 of their
   largest entry) and the same region counts;
2. Riemann sums (`integrated_gradients(steps=k)`, right rule) against a plain
   `tf.function` batched-gradient loop over the same k points per example on the
   Keras model (what PAIR saliency and xplique pay), on float32 models, at
   k = 256, 1024, 4096.

Models: the paper's 784-300x4-10 ReLU network and a small MNIST CNN
(28x28x1 -> conv 16 -> conv 32 / 2 -> dense 100 -> 10), randomly initialised
(`benchmarks._models`); inputs: MNIST test images (`--data_dir`, a Keras
`mnist.npz` or its folder) or uniform random pixels. Other jobs may share the CPU:
compare the ratios, not the times.

    python -m benchmarks.attribution [--data_dir=DIR] [--exact_examples=10]
        [--riemann_examples=4] [--steps=256,1024,4096] [--repeats=3] [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
from benchmarks._models import mlp, small_cnn  # noqa: E402
from benchmarks._util import interleaved_medians  # noqa: E402
from keras_roll.attribution.gradients import LogitGradients  # noqa: E402
from keras_roll.certification.margin_math import directional_margins  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", None, "MNIST (mnist.npz or its folder); random pixels if unset.")
flags.DEFINE_integer("exact_examples", 10, "Examples of the exact-walk comparison.")
flags.DEFINE_integer("riemann_examples", 4, "Examples of the Riemann-sum comparison.")
flags.DEFINE_list("steps", ["256", "1024", "4096"], "Riemann points per example.")
flags.DEFINE_integer("batch", 256, "Batch size of the tf.function baseline loop.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions (the median is reported).")
flags.DEFINE_list("models", ["mlp", "cnn"], "Models: mlp, cnn.")
flags.DEFINE_list("parts", ["exact", "riemann"], "What to time: exact, riemann.")
flags.DEFINE_bool("quick", False, "A short run: 3 exact examples, 2 Riemann examples, "
                                  "k = 256 only, 1 repetition.")

BUILDERS = {"mlp": (mlp, (784,)), "cnn": (small_cnn, (28, 28, 1))}


# ---------------------------------------------------------------------- the previous walk


def previous_exact_ig(model, x, y, max_regions=100_000):
    """The exact walk keras_roll used before, for comparison: from the current point
    `t`, a probe a little further (halved until its region reaches back to `t`)
    gives the next segment's gradient and, by its margins along the path, its end.
    Returns `(attributions [n, ...] float64, regions [n])`."""
    engine = LogitGradients.of(model)
    lin = engine.lin
    n, ex_shape = x.shape[0], x.shape[1:]
    dtype = np.dtype(lin.dtype)
    eps_f = float(np.finfo(dtype).eps)
    tol, tau0 = 64 * eps_f, float(np.sqrt(eps_f))
    d64 = x.reshape(n, -1).astype(np.float64)
    d_model = d64.astype(dtype).reshape(n, 1, *ex_shape)
    index, sign = np.asarray(y, np.int32), np.ones(n, dtype)
    attr, regions = np.zeros_like(d64), np.zeros(n, np.int64)
    t, s = np.zeros(n), np.full(n, min(tau0, 0.5))
    probe = _previous_probe(engine)
    last = [None] * n
    active = np.arange(n)
    while active.size:
        pts = (s[active, None] * d64[active]).astype(dtype).reshape(-1, *ex_shape)
        eps, grad, pattern = probe(tf.constant(pts), tf.constant(d_model[active]),
                                   tf.constant(index[active]), tf.constant(sign[active]))
        eps = eps.numpy().astype(np.float64)
        start = s[active] - eps[:, 1]
        ok = start <= t[active] + tol
        acc = active[ok]
        end = np.minimum(1.0, s[acc] + eps[ok, 0])
        end = np.where(end >= 1.0 - tol, 1.0, end)
        attr[acc] += grad.numpy()[ok].reshape(acc.size, -1) * d64[acc] * (end - t[acc])[:, None]
        for e, row in zip(acc, pattern.numpy()[ok]):
            key = hash(row.tobytes())
            regions[e] += key != last[e]
            last[e] = key
        t[acc] = end
        s[acc] = t[acc] + np.minimum(tau0, (1.0 - t[acc]) / 2)
        bad = active[~ok]
        s[bad] = t[bad] + (start[~ok] - t[bad]) / 2
        if regions.max() > max_regions:
            raise RuntimeError("too many regions")
        active = active[t[active] < 1.0]
    return attr.reshape(x.shape), regions


_PREVIOUS_PROBES: dict = {}


def _previous_probe(engine):
    if engine in _PREVIOUS_PROBES:
        return _PREVIOUS_PROBES[engine]
    lin = engine.lin

    def probe(pts, d, index, sign):
        grad, _, neurons = engine.select(pts, index, sign)
        rates = lin.jvp(pts, d).neurons
        eps, _ = directional_margins(tf.concat([rates, -rates], axis=1), neurons.below,
                                     neurons.above, neurons.valid)
        pattern = tf.where(neurons.valid, neurons.piece, -tf.ones_like(neurons.piece))
        return eps, grad, pattern

    fn = _PREVIOUS_PROBES[engine] = tf.function(probe, reduce_retracing=True, autograph=False)
    return fn


# ---------------------------------------------------------------------- the Riemann baseline


def tape_riemann(model, batch):
    """A plain compiled batched-gradient loop: `(x - 0) * mean_i grad f_y(t_i x)` over
    the right-rule points, in batches of `batch` points, summed in the model dtype."""

    @tf.function(reduce_retracing=True)
    def grad_sum(points, label):
        with tf.GradientTape() as tape:
            tape.watch(points)
            total = tf.reduce_sum(model(points)[:, label])
        return tf.reduce_sum(tape.gradient(total, points), axis=0)

    def run(x, y, k):
        out = np.zeros_like(x)
        alphas = (np.arange(k, dtype=x.dtype) + 1) / k
        for i in range(x.shape[0]):
            acc = tf.zeros(x.shape[1:], x.dtype)
            for b0 in range(0, k, batch):
                a = tf.reshape(alphas[b0:b0 + batch], [-1] + [1] * (x.ndim - 1))
                acc += grad_sum(a * x[i][None], tf.constant(int(y[i])))
            out[i] = x[i] * acc.numpy() / k
        return out

    return run


# ---------------------------------------------------------------------- runs


def load_inputs(n, shape, seed=0):
    if FLAGS.data_dir:
        from keras_roll.data.mnist import load_mnist

        images, labels = load_mnist(FLAGS.data_dir, split="test")
        x = (np.asarray(images[:n], np.float64) / 255.0).reshape(n, *shape)
        return x, np.asarray(labels[:n], np.int64)
    rng = np.random.default_rng(seed)
    return rng.uniform(0, 1, (n, *shape)), rng.integers(0, 10, n)


def bench_exact(name):
    build, shape = BUILDERS[name]
    model = build("float64")
    x, y = load_inputs(FLAGS.exact_examples, shape)
    new = keras_roll.integrated_gradients(model, x, y, verbose=False)
    old_attr, old_regions = previous_exact_ig(model, x, y)
    err = np.abs(new.maps - old_attr).max() / np.abs(old_attr).max()
    same = np.array_equal(new.regions, old_regions)
    times = interleaved_medians({
        "new": lambda: keras_roll.integrated_gradients(model, x, y, verbose=False),
        "previous": lambda: previous_exact_ig(model, x, y),
    }, FLAGS.repeats, warmup=0)
    n = x.shape[0]
    print(f"{name:<5}{n:>9d}{np.median(new.regions):>10.0f}{err:>12.1e}{str(same):>8}"
          f"{times['previous'] / n * 1e3:>14.0f}{times['new'] / n * 1e3:>12.0f}"
          f"{times['previous'] / times['new']:>9.2f}")


def bench_riemann(name, steps):
    build, shape = BUILDERS[name]
    model = build("float32")
    x, y = load_inputs(FLAGS.riemann_examples, shape)
    x = x.astype("float32")
    baseline = tape_riemann(model, FLAGS.batch)
    for k in steps:
        ours = keras_roll.integrated_gradients(model, x, y, steps=k, verbose=False)
        ref = baseline(x, y, k)
        err = np.abs(ours.maps - ref).max() / np.abs(ref).max()
        times = interleaved_medians({
            "keras_roll": lambda k=k: keras_roll.integrated_gradients(model, x, y, steps=k,
                                                                      verbose=False),
            "tape": lambda k=k: baseline(x, y, k),
        }, FLAGS.repeats, warmup=1)
        n = x.shape[0]
        print(f"{name:<5}{k:>7d}{n:>9d}{err:>11.1e}{times['tape'] / n * 1e3:>14.1f}"
              f"{times['keras_roll'] / n * 1e3:>14.1f}{times['tape'] / times['keras_roll']:>9.2f}")


def main(argv):
    del argv
    if FLAGS.quick:
        FLAGS.exact_examples, FLAGS.riemann_examples, FLAGS.repeats = 3, 2, 1
        FLAGS.steps = ["256"]
    print(f"machine: {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}; other jobs may "
          f"share the CPU: compare the ratios (measured in the same run), not the times")
    print(f"inputs: {'MNIST test images' if FLAGS.data_dir else 'uniform random pixels'}")
    if "exact" in FLAGS.parts:
        _exact_table()
    if "riemann" in FLAGS.parts:
        _riemann_table()


def _exact_table():
    print("\n1. exact integrated gradients, float64 models: previous walk / new walk")
    print(f"{'model':<5}{'examples':>9}{'regions':>10}{'max diff':>12}{'same':>8}"
          f"{'previous ms':>14}{'new ms':>12}{'speedup':>9}")
    for name in FLAGS.models:
        bench_exact(name)


def _riemann_table():
    print(f"\n2. Riemann integrated gradients (right rule), float32 models: tf.function tape "
          f"loop (batch {FLAGS.batch}) / keras_roll")
    print(f"{'model':<5}{'steps':>7}{'examples':>9}{'max diff':>11}{'tape ms':>14}"
          f"{'keras_roll ms':>14}{'ratio':>9}")
    for name in FLAGS.models:
        bench_riemann(name, [int(k) for k in FLAGS.steps])


if __name__ == "__main__":
    app.run(main)
