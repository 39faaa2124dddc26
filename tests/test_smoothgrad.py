"""SmoothGrad / VarGrad: against tf.GradientTape gradients at the very same noisy points,
reproducible per example and across chunkings, and the region statistics against
independent checks (tape gradients equal to x's, noise norms below the radius)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll


def _model(activation="relu", dtype="float64", seed=0):
    keras.utils.set_random_seed(seed)
    bias = keras.initializers.RandomNormal(stddev=0.5)
    inp = keras.Input((5,), dtype=dtype)
    h = keras.layers.Dense(12, activation=activation, bias_initializer=bias, dtype=dtype)(inp)
    h = keras.layers.Dense(12, activation=activation, bias_initializer=bias, dtype=dtype)(h)
    logits = keras.layers.Dense(3, bias_initializer=bias, dtype=dtype)(h)
    probs = keras.layers.Activation("softmax", dtype=dtype)(logits)
    return keras.Model(inp, probs), keras.Model(inp, logits)


def _tape(logits_model, x, y):
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        total = tf.reduce_sum(tf.gather(logits_model(xt), y, axis=1, batch_dims=1))
    return tape.gradient(total, xt).numpy()


def _noise(seed, n, samples, shape, sigma):
    """The draws smoothgrad documents: example i uses child i of SeedSequence(seed)."""
    children = np.random.SeedSequence(seed).spawn(n)
    return [np.random.default_rng(c).standard_normal((samples, *shape)) * s
            for c, s in zip(children, sigma)]


@pytest.fixture(scope="module")
def setup():
    model, logits = _model()
    x = np.random.default_rng(0).uniform(0, 1, (3, 5))
    return model, logits, x, np.array([0, 1, 2])


def test_mean_and_variance_of_tape_gradients_at_the_same_points(setup):
    model, logits, x, y = setup
    res = keras_roll.smoothgrad(model, x, y, noise=0.2, samples=40, seed=7, verbose=False)
    sigma = 0.2 * (x.max(1) - x.min(1))
    np.testing.assert_allclose(res.noise_std, sigma)
    for i, eps in enumerate(_noise(7, 3, 40, (5,), sigma)):
        g = _tape(logits, x[i] + eps, np.full(40, y[i]))
        np.testing.assert_allclose(res.maps[i], g.mean(0), rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(res.vargrad[i], g.var(0), rtol=1e-8, atol=1e-13)
    np.testing.assert_allclose(res.gradient, _tape(logits, x, y), rtol=1e-12)
    np.testing.assert_allclose(res.smoothgrad_sq, res.vargrad + res.maps ** 2)


def test_reproducible_per_example_and_across_chunks(setup):
    model, _, x, y = setup
    kw = dict(noise=0.3, samples=33, seed=3, verbose=False)
    a = keras_roll.smoothgrad(model, x, y, **kw)
    b = keras_roll.smoothgrad(model, x, y, memory_budget=12_000, **kw)  # calls of 10 samples
    np.testing.assert_allclose(b.maps, a.maps, rtol=1e-13, atol=1e-16)
    np.testing.assert_array_equal(a.in_region, b.in_region)  # the same draws
    again = keras_roll.smoothgrad(model, x, y, **kw)
    np.testing.assert_array_equal(again.maps, a.maps)
    np.testing.assert_array_equal(again.vargrad, a.vargrad)
    other = x.copy()
    other[1:] = 0.5  # the other examples change, example 0's draws do not
    c = keras_roll.smoothgrad(model, other, y, **kw)
    np.testing.assert_array_equal(c.maps[0], a.maps[0])
    assert a.seed == 3 and not np.array_equal(
        keras_roll.smoothgrad(model, x, y, noise=0.3, samples=33, seed=4,
                              verbose=False).maps, a.maps)


def test_region_fraction_against_tape_gradients_and_the_radius(setup):
    model, logits, x, y = setup
    res = keras_roll.smoothgrad(model, x, y, noise=0.05, samples=200, seed=1, verbose=False,
                                radius=True)
    sigma = res.noise_std
    radius = keras_roll.certify(model, x, norms=(2,), verbose=False).margins[2]
    np.testing.assert_array_equal(res.radius[2], radius)
    for i, eps in enumerate(_noise(1, 3, 200, (5,), sigma)):
        g = _tape(logits, x[i] + eps, np.full(200, y[i]))
        same_gradient = np.all(np.abs(g - res.gradient[i]) <= 1e-12, axis=1).mean()
        assert res.in_region[i] == pytest.approx(same_gradient)
        inside_ball = (np.linalg.norm(eps, axis=1) < radius[i]).mean()
        assert res.in_region[i] >= inside_ball  # every sample inside the ball is in the region
    assert np.all(res.certified_fraction >= 0) and np.all(res.certified_fraction <= 1)
    assert 0 < res.in_region.min() and res.in_region.min() < 1  # the test exercises both


def test_tiny_noise_stays_in_the_region(setup):
    model, _, x, y = setup
    res = keras_roll.smoothgrad(model, x, y, noise=1e-9, absolute_noise=True, samples=20,
                                seed=0, verbose=False, radius=True)
    np.testing.assert_array_equal(res.in_region, 1.0)
    np.testing.assert_allclose(res.certified_fraction, 1.0)
    np.testing.assert_allclose(res.maps, res.gradient, rtol=1e-12)
    np.testing.assert_allclose(res.vargrad, 0.0, atol=1e-20)


def test_certified_fraction_is_the_chi_square_probability(setup):
    model, _, x, y = setup
    res = keras_roll.smoothgrad(model, x, y, noise=0.02, samples=2, seed=0, verbose=False,
                                radius=True)
    draws = np.random.default_rng(5).standard_normal((200_000, 5))
    for i in range(3):
        r = res.radius[2][i] / res.noise_std[i]
        monte_carlo = (np.linalg.norm(draws, axis=1) < r).mean()
        assert res.certified_fraction[i] == pytest.approx(monte_carlo, abs=0.01)


def test_models_that_are_not_piecewise_linear():
    model, logits = _model("tanh")
    x = np.random.default_rng(2).uniform(0, 1, (2, 5))
    res = keras_roll.smoothgrad(model, x, 1, noise=0.1, samples=16, seed=2, verbose=False)
    sigma = res.noise_std
    for i, eps in enumerate(_noise(2, 2, 16, (5,), sigma)):
        g = _tape(logits, x[i] + eps, np.full(16, 1))
        np.testing.assert_allclose(res.maps[i], g.mean(0), rtol=1e-10)
    assert res.in_region is None and not res.piecewise_linear
    with pytest.raises(keras_roll.UnsupportedModelError, match="No certified radius"):
        res.radius  # noqa: B018


def test_bad_arguments(setup):
    model, _, x, y = setup
    for kw, msg in [(dict(noise=-0.1), "noise must be"), (dict(samples=0), "samples must be"),
                    (dict(seed=-1), "seed must be"), (dict(noise=float("nan")), "noise must be")]:
        with pytest.raises(ValueError, match=msg):
            keras_roll.smoothgrad(model, x, y, **kw)
