"""Targets, baselines, streams, Riemann rules and models that are not piecewise linear,
for saliency and integrated gradients, against tf.GradientTape on the Keras model."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.attribution import integrated_gradients, saliency
from keras_roll.attribution.integrated import riemann_points


def _relu_model(dtype="float64", in_dim=6, width=10, out=3, seed=0):
    keras.utils.set_random_seed(seed)
    bias = keras.initializers.RandomNormal(stddev=0.5)
    inp = keras.Input((in_dim,), dtype=dtype)
    h = keras.layers.Dense(width, activation="relu", bias_initializer=bias, dtype=dtype)(inp)
    h = keras.layers.Dense(width, activation="relu", bias_initializer=bias, dtype=dtype)(h)
    logits = keras.layers.Dense(out, bias_initializer=bias, dtype=dtype)(h)
    probs = keras.layers.Activation("softmax", dtype=dtype)(logits)
    return keras.Model(inp, probs), keras.Model(inp, logits)


def _smooth_model(fused: bool, dtype="float64", in_dim=6, out=3, seed=1):
    """tanh and gelu hidden layers: not piecewise linear."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((in_dim,), dtype=dtype)
    h = keras.layers.Dense(8, activation="tanh", dtype=dtype, name="smooth_tanh")(inp)
    h = keras.layers.Dense(8, activation="gelu", dtype=dtype)(h)
    if fused:  # the link inside the last Dense layer
        head = keras.layers.Dense(out, activation="softmax", dtype=dtype, name="head")
        probs = head(h)
        plain = keras.layers.Dense(out, dtype=dtype)
        logits = plain(h)
        plain.set_weights(head.get_weights())
    else:
        logits = keras.layers.Dense(out, dtype=dtype)(h)
        probs = keras.layers.Activation("softmax", dtype=dtype)(logits)
    return keras.Model(inp, probs), keras.Model(inp, logits)


def _tape(logits_model, x, weights):
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        total = tf.reduce_sum(logits_model(xt) * weights)
    return tape.gradient(total, xt).numpy()


@pytest.fixture(scope="module")
def relu():
    model, logits = _relu_model()
    x = np.random.default_rng(0).uniform(-1, 1, (4, 6))
    return model, logits, x


# ---------------------------------------------------------------------- Riemann rules


def test_riemann_points_by_hand():
    t, w = riemann_points(4, "trapezoid")
    np.testing.assert_allclose(t, [0, 1 / 3, 2 / 3, 1])
    np.testing.assert_allclose(w, [1 / 6, 1 / 3, 1 / 3, 1 / 6])
    np.testing.assert_allclose(riemann_points(4, "right")[0], [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(riemann_points(4, "left")[0], [0.0, 0.25, 0.5, 0.75])
    np.testing.assert_allclose(riemann_points(2, "midpoint")[0], [0.25, 0.75])
    with pytest.raises(ValueError, match="rule must be one of"):
        riemann_points(4, "simpson")
    with pytest.raises(ValueError, match="needs steps >= 2"):
        riemann_points(1, "trapezoid")


@pytest.mark.parametrize("rule", ["right", "left", "midpoint", "trapezoid"])
def test_riemann_rules_equal_a_tape_sum(relu, rule):
    model, logits, x = relu
    y = np.array([0, 1, 2, 0])
    base = np.full(6, 0.25)
    ig = integrated_gradients(model, x, y, baseline=base, steps=7, rule=rule, verbose=False)
    t, w = riemann_points(7, rule)
    want = np.zeros_like(x)
    onehot = np.eye(3)[y]
    for ti, wi in zip(t, w):
        want += wi * _tape(logits, base + ti * (x - base), onehot)
    np.testing.assert_allclose(ig.maps, (x - base) * want, rtol=1e-12, atol=1e-14)
    assert ig.rule == rule and ig.steps == 7 and ig.method == "riemann"


def test_riemann_chunks_do_not_change_the_sum(relu):
    model, _, x = relu
    full = integrated_gradients(model, x, steps=64, verbose=False).maps
    small = integrated_gradients(model, x, steps=64, memory_budget=20_000,
                                 verbose=False).maps
    np.testing.assert_allclose(small, full, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------- targets


def test_multi_hot_targets_sum_the_logits(relu):
    model, logits, x = relu
    hot = np.array([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1]], float)
    sal = saliency(model, x, hot)
    np.testing.assert_allclose(sal.gradient, _tape(logits, x, hot), rtol=1e-12)
    np.testing.assert_array_equal(sal.labels, [-1, -1, -1, -1])
    exact = integrated_gradients(model, x, hot, verbose=False)
    parts = sum(integrated_gradients(model, x, np.full(4, c), verbose=False).maps
                * hot[:, c:c + 1] for c in range(3))
    np.testing.assert_allclose(exact.maps, parts, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(exact.delta, 0, atol=1e-12)


def test_one_hot_and_integer_targets_agree(relu):
    model, _, x = relu
    y = np.array([2, 0, 1, 2])
    by_label = saliency(model, x, y)
    by_one_hot = saliency(model, x, np.eye(3)[y])
    np.testing.assert_array_equal(by_one_hot.gradient, by_label.gradient)
    np.testing.assert_array_equal(by_one_hot.labels, y)
    same_class = saliency(model, x, 1)
    np.testing.assert_array_equal(same_class.labels, [1, 1, 1, 1])
    with pytest.raises(ValueError, match="rows without any target class"):
        saliency(model, x, np.zeros((4, 3)))
    with pytest.raises(ValueError, match=r"y must be in \[0, 3\)"):
        saliency(model, x, 3)


def test_baselines_scalar_one_example_or_per_example(relu):
    model, _, x = relu
    a = integrated_gradients(model, x, 0, baseline=0.5, verbose=False)
    b = integrated_gradients(model, x, 0, baseline=np.full(6, 0.5), verbose=False)
    np.testing.assert_array_equal(a.maps, b.maps)
    per = np.random.default_rng(3).uniform(-1, 1, x.shape)
    c = integrated_gradients(model, x, 0, baseline=per, verbose=False)
    for i in range(len(x)):
        one = integrated_gradients(model, x[i:i + 1], 0, baseline=per[i], verbose=False)
        np.testing.assert_allclose(c.maps[i], one.maps[0], rtol=1e-12,
                                   atol=1e-15)


# ---------------------------------------------------------------------- streams


def test_datasets_and_generators_give_the_array_results(relu):
    model, logits, x = relu
    y = np.array([0, 2, 1, 1])
    want = saliency(model, x, y).gradient
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(3)
    got = saliency(model, ds)  # the dataset's labels are the targets
    np.testing.assert_array_equal(got.gradient, want)
    np.testing.assert_array_equal(got.labels, y)
    gen = (row for row in x)  # single unlabelled examples: the predicted class
    pred = logits(x).numpy().argmax(axis=1)
    np.testing.assert_array_equal(saliency(model, gen).labels, pred)
    ig_ds = integrated_gradients(model, ds, steps=5, verbose=False)
    ig = integrated_gradients(model, x, y, steps=5, verbose=False)
    np.testing.assert_array_equal(ig_ds.maps, ig.maps)
    radius = keras_roll.stable_radius(model, tf.data.Dataset.from_tensor_slices(x).batch(2),
                                      verbose=False)
    np.testing.assert_array_equal(radius[2], keras_roll.stable_radius(model, x,
                                                                      verbose=False)[2])


# ---------------------------------------------------------------------- not piecewise linear


@pytest.mark.parametrize("fused", [False, True])
def test_smooth_models_use_the_tape(fused):
    model, logits = _smooth_model(fused)
    x = np.random.default_rng(1).uniform(-1, 1, (3, 6))
    y = np.array([0, 2, 1])
    onehot = np.eye(3)[y]
    sal = saliency(model, x, y)
    np.testing.assert_allclose(sal.gradient, _tape(logits, x, onehot), rtol=1e-12)
    assert not sal.piecewise_linear and "not piecewise linear" in sal.note
    with pytest.raises(keras_roll.UnsupportedModelError, match="No certified radius"):
        sal.radius  # noqa: B018
    ig = integrated_gradients(model, x, y, steps=16, rule="midpoint", verbose=False)
    t, w = riemann_points(16, "midpoint")
    want = sum(wi * _tape(logits, ti * x, onehot) for ti, wi in zip(t, w))
    np.testing.assert_allclose(ig.maps, x * want, rtol=1e-12)
    assert not ig.piecewise_linear and ig.regions is None
    np.testing.assert_allclose(ig.f_x, np.sum(logits(x).numpy() * onehot, axis=1))


def test_exact_walk_and_radius_refuse_smooth_models():
    model, _ = _smooth_model(False)
    x = np.zeros((1, 6))
    with pytest.raises(keras_roll.UnsupportedModelError, match="smooth_tanh.*steps=k"):
        integrated_gradients(model, x, 0)
    with pytest.raises(keras_roll.UnsupportedModelError, match="smooth_tanh"):
        keras_roll.stable_radius(model, x)


def test_riemann_sums_behind_a_convolution_prefix_equal_a_tape_sum():
    """Rescaling, a convolution and BatchNormalization before the first ReLU: the sum
    runs from the prefix's output and goes back through its transpose; the same
    sum as the tape's at the points themselves."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((5, 5, 2), dtype="float64")
    h = keras.layers.Rescaling(2.0, offset=-0.5, dtype="float64")(inp)
    h = keras.layers.Conv2D(4, 3, dtype="float64", bias_initializer="random_normal")(h)
    h = keras.layers.BatchNormalization(dtype="float64", beta_initializer="random_normal")(h)
    h = keras.layers.ReLU(dtype="float64")(h)
    h = keras.layers.Flatten(dtype="float64")(h)
    model = keras.Model(inp, keras.layers.Dense(3, dtype="float64")(h))
    assert keras_roll.linearize(model).affine_prefix is not None
    x = np.random.default_rng(5).uniform(0, 1, (3, 5, 5, 2))
    y = np.array([2, 0, 1])
    base = np.random.default_rng(6).uniform(0, 1, (3, 5, 5, 2))
    ig = integrated_gradients(model, x, y, baseline=base, steps=9, rule="trapezoid",
                              verbose=False)
    t, w = riemann_points(9, "trapezoid")
    want = sum(wi * _tape(model, base + ti * (x - base), np.eye(3)[y]) for ti, wi in zip(t, w))
    np.testing.assert_allclose(ig.maps, (x - base) * want, rtol=1e-10, atol=1e-13)


def test_a_streams_labels_are_checked_with_their_positions(relu):
    model, _, x = relu
    y = np.array([0, 2, 1, 5])
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(3)
    for run in (lambda: saliency(model, ds),
                lambda: integrated_gradients(model, ds, steps=3, verbose=False),
                lambda: saliency(model, x, y)):
        with pytest.raises(ValueError, match=r"y must be in \[0, 3\).*\[5\] at positions \[3\]"):
            run()
    replaced = saliency(model, ds, np.array([0, 2, 1, 1]))  # y= replaces the stream's labels
    np.testing.assert_array_equal(replaced.labels, [0, 2, 1, 1])
    with pytest.raises(ValueError, match="no examples"):
        saliency(model, tf.data.Dataset.from_tensor_slices((x[:0], y[:0])).batch(3))
