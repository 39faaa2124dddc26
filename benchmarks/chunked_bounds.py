"""The traced size, tracing time, speed and peak memory of one CROWN bound pass on the
MNIST CNNs (`benchmarks.cnn_models`), as `robust_radius` compiles it, and the time of
`robust_radius` per image; `--compare` puts the previous passes beside the current ones.

For `--model` and each `--budgets` (MiB of functionals per chunk) it traces the pass
that `robust_radius(method="relaxation")` compiles (the margins' lower bounds of a
float64 twin with the rounding guard; `--method=crown_ibp`: intervals, then CROWN at
the output) for `--examples` examples, and prints the tracing time, the traced ops
(the function's graph, the loops' bodies counted once), the number of chunks of the
layer bounds, `crown_cost`'s estimated work of both methods and, with `--run`, the
wall and process CPU time of two compiled passes (the first also optimizes the graph).
`--radius_images=n` also times `robust_radius` with its defaults in l_inf on `n` test
images (`--data`; after a first image that traces, timed on its own and again warm at
the end, so that its first call's extra cost is the difference), per image, wall and CPU;
`--intermediate` sets its intermediate bounds; `--stages` splits its CPU time among its
stages (certify, walk, attack, bound passes, probes, the intermediate choice), and
`--traces` lists the functions the first image traces (`benchmarks.traces`).

`--compare` runs everything twice in the same process, interleaved: "before" is the
pass as it was (both signs of `+-I` pulled back at every layer, the rounding terms
summed from a `[B, C, n]` product, the rows of stable units pulled back too,
`robust_radius` one image per call on CNN-S, no receptive-field windows; with
`--before=dense`: today's pass with dense rows instead of windows), "now"
the current one; each variant has its own copy of the model (its own traced functions).
The process's peak RSS is printed last (`resource.getrusage`): run one budget and one
variant per process to read the peak RSS of that budget.

    python -m benchmarks.chunked_bounds --model=cnn_s --run --compare --radius_images=8
    python -m benchmarks.chunked_bounds --model=cnn_l --budgets=64 --run
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
import keras_roll.compile.bounds.crown as crown  # noqa: E402
import keras_roll.compile.bounds.ibp as ibp  # noqa: E402
import keras_roll.compile.bounds.methods as methods  # noqa: E402
import keras_roll.robust.api as robust_api  # noqa: E402
import keras_roll.robust.bounds as robust_bounds  # noqa: E402
from benchmarks.cnn_models import CNNS  # noqa: E402
from benchmarks.traces import summary, traces  # noqa: E402
from keras_roll.compile.bounds import BoundMethod, capture, crown_cost, lower_bounds  # noqa: E402
from keras_roll.compile.chunking import plan_chunks  # noqa: E402
from keras_roll.compile.structure import structure_of  # noqa: E402
from keras_roll.compile.twin import linearize  # noqa: E402
from keras_roll.data import mnist_splits  # noqa: E402
from keras_roll.robust.bounds import arithmetic_of  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "cnn_l", sorted(CNNS), "The CNN.")
flags.DEFINE_list("budgets", ["64"], "Memory budgets in MiB.")
flags.DEFINE_integer("examples", 1, "Examples per pass.")
flags.DEFINE_bool("run", False, "Also run the compiled pass twice and time it.")
flags.DEFINE_enum("method", "relaxation", ["relaxation", "crown_ibp"],
                  "The bound method: CROWN at every layer, or intervals then CROWN.")
flags.DEFINE_bool("compare", False, "Also run the previous passes ('before'), interleaved.")
flags.DEFINE_enum("before", "old", ["old", "dense"], "With --compare, 'before' is: 'old', the "
                  "passes of the first chunked round; 'dense', today's without windows.")
flags.DEFINE_integer("radius_images", 0, "Test images timed with robust_radius (l_inf).")
flags.DEFINE_string("data", "/work/shared/data/mnist.npz", "mnist.npz for --radius_images.")
flags.DEFINE_integer("epochs", 0, "Training epochs on 10,000 images first (0: random weights).")
flags.DEFINE_enum("intermediate", "auto", ["auto", "crown", "intervals"],
                  "robust_radius's intermediate bounds with --radius_images.")
flags.DEFINE_bool("traces", False, "With --radius_images: the functions the first image "
                  "traces, with their CPU seconds and ops (`benchmarks.traces`).")
flags.DEFINE_bool("stages", False, "With --radius_images: CPU seconds per image of each of "
                  "robust_radius's stages (certify, walk, attack, bound passes, probes).")

# robust_radius's stages, as keras_roll.robust.api calls them (--stages)
STAGES = ("certify", "walk_bounds", "run_attack", "relaxed_margins", "probe_attack",
          "intermediate_choice")


def _old_abs_sum(lam, delta):
    prod = tf.abs(lam) * delta[:, None]
    return tf.reduce_sum(tf.reshape(prod, tf.concat([tf.shape(prod)[:2], [-1]], 0)), -1)


@contextlib.contextmanager
def _variant(name: str):
    """The passes as they were ("before") or as they are ("now") while tracing."""
    if name == "now":
        yield
        return
    saved = (ibp.abs_sum, methods.relaxation_refiner, robust_bounds.relaxation_refiner,
             robust_bounds._MIN_ROWS)
    if FLAGS.before == "dense":
        old = functools.partial(crown.relaxation_refiner, windows=False)
    else:
        old = functools.partial(crown.relaxation_refiner, affine_shortcut=False,
                                skip_stable=False, windows=False)
        ibp.abs_sum = _old_abs_sum
        robust_bounds._MIN_ROWS = 2**62  # one chunk holds the widest layer: one image a call
    methods.relaxation_refiner = robust_bounds.relaxation_refiner = old
    try:
        yield
    finally:
        (ibp.abs_sum, methods.relaxation_refiner, robust_bounds.relaxation_refiner,
         robust_bounds._MIN_ROWS) = saved


def _chunks(twin, budget: int, b: int) -> int:
    """Pull-backs of CROWN's layer bounds in all, both signs (an upper estimate)."""
    layout = twin.layout((28, 28, 1))
    sizes = [int(np.prod(s)) for _, _, s in layout]
    total, largest = 0, 784
    for n in sizes:
        largest = max(largest, n)
        total += plan_chunks(b, 2 * n, 24 * largest, budget, batch_size=b).direction_chunks
    return total


def _timed(fn):
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - start, time.process_time() - cpu


def _pass(model, budget: int, x):
    """Traces the pass for `model`; returns its line's start and the concrete function."""
    twin = linearize(model).at_dtype("float64")
    structure = structure_of(twin.program)
    arithmetic = arithmetic_of(twin, guard=True)
    b = FLAGS.examples
    rows = np.eye(10)[None, 1:] - np.eye(10)[None, :1]

    @functools.partial(tf.function, autograph=False)  # as robust_radius compiles it
    def bounds(t, eps):
        values = capture(twin.interpreter, t)
        return lower_bounds(structure, values, tf.constant(rows), eps, np.inf,
                            BoundMethod(FLAGS.method), arithmetic, budget, b)

    spec = [tf.TensorSpec([b, 28, 28, 1], tf.float64), tf.TensorSpec([b], tf.float64)]
    concrete, traced, _ = _timed(lambda: bounds.get_concrete_function(*spec))
    ops = len(concrete.graph.get_operations())
    crown_work, ibp = crown_cost(structure, capture(twin.interpreter, tf.constant(x)), 9,
                                 budget, b)
    line = (f"{_chunks(twin, budget, b)} chunks at most, {ops} traced ops, tracing "
            f"{traced:.1f} s, estimated elements CROWN {crown_work.elements:.3g} / CROWN-IBP "
            f"{ibp.elements:.3g}")
    return line, concrete


def _models(names):
    model = CNNS[FLAGS.model]()
    if FLAGS.epochs:
        (x, y), _, _ = mnist_splits(FLAGS.data, val=5000)
        x = x.reshape(-1, 28, 28, 1) * (255.0 if x.max() <= 1 else 1.0)
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x[:10000], y[:10000], epochs=FLAGS.epochs, batch_size=128, verbose=0)
    copies = {}
    for name in names:
        copies[name] = keras.models.clone_model(model)
        copies[name].set_weights(model.get_weights())
    return copies


def _passes(models, x):
    b = FLAGS.examples
    for mib in FLAGS.budgets:
        budget = int(float(mib) * 2**20)
        lines, fns = {}, {}
        for name, model in models.items():
            with _variant(name):
                lines[name], fns[name] = _pass(model, budget, x)
        if FLAGS.run:
            eps, lows = tf.fill([b], tf.constant(0.5, tf.float64)), {}
            for call in ("first", "second"):  # the first call also optimizes the graph
                for name, fn in fns.items():
                    lows[name], wall, cpu = _timed(
                        lambda fn=fn, e=eps: fn(tf.constant(x), e).numpy())
                    lines[name] += f", {call} pass {wall:.2f} s wall / {cpu:.2f} s CPU"
            for name, low in lows.items():
                lines[name] += f" (min bound {low.min():.15g})"
        for name, line in lines.items():
            print(f"{FLAGS.model} {FLAGS.method} budget {mib} MiB, {name}: {line}", flush=True)


@contextlib.contextmanager
def _stage_timer():
    """`{stage: CPU seconds}` of robust_radius's stages while inside (with --stages)."""
    seconds = dict.fromkeys(STAGES, 0.0) if FLAGS.stages else {}
    saved = {name: getattr(robust_api, name) for name in seconds}

    def timed(name, fn):
        def run(*args, **kwargs):
            cpu = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.process_time() - cpu
        return run

    for name, fn in saved.items():
        setattr(robust_api, name, timed(name, fn))
    try:
        yield seconds
    finally:
        for name, fn in saved.items():
            setattr(robust_api, name, fn)


def _radius(models):
    n = FLAGS.radius_images
    _, _, (xte, yte) = mnist_splits(FLAGS.data, val=5000)
    xte = xte.reshape(-1, 28, 28, 1) * (255.0 if xte.max() <= 1 else 1.0)
    lowers = {}
    for name, model in models.items():
        with _variant(name), traces() as seen:
            _, wall, cpu = _timed(lambda model=model: keras_roll.robust_radius(
                model, xte[:1], yte[:1], norms=(np.inf,), verbose=False,
                intermediate=FLAGS.intermediate))
        with _variant(name), _stage_timer() as stages:
            rr, wall_n, cpu_n = _timed(lambda model=model: keras_roll.robust_radius(
                model, xte[1:n + 1], yte[1:n + 1], norms=(np.inf,), verbose=False,
                intermediate=FLAGS.intermediate))
        with _variant(name):  # the first image again, warm: what its first call paid extra
            _, wall_0, cpu_0 = _timed(lambda model=model: keras_roll.robust_radius(
                model, xte[:1], yte[:1], norms=(np.inf,), verbose=False,
                intermediate=FLAGS.intermediate))
        lowers[name] = rr.lower[np.inf]
        shown = np.array2string(lowers[name], precision=4, max_line_width=200)
        print(f"{FLAGS.model} robust_radius l_inf, {name}: first image (tracing) {wall:.1f} s "
              f"wall / {cpu:.1f} s CPU; {n} images: {wall_n / n:.2f} s wall / "
              f"{cpu_n / n:.2f} s CPU per image; {np.mean(rr.bound_passes[np.inf]):.1f} "
              f"bound passes per image; lower bounds {shown}",
              flush=True)
        print(f"  first call's extra cost (first image, less the same image warm: "
              f"{wall_0:.1f} s wall / {cpu_0:.1f} s CPU): {wall - wall_0:.1f} s wall / "
              f"{cpu - cpu_0:.1f} s CPU", flush=True)
        if FLAGS.traces:
            print(f"  first image: {summary(seen)}", flush=True)
        if stages:
            print("  CPU s per image: " + ", ".join(f"{k} {v / n:.3f}" for k, v in stages.items()),
                  flush=True)
    if len(lowers) == 2:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = lowers["now"] / lowers["before"]
        print(f"lower bounds now / before: min {np.nanmin(ratio):.15f}, "
              f"max {np.nanmax(ratio):.15f}", flush=True)


def main(_):
    models = _models(["before", "now"] if FLAGS.compare else ["now"])
    x = np.random.default_rng(0).uniform(0, 255, (FLAGS.examples, 28, 28, 1))
    print(f"machine: {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}", flush=True)
    _passes(models, x)
    if FLAGS.radius_images:
        _radius(models)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak:.2f} GiB", flush=True)


if __name__ == "__main__":
    app.run(main)
