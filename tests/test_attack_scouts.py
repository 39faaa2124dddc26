"""The attack's schedule: full targeted runs, then short scouting runs, then polishing.

On a small random ReLU net with a box domain, checked independently of the attack:

* every point returned changes the prediction of `model.predict` (float32, another
  call and batch), lies inside the box, and its distance recomputed from the point
  equals the one reported;
* the steps spent are the schedule's: `steps` for the untargeted run and the first
  `FULL_TARGETS` targeted runs, `scout_steps` for the later ones, `steps` per
  polishing run;
* the scouting runs never leave a result worse than the same attack without them,
  and known starts bound the result from above (the attack only keeps closer points).
"""

import keras
import numpy as np
import pytest

from keras_roll.robust import AttackOptions, minimal_norm_attack
from keras_roll.robust.attacks import FULL_TARGETS, run_attack

pytestmark = pytest.mark.graph  # the attack's loop of steps: much faster compiled
NORMS = (1, 2, np.inf)
BOX = (0.0, 1.0)
OPTS = dict(steps=25, scout_steps=10, polish=2, probe_steps=10, probe_budget=30)


@pytest.fixture(scope="module")
def net():
    """A 8-16-16-5 ReLU net and 4 inputs in [0, 1]^8 (seeded)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dense(5)])
    x = np.random.default_rng(4).uniform(0.2, 0.8, size=(4, 8)).astype(np.float32)
    return model, x


def _measured(model, x, nb, p):
    """The distances of the returned points, after checking that each flips
    `model.predict` and lies in the box (NaN rows where none was found)."""
    pred = np.argmax(model.predict(x, verbose=0), axis=1)
    found = np.isfinite(nb.upper)
    pts = nb.adversarial[found].astype(np.float32)
    assert np.all(np.argmax(model.predict(pts, verbose=0), axis=1) != pred[found])
    assert np.all((pts >= BOX[0]) & (pts <= BOX[1]))
    d = np.full(len(x), np.nan)
    d[found] = np.linalg.norm(pts.astype(np.float64) - x[found].astype(np.float64),
                              ord=p, axis=1)
    return d


@pytest.mark.parametrize("p", NORMS)
def test_points_flip_stay_in_the_box_and_report_their_norm(net, p):
    model, x = net
    opts = AttackOptions(restarts=5, **OPTS)
    nb, spent = run_attack(model, x, p, domain=BOX, options=opts, probes=False)
    assert np.mean(np.isfinite(nb.upper)) >= 0.5
    np.testing.assert_allclose(_measured(model, x, nb, p), nb.upper, rtol=1e-12)
    # untargeted + FULL_TARGETS full runs, two scouts, the polishing runs
    full = (1 + FULL_TARGETS) * opts.steps + 2 * opts.scout_steps
    assert set(spent.tolist()) <= {full, full + opts.polish * opts.steps}


def test_scouts_and_starts_never_make_the_result_worse(net):
    model, x = net
    p = np.inf  # the schedule is the same in every norm; the box matters most in l_inf
    without = minimal_norm_attack(model, x, p, domain=BOX,
                                  options=AttackOptions(restarts=1 + FULL_TARGETS, **OPTS))
    scouted = minimal_norm_attack(model, x, p, domain=BOX,
                                  options=AttackOptions(restarts=5, **OPTS))
    np.testing.assert_allclose(_measured(model, x, scouted, p), scouted.upper, rtol=1e-12)
    both = np.isfinite(without.upper)
    assert np.all(np.isfinite(scouted.upper[both]))
    assert np.all(scouted.upper[both] <= without.upper[both] * (1 + 1e-12))
    # the points of both runs as starts: the result is at most the closer of them
    again = minimal_norm_attack(model, x, p, domain=BOX, start=[without.adversarial,
                                                                scouted.adversarial],
                                options=AttackOptions(restarts=1, **OPTS))
    known = np.fmin(without.upper, scouted.upper)
    has = np.isfinite(known)
    assert np.all(again.upper[has] <= known[has] * (1 + 1e-12))
    np.testing.assert_allclose(_measured(model, x, again, p), again.upper, rtol=1e-12)


def test_scout_steps_must_be_positive():
    with pytest.raises(ValueError, match="scout_steps.*0"):
        AttackOptions(scout_steps=0).checked()
