"""Gradient distortion throughput: input gradients per second of
`keras_roll.gradient_distortion(mode="max")` (the paper's genetic algorithm),
beside a plain `tf.GradientTape` loop over the very same candidates in batches
of 256, measured in the same run (interleaved repetitions, medians).

Two models: the paper's 784-300x4-10 ReLU network on MNIST-shaped inputs and a
small CNN (28x28x1 -> conv 16 -> conv 32 / 2 -> dense 100 -> 10). The rate of
keras_roll includes everything the search does (sampling, selection, crossover,
projection, distances); the baselines only compute the candidates' gradients and
their l1 distances to the reference gradient. The eager loop is what a user
writes by hand; the compiled loop (`tf.function`, batch 256) is shown for context.

    python -m benchmarks.distortion [--num_examples=2] [--population=4800]
                                    [--generations=3] [--repeats=3] [--quick]

`--cnn=cnn_l` (or `cnn_s`, `resnet18`) instead times the README's settings on one of
the CNNs of `benchmarks/cnn.py` (MNIST test images from `--data`, else random ones;
the predicted classes): the worst case (population 4800, `--generations=30` for the
README's settings) and the expected distortion (8000 draws) of `--num_examples`
images, eps 8/256 in [0, 1] pixels; the first call (tracing included) and a warm
call, in wall and CPU seconds (`time.process_time()`, all threads), the peak RSS and
the distortion found.

    python -m benchmarks.distortion --cnn=cnn_l --generations=30 [--num_examples=1]
                                    [--samples=8000] [--nowarm] [--modes=max,expected]

`--memory` instead measures the peak memory of one worst-case search at 299x299x3
with the paper's population of 4800 (populations stored in a temporary file in
chunks) against the memory budget: the peak resident set size above what the model
and TensorFlow held before the search (Linux `VmHWM`, reset before the search).

    python -m benchmarks.distortion --memory [--memory_budget_mib=64] [--generations=1]
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
from benchmarks._models import mlp, small_cnn  # noqa: E402
from benchmarks._util import interleaved_medians  # noqa: E402
from benchmarks.cnn_models import CNNS  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_examples", 2, "Examples searched per run.")
flags.DEFINE_integer("population", 4800, "Population of the genetic algorithm (paper: 4800).")
flags.DEFINE_integer("generations", 3, "Generations per run (paper: 30; the rate is the same).")
flags.DEFINE_integer("repeats", 3, "Timed repetitions (the median is reported).")
flags.DEFINE_integer("batch", 256, "Batch size of the tf.GradientTape baselines.")
flags.DEFINE_bool("memory", False, "Measure the peak memory of a 299x299x3 search instead.")
flags.DEFINE_integer("memory_budget_mib", 64, "memory_budget of the --memory run, in MiB.")
flags.DEFINE_string("cnn", None, "Time the README's settings on this CNN of benchmarks/cnn.py "
                    "(cnn_s, cnn_l, resnet18) instead.")
flags.DEFINE_string("data", "/work/shared/data/mnist.npz", "mnist.npz for --cnn (absent: "
                    "random images).")
flags.DEFINE_integer("samples", 8000, "Draws of the expected distortion (--cnn).")
flags.DEFINE_list("modes", ["max", "expected"], "Modes timed by --cnn, in this order (the "
                  "first call of the first one traces the shared gradient function).")
flags.DEFINE_bool("warm", True, "Also a warm call after the first (--cnn).")
flags.DEFINE_bool("quick", False, "A short run: population 480, 1 generation, 1 repetition.")

EPS = 8 / 256


def tape_step(model):
    """Gradients of the selected logits and their l1 distance to the reference."""

    def step(xb, yb, ref):
        with tf.GradientTape() as tape:
            tape.watch(xb)
            picked = tf.gather(model(xb), yb, axis=1, batch_dims=1)
            total = tf.reduce_sum(picked)
        g = tape.gradient(total, xb)
        g = tf.reshape(g, (tf.shape(g)[0], -1))
        return tf.reduce_sum(tf.abs(g - ref), axis=1)

    return step


def bench(model, x, y):
    kw = dict(eps=EPS, mode="max", population=FLAGS.population,
              generations=FLAGS.generations, seed=0, verbose=False)
    owners, cands = [], []

    def keep(ex, c, d):
        owners.append(ex)
        cands.append(c)

    res = keras_roll.gradient_distortion(model, x, y, callback=keep, **kw)  # also warms up
    owners, cands = np.concatenate(owners), np.concatenate(cands)
    n = cands.shape[0]
    assert n == res.evaluations * x.shape[0]
    ref_step = tape_step(model)
    with tf.GradientTape() as tape:
        xt = tf.constant(x)
        tape.watch(xt)
        total = tf.reduce_sum(tf.gather(model(xt), y, axis=1, batch_dims=1))
    ref = tf.reshape(tape.gradient(total, xt), (x.shape[0], -1)).numpy()
    compiled = tf.function(ref_step, reduce_retracing=True)
    b = FLAGS.batch

    def loop(step):
        out = []
        for i in range(0, n, b):
            o = owners[i:i + b]
            out.append(step(tf.constant(cands[i:i + b]), tf.constant(y[o]),
                            tf.constant(ref[o])).numpy())
        return np.concatenate(out)

    # the baselines reproduce our distances (same candidates, same function)
    np.testing.assert_allclose(loop(compiled).max(), res.distortion.max(), rtol=1e-3)
    times = interleaved_medians({
        "keras_roll": lambda: keras_roll.gradient_distortion(model, x, y, **kw),
        "tape_eager": lambda: loop(ref_step),
        "tape_compiled": lambda: loop(compiled),
    }, FLAGS.repeats, warmup=1)
    return n, times


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (the --memory run needs Linux)")


def memory_run():
    """Peak memory of one 299x299x3 worst-case search above the model's footprint."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((299, 299, 3))
    h = keras.layers.Conv2D(8, 5, strides=4, activation="relu")(inp)
    h = keras.layers.Conv2D(16, 3, strides=2, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inp, keras.layers.Dense(10)(h), name="conv_299")
    x = np.random.default_rng(0).uniform(0, 1, (1, 299, 299, 3)).astype("float32")
    budget = FLAGS.memory_budget_mib * 2**20
    kw = dict(eps=EPS, mode="max", seed=0, memory_budget=budget, verbose=False)
    keras_roll.gradient_distortion(model, x, [0], population=64, generations=1, **kw)  # warm
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set size
    start = time.perf_counter()
    res = keras_roll.gradient_distortion(model, x, [0], population=FLAGS.population,
                                         generations=FLAGS.generations, **kw)
    wall = time.perf_counter() - start
    peak = _status_kib("VmHWM")
    population_gib = FLAGS.population * x.size * 4 / 2**30
    print(f"gradient_distortion(mode='max') at 299x299x3, population {FLAGS.population} "
          f"({population_gib:.2f} GiB per population), {FLAGS.generations} generation(s), "
          f"{res.evaluations} gradients, memory_budget {FLAGS.memory_budget_mib} MiB, "
          f"{wall:.0f} s")
    print(f"resident before the search (model, TensorFlow, data): {before / 1024:.0f} MiB")
    print(f"peak during the search: {peak / 1024:.0f} MiB, i.e. {(peak - before) / 1024:.0f} MiB "
          f"above it ({(peak - before) / 1024 / FLAGS.memory_budget_mib:.2f} x the budget)")


def cnn_run():
    """The README's settings on a CNN: first and warm calls, wall and CPU seconds, peak RSS."""
    if FLAGS.cnn == "resnet18":
        keras.utils.set_random_seed(0)
        model = keras_roll.models.resnet18(input_shape=(32, 32, 3), classes=10)
    else:
        model = CNNS[FLAGS.cnn]()
    n, shape = FLAGS.num_examples, tuple(model.input_shape[1:])
    kw = dict(eps=EPS, seed=0, verbose=False, domain=(0.0, 1.0))
    if shape == (28, 28, 1) and os.path.exists(FLAGS.data):  # MNIST behind "rescale"
        with np.load(FLAGS.data) as f:
            x = f["x_test"][:n].reshape(n, *shape).astype("float32")
        kw["wrt"] = "rescale"
    else:
        x = np.random.default_rng(0).uniform(0, 1, (n, *shape)).astype("float32")
        if shape == (28, 28, 1):
            x, kw["wrt"] = 255 * x, "rescale"
    y = np.argmax(model.predict(x, verbose=0), axis=-1)  # the predicted classes
    modes = {"max": dict(mode="max", population=FLAGS.population,
                         generations=FLAGS.generations),
             "expected": dict(mode="expected", samples=FLAGS.samples)}
    print(f"{model.name}: {x.shape[0]} image(s), eps={EPS:g}, population "
          f"{FLAGS.population}, {FLAGS.generations} generations, {FLAGS.samples} draws; "
          f"{os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.1f} at the start")
    for mode in FLAGS.modes:
        extra = modes[mode]
        for call in ("first", "warm")[:2 if FLAGS.warm else 1]:
            xs, ys = (x[:1], y[:1]) if call == "first" else (x, y)
            wall, cpu = time.perf_counter(), time.process_time()
            res = keras_roll.gradient_distortion(model, xs, ys, **kw, **extra)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            peak = _status_kib("VmHWM") / 2**20
            print(f"{mode:>8} {call:>5}: {wall / len(xs):7.1f} s wall, {cpu / len(xs):7.1f} s "
                  f"CPU per image ({res.evaluations} gradients each), peak RSS {peak:.2f} GiB, "
                  f"distortion {np.round(res.distortion, 4).tolist()}, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)


def main(argv):
    del argv
    if FLAGS.memory:
        memory_run()
        return
    if FLAGS.cnn:
        cnn_run()
        return
    if FLAGS.quick:
        FLAGS.population, FLAGS.generations, FLAGS.repeats = 480, 1, 1
    rng = np.random.default_rng(0)
    print(f"machine: {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}; other jobs may "
          f"share the CPU, so compare the ratios (measured in the same run), not the rates")
    print(f"gradient_distortion(mode='max'): {FLAGS.num_examples} examples, population "
          f"{FLAGS.population}, {FLAGS.generations} generations, eps={EPS:g}; baselines: "
          f"tf.GradientTape over the same candidates in batches of {FLAGS.batch}")
    header = (f"{'model':<20}{'gradients':>10}{'keras_roll/s':>14}{'eager tape/s':>14}"
              f"{'ratio':>7}{'tf.function tape/s':>20}{'ratio':>7}")
    print(header)
    print("-" * len(header))
    for build, shape in ((mlp, (784,)), (small_cnn, (28, 28, 1))):
        model = build()
        x = rng.uniform(0, 1, size=(FLAGS.num_examples, *shape)).astype("float32")
        y = rng.integers(0, 10, size=FLAGS.num_examples)
        n, t = bench(model, x, y)
        ours, eager, comp = n / t["keras_roll"], n / t["tape_eager"], n / t["tape_compiled"]
        print(f"{model.name:<20}{n:>10d}{ours:>14.0f}{eager:>14.0f}{ours / eager:>7.2f}"
              f"{comp:>20.0f}{ours / comp:>7.2f}")


if __name__ == "__main__":
    app.run(main)
