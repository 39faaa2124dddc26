"""The radius search where the relaxation's bound falls steeply near the answer.

On larger trained CNNs the lower bound `v(eps)` of the smallest margin loses to the
relaxation a share of the margin `m0` that grows like a high power of the radius
(eps^4 to eps^5 near the answer on CNN-L), so the root of a pass (its linear form
held fixed) overshoots the answer many times over and the bracketing steps crawl.
The search then steers by the loss model of `keras_roll.robust.search` (`log(1 - v /
m0)` against `log eps`). Checked on hand-built margins with a known answer `R`
(computed here by `scipy.optimize.brentq`, not by the search): the answer stays a
certified radius within the tolerance, in fewer passes than the bracketing alone.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import brentq

from keras_roll.robust.search import MAX_STEPS, search_certified

TOL = 1e-3
M0 = np.array([7.0, 5.5, 3.6, 1.2, 9.0])
G = np.array([0.25, 0.15, 0.25, 0.05, 1.0])  # the affine map's slope at eps = 0
C = np.array([0.02, 0.1, 0.002, 1e-4, 3.0])
K = np.array([4.5, 4.0, 3.0, 5.0, 1.5])
UPPER = np.array([22.0, 23.0, 15.0, np.inf, 4.0])


def _v(i, eps):
    return M0[i] - G[i] * eps - C[i] * eps ** K[i]


def _answers():
    return np.array([brentq(lambda e, i=i: _v(i, e), 0.0, 100.0, xtol=1e-14)
                     for i in range(len(M0))])


def _search(roots: bool, model: bool):
    calls = []

    def values(i, eps):
        calls.append(len(i))
        v = _v(i, eps)
        # A sound linear form, as a pass's: through (eps, v) with the slope -G of
        # the affine map; v falls at least that fast, so the line stays below v on
        # [0, eps], and its root `eps + v / G` is certified up to eps. Near the
        # answer its slope in eps is v' / G, -7 to -30 here (CNN-L: -35 to -100).
        root = eps + v / G[i]
        return v, (root if roots else np.full(len(i), np.nan))

    res = search_certified(values, np.zeros(len(M0)), UPPER, M0 / G, TOL,
                           values_at_lower=M0.copy(),
                           root_at_zero=M0 / G if roots else None,
                           value_at_zero=M0.copy() if model else None)
    assert sum(calls) == int(res.passes.sum())
    return res


def test_steep_losses_answer_within_the_tolerance_in_few_passes():
    r = _answers()
    steered = _search(roots=True, model=True)
    rooted = _search(roots=True, model=False)  # the search before the loss model
    alone = _search(roots=False, model=False)  # the bracketing rules alone
    for res in (steered, rooted, alone):
        assert np.all(_v(np.arange(len(M0)), res.lower) > 0)  # certified radii
        assert np.all(res.lower <= r) and np.all(res.lower >= r / (1 + TOL) ** 2), (res.lower, r)
        assert np.all(res.passes < MAX_STEPS)
    assert steered.passes.max() <= 7, steered.passes
    assert steered.passes.sum() <= 0.75 * rooted.passes.sum(), (steered.passes, rooted.passes)
    assert steered.passes.sum() <= 0.65 * alone.passes.sum(), (steered.passes, alone.passes)


def test_the_loss_model_steers_without_roots():
    """No roots at all (interval bounds): the loss model alone reaches the answer."""
    r = _answers()
    res = _search(roots=False, model=True)
    assert np.all(res.lower <= r) and np.all(res.lower >= r / (1 + TOL) ** 2), (res.lower, r)
    assert res.passes.max() <= 9, res.passes
