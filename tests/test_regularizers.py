"""The regularizers beside ROLL: MMR and the input-gradient penalty.

* MMR's distances and loss against numpy computed by hand from the weights of a
  small ReLU network (l1, l2, l_inf; the k_B / k_D smallest), its weight
  gradient against central differences of that numpy loss;
* the input-gradient penalty against the closed-form input gradient of a tanh
  network's cross entropy (numpy) and, with its weight gradient, against nested
  `tf.GradientTape`s;
* `wrap(model, regularizer=...)`: the logs hold the term and `val_loss` is the
  training objective, `.keras` round trip, a two-replica MirroredStrategy step
  equal to one replica (in a fresh interpreter: `tests/_regularizers_distribute.py`),
  clear errors for bad configs, and ROLL's `wrap(model, lam=2, C=1)` unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.regularizers.base import labelled_step
from keras_roll.regularizers.mmr import mmr_distances
from keras_roll.roll.config import RollConfig
from keras_roll.roll.factored import factored_entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NORMS = [1, 2, np.inf]


# ----------------------------------------------------------------------------- MMR by hand


def relu_net(seed=0, d=8, hidden=(6, 5), classes=3):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((d,))
    h = inp
    for i, n in enumerate(hidden):
        h = keras.layers.Dense(n, activation="relu", name=f"d{i}",
                               bias_initializer=keras.initializers.RandomNormal(0, 0.3))(h)
    out = keras.layers.Dense(classes, activation="softmax", name="logits")(h)
    return keras.Model(inp, out)


def numpy_distances(weights, x, y, p):
    """d_B [B, N] and d_D [B, L] (inf for the label) in float64 from the weights."""
    q = {1: np.inf, 2: 2, np.inf: 1}[p]
    pairs = [(np.float64(weights[i]), np.float64(weights[i + 1]))
             for i in range(0, len(weights), 2)]
    h = np.float64(x)
    v = np.broadcast_to(np.eye(x.shape[1]), (len(x), x.shape[1], x.shape[1]))
    d_b = []
    for w, b in pairs[:-1]:
        z = h @ w + b
        g = v @ w                                                  # [B, D, H]
        d_b.append(np.abs(z) / np.linalg.norm(g, ord=q, axis=1))
        s = (z > 0).astype(np.float64)
        h, v = z * s, g * s[:, None, :]
    w, b = pairs[-1]
    logits, g = h @ w + b, v @ w
    rows = np.arange(len(x))
    num = logits[rows, y][:, None] - logits
    den = np.linalg.norm(g[rows, :, y][:, :, None] - g, ord=q, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        d_d = np.where(np.arange(logits.shape[1])[None] == y[:, None], np.inf, num / den)
    return np.concatenate(d_b, axis=1), d_d


def numpy_mmr(weights, x, y, p, k_b, k_d, gamma_b, gamma_d):
    d_b, d_d = numpy_distances(weights, x, y, p)
    rb = np.maximum(0, 1 - np.sort(d_b, axis=1)[:, :k_b] / gamma_b).mean(axis=1)
    db = np.maximum(0, 1 - np.sort(d_d, axis=1)[:, :k_d] / gamma_d).mean(axis=1)
    return rb + db


@pytest.fixture(scope="module")
def relu_case():
    # 8 inputs and 6 units in the first layer: in l2 MMR pushes the 6 rows of a Gram
    # factor of its kernel (fewest_directions) instead of the 8 input axes
    model = relu_net()
    x = np.random.default_rng(1).normal(size=(12, 8)).astype("float32")
    y = np.random.default_rng(2).integers(0, 3, size=12).astype("int32")
    return model, x, y


@pytest.mark.parametrize("fewest", [True, False])
@pytest.mark.parametrize("p", NORMS)
def test_mmr_distances_equal_numpy_by_hand(relu_case, p, fewest):
    model, x, y = relu_case
    ref_b, ref_d = numpy_distances(model.get_weights(), x, y, p)
    lin = keras_roll.linearize(model)
    entry = factored_entry(lin.program, 0)
    assert entry is not None and (entry.units, entry.depth) == (6, 8)  # the factored path runs
    dist = mmr_distances(lin, tf.constant(x), tf.constant(y), float(p), fewest)
    np.testing.assert_allclose(dist.boundary.numpy(), ref_b, rtol=1e-5, atol=1e-6)
    got_d = dist.decision.numpy()
    assert np.array_equal(np.isinf(got_d), np.isinf(ref_d))
    np.testing.assert_allclose(got_d[np.isfinite(got_d)], ref_d[np.isfinite(ref_d)], rtol=1e-5,
                               atol=1e-6)
    assert (ref_d[np.isfinite(ref_d)] < 0).any()  # misclassified examples are covered


@pytest.mark.parametrize("p", NORMS)
@pytest.mark.parametrize("k_b,k_d", [(3, 1), (11, None), (100, 2)])
def test_mmr_loss_equals_numpy_by_hand(relu_case, p, k_b, k_d):
    model, x, y = relu_case
    ref_b, _ = numpy_distances(model.get_weights(), x, y, p)
    gamma_b = 2 * float(np.median(ref_b))  # some hinges active, some not
    gamma_d = 1.5
    got = keras_roll.regularizer_loss(model, x, y, keras_roll.MMRConfig(), p=p, k_B=k_b,
                                      k_D=k_d, gamma_B=gamma_b, gamma_D=gamma_d).numpy()
    k_b_used = min(k_b, ref_b.shape[1])       # 11 neurons: k_B=100 means all of them
    k_d_used = 3 if k_d is None else k_d      # None: every class (the label's hinge is 0)
    ref = numpy_mmr(model.get_weights(), x, y, p, k_b_used, k_d_used, gamma_b, gamma_d)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    # the selection matters: the mean over every distance is another number
    if k_b == 3:
        everything = numpy_mmr(model.get_weights(), x, y, p, 11, k_d_used, gamma_b, gamma_d)
        assert np.max(np.abs(everything - ref)) > 1e-2


def test_mmr_on_the_first_examples_of_a_batch(relu_case):
    """`examples=m`: the term of the first m examples only (numpy on x[:m]); the
    outputs of the whole batch; in `fit` the logged term is their mean."""
    model, x, y = relu_case
    config = keras_roll.MMRConfig(p=2, k_B=3, gamma_B=1.0, gamma_D=1.5, examples=3)
    term = config.term(model)
    result = term(tf.constant(x), tf.constant(y), training=True)
    ref = numpy_mmr(model.get_weights(), x[:3], y[:3], 2, 3, 3, 1.0, 1.5)
    np.testing.assert_allclose(result.per_example.numpy(), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result.outputs.numpy(), model(x).numpy(), rtol=1e-6)
    # more examples asked than the batch has: every example
    whole = keras_roll.MMRConfig(p=2, k_B=3, gamma_B=1.0, gamma_D=1.5, examples=100)
    np.testing.assert_allclose(
        whole.term(model)(tf.constant(x), tf.constant(y), training=True).per_example.numpy(),
        numpy_mmr(model.get_weights(), x, y, 2, 3, 3, 1.0, 1.5), rtol=1e-5, atol=1e-6)


def test_mmr_accepts_one_hot_labels(relu_case):
    model, x, y = relu_case
    sparse = keras_roll.regularizer_loss(model, x, y, keras_roll.MMRConfig(k_B=3)).numpy()
    one_hot = keras_roll.regularizer_loss(model, x, np.eye(3, dtype="float32")[y],
                                          keras_roll.MMRConfig(k_B=3)).numpy()
    np.testing.assert_array_equal(sparse, one_hot)


@pytest.mark.parametrize("p,fewest", [(1, True), (2, True), (2, False), (np.inf, True)])
def test_mmr_weight_gradient_equals_central_differences(relu_case, p, fewest):
    model, x, y = relu_case
    config = keras_roll.MMRConfig(p=p, k_B=4, k_D=2, gamma_B=1.0, gamma_D=2.0,
                                  fewest_directions=fewest)
    with tf.GradientTape() as tape:
        reg = tf.reduce_mean(keras_roll.regularizer_loss(model, x, y, config))
    grads = tape.gradient(reg, model.trainable_variables)
    weights = [np.float64(w) for w in model.get_weights()]
    rng = np.random.default_rng(3)
    eps = 1e-5
    for i, (w, g) in enumerate(zip(weights, grads)):
        for _ in range(4):
            idx = tuple(rng.integers(0, s) for s in w.shape)
            plus, minus = [list(weights) for _ in range(2)]
            plus[i], minus[i] = w.copy(), w.copy()
            plus[i][idx] += eps
            minus[i][idx] -= eps
            args = (x, y, p, 4, 2, 1.0, 2.0)
            fd = (numpy_mmr(plus, *args).mean() - numpy_mmr(minus, *args).mean()) / (2 * eps)
            assert g.numpy()[idx] == pytest.approx(fd, rel=2e-3, abs=2e-4), (i, idx)


def test_mmr_region_distance_is_the_certified_margin(relu_case):
    # k_B = 1 and a gamma above every distance: the hinge is 1 - eps_p(x) / gamma, where
    # eps_p is the real-arithmetic margin certify reports (rigor="float32").
    model, x, y = relu_case
    cert = keras_roll.certify(model, x, norms=(1, 2, np.inf), rigor="float32")
    for p in NORMS:
        dist = mmr_distances(keras_roll.linearize(model), tf.constant(x), tf.constant(y),
                             float(p))
        np.testing.assert_allclose(np.min(dist.boundary.numpy(), axis=1),
                                   np.asarray(cert.margins[p]), rtol=1e-5)


# ----------------------------------------------------------------------------- input gradient


def tanh_net(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh", name="h")(inp)
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax", name="out")(h))


def numpy_input_gradient(model, x, y):
    """grad_x of the cross entropy of a Dense-tanh-Dense-softmax net, by hand."""
    w1, b1, w2, b2 = [np.float64(w) for w in model.get_weights()]
    h = np.tanh(x @ w1 + b1)
    logits = h @ w2 + b2
    prob = np.exp(logits - logits.max(1, keepdims=True))
    prob /= prob.sum(1, keepdims=True)
    delta = prob - np.eye(3)[y]                              # dCE / dlogits
    return ((delta @ w2.T) * (1 - h ** 2)) @ w1.T


@pytest.mark.parametrize("p", NORMS)
def test_input_gradient_penalty_equals_numpy_and_nested_tapes(p):
    model = tanh_net()
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.integers(0, 3, size=8).astype("int32")
    g = numpy_input_gradient(model, x, y)
    q = {1: np.inf, 2: 2, np.inf: 1}[p]
    ref = np.linalg.norm(g, ord=q, axis=1) ** 2
    config = keras_roll.InputGradientConfig(p=p, loss="sparse_categorical_crossentropy")
    with tf.GradientTape() as tape:
        got = keras_roll.regularizer_loss(model, x, y, config)
        mean = tf.reduce_mean(got)
    grads = tape.gradient(mean, model.trainable_variables)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-7)

    xt = tf.constant(x)
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            inner.watch(xt)
            ce = tf.reduce_sum(keras.losses.sparse_categorical_crossentropy(y, model(xt)))
        gx = inner.gradient(ce, xt)
        norms = {1: tf.reduce_max(tf.abs(gx), 1), 2: tf.norm(gx, axis=1),
                 np.inf: tf.reduce_sum(tf.abs(gx), 1)}[p]
        ref_mean = tf.reduce_mean(tf.square(norms))
    ref_grads = outer.gradient(ref_mean, model.trainable_variables)
    assert float(ref_mean) == pytest.approx(float(mean), rel=1e-5)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
    assert max(float(tf.reduce_max(tf.abs(a))) for a in grads) > 1e-3


# ----------------------------------------------------------------------------- wrap


def small_data(n=24, seed=5):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, size=n).astype("int32")


CONFIGS = [keras_roll.MMRConfig(lam=0.5, p="inf", k_B=3, gamma_B=0.5, gamma_D=0.5),
           keras_roll.InputGradientConfig(lam=0.5, p=2)]


def wrapped_model(config):
    model = relu_net()
    wrapped = keras_roll.wrap(model, regularizer=config)
    wrapped.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    return model, wrapped


def reference_term(model, x, y, config):
    if isinstance(config, keras_roll.MMRConfig):
        return keras_roll.regularizer_loss(model, x, y, config).numpy()
    return keras_roll.regularizer_loss(model, x, y, config,
                                       loss="sparse_categorical_crossentropy").numpy()


@pytest.mark.parametrize("config", CONFIGS, ids=["mmr", "input_gradient"])
def test_logs_hold_the_term_and_val_loss_is_the_objective(config):
    model, wrapped = wrapped_model(config)
    x, y = small_data()
    hist = wrapped.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(x, y))
    name = config.log_name
    assert set(hist.history) == {"loss", name, "val_loss", f"val_{name}"}
    term = reference_term(model, x, y, config).mean()
    ce = keras.losses.sparse_categorical_crossentropy(y, model(x)).numpy().mean()
    assert hist.history[f"val_{name}"][-1] == pytest.approx(term, rel=1e-4)
    assert hist.history["val_loss"][-1] == pytest.approx(ce + config.lam * term, rel=1e-4)
    assert term > 1e-3
    # predict only runs the model
    np.testing.assert_allclose(wrapped.predict(x, verbose=0), model(x).numpy(), rtol=1e-5,
                               atol=1e-6)


def test_on_eval_false_computes_the_term_in_training_only():
    config = keras_roll.InputGradientConfig(lam=0.5, on_eval=False)
    model, wrapped = wrapped_model(config)
    x, y = small_data()
    logs = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    ce = keras.losses.sparse_categorical_crossentropy(y, model(x)).numpy().mean()
    assert np.isnan(logs["input_gradient_loss"])          # "not computed", never 0
    assert logs["loss"] == pytest.approx(ce, rel=1e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=["mmr", "input_gradient"])
def test_keras_round_trip(config, tmp_path):
    model, wrapped = wrapped_model(config)
    x, y = small_data()
    wrapped.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "wrapped.keras"
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, keras_roll.RollModel)
    layer = loaded.layers[-1]
    assert isinstance(layer, keras_roll.SupervisedRegularizer)
    assert layer.config == config
    np.testing.assert_allclose(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0),
                               rtol=1e-6)
    before = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    after = loaded.evaluate(x, y, verbose=0, return_dict=True)
    assert after == pytest.approx(before, rel=1e-5)
    assert keras_roll.unwrap(loaded) is layer.inner_model


def two_replica_cases(tmp_path, *names) -> dict:
    """Runs tests/_regularizers_distribute.py for `names` in a fresh interpreter and
    checks, per regularizer, that two replicas take the step one replica takes;
    returns the report's cases."""
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests",
                                                        "_regularizers_distribute.py"),
                           str(out), *names], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["replicas"] == 2
    for name in names:
        case = report[name]
        # the regularizer moves the weights by far more than the tolerance, so an
        # add_loss that Keras did not scale by 1 / replicas would fail here
        assert case["reg_update"] > 1e-2, name
        assert case["weight_diff"] <= 1e-6 + 1e-4 * case["reg_update"], name
        assert case["loss"][1] == pytest.approx(case["loss"][0], rel=1e-5), name
        assert case["term"][1] == pytest.approx(case["term"][0], rel=1e-5), name
    return {name: report[name] for name in names}


@pytest.mark.slow  # a fresh interpreter with two logical CPU devices, as ROLL's own
def test_two_replicas_step_equals_one_replica(tmp_path):
    two_replica_cases(tmp_path, "mmr", "input_gradient")


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("cls,kwargs,match", [
    (keras_roll.MMRConfig, {"p": 3}, "p must be 1, 2 or inf"),
    (keras_roll.MMRConfig, {"k_B": 0}, "k_B=0"),
    (keras_roll.MMRConfig, {"k_B": 2.5}, "k_B=2.5"),
    (keras_roll.MMRConfig, {"k_D": 0}, "or None"),
    (keras_roll.MMRConfig, {"examples": 0}, "examples per batch"),
    (keras_roll.MMRConfig, {"gamma_B": 0.0}, "gamma_B=0.0"),
    (keras_roll.MMRConfig, {"gamma_D": float("inf")}, "gamma_D=inf"),
    (keras_roll.MMRConfig, {"lam": -1.0}, "lam=-1.0"),
    (keras_roll.MMRConfig, {"on_eval": True}, "on_eval=True"),
    (keras_roll.MMRConfig, {"fewest_directions": 1}, "fewest_directions=1"),
    (keras_roll.InputGradientConfig, {"p": "l3"}, "p='l3'"),
    (keras_roll.InputGradientConfig, {"lam": float("nan")}, "lam=nan"),
    (keras_roll.InputGradientConfig, {"loss": "no_such_loss"}, "not a Keras loss"),
    (keras_roll.InputGradientConfig, {"loss": 3}, "loss=3"),
])
def test_bad_config_values_are_refused(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_wrap_refuses_unknown_fields_and_two_configs():
    model = relu_net()
    with pytest.raises(TypeError, match="Unknown MMRConfig field"):
        keras_roll.wrap(model, regularizer=keras_roll.MMRConfig(), C=1.0)
    with pytest.raises(TypeError, match="once"):
        keras_roll.wrap(model, RollConfig(), regularizer=keras_roll.MMRConfig())
    with pytest.raises(TypeError, match=r"registered regularizer, one of \[.*'InputGradientConfig"
                                         r".*'MMRConfig'.*'RollConfig'"):
        keras_roll.wrap(model, regularizer={"lam": 1.0})
    wrapped = keras_roll.wrap(model, regularizer=keras_roll.MMRConfig(), k_B=7)
    assert wrapped.layers[-1].config.k_B == 7


def test_mmr_needs_two_logits_and_labels():
    inp = keras.Input((8,))
    one = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(
        keras.layers.Dense(3, activation="relu")(inp)))
    with pytest.raises(ValueError, match="at least 2 output logits"):
        keras_roll.wrap(one, regularizer=keras_roll.MMRConfig())
    _, wrapped = wrapped_model(CONFIGS[0])
    x, y = small_data()
    with pytest.raises(ValueError, match="needs the labels"):
        wrapped(x, training=True)
    with labelled_step(np.zeros((24, 2, 2)), None), pytest.raises(ValueError,
                                                                  match="one class per"):
        wrapped(x, training=True)


# ----------------------------------------------------------------------------- ROLL unchanged


def test_wrap_lam_c_is_still_roll():
    model = relu_net()
    wrapped = keras_roll.wrap(model, lam=2, C=1)
    layer = wrapped.layers[-1]
    assert isinstance(wrapped, keras_roll.RollModel)
    assert isinstance(layer, keras_roll.RollRegularizer)
    assert layer.roll_config == RollConfig(lam=2.0, C=1.0)
    same = keras_roll.wrap(relu_net(), regularizer=RollConfig(lam=2, C=1))
    assert same.layers[-1].roll_config == layer.roll_config
    x, y = small_data()
    wrapped.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
    logs = wrapped.evaluate(x, y, verbose=0, return_dict=True)
    roll = keras_roll.roll_loss(model, x, C=1.0).numpy().mean()
    assert set(logs) == {"loss", "roll_loss"}
    assert logs["roll_loss"] == pytest.approx(roll, rel=1e-5)
