"""Timing helpers and flags shared by the benchmarks."""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf
from absl import flags


def define_mnist_flags(num_examples: int, examples_help: str, epochs: int) -> None:
    """Defines the flags every MNIST benchmark has: `--data` (what
    `keras_roll.data.mnist_splits` reads), `--num_examples` (the test images measured)
    and `--epochs` (the training of the measured network), with these defaults.

    Example:

    ```python
    define_mnist_flags(20, "Test images attacked.", epochs=1)
    (x, y), val, test = mnist_splits(flags.FLAGS.data, val=5000)
    ```
    """
    flags.DEFINE_string("data", None, "mnist.npz, or a folder with it or the IDX files "
                        "(default: the Keras cache).")
    flags.DEFINE_integer("num_examples", num_examples, examples_help)
    flags.DEFINE_integer("epochs", epochs, "Training epochs.")


def median_time(fn, repeats: int, warmup: int = 2) -> float:
    """Median wall time of `fn()` over `repeats` calls after `warmup` calls.

    `fn` must block until its result is ready (e.g. call `.numpy()`).

    Example:

    ```python
    t = median_time(lambda: step(x).numpy(), repeats=10)
    ```
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def matmul_rate(m: int, k: int, n: int, repeats: int = 5) -> float:
    """Measured float32 GFLOP/s of a compiled `[m, k] @ [k, n]` matmul."""
    a = tf.random.normal((m, k))
    b = tf.random.normal((k, n))
    fn = tf.function(lambda: tf.reduce_sum(tf.matmul(a, b)))
    t = median_time(lambda: fn().numpy(), repeats)
    return 2.0 * m * k * n / t / 1e9


def interleaved_medians(fns: dict, repeats: int, warmup: int = 2, setup=None) -> dict:
    """Median wall time of each `fn()`, timing them round-robin.

    Interleaving makes ratios robust to slow drifts of the machine's speed
    (other processes, thermal state). `setup()`, when given, runs untimed before
    every call (for example, to put back weights that a training step changed).

    Example:

    ```python
    t = interleaved_medians({"a": lambda: f(x).numpy(), "b": lambda: g(x).numpy()}, 20)
    ```
    """
    setup = setup or (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            setup()
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            setup()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}
