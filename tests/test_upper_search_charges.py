"""`shrink_upper` charges each probe the steps it reports having run.

A probe of the attack ends at its first adversarial point; charging it its whole
budget would stop the search early on the inputs where probes succeed fast. Checked
on a hand-made probe with a known threshold (no model): the steps charged are the sum
of those reported, a probe that reports fewer steps than its budget leaves room for
more probes, and a probe that reports none keeps the old charge (its budget).
"""

import numpy as np

from keras_roll.robust.upper_search import shrink_upper


def _probe(r, ran_on_hit, seen):
    def probe(idx, eps, steps):
        hit = eps >= r[idx]
        seen.append((idx.copy(), steps.copy(), hit.copy()))
        ran = np.where(hit, np.minimum(ran_on_hit, steps), steps)
        return np.where(hit, eps, np.nan), ran
    return probe


def test_a_probe_is_charged_the_steps_it_ran():
    r = np.array([1.0, 2.0])
    upper = r * 1.01
    seen = []
    res = shrink_upper(_probe(r, 3, seen), np.zeros(2), upper, steps=50, max_steps=400,
                       tol=1e-4)
    for row in range(2):
        charged = sum(int(min(3, s[list(i).index(row)])) if h[list(i).index(row)]
                      else int(s[list(i).index(row)]) for i, s, h in seen if row in i)
        assert res.steps[row] == charged <= 400
    assert np.all(res.upper >= r) and np.all(res.upper <= upper)


def test_early_ends_leave_room_for_more_probes():
    r = np.array([1.0])
    upper = np.array([1.01])
    full = shrink_upper(lambda i, e, s: np.where(e >= r[i], e, np.nan), np.zeros(1), upper,
                        steps=50, max_steps=400, tol=1e-6)
    seen = []
    early = shrink_upper(_probe(r, 1, seen), np.zeros(1), upper, steps=50, max_steps=400,
                         tol=1e-6)
    assert early.probes[0] > full.probes[0]
    assert early.upper[0] <= full.upper[0] and early.upper[0] >= r[0]
    assert early.steps[0] <= 400 and full.steps[0] <= 400
