"""Certify throughput: l1 + l2 + l_inf certificates of a 784-300x4-10 ReLU network
and of ResNet-18.

Prints examples per second of `keras_roll.certify` on 1,000 MNIST-shaped inputs
under the three rigors, timed interleaved in the same run: `"float64"` (the
default: float32 tangents with a rigorous bound on their rounding, float64
norms of the neurons that can bind, the probabilistic rounding guard's noise
pass and the worst-case pass), `"strict"` (the float64 pass of every neuron and
the worst-case pass) and `"float32"` (no guard), and their ratios to float32
(goals: the default at most 1.3x float32 on the MLP, 2.0x on ResNet-18); then
the achieved GFLOP/s of the float32 tangent (perturbation) pass beside a
float32 matmul rate measured in the same run, on matmuls of the same shapes.
`--resnet_examples=n` (default 1; 0 skips it) also times the default and
float32 certificates of `n` images of an untrained ResNet-18
(`keras_roll.models.resnet18`, the paper's average-pooled stem) at
`--resnet_size` pixels, interleaved. Timings are medians of interleaved
repetitions in one process: compare the ratios, not the absolute times, on a
shared machine.

    python -m benchmarks.certify [--num_examples=1000] [--repeats=3] [--resnet_examples=1]
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402
from benchmarks._util import interleaved_medians  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_examples", 1000, "Inputs to certify.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions (the median is reported).")
flags.DEFINE_integer("width", 300, "Hidden width.")
flags.DEFINE_integer("depth", 4, "Hidden layers.")
flags.DEFINE_integer("resnet_examples", 1, "ResNet-18 images to certify (0: skip).")
flags.DEFINE_integer("resnet_size", 32, "Height and width of the ResNet-18 images.")
flags.DEFINE_integer("resnet_repeats", 2, "Timed repetitions of the ResNet-18 case.")

D = 784


def build(width: int, depth: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((D,))
    h = inp
    for i in range(depth):
        h = keras.layers.Dense(width, activation="relu", name=f"fc{i}")(h)
    return keras.Model(inp, keras.layers.Dense(10, name="logits")(h), name="mlp")


def tangent_flops(n: int, width: int, depth: int) -> float:
    """Matmul FLOPs of the tangent pass over all D input axes for n examples.

    Along one-hot input axes the first layer's tangents are rows of its kernel
    (a gather, no FLOPs, shared by the batch until the first mask); every later
    layer multiplies per example and direction.
    """
    return n * D * 2 * ((depth - 1) * width * width + width * 10)


def main(argv):
    del argv
    n, width, depth = FLAGS.num_examples, FLAGS.width, FLAGS.depth
    model = build(width, depth)
    x = np.random.default_rng(0).uniform(0, 1, size=(n, D)).astype("float32")
    lin = keras_roll.linearize(model)

    last = {}

    def run(rigor):
        last[rigor] = keras_roll.certify(lin, x, verbose=0, rigor=rigor)

    certs = interleaved_medians({rigor: (lambda r=rigor: run(r))
                                 for rigor in ("float64", "strict", "float32")},
                                FLAGS.repeats, warmup=1)
    t_cert32 = certs["float32"]

    chunks = []

    def reduce(jvp, start):
        return tf.reduce_sum(jvp.neurons, axis=1)

    def tangent_pass():
        chunks.clear()
        out = None
        for sl, _, _start, k, result in lin.iter_axis_chunks(x, reduce=reduce, per_neuron=True):
            chunks.append((sl, k))
            out = result
        out.numpy()

    tangent_pass()  # warm-up (tracing), also reads the chunk sizes
    example_chunk = chunks[0][0].stop - chunks[0][0].start
    k = chunks[0][1]
    flops = tangent_flops(n, width, depth)

    rows = example_chunk * k
    a = tf.random.normal((rows, width))
    w = tf.random.normal((width, width))
    same_shape = tf.function(lambda: tf.matmul(a, w))
    sq = tf.random.normal((2048, 2048))
    square = tf.function(lambda: tf.matmul(sq, sq))
    same_shape().numpy(), square().numpy()
    # Interleave the timings so that the rates see the same machine load.
    times = interleaved_medians({
        "tangent": tangent_pass,
        "same_shape": lambda: same_shape().numpy(),
        "square": lambda: square().numpy(),
    }, FLAGS.repeats * 3, warmup=1)
    t_tan = times["tangent"]
    mm_rate = 2 * rows * width * width / times["same_shape"] / 1e9
    sq_rate = 2 * 2048**3 / times["square"] / 1e9

    rate = flops / t_tan / 1e9
    print(f"machine: {os.cpu_count()} CPU cores, TensorFlow {tf.__version__}")
    print(f"network: {D}-{'-'.join([str(width)] * depth)}-10 ReLU, {n} inputs, "
          f"{lin.forward(x[:1]).neurons.z.shape[-1]} neurons")
    for rigor, t in certs.items():
        print(f"certify (l1 + l2 + l_inf), rigor {rigor:>7}: {t:8.3f} s  -> "
              f"{n / t:8.1f} examples/s  ({t / t_cert32:.2f} x float32)")
    print(f"ratio float64 (default) / float32: {certs['float64'] / t_cert32:.2f} "
          f"(goal <= 1.3); strict / float32: {certs['strict'] / t_cert32:.2f}; default "
          f"l2 radii 0 (decided without gradients) for "
          f"{100 * np.mean(last['float64'].margins[2] == 0):.0f} % of the inputs")
    print(f"tangent pass alone:        {t_tan:8.3f} s  -> {rate:8.1f} GFLOP/s "
          f"({flops / 1e9:.0f} GFLOP; chunks of {example_chunk} examples x {k} axes)")
    print(f"matmul [{rows}x{width}]@[{width}x{width}]: {mm_rate:8.1f} GFLOP/s; "
          f"[2048x2048]^2: {sq_rate:8.1f} GFLOP/s")
    print(f"ratio tangent / same-shape matmul: {rate / mm_rate:.2f} "
          f"(target >= 0.50); tangent / square matmul: {rate / sq_rate:.2f}")

    if FLAGS.resnet_examples:
        resnet_case(FLAGS.resnet_examples, FLAGS.resnet_size, FLAGS.resnet_repeats)


def resnet_case(n: int, size: int, repeats: int) -> None:
    """The default and float32 certificates of `n` ResNet-18 images, interleaved."""
    keras.utils.set_random_seed(0)
    model = keras_roll.models.resnet18(input_shape=(size, size, 3), classes=10)
    x = np.random.default_rng(0).uniform(0, 1, size=(n, size, size, 3)).astype("float32")
    lin = keras_roll.linearize(model, memory_budget=2**30)
    certs = {}

    def run(rigor):
        certs[rigor] = keras_roll.certify(lin, x, verbose=0, rigor=rigor)

    times = interleaved_medians({r: (lambda r=r: run(r)) for r in ("float64", "float32")},
                                repeats, warmup=1)
    zero = float(np.mean(certs["float64"].margins[2] == 0))
    print(f"ResNet-18 at {size}x{size}x3, {n} image(s), {lin.num_neurons(x.shape[1:])} "
          f"neurons: float64 (default) {times['float64']:.2f} s, float32 "
          f"{times['float32']:.2f} s; ratio {times['float64'] / times['float32']:.2f} "
          f"(goal <= 2.0); default radii 0 for {100 * zero:.0f} % of the images")


if __name__ == "__main__":
    app.run(main)
