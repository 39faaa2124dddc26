"""ResNet-18 ROLL training-step cost: vanilla vs sampled ROLL, and exact certify.

Times, interleaved in one run, Keras `train_on_batch` steps (SGD with momentum) of
`keras_roll.models.resnet18` (BatchNorm, the paper's average-pooled stem) for

* vanilla: cross-entropy only;
* sampled ROLL, `--samples` axes per channel (`strata="channel"`, the paper's
  Caltech-256 setting: `wrt="normalize"`, lam=0.001, C=8, gamma=100): one step of
  `keras_roll.wrap(model, ...)`, whose regularizer linearizes the inference-mode
  network (the training-mode pass of the model is computed beside it);

and reports, per ROLL variant, the median step time, the ratio to vanilla, the
**per-direction cost** `(roll step - vanilla step) / (directions * vanilla step)`
(directions = samples x channels) and the **peak memory** of the TensorFlow
allocator during one step (`tf.config.experimental.get_memory_info`, CPU:0 or
GPU:0). The system load (1, 5 and 15 minutes) is printed before and after: the CPU
figures are medians of interleaved repetitions on a machine shared with other work.

`--certify_examples=n` also times the exact certificate (`keras_roll.certify`,
l1 + l2 + l_inf radii through every input axis) of n images, per rigor in
`--certify_rigor`, as images per second. `--certify_only` skips the steps.

    python -m benchmarks.resnet                                  # CPU: 64x64, batch 16
    python -m benchmarks.resnet --quick                          # 32x32, batch 4, 1 and 2 axes
    python -m benchmarks.resnet --image_size=299 --batch=32 --mixed_precision \\
        --memory_budget=17179869184 --certify_examples=1        # a GPU (benchmarks/gpu_check.sh)

Under `--mixed_precision` the model is built under `mixed_float16` on a GPU
(`mixed_bfloat16` on a CPU) and the ROLL tangents are kept in that 16-bit dtype
(`tangent_dtype=`), with the sums of squares accumulated in float32.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import platform  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("image_size", 64, "Height and width of the inputs.")
flags.DEFINE_integer("batch", 16, "Batch size.")
flags.DEFINE_integer("classes", 256, "Output classes (Caltech-256).")
flags.DEFINE_list("samples", ["1", "6", "120"], "Sampled axes per channel, one ROLL "
                  "variant each.")
flags.DEFINE_integer("repeats", 3, "Interleaved timed repetitions (the median is reported).")
flags.DEFINE_integer("warmup", 0, "Untimed steps of every variant after its first "
                     "(compiling) step and the step that measures its peak memory.")
flags.DEFINE_float("max_seconds", 0, "Stop the repetitions after the round that passes this "
                   "many seconds (at least one round; 0: no limit).")
flags.DEFINE_integer("memory_budget", 2**30, "Bytes of ROLL tangents per chunk (as "
                     "the Caltech-256 example's default).")
flags.DEFINE_bool("mixed_precision", False, "mixed_float16 on a GPU, mixed_bfloat16 on a "
                  "CPU; ROLL tangents in that 16-bit dtype.")
flags.DEFINE_string("tangent_dtype", "auto", "ROLL tangent dtype: 'auto' (the compute "
                    "dtype under --mixed_precision, else the twin's), float32, float16 or "
                    "bfloat16.")
flags.DEFINE_float("lam", 0.001, "ROLL weight (the paper's Caltech-256 value).")
flags.DEFINE_float("C", 8.0, "ROLL hinge weight.")
flags.DEFINE_float("gamma", 100.0, "ROLL: percentage of neurons kept.")
flags.DEFINE_integer("certify_examples", 0, "Images to certify exactly (0: skip).")
flags.DEFINE_list("certify_rigor", ["float32", "float64"], "Rigors of the certify timing.")
flags.DEFINE_integer("certify_budget", 0, "memory_budget of the certify twin in bytes "
                     "(0: --memory_budget).")
flags.DEFINE_bool("certify_only", False, "Only the certify timing.")
flags.DEFINE_bool("quick", False, "A short run: 32x32, batch 4, 1 and 2 axes per channel, "
                  "2 repetitions (flags given explicitly still win).")

QUICK = {"image_size": 32, "batch": 4, "samples": ["1", "2"], "repeats": 2,
         "certify_examples": 1}


def device_name() -> str:
    """The accelerator's name (the first GPU), else the CPU's model name."""
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        return f"GPU: {details.get('device_name', gpus[0].name)} (x{len(gpus)})"
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {name}, {os.cpu_count()} cores"


def memory_device() -> str:
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def peak_memory(fn) -> int | None:
    """Peak bytes of the TensorFlow allocator while `fn()` runs (None if not tracked)."""
    dev = memory_device()
    try:
        tf.config.experimental.reset_memory_stats(dev)
        fn()
        return int(tf.config.experimental.get_memory_info(dev)["peak"])
    except (ValueError, RuntimeError):
        fn()
        return None


def load() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"loadavg {one:.2f} {five:.2f} {fifteen:.2f}"
    except OSError:
        return "loadavg n/a"


def policy() -> str:
    if not FLAGS.mixed_precision:
        return "float32"
    return "mixed_float16" if tf.config.list_physical_devices("GPU") else "mixed_bfloat16"


def tangent_dtype(model) -> str | None:
    if FLAGS.tangent_dtype != "auto":
        return None if FLAGS.tangent_dtype == "float32" else FLAGS.tangent_dtype
    compute = keras.backend.standardize_dtype(model.get_layer("conv1").compute_dtype)
    return compute if compute in ("float16", "bfloat16") else None


def build(size: int):
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(policy())
    try:
        model = keras_roll.models.resnet18(input_shape=(size, size, 3), classes=FLAGS.classes)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model


def data(n: int, size: int):
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (n, size, size, 3)).astype("float32")
    y = rng.integers(0, FLAGS.classes, n).astype("int32")
    return x, y


def compiled(model):
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy())
    return model


def time_steps(size: int) -> None:
    b = FLAGS.batch
    model = build(size)
    x, y = data(b, size)
    channels = x.shape[-1]
    tdtype = tangent_dtype(model)
    steps = {"vanilla": compiled(model)}
    directions = {"vanilla": 0}
    for s in (int(v) for v in FLAGS.samples):
        name = f"ROLL {s} axes/channel"
        steps[name] = compiled(keras_roll.wrap(
            model, lam=FLAGS.lam, C=FLAGS.C, gamma=FLAGS.gamma, samples=s, strata="channel",
            wrt="normalize", seed=0, memory_budget=FLAGS.memory_budget,
            tangent_dtype=tdtype))
        directions[name] = s * channels
    fns = {name: (lambda m=m: m.train_on_batch(x, y)) for name, m in steps.items()}
    compile_s = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        compile_s[name] = time.perf_counter() - start
    peaks = {name: peak_memory(fn) for name, fn in fns.items()}
    before = load()
    times, rounds = interleaved(fns, FLAGS.repeats, FLAGS.warmup, FLAGS.max_seconds)
    after = load()

    lin = keras_roll.linearize(model, memory_budget=FLAGS.memory_budget)
    print(f"machine: {device_name()}; TensorFlow {tf.__version__}, Keras {keras.__version__}")
    print(f"ResNet-18 at {size}x{size}x3, batch {b}, {FLAGS.classes} classes, policy "
          f"{policy()}, ROLL tangents in {tdtype or lin.dtype}; SGD(momentum 0.9); "
          f"lam={FLAGS.lam}, C={FLAGS.C}, gamma={FLAGS.gamma}, wrt='normalize', "
          f"memory_budget={FLAGS.memory_budget / 2**20:.0f} MiB")
    print(f"median of {rounds} interleaved repetitions; {before} (before), {after} (after)")
    van = times["vanilla"]
    head = (f"  {'step':<24} {'directions':>10} {'chunks':>6} {'ms/step':>10} {'/ vanilla':>9} "
            f"{'per-direction':>13} {'peak MiB':>9} {'first step s':>12}")
    print(head)
    for name, t in times.items():
        d = directions[name]
        if d:
            plan = keras_roll.roll.loss.memory_plan(lin, x, samples=d // channels, strata="channel",
                                               wrt="normalize")
            chunks, per_dir = f"{plan.chunks}", f"{(t - van) / (d * van):13.3f}"
        else:
            chunks, per_dir = "", f"{'':>13}"
        peak = peaks[name]
        peak_s = f"{peak / 2**20:9.0f}" if peak is not None else f"{'n/a':>9}"
        print(f"  {name:<24} {d or '':>10} {chunks:>6} {1e3 * t:10.1f} {t / van:9.2f} "
              f"{per_dir} {peak_s} {compile_s[name]:12.1f}")
    print("per-direction = (roll step - vanilla step) / (directions * vanilla step); "
          "peak = TensorFlow allocator peak during one step "
          f"({memory_device()}, weights and data included)")


def interleaved(fns: dict, repeats: int, warmup: int, max_seconds: float):
    """`({name: median seconds}, rounds)`: `fns` timed round-robin (as
    `benchmarks._util.interleaved_medians`), stopping early after the round that
    passes `max_seconds` (if > 0)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    start = time.perf_counter()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        if max_seconds and time.perf_counter() - start > max_seconds:
            break
    return {name: float(np.median(t)) for name, t in times.items()}, len(times["vanilla"])


def time_certify(size: int) -> None:
    n = FLAGS.certify_examples
    model = build(size)
    x, _ = data(n, size)
    budget = FLAGS.certify_budget or FLAGS.memory_budget
    lin = keras_roll.linearize(model, memory_budget=budget)
    d = size * size * 3
    print(f"exact certify (l1, l2, l_inf radii; {d} input axes per image) of {n} image(s), "
          f"ResNet-18 at {size}x{size}x3, policy {policy()}, memory_budget "
          f"{budget / 2**20:.0f} MiB, {load()}:")
    for rigor in FLAGS.certify_rigor:
        start = time.perf_counter()
        keras_roll.certify(lin, x[:1], rigor=rigor, verbose=0)  # compiles
        first = time.perf_counter() - start
        start = time.perf_counter()
        peak = peak_memory(lambda r=rigor: keras_roll.certify(lin, x, rigor=r, verbose=0))
        t = time.perf_counter() - start
        peak_s = f", peak {peak / 2**20:.0f} MiB" if peak is not None else ""
        print(f"  rigor {rigor}: {t:8.2f} s for {n} -> {n / t:8.4f} images/s "
              f"({t / n:.2f} s/image; first (compiling) call {first:.1f} s{peak_s})",
              flush=True)


def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")
    if FLAGS.quick:
        for name, value in QUICK.items():
            if not FLAGS[name].present:
                FLAGS[name].value = value
    size = FLAGS.image_size
    if not FLAGS.certify_only:
        time_steps(size)
    if FLAGS.certify_examples:
        time_certify(size)


if __name__ == "__main__":
    app.run(main)
