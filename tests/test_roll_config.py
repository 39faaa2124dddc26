"""ROLL's hyperparameters in one place: `RollConfig` and `config=None, **overrides`.

`wrap`, `RollRegularizer`, `roll_loss`, `neuron_grad_sq` and `memory_plan` take a
`RollConfig`, its fields by keyword, or both. The references are independent of
the code under test: the loss of a config equals the loss of the same
hyperparameters spelled as keywords (checked against a numpy Eq. 9 in
tests/test_roll.py), the refusals name the bad argument, and a `.keras` file
written by the earlier code (tests/fixtures/wrapped_v0_1.keras, saved before
`tangent_dtype` was a field of `RollConfig`) loads with its hyperparameters and
trains.
"""

from __future__ import annotations

import dataclasses
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.roll import loss as roll
from keras_roll.roll.config import RollConfig, resolve_config
from tests.test_roll import mlp_groups, reference_loss

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "wrapped_v0_1.keras")


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,), name="x")
    h = keras.layers.Dense(5, name="d0")(inp)
    h = keras.layers.ReLU(name="r0")(h)
    return keras.Model(inp, keras.layers.Dense(3, name="d1")(h), name="tiny")


@pytest.fixture(scope="module")
def batch():
    return np.random.default_rng(0).normal(size=(6, 4)).astype("float32")


def test_resolve_config_replaces_fields_and_validates():
    base = RollConfig(lam=2.0, samples=3)
    got = resolve_config(base, seed=5, C=0.25)
    assert (got.lam, got.samples, got.seed, got.C) == (2.0, 3, 5, 0.25)
    assert base.seed is None  # frozen: the base is unchanged
    assert resolve_config(None) == RollConfig()
    assert resolve_config(base) is base
    with pytest.raises(ValueError, match="gamma"):
        resolve_config(base, gamma=0.0)
    with pytest.raises(TypeError, match=r"\['lamda'\].*'lam'"):
        resolve_config(base, lamda=1.0)
    with pytest.raises(TypeError, match="by keyword"):
        resolve_config({"lam": 1.0})


def test_tangent_dtype_is_a_validated_field():
    assert RollConfig(tangent_dtype=np.float16).tangent_dtype == "float16"
    assert RollConfig(tangent_dtype=tf.bfloat16).tangent_dtype == "bfloat16"
    assert "tangent_dtype" in dataclasses.asdict(RollConfig())
    with pytest.raises(ValueError, match="tangent_dtype='int8'"):
        RollConfig(tangent_dtype="int8")


def test_config_and_keywords_give_the_same_loss(batch):
    model = _mlp()
    want = reference_loss(mlp_groups(model, batch, ["d0"]), 0.25, 50.0)
    config = RollConfig(C=0.25, gamma=50.0)
    for got in (roll.roll_loss(model, batch, C=0.25, gamma=50.0),
                roll.roll_loss(model, batch, config),
                roll.roll_loss(model, batch, RollConfig(C=3.0, gamma=50.0), C=0.25),
                keras_roll.roll_loss(model, batch, config)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
    sq = roll.neuron_grad_sq(model, batch, RollConfig(samples=2), seed=1)
    np.testing.assert_allclose(sq.numpy(), roll.neuron_grad_sq(model, batch, samples=2,
                                                               seed=1).numpy())
    seeded = roll.neuron_grad_sq(model, batch, RollConfig(samples=2, seed=1))
    np.testing.assert_allclose(seeded.numpy(), sq.numpy())  # config.seed is the default seed
    assert roll.memory_plan(model, batch, RollConfig(samples=2)).directions == 2
    assert roll.memory_plan(model, batch, samples=2).directions == 2


@pytest.mark.parametrize("call", ["roll_loss", "wrap", "neuron_grad_sq", "memory_plan"])
def test_positional_hyperparameters_and_unknown_keywords_are_refused(call, batch):
    model = _mlp()
    fn = {"roll_loss": lambda *a, **k: roll.roll_loss(model, batch, *a, **k),
          "wrap": lambda *a, **k: keras_roll.wrap(model, *a, **k),
          "neuron_grad_sq": lambda *a, **k: roll.neuron_grad_sq(model, batch, *a, **k),
          "memory_plan": lambda *a, **k: roll.memory_plan(model, batch, *a, **k)}[call]
    with pytest.raises(TypeError, match="got 1.0; pass the hyperparameters by keyword"):
        fn(1.0)
    with pytest.raises(TypeError, match="Unknown ROLL hyperparameter"):
        fn(gama=50.0)


def test_wrap_and_layer_take_a_config_and_keywords(batch):
    model = _mlp()
    config = RollConfig(lam=0.5, samples=2, seed=3)
    wrapped = keras_roll.wrap(model, config, C=0.25, tangent_dtype="float16")
    layer = wrapped.get_layer("roll_regularizer")
    assert layer.roll_config == dataclasses.replace(config, C=0.25, tangent_dtype="float16")
    assert (layer.lam, layer.C, layer.tangent_dtype) == (0.5, 0.25, "float16")
    direct = keras_roll.RollRegularizer(model, config, gamma=40.0, name="mine")
    assert direct.name == "mine" and direct.gamma == 40.0 and direct.samples == 2
    assert keras_roll.RollRegularizer(model, lam=1.5).roll_config == RollConfig(lam=1.5)


def test_round_trip_keeps_the_config(tmp_path, batch):
    config = RollConfig(lam=0.5, C=0.25, gamma=80.0, samples=2, seed=11, wrt=None,
                        tangent_dtype="bfloat16", memory_budget=2**20)
    wrapped = keras_roll.wrap(_mlp(), config)
    path = os.path.join(tmp_path, "wrapped.keras")
    wrapped.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.get_layer("roll_regularizer").roll_config == config


def test_file_saved_by_the_earlier_code_loads_and_trains(batch):
    """tests/fixtures/wrapped_v0_1.keras: `wrap(tiny, lam=0.5, C=0.25, gamma=80.0, samples=2,
    seed=11, tangent_dtype="float16")` saved by keras_roll 0.1.0 before this refactoring
    (tangent_dtype then stored beside the config's fields)."""
    loaded = keras.saving.load_model(FIXTURE)
    layer = loaded.get_layer("roll_regularizer")
    assert layer.roll_config == RollConfig(lam=0.5, C=0.25, gamma=80.0, samples=2, seed=11,
                                           tangent_dtype="float16")
    assert isinstance(loaded, keras_roll.RollModel)
    y = np.arange(len(batch)) % 3
    hist = loaded.fit(batch, y, batch_size=6, epochs=1, verbose=0).history
    assert np.isfinite(hist["roll_loss"][0]) and hist["roll_loss"][0] > 0
