"""The radius search of branch and bound (`robust/branch.py`) against an oracle ball.

`verify_ball` is replaced by an oracle with a known minimal perturbation `r`: a ball
below `r / (1 + hard)` is certified, one above `r` holds a point at distance
`eps` (shrunk to `r * (1 + slack)` by the replaced minimal-norm attack), and the
balls between are undecided unless the probe's budget reaches `decide_seconds`
(the hard balls near the radius need the most leaves). Checked: the bracket always
holds `r`, closes within `rtol` where the budget allows, probes bisect in log space,
and the budgets it hands out grow as the bracket narrows and never exceed the time.
"""

import time

import numpy as np
import pytest

import keras_roll.robust.branch as branch
from keras_roll.robust import BranchOptions
from keras_roll.robust.subdomains import BallVerdict


class _Oracle:
    def __init__(self, r, hard, decide_seconds, slack=0.0):
        self.r, self.hard, self.decide, self.slack = r, hard, decide_seconds, slack
        self.probes, self.budgets = [], []
        self.clock = 0.0

    def monotonic(self):
        return self.clock

    def verify(self, passes, model, x, pred, eps, gap, options, deadline, cover=None):
        budget = deadline - self.clock
        self.probes.append(eps)
        self.budgets.append(budget)
        easy = eps < self.r / (1 + self.hard) or eps > self.r
        spend = min(budget, 0.01) if easy or budget >= self.decide else budget
        self.clock += spend
        if eps > self.r:
            return BallVerdict("adversarial", np.full(2, eps), 4, -np.inf, 1, 0)
        if easy or budget >= self.decide:
            return BallVerdict("certified", None, 4, np.inf, 1, 0)
        return BallVerdict("unknown", None, 64, -1.0, 8, 0)

    def shrink(self, model, x, point, pred, p):
        d = max(self.r * (1 + self.slack), 0.0)
        return np.full(2, d), d, 50


def _run(monkeypatch, oracle, lo, hi, seconds=30.0, rtol=1e-3):
    monkeypatch.setattr(branch, "verify_ball", oracle.verify)
    monkeypatch.setattr(branch, "_shrink", oracle.shrink)
    monkeypatch.setattr(time, "monotonic", oracle.monotonic)

    class _P:
        p = np.inf

    return branch._bracket(_P(), None, np.zeros(2), 0, lo, hi, 0.0, rtol,
                           BranchOptions(max_seconds=seconds))


@pytest.mark.parametrize("hard,decide", [(0.0, 0.0), (0.05, 2.0), (0.2, 6.0)])
def test_the_bracket_holds_the_radius_and_closes(monkeypatch, hard, decide):
    oracle = _Oracle(r=1.0, hard=hard, decide_seconds=decide)
    lo, hi, point, spent = _run(monkeypatch, oracle, 0.55, 1.0)
    assert lo <= 1.0 <= hi
    assert hi - lo <= 1e-3 * hi, (lo, hi, oracle.probes)
    assert oracle.clock <= 30.0 + 1e-9
    assert spent.probes == len(oracle.probes) and spent.leaves >= 4 * spent.probes


def test_probes_bisect_between_the_ends_in_log_space(monkeypatch):
    oracle = _Oracle(r=10.0, hard=0.0, decide_seconds=0.0)  # every probe certifies
    lo, hi, _, _ = _run(monkeypatch, oracle, 1.0, 16.0)
    # no upper point near the lower bound: no first probe just below the upper bound
    np.testing.assert_allclose(oracle.probes[:2], [4.0, 8.0], rtol=1e-12)
    assert 10.0 * (1 - 1e-3) <= lo <= 10.0 <= hi


def test_budgets_grow_as_the_bracket_narrows(monkeypatch):
    oracle = _Oracle(r=1.0, hard=1.0, decide_seconds=1e9)  # [0.5, 1]: never decided
    lo, hi, _, _ = _run(monkeypatch, oracle, 0.25, 2.0, seconds=32.0)
    assert 0.45 < lo < 0.5 and hi == 2.0  # only the easy balls below 0.5 certified
    b = np.array(oracle.budgets)
    assert b[0] == pytest.approx(1.0)  # 1/32 of the time in the first bracket
    assert np.all(np.diff(b[:4]) > 0), b
    assert oracle.clock <= 32.0 + 1e-9


def test_a_close_attack_is_confirmed_by_one_probe(monkeypatch):
    oracle = _Oracle(r=1.0, hard=0.0, decide_seconds=0.0)
    lo, hi, point, spent = _run(monkeypatch, oracle, 0.9, 1.0)
    assert spent.probes == 1 and oracle.probes[0] == pytest.approx(1.0 - 5e-4)
    assert hi == 1.0 and lo == oracle.probes[0] and point is None
