"""The attack's polishing runs (`AttackOptions.polish`) against independent references.

* A linear model (l1, l2): from an adversarial start twice as far as the boundary along
  a random direction, a single short run stays far (the test checks it); the polishing
  runs never lengthen its point and come within 3 % of the closed form
  `min_j (f_y - f_j) / ||w_y - w_j||_q`, and never below it. (l_inf is not covered:
  there a start in a third class's region keeps the polishing runs in that class.)
* A small ReLU net: with the probes off, polishing only ever shrinks the distance of
  the restarts' points, and every point flips `model.predict` (another call, another
  batch size).
"""

import keras
import numpy as np
import pytest

from keras_roll.robust import AttackOptions, minimal_norm_attack
from tests.test_attacks import _linear

pytestmark = pytest.mark.graph  # the attack's loop of steps: much faster compiled
DUAL = {1: np.inf, 2: 2, np.inf: 1}


def _flips(model, pts, pred):
    return np.argmax(np.asarray(model(pts.astype(np.float32), training=False)), axis=1) != pred


# l2 slow: its polishing runs reach the closed form by default in tests/test_attacks.py
# (test_linear_model_meets_the_closed_form[2], default budgets with polish); l1 stays.
@pytest.mark.parametrize("p", (1, pytest.param(2, marks=pytest.mark.slow)))
def test_polish_reaches_the_closed_form_from_a_far_start(p):
    model, w, b = _linear(d=12, classes=3, seed=5)
    rng = np.random.default_rng(6)
    x = rng.normal(size=(8, w.shape[0])).astype(np.float32)
    x64 = x.astype(np.float64)
    f = x64 @ w + b
    pred = np.argmax(f, axis=1)
    exact, far = np.zeros(8), np.zeros_like(x64)
    for i, y in enumerate(pred):
        dist = {j: (f[i, y] - f[i, j]) / np.linalg.norm(w[:, y] - w[:, j], DUAL[p])
                for j in range(w.shape[1]) if j != y}
        exact[i] = min(dist.values())
        j = min(dist, key=dist.get)
        # a start beyond the nearest hyperplane, twice as far, along a random direction
        a = w[:, j] - w[:, y]
        v = np.random.default_rng(i).normal(size=w.shape[0])
        v = v if v @ a > 0 else -v
        far[i] = x64[i] + 2.0 * (f[i, y] - f[i, j]) / (v @ a) * v
    assert np.all(_flips(model, far, pred))
    opts = dict(steps=30, restarts=1, probe_steps=0, refine=0)  # the polishing runs alone
    rough = minimal_norm_attack(model, x, p, start=far, options=AttackOptions(**opts, polish=0))
    nb = minimal_norm_attack(model, x, p, start=far,
                             options=AttackOptions(**opts, polish=3))
    assert np.all(np.isfinite(nb.upper)) and np.all(_flips(model, nb.adversarial, pred))
    assert np.all(nb.upper >= exact * (1 - 1e-6))  # never below the true minimum
    assert np.all(nb.upper <= exact * 1.03)
    assert np.all(nb.upper <= rough.upper)
    assert np.max(rough.upper / exact) > 1.3  # the single run alone stays far: polish needed


# l2 slow: `_polish` is the same code in every norm ([1] and [inf] run it); only the step
# direction differs, and l2's (the plain gradient step) runs in test_attacks.py's [2]
# cases and test_attack_scouts.py's [2].
@pytest.mark.parametrize("p", (1, pytest.param(2, marks=pytest.mark.slow), np.inf))
def test_polish_only_shrinks_the_restarts_points(p):
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(24, activation="relu"),
                              keras.layers.Dense(24, activation="relu"), keras.layers.Dense(4)])
    x = np.random.default_rng(8).normal(size=(10, 6)).astype(np.float32)
    pred = np.argmax(np.asarray(model(x, training=False)), axis=1)
    opts = dict(steps=30, restarts=2, probe_steps=0, refine=0)  # the polishing runs alone
    before = minimal_norm_attack(model, x, p, options=AttackOptions(**opts, polish=0))
    after = minimal_norm_attack(model, x, p, options=AttackOptions(**opts, polish=2))
    found = np.isfinite(before.upper)
    assert found.any()
    assert np.all(np.isfinite(after.upper[found]))
    assert np.all(after.upper[found] <= before.upper[found])
    assert np.all(_flips(model, after.adversarial[found], pred[found]))
    d = np.linalg.norm((after.adversarial[found].astype(np.float32).astype(np.float64)
                        - x[found]).reshape(int(found.sum()), -1), ord=p, axis=1)
    np.testing.assert_allclose(d, after.upper[found], rtol=1e-12)


def test_bad_polish_names_the_option():
    with pytest.raises(ValueError, match=r"AttackOptions.polish must be an integer >= 0"):
        AttackOptions(polish=-1).checked()
