"""The radius search where the passes certify nothing, or only very small radii.

A pass that fails at every radius (margins below the rounding guard, as on CNNs at
initialisation) used to drive the bracket's upper end toward 0 for all 64 passes of
`MAX_STEPS`; the search now stops once that end falls below `FLOOR` times the first
end of the bracket, and still finds small radii above it within the tolerance.
"""

from __future__ import annotations

import numpy as np

from keras_roll.robust.search import FLOOR, MAX_STEPS, search_certified

TOL = 1e-3


def test_nothing_certified_stops_in_a_few_passes():
    """Every pass fails (value -1, a negative root or none): lower 0, a handful of
    passes per example instead of `MAX_STEPS`."""
    calls = []

    def values(i, eps):
        calls.append(len(i))
        roots = np.where(i % 2 == 0, -1.0, np.nan)  # negative roots, or none
        return np.full(len(i), -1.0), roots

    upper = np.array([3.8e-4, np.inf, 2.0, np.nan])
    res = search_certified(values, np.zeros(4), upper, np.array([1e-3, 0.5, 1.0, 7.0]), TOL,
                           values_at_lower=np.ones(4), root_at_zero=np.full(4, 1e-3))
    assert np.all(res.lower == 0.0)
    assert np.all(res.passes <= 12), res.passes
    assert sum(calls) <= 12 * 4 < 4 * MAX_STEPS


def test_small_radii_above_the_floor_are_still_found():
    """The passes certify up to `r` (value `r - eps`, root `r`), with `r` down to 100
    times the floor: the search reaches `r` within the tolerance, as before."""
    upper = np.array([1.0, 2.0, np.inf, 0.5])
    scale = np.ones(4)
    r = np.array([1e-4, 3e-3, 100 * FLOOR, 100 * FLOOR * 0.5])

    def values(i, eps):
        return r[i] - eps, r[i].copy()

    res = search_certified(values, np.zeros(4), upper, scale, TOL)
    assert np.all(res.lower <= r) and np.all(res.lower >= r / (1 + TOL) ** 2), (res.lower, r)
    assert np.all(res.passes < MAX_STEPS)

    def bracketing(i, eps):  # no roots: the bracketing rules alone
        return r[i] - eps

    res = search_certified(bracketing, np.zeros(4), upper, scale, TOL)
    assert np.all(res.lower <= r) and np.all(res.lower >= r / (1 + TOL) ** 2), (res.lower, r)


def test_the_answer_is_always_a_certified_radius():
    """Passes certify only below `r` far under the floor: the search may stop at 0, but
    never answers a radius the passes did not certify."""
    upper = np.array([1.0, np.inf])
    r = np.array([FLOOR * 1e-3, FLOOR * 1e-2])
    certified = []

    def values(i, eps):
        v = r[i] - eps
        certified.extend(eps[v > 0])
        return v

    res = search_certified(values, np.zeros(2), upper, np.ones(2), TOL)
    assert np.all((res.lower == 0) | np.isin(res.lower, certified))
    assert np.all(res.lower <= r)
    assert np.all(res.passes <= 12), res.passes
