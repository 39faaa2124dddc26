"""ROLL training-step time in the paper's MNIST setting (784-300x4-10 ReLU, batch 64, SGD).

Times, in one run, tf.function-compiled train steps (cross-entropy + lam * ROLL,
then an SGD update) for

* vanilla: cross-entropy only;
* exact ROLL through the perturbation (forward-mode) pass of `keras_roll.roll.loss`,
  in one chunk (budget 1 GiB), with the default budget (64 MiB: 11 chunks,
  recomputed in the backward pass) and with a 16 MiB budget (44 cache-sized
  chunks: on this CPU the recomputation costs less than the memory traffic of
  large tangents);
* the same exact loss through `tf.GradientTape.batch_jacobian` (the autodiff
  baseline: reverse mode per neuron, vectorized by pfor);
* sampled ROLL with 3 input axes per example (Eq. 10), and with 3 axes shared by
  the batch (`share_axes=True`: the first layer's tangents are then shared);

and prints the medians, the ratios sampled / vanilla and autodiff / perturbation,
and the achieved GFLOP/s of the exact step beside float32 matmul rates measured
in the same run.

    python -m benchmarks.step_time            # full run
    python -m benchmarks.step_time --quick    # a short run

FLOP count of the exact step (matmuls only, multiply-add = 2 FLOPs; B = 64,
D = 784 axes, H = 300, L = 10):

* forward of the twin (its logits also feed the cross-entropy) and its backward:
  `3 * 2B(DH + 3H^2 + HL) - 2BDH` (no input gradient);
* tangent forward: the first layer once for all examples (one-hot axes are shared
  until the first mask: `2 D D H`), then `2 B D H^2` per hidden layer 2..4 and
  `2 B D H L` for the logits' tangent (computed by the twin though unused);
* tangent backward: weight and input gradients of layers 2..4 (`2 * 2 B D H^2`
  each) and the first layer's weight gradient (`2 D D H`).

The elementwise work (masks, squares, reductions) is not counted.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks._util import interleaved_medians, matmul_rate  # noqa: E402
from benchmarks.roll_steps import (  # noqa: E402
    DEPTH,
    LAM,
    C,
    D,
    H,
    L,
    build,
    exact_step_flops,
    make_steps,
)
from keras_roll.roll import loss as roll  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "A short run: fewer repetitions.")
flags.DEFINE_integer("batch", 64, "Batch size.")
flags.DEFINE_integer("samples", 3, "Axes per example of the sampled ROLL.")

def main(argv):
    del argv
    tf.get_logger().setLevel("ERROR")  # retracing notes of the per-budget twins
    b, samples = FLAGS.batch, FLAGS.samples
    quick = FLAGS.quick
    # matmul rates first, on a quiet machine
    mm = {"[2048x2048]^2": matmul_rate(2048, 2048, 2048, repeats=3 if quick else 10),
          f"[{b * D}x{H}]@[{H}x{H}]": matmul_rate(b * D, H, H, repeats=3 if quick else 10)}
    model = build()
    rng = np.random.default_rng(0)
    x = tf.constant(rng.uniform(0, 1, size=(b, D)).astype("float32"))
    y = tf.constant(rng.integers(0, L, size=b).astype("int32"))
    fast, slow, lins = make_steps(model, b, samples)
    times = interleaved_medians({k: (lambda s=s: s(x, y).numpy()) for k, s in fast.items()},
                                repeats=10 if quick else 60)
    times.update(interleaved_medians(
        {k: (lambda s=s: s(x, y).numpy()) for k, s in slow.items()}, repeats=1 if quick else 5,
        warmup=1))
    chunk_mm = {}
    for mib, lin in lins.items():
        plan = roll.memory_plan(lin, x)
        rows = b * plan.per_chunk
        if mib != 1024 and f"[{rows}x{H}]" not in chunk_mm:
            chunk_mm[f"[{rows}x{H}]@[{H}x{H}]"] = matmul_rate(rows, H, H, repeats=3 if quick
                                                              else 10)

    flops = exact_step_flops(b)
    total = sum(flops.values())
    print(f"machine: {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}, "
          f"Keras {keras.__version__}")
    print(f"network: {D}-{'-'.join([str(H)] * DEPTH)}-{L} ReLU, batch {b}, SGD, "
          f"lam={LAM}, C={C}, gamma=100 (median of interleaved repetitions)")
    for name, t in times.items():
        print(f"  {name:<38} {1e3 * t:10.1f} ms/step")
    exact_names = [k for k in times if "perturbation" in k]
    best = min(exact_names, key=times.get)
    exact = times[best]
    sampled = times[f"sampled ROLL, {samples} axes"]
    shared = times[f"sampled ROLL, {samples} shared axes"]
    autodiff = times["exact ROLL, autodiff batch_jacobian"]
    print(f"ratio sampled({samples}) / vanilla:   {sampled / times['vanilla']:6.2f}  "
          f"(target <= 2.5; axes shared by the batch: {shared / times['vanilla']:.2f})")
    print(f"ratio autodiff / perturbation: {autodiff / exact:6.2f}  (target >= 4; best "
          f"perturbation variant: {best}; vs 1 chunk: "
          f"{autodiff / times['exact ROLL, perturbation (1024 MiB)']:.2f})")
    for mib, lin in lins.items():
        plan = roll.memory_plan(lin, x)
        print(f"  budget {mib:5d} MiB: {plan.chunks:3d} chunk(s) of {plan.per_chunk} axes "
              f"({plan.bytes_per_direction / 2**20:.2f} MiB per axis)")
    rate = total / exact / 1e9
    print(f"exact step: {total / 1e9:.1f} GFLOP ("
          + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in flops.items())
          + f"; recomputed chunks add {flops['tangent'] / 1e9:.1f} not counted)")
    print(f"  -> {rate:.1f} GFLOP/s ({best})")
    mm.update(chunk_mm)
    for name, r in mm.items():
        print(f"matmul {name:<24} {r:7.1f} GFLOP/s   exact step / this: {rate / r:.2f}")
    print(f"exact step / best measured matmul: {rate / max(mm.values()):.2f}  (target >= 0.50)")


if __name__ == "__main__":
    app.run(main)
