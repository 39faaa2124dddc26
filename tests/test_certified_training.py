"""Certified training by bound passes: IBP and CROWN-IBP (`keras_roll.regularizers.certified`).

* the worst-case logits against interval bound propagation written by hand in numpy
  (Gowal et al.: boxes through the layers, the margins folded into the last Dense;
  the margins of every class pair, or each example's when they do not fit the budget),
  against `robust_radius`'s passes (`keras_roll.robust.interval_bounds`), and, on a
  2-D net, against brute force over a fine grid of the l_inf box (never above the
  true minimum of any margin);
* the loss and `val_loss` against the paper's objective computed by hand from the
  numpy bounds;
* the certified accuracy training reports at `eps` against what `robust_radius`
  (method "interval") certifies for the trained model;
* `on_eval=False`: `evaluate` is the compiled loss, the term and certified accuracy NaN;
* the ramps against their schedules; a two-replica MirroredStrategy step equal to
  one replica (in a fresh interpreter: `tests/_certified_distribute.py`); `.keras`
  round trip; clear errors for bad eps / kappa / beta.
"""

from __future__ import annotations

import dataclasses
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.callbacks import BetaRamp, EpsilonRamp, KappaRamp
from keras_roll.robust.bounds import interval_bounds
from tests.test_regularizers import two_replica_cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def relu_net(seed=0, d=4, hidden=(8, 6), classes=3):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((d,))
    h = inp
    for i, n in enumerate(hidden):
        h = keras.layers.Dense(n, activation="relu", name=f"d{i}",
                               bias_initializer=keras.initializers.RandomNormal(0, 0.3))(h)
    out = keras.layers.Dense(classes, activation="softmax", name="logits")(h)
    return keras.Model(inp, out)


def small_data(n=24, d=4, seed=5):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype("float32"), rng.integers(0, 3, size=n).astype("int32")


def dense_weights(model):
    return [(layer.kernel.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64))
            for layer in model.layers if isinstance(layer, keras.layers.Dense)]


def numpy_logits(model, x):
    h = np.asarray(x, np.float64)
    weights = dense_weights(model)
    for w, b in weights[:-1]:
        h = np.maximum(h @ w + b, 0)
    w, b = weights[-1]
    return h @ w + b


def numpy_ibp(model, x, y, eps):
    """`[B, L]` interval lower bounds of `z_y - z_j` over the l_inf box (Gowal et al.)."""
    weights = dense_weights(model)
    lo, hi = np.asarray(x, np.float64) - eps, np.asarray(x, np.float64) + eps
    for w, b in weights[:-1]:
        mid, rad = (hi + lo) / 2, (hi - lo) / 2
        mid, rad = mid @ w + b, rad @ np.abs(w)
        lo, hi = np.maximum(mid - rad, 0), np.maximum(mid + rad, 0)
    w, b = weights[-1]
    mid, rad = (hi + lo) / 2, (hi - lo) / 2
    out = np.zeros((len(y), w.shape[1]))
    for i, label in enumerate(y):
        c = w[:, label][:, None] - w                       # [H, L]: z_y - z_j
        out[i] = mid[i] @ c + (b[label] - b) - rad[i] @ np.abs(c)
        out[i, label] = 0.0
    return out


def logsumexp(z):
    m = z.max(-1, keepdims=True)
    return (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[:, 0]


# ----------------------------------------------------------------------------- the bounds


def test_ibp_worst_case_logits_equal_numpy_and_robust_passes():
    model = relu_net()
    x, y = small_data()
    worst = keras_roll.worst_case_logits(model, x, y, 0.1)
    np.testing.assert_allclose(worst.lower.numpy(), numpy_ibp(model, x, y, 0.1), rtol=1e-4,
                               atol=1e-5)
    passes = interval_bounds(model, x, 0.1, y)
    np.testing.assert_allclose(worst.lower.numpy(), passes.lower.numpy(), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(worst.logits.numpy(), numpy_logits(model, x), rtol=1e-4,
                               atol=1e-5)
    certified = (numpy_ibp(model, x, y, 0.1) + np.eye(3)[y] > 0).all(-1)
    np.testing.assert_array_equal(worst.certified.numpy(), certified)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_margins_without_the_class_pairs_are_the_same(beta):
    """Where the functionals of every pair of classes would not fit the twin's memory
    budget, each example's L - 1 rows are bounded instead: the same bounds (against the
    numpy intervals too)."""
    model = relu_net()
    x, y = small_data()
    pairs = keras_roll.worst_case_logits(model, x, y, 0.1, beta=beta)
    rows = keras_roll.worst_case_logits(keras_roll.linearize(model, memory_budget=16), x, y,
                                        0.1, beta=beta)
    np.testing.assert_allclose(rows.lower.numpy(), pairs.lower.numpy(), rtol=1e-6, atol=1e-6)
    if beta == 0.0:
        np.testing.assert_allclose(rows.lower.numpy(), numpy_ibp(model, x, y, 0.1), rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("beta", [pytest.param(1.0, marks=pytest.mark.slow), 0.3])  # 0.3: both
def test_crown_ibp_worst_case_logits_mix_the_robust_passes(beta):
    model = relu_net()
    x, y = small_data()
    worst = keras_roll.worst_case_logits(model, x, y, 0.2, beta=beta)
    crown = interval_bounds(model, x, 0.2, y, method="crown_ibp").lower.numpy()
    ibp = interval_bounds(model, x, 0.2, y).lower.numpy()
    np.testing.assert_allclose(worst.lower.numpy(), beta * crown + (1 - beta) * ibp,
                               rtol=1e-5, atol=1e-6)


def test_a_zero_beta_variable_gives_the_intervals():
    model = relu_net()
    x, y = small_data()
    at_zero = keras_roll.worst_case_logits(model, x, y, 0.2, beta=tf.Variable(0.0))
    np.testing.assert_allclose(at_zero.lower.numpy(), numpy_ibp(model, x, y, 0.2), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("beta", [  # a mix of both: test_crown_ibp_worst_case_logits_mix_...
    0.0, pytest.param(0.5, marks=pytest.mark.slow), 1.0])
def test_bounds_never_exceed_the_brute_force_minimum_on_a_2d_net(beta):
    model = relu_net(seed=3, d=2, hidden=(10, 10))
    x, y = small_data(n=6, d=2, seed=1)
    eps = 0.25
    worst = keras_roll.worst_case_logits(model, x, y, eps, beta=beta).lower.numpy()
    grid = np.linspace(-eps, eps, 201)
    offsets = np.stack(np.meshgrid(grid, grid), -1).reshape(-1, 2)
    for i in range(len(x)):
        z = numpy_logits(model, x[i] + offsets)                  # [G, L]
        true_min = (z[:, y[i]][:, None] - z).min(0)               # [L]
        assert (worst[i] <= true_min + 1e-5).all(), (i, worst[i], true_min)
        others = np.arange(3) != y[i]
        assert np.isfinite(worst[i]).all() and (true_min[others] - worst[i][others] < 50).all()


# ----------------------------------------------------------------------------- the loss


def wrapped_model(config, model=None):
    model = model or relu_net()
    wrapped = keras_roll.wrap(model, regularizer=config)
    wrapped.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    return model, wrapped


def test_loss_and_val_loss_are_the_papers_objective():
    config = keras_roll.IBPConfig(eps=0.15, kappa=0.3)
    model, wrapped = wrapped_model(config)
    x, y = small_data()
    logs = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    z = numpy_logits(model, x)
    clean = logsumexp(z) - z[np.arange(len(y)), y]
    robust = logsumexp(-numpy_ibp(model, x, y, 0.15))
    assert logs["ibp_loss"] == pytest.approx(np.mean(0.7 * (robust - clean)), rel=1e-4)
    assert logs["loss"] == pytest.approx(np.mean(0.3 * clean + 0.7 * robust), rel=1e-4)
    assert logs["ibp_loss"] > 1e-2
    hist = wrapped.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(x, y))
    assert set(hist.history) == {"loss", "ibp_loss", "certified_accuracy", "val_loss",
                                 "val_ibp_loss", "val_certified_accuracy"}
    np.testing.assert_allclose(wrapped.predict(x, verbose=0), model(x).numpy(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.graph  # 45 training steps: faster compiled
def test_reported_certified_accuracy_is_what_robust_radius_certifies():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(96, 2)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.4).astype("int32")
    model = relu_net(seed=1, d=2, hidden=(16, 16))
    eps = 0.05
    _, wrapped = wrapped_model(keras_roll.IBPConfig(eps=eps, kappa=0.5), model)
    wrapped.compile(keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy")
    wrapped.fit(x, y, batch_size=32, epochs=15, verbose=0,
                callbacks=[EpsilonRamp(eps, length=20)])
    reported = wrapped.evaluate(x, y, batch_size=96, verbose=0,
                                return_dict=True)["certified_accuracy"]
    radius = keras_roll.robust_radius(model, x, y, norms=(np.inf,), method="interval")
    by_radius = radius.lower[np.inf] >= eps
    assert 0.2 < reported < 1.0
    # the searches' brackets decide at eps only up to their tolerance
    margin = numpy_ibp(model, x, y, eps) + 1e9 * np.eye(3)[y]
    clear = np.abs(margin.min(-1)) > 1e-4
    by_bounds = (margin.min(-1) > 0)
    np.testing.assert_array_equal(by_radius[clear], by_bounds[clear])
    assert reported == pytest.approx(by_radius.mean(), abs=(~clear).sum() / len(x) + 1e-6)


def test_on_eval_false_leaves_evaluate_to_the_compiled_loss():
    model, wrapped = wrapped_model(keras_roll.IBPConfig(eps=0.1, on_eval=False))
    x, y = small_data()
    logs = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    z = numpy_logits(model, x)
    assert logs["loss"] == pytest.approx(np.mean(logsumexp(z) - z[np.arange(len(y)), y]),
                                         rel=1e-4)
    assert np.isnan(logs["ibp_loss"]) and np.isnan(logs["certified_accuracy"])


# ----------------------------------------------------------------------------- ramps


class Recorder(keras.callbacks.Callback):
    def __init__(self, term, per_epoch=False):
        super().__init__()
        self.term, self.seen = term, []
        self.per_epoch = per_epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not self.per_epoch or batch == 0:
            self.seen.append((float(self.term.eps.numpy()), float(self.term.kappa.numpy()),
                              float(self.term.beta.numpy())))


def test_ramps_reach_their_targets_on_schedule():
    config = keras_roll.CrownIBPConfig(eps=0.2, kappa=0.0, beta=0.0)
    model, wrapped = wrapped_model(config)
    x, y = small_data(n=32)
    term = wrapped.layers[-1].term
    rec = Recorder(term)
    ramps = [EpsilonRamp(0.2, length=4, begin=2), KappaRamp(1.0, 0.5, length=2, begin=1),
             BetaRamp(1.0, 0.0, length=4, begin=2)]
    wrapped.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[*ramps, rec])
    eps, kappa, beta = (np.array(v) for v in zip(*rec.seen))
    np.testing.assert_allclose(eps, [0, 0, 0, 0.05, 0.1, 0.15, 0.2, 0.2], atol=1e-7)
    np.testing.assert_allclose(kappa, [1, 1, 0.75, 0.5, 0.5, 0.5, 0.5, 0.5], atol=1e-7)
    np.testing.assert_allclose(beta, [1, 1, 1, 0.75, 0.5, 0.25, 0, 0], atol=1e-7)


def test_epoch_ramp():
    model, wrapped = wrapped_model(keras_roll.IBPConfig(eps=0.1))
    x, y = small_data(n=16)
    term = wrapped.layers[-1].term
    rec = Recorder(term, per_epoch=True)
    wrapped.fit(x, y, batch_size=8, epochs=4, verbose=0,
                callbacks=[EpsilonRamp(0.3, length=2, per="epoch"), rec])
    np.testing.assert_allclose([s[0] for s in rec.seen], [0, 0.15, 0.3, 0.3], atol=1e-7)


# ----------------------------------------------------------------------------- distribute, saving


@pytest.mark.slow  # a fresh interpreter with two logical CPU devices, as ROLL's own
def test_two_replicas_step_equals_one_replica(tmp_path):
    for name, case in two_replica_cases(tmp_path, "ibp", "crown_ibp").items():
        assert case["certified"][1] == pytest.approx(case["certified"][0], abs=1e-7), name


@pytest.mark.parametrize("config", [  # CrownIBPConfig extends IBPConfig: the crown_ibp case
    pytest.param(keras_roll.IBPConfig(eps=0.1, kappa=0.4, p=2), marks=pytest.mark.slow),
    keras_roll.CrownIBPConfig(eps=0.1, beta=0.5)], ids=["ibp", "crown_ibp"])
def test_keras_round_trip(config, tmp_path):
    model, wrapped = wrapped_model(config)
    x, y = small_data()
    wrapped.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "wrapped.keras"
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    layer = loaded.layers[-1]
    assert isinstance(layer, keras_roll.SupervisedRegularizer)
    assert layer.config == config and type(layer.config) is type(config)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0),
                               rtol=1e-6)
    before = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    after = loaded.evaluate(x, y, verbose=0, return_dict=True)
    assert after == pytest.approx(before, rel=1e-5)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("make,match", [
    (lambda: keras_roll.IBPConfig(eps=-0.1), "eps=-0.1"),
    (lambda: keras_roll.IBPConfig(eps=float("nan")), "eps=nan"),
    (lambda: keras_roll.IBPConfig(eps="0.1"), "eps='0.1'"),
    (lambda: keras_roll.IBPConfig(kappa=1.5), "kappa=1.5"),
    (lambda: keras_roll.IBPConfig(p=3), "p must be 1, 2 or inf"),
    (lambda: keras_roll.CrownIBPConfig(beta=-0.1), "beta=-0.1"),
    (lambda: keras_roll.CrownIBPConfig(lam=-1), "lam=-1"),
    (lambda: EpsilonRamp(-1.0, length=3), "end=-1.0"),
    (lambda: KappaRamp(1.0, 2.0, length=3), "end=2.0"),
    (lambda: BetaRamp(1.0, 0.0, length=-1), "length=-1"),
    (lambda: EpsilonRamp(0.1, length=3, per="batch"), "per='batch'"),
])
def test_bad_values_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_ramps_need_a_certified_term():
    _, wrapped = wrapped_model(keras_roll.InputGradientConfig(lam=0.1))
    x, y = small_data(n=8)
    with pytest.raises(ValueError, match="no such term"):
        wrapped.fit(x, y, verbose=0, callbacks=[EpsilonRamp(0.1, length=3)])
    _, wrapped = wrapped_model(keras_roll.IBPConfig())
    with pytest.raises(ValueError, match="no CROWN-IBP term"):
        wrapped.fit(x, y, verbose=0, callbacks=[BetaRamp(1.0, 0.0, length=3)])


def test_eps_in_the_units_of_a_leading_rescaling():
    """wrt="rescale": eps in [0, 1] pixels for a model of 0-255 pixels equals eps on the
    same network without its Rescaling fed x / 255."""
    plain = relu_net(seed=3, d=4, hidden=(8, 6))
    inp = keras.Input((4,))
    h = keras.layers.Rescaling(1 / 255, name="rescale")(inp)
    for layer in plain.layers[1:]:
        h = layer(h)
    scaled = keras.Model(inp, h)
    x, y = small_data(n=16)
    pixels = (np.abs(x) * 255).astype("float32")
    for config in (keras_roll.IBPConfig(eps=0.1, kappa=0.0),
                   keras_roll.CrownIBPConfig(eps=0.1, beta=0.5)):
        ours = dataclasses.replace(config, wrt="rescale").term(scaled)(
            tf.constant(pixels), tf.constant(y), training=False).per_example.numpy()
        ref = config.term(plain)(tf.constant(pixels / 255), tf.constant(y),
                                 training=False).per_example.numpy()
        np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=1e-6)
        assert np.all(ref > 0)
        in_pixels = config.term(scaled)(tf.constant(pixels), tf.constant(y),
                                        training=False).per_example.numpy()
        assert np.all(in_pixels < ref)          # eps 0.1 of a 0-255 pixel is much less
    with pytest.raises(ValueError, match="nosuch"):
        keras_roll.IBPConfig(wrt="nosuch").term(scaled)
    with pytest.raises(ValueError, match="wrt=3"):
        keras_roll.IBPConfig(wrt=3)


def test_one_output_models_are_refused():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    with pytest.raises(ValueError, match="one logit per class"):
        keras_roll.wrap(model, regularizer=keras_roll.IBPConfig())
