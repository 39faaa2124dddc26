"""Noisy polishing runs (`AttackOptions.hop`) and the smooth l1 steps, checked independently.

* The step direction of the l1 runs: the gradient over its largest entry, or (smooth
  runs) over its l2 norm divided by `L1_SMOOTH`, against numpy.
* On a linear model the minimal distance has a closed form
  (`min_j (f_y - f_j) / ||w_y - w_j||_q`): with noisy polishing runs the attack never
  reports less than it (each point flips the model) and comes within 3 % of it.
* On a small ReLU net in a box: every point flips `model.predict` (another call and
  batch), lies in the box and has the distance reported; known starts bound the result
  from above (the noisy runs start near the best point, but only closer points are kept).
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_roll.robust import AttackOptions, minimal_norm_attack
from keras_roll.robust.attack_loop import L1_SMOOTH, _direction
from tests.test_attack_scouts import net  # noqa: F401 (the 8-16-16-5 net fixture)
from tests.test_attacks import _linear

pytestmark = pytest.mark.graph  # the attack's loop of steps: much faster compiled
BOX = (0.0, 1.0)
DUAL = {1: np.inf, 2: 2, np.inf: 1}
OPTS = dict(steps=25, restarts=2, polish=3, probe_steps=0, hop=0.3)


def _checked_distances(model, x, nb, p, box=None):
    """The distances of the returned points, recomputed, after checking that each
    flips `model.predict` (and lies in `box`); NaN rows where none was found."""
    pred = np.argmax(model.predict(x, verbose=0), axis=1)
    found = np.isfinite(nb.upper)
    pts = nb.adversarial[found].astype(np.float32)
    assert np.all(np.argmax(model.predict(pts, verbose=0), axis=1) != pred[found])
    if box is not None:
        assert np.all((pts >= box[0]) & (pts <= box[1]))
    d = np.full(len(x), np.nan)
    d[found] = np.linalg.norm(pts.astype(np.float64) - x[found].astype(np.float64), ord=p,
                              axis=1)
    return d


def test_l1_steps_are_normalized_by_the_largest_entry_or_smoothly():
    g = np.random.default_rng(0).normal(size=(3, 10)).astype(np.float32)
    top = g / np.max(np.abs(g), axis=1, keepdims=True)
    smooth = g * L1_SMOOTH / np.linalg.norm(g, axis=1, keepdims=True)
    for flag, want in ((False, top), (True, smooth)):
        got = _direction(tf.constant(g), 1.0, tf.constant(flag)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("p", (1, 2))
def test_hop_stays_above_and_near_the_closed_form_on_a_linear_model(p):
    model, w, b = _linear(d=12, classes=3, seed=7)
    x = np.random.default_rng(8).normal(size=(6, w.shape[0])).astype(np.float32)
    x64 = x.astype(np.float64)
    f = x64 @ w + b
    pred = np.argmax(f, axis=1)
    exact = np.array([min((f[i, y] - f[i, j]) / np.linalg.norm(w[:, y] - w[:, j], DUAL[p])
                          for j in range(w.shape[1]) if j != y) for i, y in enumerate(pred)])
    nb = minimal_norm_attack(model, x, p, options=AttackOptions(**OPTS))
    d = _checked_distances(model, x, nb, p)
    np.testing.assert_allclose(d, nb.upper, rtol=1e-12)
    assert np.all(nb.upper >= exact * (1 - 1e-6))
    assert np.all(nb.upper <= exact * 1.03)


@pytest.mark.slow
def test_smooth_l1_hop_points_flip_stay_in_the_box_and_report_their_norm(net):  # noqa: F811
    model, x = net
    nb = minimal_norm_attack(model, x, 1, domain=BOX, options=AttackOptions(
        steps=10, restarts=2, polish=2, probe_steps=0, hop=0.3))
    assert np.mean(np.isfinite(nb.upper)) >= 0.5
    np.testing.assert_allclose(_checked_distances(model, x, nb, 1, BOX), nb.upper,
                               rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("p", (1, 2, np.inf))
def test_hop_points_flip_stay_in_the_box_and_never_exceed_a_known_start(net, p):  # noqa: F811
    model, x = net
    first = minimal_norm_attack(model, x, p, domain=BOX,
                                options=AttackOptions(**{**OPTS, "hop": 0.0}))
    nb = minimal_norm_attack(model, x, p, domain=BOX, start=first.adversarial,
                             options=AttackOptions(**OPTS))
    np.testing.assert_allclose(_checked_distances(model, x, nb, p, BOX), nb.upper,
                               rtol=1e-12)
    known = np.isfinite(first.upper)
    assert np.mean(known) >= 0.5
    assert np.all(nb.upper[known] <= first.upper[known] * (1 + 1e-12))


@pytest.mark.parametrize("hop", (-0.1, 1.5, "0.1"))
def test_bad_hop_names_the_option(hop):
    with pytest.raises(ValueError, match="hop.*" + str(hop)):
        AttackOptions(hop=hop).checked()
