"""Integrated gradients on ResNet-18 at 32x32x3, 10 classes, with the work capped.

`keras_roll.models.resnet18(input_shape=(32, 32, 3), classes=10)`, random weights
(seed 0), `--images` random images in [0, 1], the black baseline, the predicted
class: `keras_roll.integrated_gradients(model, x, max_regions=..., fallback_steps=...)`
twice (the first call traces), printing wall and CPU seconds (`time.process_time()`),
the peak RSS (`ru_maxrss`), which paths were exact, their region counts (estimated
for a path over the cap), the fallbacks' error estimates and the completeness gaps.

    python -m benchmarks.resnet_ig --max_regions=2000 --fallback_steps=128
    python -m benchmarks.resnet_ig --max_regions=100000 --fallback_steps=0   # exact
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import resource  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import keras_roll  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("images", 1, "Random images.")
flags.DEFINE_integer("max_regions", 2000, "integrated_gradients' max_regions.")
flags.DEFINE_integer("fallback_steps", 128, "integrated_gradients' fallback_steps (0: None).")
flags.DEFINE_integer("memory_budget", 0, "Bytes per compiled chunk (0: the default).")
flags.DEFINE_integer("calls", 2, "Calls on the same images (the first traces).")


def main(argv) -> None:
    del argv
    keras.utils.set_random_seed(0)
    model = keras_roll.models.resnet18(input_shape=(32, 32, 3), classes=10)
    x = np.random.default_rng(0).uniform(0, 1, (FLAGS.images, 32, 32, 3)).astype("float32")
    kw = dict(max_regions=FLAGS.max_regions, fallback_steps=FLAGS.fallback_steps or None,
              verbose=False)
    if FLAGS.memory_budget:
        kw["memory_budget"] = FLAGS.memory_budget
    for call in range(FLAGS.calls):
        wall, cpu = time.perf_counter(), time.process_time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ig = keras_roll.integrated_gradients(model, x, **kw)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"call {call}: {wall:.1f} s wall, {cpu:.1f} s CPU, peak {peak:.2f} GiB; "
              f"exact {ig.exact.tolist()}, regions {ig.regions.tolist()}, error "
              f"{np.round(ig.error, 6).tolist()}, |delta| {np.abs(ig.delta).round(6).tolist()}, "
              f"f(x) - f(0) {np.round(ig.f_x - ig.f_baseline, 6).tolist()}", flush=True)
        for w in caught:
            print(f"  warning: {w.message}", flush=True)


if __name__ == "__main__":
    app.run(main)
