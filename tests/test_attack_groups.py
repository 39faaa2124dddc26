"""The attack's restarts from `x` run through the loop together (`attacks._groups`).

Checked by hand: run 0 (from the best known point) runs alone and first; every later
run appears exactly once; in l_inf and l1 a group holds runs of one kind of step only
(the loop takes sign or smooth steps as one scalar: odd runs smooth, even ones sign)
and runs of one length (full runs, then the scouts);
no group exceeds `GROUP_ROWS` rows unless a single run does.
"""

import numpy as np
import pytest

from keras_roll.robust.attacks import FULL_TARGETS, GROUP_ROWS, _groups


@pytest.mark.parametrize("p", [np.inf, 1, 2])
@pytest.mark.parametrize("restarts, rows", [(1, 8), (7, 8), (7, 200), (12, 3), (5, 600)])
def test_groups_cover_every_run_once(p, restarts, rows):
    groups = _groups(restarts, p, rows)
    assert groups[0] == [0]
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(restarts))
    for g in groups[1:]:
        assert g and 0 not in g
        assert len(g) == 1 or len(g) * rows <= GROUP_ROWS
        if p != 2:
            assert len({r % 2 for r in g}) == 1
        assert len({r <= FULL_TARGETS for r in g}) == 1


def test_l2_runs_from_x_share_one_batch():
    assert _groups(7, 2, 8) == [[0], [1, 2], [3, 4, 5, 6]]
    assert _groups(7, np.inf, 8) == [[0], [1], [2], [3, 5], [4, 6]]
