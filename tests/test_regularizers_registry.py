"""The registry of the regularizer family (`keras_roll.regularizers`): a regularizer
of one's own, registered with `register_regularizer`, trains through `wrap(...).fit`
with the loss a numpy computation from the weights gives; unknown configs are
refused with the registered ones listed; the shared dual norm.
"""

from __future__ import annotations

import collections
import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.geometry import dual_norm
from keras_roll.regularizers import (
    RegularizerConfig,
    TermResult,
    register_regularizer,
    registered_regularizers,
)


@register_regularizer
@dataclasses.dataclass(frozen=True)
class SquaredLogitsConfig(RegularizerConfig):
    """`R(x) = ||z(x)||_2^2`, the squared norm of the logits (the guide's example)."""

    lam: float = 0.01
    on_eval: bool | None = None

    log_name = "logit_norm_loss"

    def term(self, model):
        def logit_norm(x, y, training):
            outputs = model(x, training=training)
            return TermResult(tf.reduce_sum(tf.square(outputs), axis=-1), outputs)

        return logit_norm


def logits_net(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((5,))
    h = keras.layers.Dense(7, activation="relu", name="h",
                           bias_initializer=keras.initializers.RandomNormal(0, 0.3))(inp)
    return keras.Model(inp, keras.layers.Dense(3, name="logits")(h))


def numpy_step(weights, x, y, lam):
    """Loss terms and weight gradients of `mean CE(z, y) + lam * mean ||z||^2` by hand."""
    w1, b1, w2, b2 = [np.float64(w) for w in weights]
    pre = x @ w1 + b1
    h = np.maximum(pre, 0)
    z = h @ w2 + b2
    b = len(x)
    shifted = z - z.max(1, keepdims=True)
    prob = np.exp(shifted) / np.exp(shifted).sum(1, keepdims=True)
    ce = -np.log(prob[np.arange(b), y])
    reg = (z ** 2).sum(1)
    dz = (prob - np.eye(3)[y]) / b + lam * 2 * z / b
    dh = dz @ w2.T * (pre > 0)
    grads = [x.T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]
    return ce.mean(), reg.mean(), grads


def test_a_registered_regularizer_trains_with_the_loss_numpy_gives():
    model = logits_net()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5)).astype("float32")
    y = rng.integers(0, 3, size=16)
    lam, lr = 0.05, 0.1
    wrapped = keras_roll.wrap(model, regularizer=SquaredLogitsConfig(lam=lam))
    assert [layer.name for layer in wrapped.layers][-1] == "logit_norm_regularizer"
    wrapped.compile(keras.optimizers.SGD(lr),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(3):
        before = model.get_weights()
        ce, reg, grads = numpy_step(before, np.float64(x), y, lam)
        logs = wrapped.fit(x, y, batch_size=16, epochs=1, verbose=0).history
        # the logged term and loss are those of the weights before the step
        np.testing.assert_allclose(logs["logit_norm_loss"][0], reg, rtol=1e-5)
        np.testing.assert_allclose(logs["loss"][0], ce + lam * reg, rtol=1e-5)
        # and the step descends their sum: the added loss is in the gradient
        for w_new, w_old, g in zip(model.get_weights(), before, grads):
            np.testing.assert_allclose(w_new, w_old - lr * g, rtol=1e-4, atol=1e-6)
    ce, reg, _ = numpy_step(model.get_weights(), np.float64(x), y, lam)
    result = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    np.testing.assert_allclose(result["logit_norm_loss"], reg, rtol=1e-5)
    np.testing.assert_allclose(result["loss"], ce + lam * reg, rtol=1e-5)
    np.testing.assert_allclose(
        keras_roll.regularizer_loss(model, x, y, SquaredLogitsConfig()).numpy(),
        (np.float64(wrapped.predict(x, verbose=0)) ** 2).sum(1), rtol=1e-5)


def test_a_registered_regularizer_is_saved_and_loaded(tmp_path):
    model = logits_net(1)
    wrapped = keras_roll.wrap(model, regularizer=SquaredLogitsConfig(lam=0.2, on_eval=False))
    path = tmp_path / "logit_norm.keras"
    wrapped.save(path)
    loaded = keras.saving.load_model(path)
    layer = loaded.layers[-1]
    assert layer.config == SquaredLogitsConfig(lam=0.2, on_eval=False)
    x = np.ones((2, 5), "float32")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0),
                               rtol=1e-6)


def test_unknown_configs_are_refused_with_the_registered_ones_listed():
    model = logits_net()
    for call in (lambda: keras_roll.wrap(model, regularizer=object()),
                 lambda: keras_roll.regularizer_loss(model, np.ones((1, 5)), None, "MMR")):
        with pytest.raises(TypeError) as info:
            call()
        for name in ("RollConfig", "MMRConfig", "InputGradientConfig", "IBPConfig",
                     "CrownIBPConfig", "SquaredLogitsConfig"):
            assert name in str(info.value)
    assert set(registered_regularizers()) >= {"RollConfig", "MMRConfig", "SquaredLogitsConfig"}


def test_registration_names_what_a_config_lacks():
    @dataclasses.dataclass(frozen=True)
    class NoLogName(RegularizerConfig):
        lam: float = 1.0
        on_eval: bool | None = None

        def term(self, model):
            return None

    with pytest.raises(TypeError, match="log_name"):
        register_regularizer(NoLogName)

    @dataclasses.dataclass(frozen=True)
    class NoLam:
        on_eval: bool | None = None
        log_name = "x_loss"

    with pytest.raises(TypeError, match=r"\['lam'\]"):
        register_regularizer(NoLam)
    with pytest.raises(TypeError, match="dataclass"):
        register_regularizer(int)

    @dataclasses.dataclass(frozen=True)
    class SquaredLogitsConfig(RegularizerConfig):  # noqa: F811 (the same name, another class)
        lam: float = 1.0
        on_eval: bool | None = None
        log_name = "other_loss"

        def term(self, model):
            return None

    with pytest.raises(TypeError, match="another regularizer config named"):
        register_regularizer(SquaredLogitsConfig)
    with pytest.raises(ValueError, match="lam must be a finite number"):
        SquaredLogitsConfig(lam=-1.0)


@pytest.mark.parametrize("p", [1.0, 2.0, np.inf])
def test_the_dual_norm_matches_numpy_and_has_finite_gradients_at_zero(p):
    g = np.random.default_rng(1).normal(size=(4, 6))
    q = {1.0: np.inf, 2.0: 2, np.inf: 1}[p]
    expected = np.linalg.norm(g, ord=q, axis=-1)
    g = tf.constant(g, tf.float32)
    np.testing.assert_allclose(dual_norm(g, p).numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(dual_norm(g, p, squared=True).numpy(), expected ** 2, rtol=1e-5)
    zero = tf.zeros((2, 6))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(zero)
        norm = tf.reduce_sum(dual_norm(zero, p))
        squared = tf.reduce_sum(dual_norm(zero, p, squared=True))
    for value in (norm, squared):
        assert np.isfinite(tape.gradient(value, zero).numpy()).all()


def test_public_names_are_listed_once():
    counts = collections.Counter(keras_roll.__all__)
    assert [name for name, n in counts.items() if n > 1] == []
    assert all(hasattr(keras_roll, name) for name in keras_roll.__all__)
    assert keras_roll.callbacks.EpsilonRamp(0.1, length=2000).length == 2000


def test_the_generic_loss_is_each_regularizers_own():
    """`regularizer_loss` computes ROLL as `roll_loss` does (MMR and the input gradient
    against numpy: tests/test_regularizers.py), with ROLL's own field check."""
    model = logits_net(2)
    x = np.random.default_rng(3).normal(size=(6, 5)).astype("float32")
    np.testing.assert_allclose(
        keras_roll.regularizer_loss(model, x, None, keras_roll.RollConfig(lam=0.5), C=0.5),
        keras_roll.roll_loss(model, x, C=0.5), rtol=1e-6)
    with pytest.raises(TypeError, match="Unknown ROLL hyperparameter"):
        keras_roll.regularizer_loss(model, x, None, keras_roll.RollConfig(), gama=1.0)
