"""Table 2 of the paper: the time of one training step of vanilla, exact ROLL by
back-propagation and by perturbation, and sampled ROLL with 3 axes, measured in one
run (interleaved medians; the ratios are what to read, not the absolute times).

Example:

```python
md = timing(config, out)    # writes out/table2.md and .json
```
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import keras_roll
from examples.common.tables import fmt, write_table
from examples.mnist.configs.default import Config

__all__ = ["timing"]


def timing(config: Config, out: Path) -> str:
    """Times the steps of `benchmarks/roll_steps.py` (as `benchmarks/step_time.py`) at
    `--batch_size`; writes `out/table2.md` / `.json` and returns the Markdown."""
    import tensorflow as tf

    from benchmarks import roll_steps
    from benchmarks._util import interleaved_medians

    b = config.batch_size
    model = roll_steps.build()
    lin = keras_roll.linearize(model)
    rng = np.random.default_rng(config.seed)
    x = tf.constant(rng.uniform(0, 1, size=(b, roll_steps.D)).astype("float32"))
    y = tf.constant(rng.integers(0, roll_steps.L, size=b).astype("int32"))
    fast = {"vanilla": roll_steps.vanilla_step(model),
            "ROLL, 3 sampled axes (Eq. 10)": roll_steps.roll_step(model, lin, samples=3)}
    slow = {"exact ROLL, back-propagation (tf.GradientTape.batch_jacobian)":
            roll_steps.autodiff_step(model),
            "exact ROLL, perturbation (keras_roll)": roll_steps.roll_step(model, lin)}
    reps = config.timing_repeats
    reset = roll_steps.weight_reset(model)  # every step timed from the initial weights
    times = interleaved_medians(
        {k: (lambda s=roll_steps.compile_step(s, b): s(x, y).numpy()) for k, s in fast.items()},
        repeats=reps, setup=reset)
    times.update(interleaved_medians(
        {k: (lambda s=roll_steps.compile_step(s, b): s(x, y).numpy()) for k, s in slow.items()},
        repeats=max(1, reps // 4), warmup=1, setup=reset))
    order = ["vanilla", *slow, "ROLL, 3 sampled axes (Eq. 10)"]
    base = times["vanilla"]
    rows = [{"method": k, "ms": 1e3 * times[k], "ratio": times[k] / base} for k in order]
    rows.append({"method": "back-propagation / perturbation", "ms": None,
                 "ratio": times[order[1]] / times[order[2]]})
    notes = [f"784-300x4-10 ReLU, batch {b}, SGD, lam={roll_steps.LAM:g}, C={roll_steps.C:g}, "
             f"gamma=100; median of interleaved repetitions in one run; {os.cpu_count()} CPU "
             f"cores, TensorFlow {tf.__version__}, {len(tf.config.list_physical_devices('GPU'))}"
             f" GPU(s). Steps from benchmarks/roll_steps.py (as benchmarks/step_time.py)."]
    return write_table(out, "table2", "Table 2: time of one training step",
                       [("method", "Method", fmt), ("ms", "ms / step", fmt),
                        ("ratio", "x vanilla", fmt)], rows, notes)
