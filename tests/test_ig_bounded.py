"""Exact integrated gradients with the work bounded by `max_regions`.

On a ReLU MLP whose first path crosses about 75 linear regions and whose second
crosses 3:

* a cap far below the first path's count stops its walk early, from the estimated
  count, with an error naming the ways out (fewer probes than the path has regions);
* with `fallback_steps=k` that path is a right Riemann sum of `k` points, equal to
  one of `tf.GradientTape` gradients of the Keras model, with a warning, `exact`
  False and an error estimate within a small factor of its true error (against a
  midpoint sum of 20,000 tape gradients); the short path stays exact (equal to an
  uncapped call).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.attribution.path_program import PathTwin

CAP = 10


@pytest.fixture(scope="module")
def case():
    keras.utils.set_random_seed(0)
    bias = keras.initializers.RandomNormal(0, 0.5)
    inp = keras.Input((4,), dtype="float64")
    h = inp
    for _ in range(4):
        h = keras.layers.Dense(48, activation="relu", dtype="float64",
                               bias_initializer=bias)(h)
    model = keras.Model(inp, keras.layers.Dense(3, dtype="float64")(h))
    x = np.random.default_rng(0).uniform(-10, 10, (2, 4))
    x[1] *= 0.01
    return model, x, np.array([0, 1])


def tape_sum(model, x, label, t):
    """`x * mean_t grad f(t x)` (zero baseline) from the Keras model's gradients."""
    pts = tf.constant(t[:, None] * x[None])
    with tf.GradientTape() as tape:
        tape.watch(pts)
        out = tf.reduce_sum(model(pts)[:, label])
    return x * tape.gradient(out, pts).numpy().mean(axis=0)


def test_a_path_over_the_cap_stops_early_with_the_ways_out(case, monkeypatch):
    model, x, y = case
    probed = []
    real = PathTwin.probe

    def counted(self, u0, u1, owner, t, weights):
        probed.append(len(t))
        return real(self, u0, u1, owner, t, weights)

    monkeypatch.setattr(PathTwin, "probe", counted)
    with pytest.raises(RuntimeError, match="example 0 crosses about .*max_regions=10.*"
                                           "fallback_steps=k"):
        keras_roll.integrated_gradients(model, x, y, max_regions=CAP, verbose=False)
    assert sum(probed) < 40  # the whole walk probes at least once per region (about 75)


def test_fallback_is_a_riemann_sum_with_its_error_and_the_rest_stays_exact(case):
    model, x, y = case
    with pytest.warns(RuntimeWarning, match="1 of 2 paths .* fallback_steps=64"):
        ig = keras_roll.integrated_gradients(model, x, y, max_regions=CAP, fallback_steps=64,
                                             verbose=False)
    np.testing.assert_array_equal(ig.exact, [False, True])
    assert ig.regions[0] > 2 * CAP  # the estimated count
    alone = keras_roll.integrated_gradients(model, x[1:], y[1:], verbose=False)
    np.testing.assert_allclose(ig.maps[1], alone.maps[0], rtol=1e-12, atol=1e-14)
    assert ig.error[1] == 0

    right = tape_sum(model, x[0], 0, np.arange(1, 65) / 64)
    np.testing.assert_allclose(ig.maps[0], right, rtol=1e-10, atol=1e-12)
    fine = tape_sum(model, x[0], 0, (np.arange(20000) + 0.5) / 20000)
    true_error = np.abs(ig.maps[0] - fine).max()
    assert true_error > 1e-6  # the sum is not exact here
    assert true_error / 4 < ig.error[0] < 4 * true_error
