"""The traced size, tracing time and peak memory of one CROWN bound pass on the MNIST
CNNs (`benchmarks.cnn_models`), as `robust_radius` compiles it.

For `--model` and each `--budgets` (MiB of functionals per chunk) it traces the pass
that `robust_radius(method="relaxation")` compiles (the margins' lower bounds of a
float64 twin with the rounding guard; `--method=crown_ibp`: intervals, then CROWN at
the output) for `--examples` examples, and prints the tracing time, the traced ops
(the function's graph, the loops' bodies counted once), the number of chunks of the
layer bounds, `crown_cost`'s estimated work of both methods and, with `--run`, the
time of two compiled passes (the first also optimizes the graph); the process's peak
RSS is printed last (`resource.getrusage`). Run one budget per process to read the
peak RSS of that budget.

    python -m benchmarks.chunked_bounds --model=cnn_l --budgets=64 --run
"""

from __future__ import annotations

import functools
import os
import resource
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.cnn_models import CNNS  # noqa: E402
from keras_roll.compile.bounds import BoundMethod, capture, crown_cost, lower_bounds  # noqa: E402
from keras_roll.compile.chunking import plan_chunks  # noqa: E402
from keras_roll.compile.structure import structure_of  # noqa: E402
from keras_roll.compile.twin import linearize  # noqa: E402
from keras_roll.robust.bounds import arithmetic_of  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "cnn_l", sorted(CNNS), "The CNN.")
flags.DEFINE_list("budgets", ["64"], "Memory budgets in MiB.")
flags.DEFINE_integer("examples", 1, "Examples per pass.")
flags.DEFINE_bool("run", False, "Also run the compiled pass once and time it.")
flags.DEFINE_enum("method", "relaxation", ["relaxation", "crown_ibp"],
                  "The bound method: CROWN at every layer, or intervals then CROWN.")


def _chunks(twin, budget: int, b: int) -> int:
    """Pull-backs of CROWN's layer bounds in all (crown.py's plan, recomputed)."""
    layout = twin.layout((28, 28, 1))
    sizes = [int(np.prod(s)) for _, _, s in layout]
    total, largest = 0, 784
    for n in sizes:
        largest = max(largest, n)
        total += plan_chunks(b, 2 * n, 24 * largest, budget, batch_size=b).direction_chunks
    return total


def main(_):
    model = CNNS[FLAGS.model]()
    twin = linearize(model).at_dtype("float64")
    structure = structure_of(twin.program)
    arithmetic = arithmetic_of(twin, guard=True)
    b = FLAGS.examples
    x = np.random.default_rng(0).uniform(0, 255, (b, 28, 28, 1))
    rows = np.eye(10)[None, 1:] - np.eye(10)[None, :1]
    for mib in FLAGS.budgets:
        budget = int(float(mib) * 2**20)

        @functools.partial(tf.function, autograph=False)  # as robust_radius compiles it
        def bounds(t, eps, budget=budget):
            values = capture(twin.interpreter, t)
            return lower_bounds(structure, values, tf.constant(rows), eps, np.inf,
                                BoundMethod(FLAGS.method), arithmetic, budget, b)

        spec = [tf.TensorSpec([b, 28, 28, 1], tf.float64), tf.TensorSpec([b], tf.float64)]
        start = time.perf_counter()
        concrete = bounds.get_concrete_function(*spec)
        traced = time.perf_counter() - start
        ops = len(concrete.graph.get_operations())
        crown, ibp = crown_cost(structure, capture(twin.interpreter, tf.constant(x)), 9,
                                budget, b)
        line = (f"{FLAGS.model} {FLAGS.method} budget {mib} MiB: "
                f"{_chunks(twin, budget, b)} chunks, {ops} traced ops, tracing {traced:.1f} s, "
                f"estimated elements CROWN {crown.elements:.3g} / CROWN-IBP "
                f"{ibp.elements:.3g}")
        if FLAGS.run:
            for call in ("first", "second"):  # the first call also optimizes the graph
                start, cpu = time.perf_counter(), time.process_time()
                eps = tf.fill([b], tf.constant(0.5, tf.float64))
                low = concrete(tf.constant(x), eps).numpy()
                line += (f", {call} pass {time.perf_counter() - start:.1f} s wall / "
                         f"{time.process_time() - cpu:.1f} s CPU")
            line += f" (min bound {low.min():.3g})"
        print(line, flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak:.2f} GiB", flush=True)


if __name__ == "__main__":
    app.run(main)
