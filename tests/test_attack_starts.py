"""The attack's several starts (`minimal_norm_attack(start=[...])`) against a closed form.

A linear model on 2-D inputs with two other classes on opposite sides of `x`: class 1
beyond `x1 = 1`, class 2 beyond `x1 = -0.8`. A run from a point of class 1 stays on
that side (there the largest other output is class 1's), so one start gives about 1;
a second start in class 2's half-plane, farther from `x`, lets the attack reach the
minimum 0.8 (the same in l1, l2 and l_inf: the margins depend on `x1` alone). The
test fails without the second start's run. Every point is checked with
`model.predict`.
"""

import keras
import numpy as np
import pytest

from keras_roll.robust import AttackOptions, minimal_norm_attack

pytestmark = pytest.mark.graph  # the attack's loop of steps: much faster compiled
EXACT = 0.8  # the distance from x (x1 = 0) to class 2's half-plane x1 < -0.8
ONE_RUN = AttackOptions(steps=60, restarts=1, polish=0, probe_steps=0)


def _two_sided():
    """Logits `(0, 10 (x1 - 1), 10 (-x1 - 0.8))`: class 0 for -0.8 < x1 < 1."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    w = np.array([[0.0, 10.0, -10.0], [0.0, 0.0, 0.0]], np.float32)
    model.layers[0].set_weights([w, np.array([0.0, -10.0, -8.0], np.float32)])
    x = np.stack([np.zeros(4), np.linspace(-1.0, 1.0, 4)], axis=1).astype(np.float32)
    return model, x


def _flips(model, pts):
    return np.argmax(np.asarray(model(pts.astype(np.float32), training=False)), axis=1) != 0


# l2 slow: l1 and l_inf keep the two other projections; the attack's l2 runs from known
# starts are tests/test_attacks.py's test_starts_from_a_known_point_and_only_shrinks_it.
@pytest.mark.parametrize("p", (1, pytest.param(2, marks=pytest.mark.slow), np.inf))
def test_a_second_start_reaches_the_other_side(p):
    model, x = _two_sided()
    near = x + np.array([1.5, 0.0], np.float32)  # class 1, distance 1.5
    far = x + np.array([-2.0, 0.3], np.float32)  # class 2, farther
    assert np.all(_flips(model, near)) and np.all(_flips(model, far))
    one = minimal_norm_attack(model, x, p, start=near, options=ONE_RUN)
    assert np.all(one.upper > 0.95)  # one start: stuck on class 1's side
    both = minimal_norm_attack(model, x, p, start=[near, far], options=ONE_RUN)
    assert np.all(_flips(model, both.adversarial))
    d = np.linalg.norm((both.adversarial.astype(np.float32).astype(np.float64)
                        - x).reshape(len(x), -1), ord=p, axis=1)
    np.testing.assert_allclose(d, both.upper, rtol=1e-12)
    assert np.all(both.upper >= EXACT * (1 - 1e-6))  # never below the true minimum
    assert np.all(both.upper <= EXACT * 1.03)
    assert np.all(both.runner_up == 2)


def test_starts_that_do_not_flip_are_ignored_and_shapes_are_checked():
    model, x = _two_sided()
    inside = x + np.array([0.1, 0.0], np.float32)  # still class 0: not a start
    nan = np.full_like(x, np.nan)
    nb = minimal_norm_attack(model, x, 2, start=[inside, nan],
                             options=AttackOptions(steps=60, restarts=2, probe_steps=0))
    assert np.all(np.isfinite(nb.upper)) and np.all(_flips(model, nb.adversarial))
    assert np.all(nb.upper >= EXACT * (1 - 1e-6))
    with pytest.raises(ValueError, match=r"start must be None, an array of the inputs' "
                                         r"shape \(4, 2\)"):
        minimal_norm_attack(model, x, 2, start=[x[:2]])
