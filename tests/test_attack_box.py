"""The attack inside a box domain, where the steepest coordinates are held at a bound.

A linear model on `[0, 1]^d` whose two steepest coordinates cannot help (the margin
falls only if they leave the box): the minimal l1 distance to the other class is the
fractional knapsack over the others (greedy by `|a_i|`, each up to its room in the box),
computed here independently. The attack must find it within 3 % and never below it, and
every point must stay in the box and flip `model.predict`.
"""

import keras
import numpy as np
import pytest

from keras_roll.robust import AttackOptions, minimal_norm_attack

pytestmark = pytest.mark.graph  # the attack's loop of steps: much faster compiled


def _greedy_l1(a, c, x):
    """The least l1 move within [0, 1]^d that brings `a . z + c` to 0 (or None)."""
    need = a @ x + c
    room = np.where(a > 0, x, 1.0 - x)  # how far each coordinate can lower the margin
    total = 0.0
    for i in np.argsort(-np.abs(a)):
        step = min(room[i], need / abs(a[i]))
        total, need = total + step, need - step * abs(a[i])
        if need <= 0:
            return total
    return None


def test_l1_in_a_box_skips_coordinates_held_at_a_bound():
    a = np.array([5.0, 4.0, 1.0, -0.9, 0.8, 0.7, -0.6, 0.5])
    c = 0.5
    model = keras.Sequential([keras.Input((a.size,)), keras.layers.Dense(2)])
    w = np.stack([a, np.zeros_like(a)], axis=1).astype(np.float32)
    model.layers[0].set_weights([w, np.array([c, 0.0], np.float32)])
    rng = np.random.default_rng(3)
    x = rng.uniform(0.3, 0.7, size=(6, a.size))
    x[:, :2] = 0.0  # the steepest two, held at the bound they would cross
    x = x.astype(np.float32)
    x64 = x.astype(np.float64)
    assert np.all(x64 @ a + c > 0)  # class 0 everywhere
    exact = np.array([_greedy_l1(a, c, row) for row in x64])
    nb = minimal_norm_attack(model, x, 1, domain=(0.0, 1.0),
                             options=AttackOptions(steps=100, restarts=1, polish=1,
                                                   probe_steps=0))
    assert np.all(np.isfinite(nb.upper))
    pts = nb.adversarial.astype(np.float32)
    assert np.all((pts >= 0) & (pts <= 1))
    assert np.all(np.argmax(np.asarray(model(pts, training=False)), axis=1) == 1)
    assert np.all(nb.upper >= exact * (1 - 1e-6))  # never below the true minimum
    assert np.all(nb.upper <= exact * 1.03)
