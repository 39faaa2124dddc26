"""`memory_budget="auto"` for ROLL: the chunk size of the first call picked by a timed probe.

References: the loss of every candidate budget is the loss of one fixed budget
(the chunking must not change the loss), the probe's choice is one of the
candidates of `keras_roll.compile.chunking.auto_candidates`, and it is made once
per model and shape.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.roll import autotune
from keras_roll.roll import loss as roll
from keras_roll.roll.config import RollConfig


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((12,))
    h = keras.layers.Dense(16, activation="relu")(inp)
    h = keras.layers.Dense(16, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(3)(h))


def test_linearize_defaults_to_auto_and_fixed_budgets_stay_fixed():
    model = _mlp()
    auto = keras_roll.linearize(model)
    assert auto.auto_budget and auto is keras_roll.linearize(model, memory_budget="auto")
    fixed = keras_roll.linearize(model, memory_budget=auto.memory_budget)
    assert fixed is not auto and not fixed.auto_budget
    x = np.zeros((4, 12), "float32")
    config = autotune.tuned_config(fixed, x, RollConfig(), False, None)
    assert config.memory_budget == fixed.memory_budget  # no probe on a fixed twin
    assert autotune.tuned_config(auto, x, RollConfig(memory_budget=1234), False,
                                 None).memory_budget == 1234


@pytest.fixture
def small_candidates(auto_probes):
    """Candidates of a few KB, so that a tiny model has several plans to time."""
    return auto_probes(autotune)


def test_the_probe_chooses_a_candidate_once_per_model_and_shape(small_candidates):
    model = _mlp(1)
    lin = keras_roll.linearize(model)
    x = np.random.default_rng(0).normal(size=(8, 12)).astype("float32")
    want = roll.roll_loss(keras_roll.linearize(model, memory_budget=2**30), x, C=0.5)
    got = roll.roll_loss(lin, x, C=0.5)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    assert len(small_candidates) == 1 and len(small_candidates[0]) > 1
    plan = roll.memory_plan(lin, x)
    assert plan.memory_budget in small_candidates[0]
    roll.roll_loss(lin, x, C=0.25)  # the same shape and directions: no second probe
    assert len(small_candidates) == 1
    roll.roll_loss(lin, x[:5], C=0.5)  # another batch size: another probe
    assert len(small_candidates) == 2
