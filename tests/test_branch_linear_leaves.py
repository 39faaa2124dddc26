"""Complete leaves of the branch and bound solved as linear programs (`leaf_lp`).

* On a 2-D network, every unit split the way a grid point of the ball has it (a
  complete leaf holding that point): the bound with the program's dual multipliers is
  at most the smallest margin over the grid points of that leaf (sound), and within a
  grid step's worth of it (the program is exact on the leaf).
* Split patterns at random (most hold no point of the ball): every pattern that does
  hold grid points keeps a sound bound; every pattern the program finds infeasible is
  bounded above the gap by its Farkas multipliers, and holds no grid point.
* Hand-made leaves (numpy forms, no network): the duals' bound equals the program's
  minimum, an infeasible pair of splits is closed by its Farkas multipliers.
* The minimiser of a leaf whose minimum is below 0 is a point of the ball that the
  network (numpy, layer by layer) classifies as another class.
"""

import numpy as np
import pytest

from keras_roll.compile.twin import linearize
from keras_roll.robust import BranchOptions
from keras_roll.robust.leaf_lp import available, solve_leaves
from keras_roll.robust.subdomains import LeafPasses, _Ball
from tests.test_robust_exact import _mlp, affine_stack, forward, pre_activations

pytestmark = [pytest.mark.graph,
              pytest.mark.skipif(not available(np.inf), reason="scipy is not installed")]


def _lagrangian(forms, splits, betas, eps):
    """`[m, C]` the split multipliers' bound in closed form (numpy): the minimum over
    the box of `margin(d) - sum_j beta_j s_j (z_j(d) - t_j)`."""
    offset, lam, u_off, u_lam, edge = forms
    sb = betas * splits[:, None, :]  # [m, C, size]
    g = lam - np.einsum("mcs,msn->mcn", sb, u_lam)
    const = offset - np.einsum("mcs,ms->mc", sb, u_off - edge[None])
    return const - eps * np.abs(g).sum(-1)


def test_programs_on_hand_made_leaves():
    # margin 0.5 + d1 + d2 (or -0.5 + ...), units z_1 = d1, z_2 = d2 split active,
    # or z_1 = d1 >= 0.5 and z_2 = d1 <= 0 (infeasible); the box |d| <= 1
    eye = np.eye(2)[None]
    forms = (np.array([[0.5], [-0.5], [0.5]]), np.ones((3, 1, 2)), np.zeros((3, 2)),
             np.concatenate([eye, eye, [[[1.0, 0.0], [1.0, 0.0]]]]), np.zeros(2))
    splits = np.array([[1, 1], [1, 1], [1, -1]], np.int8)
    feasible = tuple(f[:2] for f in forms[:4]) + (np.zeros(2),)
    sol = solve_leaves(feasible, splits[:2], np.zeros((2, 1, 2)), np.full((2, 1), -1.0),
                       1.0, 0.0)
    np.testing.assert_allclose(sol.betas[:, 0], [[1, 1], [1, 1]], atol=1e-9)
    np.testing.assert_allclose(_lagrangian(feasible, splits[:2], sol.betas, 1.0)[:, 0],
                               [0.5, -0.5], atol=1e-9)  # the programs' minima, at d = 0
    assert sol.below[0] == np.inf and sol.below[1] == pytest.approx(-0.5)
    np.testing.assert_allclose(sol.points[1], [0, 0], atol=1e-9)
    edge = np.array([0.5, 0.0])  # z_1 - t_1 = d1 - 0.5
    third = tuple(f[2:] for f in forms[:4]) + (edge,)
    sol = solve_leaves(third, splits[2:], np.zeros((1, 1, 2)), np.full((1, 1), -1.0), 1.0, 0.3)
    assert np.all(sol.betas > 0) and sol.below[0] == np.inf
    assert _lagrangian(third, splits[2:], sol.betas, 1.0)[0, 0] > 0.3  # closed


@pytest.fixture(scope="module")
def setup():
    return _setup()


def _setup(seed=1, eps=0.8):
    model = _mlp((8, 8), 0.0, 2, 3, seed)
    stages = affine_stack(model)
    twin = linearize(model).at_dtype("float64")
    passes = LeafPasses(twin, np.inf, False, twin.memory_budget, 16)
    x = np.random.default_rng(seed).normal(size=2)
    pred = int(np.argmax(forward(stages, x[None])))
    t = np.linspace(-eps, eps, 201)
    pts = x + np.stack(np.meshgrid(t, t), -1).reshape(-1, 2)
    pre, logits = pre_activations(stages, pts)
    pre = np.concatenate(pre, axis=1)
    others = [(pred + 1 + k) % 3 for k in range(2)]  # the order of the bound's rows
    margins = logits[:, [pred]] - logits[:, others]
    ball = _Ball(passes, model, x, pred, eps, 0.0, BranchOptions())
    return passes, ball, x, pts, pre, margins, eps


def _solved(passes, ball, splits, eps, gap=np.inf):
    """`(sound bounds [n, C] with the programs' multipliers, LinearLeaves)`."""
    n, size = splits.shape
    s = splits.astype(np.float64)
    los, his, deltas, empty = ball.layer_boxes(s)
    forms = passes.forms(ball.xt, ball.pt, los, his, deltas, s)
    betas = np.zeros((n, passes.rows, size))
    sol = solve_leaves(forms, splits, betas, np.full((n, passes.rows), -np.inf), eps, gap)
    lower, *_ = passes.bounds(ball.xt, ball.pt, ball.et, los, his, deltas, s, sol.betas)
    return np.where(empty[:, None], np.inf, lower.numpy()), sol


@pytest.mark.slow
def test_programs_make_complete_leaves_exact_and_stay_sound(setup):
    passes, ball, x, pts, pre, margins, eps = setup
    rng = np.random.default_rng(1)
    picks = rng.choice(len(pts), size=8, replace=False)
    splits = np.where(pre[picks] >= 0, 1, -1).astype(np.int8)  # every unit split
    lower, sol = _solved(passes, ball, splits, eps)
    for k in range(len(splits)):
        inside = np.all(splits[k] * pre >= 0, axis=1)
        true = margins[inside].min(axis=0)
        assert np.all(lower[k] <= true + 1e-9), (k, lower[k], true)
        # the grid's minimum is within 0.01 of the leaf's (zero multipliers, the
        # relaxation without the program, are 0.1-0.8 below it on most of these leaves)
        assert np.all(lower[k] >= true - 0.01), (k, lower[k], true)
    # the minimisers are points of the ball with the program's margins
    assert np.all(np.abs(sol.points) <= eps * (1 + 1e-9))


@pytest.mark.slow
def test_infeasible_patterns_are_bounded_above_the_gap(setup):
    passes, ball, x, pts, pre, margins, eps = setup
    rng = np.random.default_rng(2)
    splits = rng.choice([-1, 1], size=(16, pre.shape[1])).astype(np.int8)
    lower, _ = _solved(passes, ball, splits, eps, gap=0.5)
    empty = 0
    for k in range(len(splits)):
        inside = np.all(splits[k] * pre >= 0, axis=1)
        if inside.any():
            assert np.all(lower[k] <= margins[inside].min(axis=0) + 1e-9)
        else:
            empty += 1
    assert empty >= 8
    # an empty pattern may keep a bound <= the gap only where the program was feasible
    # on its closure (a leaf of measure zero); most are closed by their multipliers
    assert np.sum(np.all(lower > 0.5, axis=1)) >= empty - 2


@pytest.mark.slow
def test_a_negative_minimum_is_an_adversarial_point(setup):
    passes, ball, x, pts, pre, margins, eps = setup
    low = np.argmin(margins.min(axis=1))  # the grid point with the smallest margin
    assert margins[low].min() < 0
    splits = np.where(pre[low:low + 1] >= 0, 1, -1).astype(np.int8)
    _, sol = _solved(passes, ball, splits, eps, gap=0.0)
    assert sol.below[0] < 0
    point = x + sol.points[0]
    assert np.abs(point - x).max() <= eps * (1 + 1e-9)
    assert np.argmax(forward(affine_stack(ball.model), point[None])) != ball.pred
