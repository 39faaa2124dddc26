"""benchmarks/_util.py: round-robin timing, with an untimed set-up before every call;
benchmarks/roll_steps.py: the weights put back between timed steps."""

import time

import keras
import numpy as np

from benchmarks._util import interleaved_medians
from benchmarks.roll_steps import weight_reset


def test_setup_runs_before_every_call_and_is_not_timed():
    calls = []

    def setup():
        calls.append("setup")
        time.sleep(0.1)  # untimed: must not reach the medians

    def fn(name):
        calls.append(name)
        time.sleep(0.002)

    times = interleaved_medians({"a": lambda: fn("a"), "b": lambda: fn("b")}, repeats=3,
                                warmup=1, setup=setup)
    assert calls == ["setup", "a", "setup", "b"] + ["setup", "a", "setup", "b"] * 3
    assert set(times) == {"a", "b"}
    assert all(0.002 <= t < 0.08 for t in times.values())


def test_weight_reset_puts_back_the_weights_a_step_changed():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    before = [w.copy() for w in model.get_weights()]
    reset = weight_reset(model)
    model.set_weights([w + 1.0 for w in before])
    reset()
    for w, ref in zip(model.get_weights(), before):
        np.testing.assert_array_equal(w, ref)
