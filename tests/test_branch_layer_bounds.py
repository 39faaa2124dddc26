"""The layer bounds of branch and bound's leaves with split multipliers and slopes
(beta-CROWN's constraints in the intermediate bounds), against a dense grid.

* Random multipliers `beta >= 0` per bound row (on the splits of the op itself and of
  earlier ops) and random lower slopes per row (some outside the slope range) keep
  every leaf's bound of every unit of every layer below the smallest value over the
  grid's points of the ball that lie in the leaf (2-D network, numpy layer by layer).
* The optimized layer bounds (`split_refiner`, as `LeafPasses` runs them) hold every
  grid point of each leaf, and are tighter than CROWN's on the cut intervals.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_roll.compile.bounds import capture
from keras_roll.compile.bounds.splits import SplitRelaxedOps, root_boxes, split_row_bounds
from keras_roll.compile.twin import linearize
from keras_roll.robust.subdomains import LeafPasses
from tests.test_robust_exact import _mlp, affine_stack, pre_activations

EPS = 0.6


def _case(p, seed=0):
    """`(twin, x, grid pre-activations [n, 20], leaf splits [8, 20])` on a 2-D 10-10 net:
    leaf 0 unsplit, leaves 1-5 split as a grid point has its units, 6-7 at random."""
    model = _mlp((10, 10), 0.0, 2, 3, 5)
    stages = affine_stack(model)
    twin = linearize(model).at_dtype("float64")
    rng = np.random.default_rng(seed)
    x = rng.normal(size=2)
    t = np.linspace(-EPS, EPS, 161)
    pts = x + np.stack(np.meshgrid(t, t), -1).reshape(-1, 2)
    if p == 2:
        pts = pts[np.sum((pts - x) ** 2, axis=1) <= EPS * EPS]
    pre = np.concatenate(pre_activations(stages, pts)[0], axis=1)
    splits = np.zeros((8, pre.shape[1]), np.int8)
    for k in range(1, 8):
        units = rng.choice(pre.shape[1], size=rng.integers(2, 9), replace=False)
        side = (np.sign(pre[rng.integers(len(pre)), units]) if k < 6
                else rng.choice([-1, 1], size=units.size))
        splits[k, units] = np.where(side == 0, 1, side)
    return twin, x, pre, splits, rng


def _inside(splits, pre):
    return np.all((splits == 0) | (splits * pre >= 0), axis=1)


@pytest.mark.parametrize("p", [np.inf, 2])
def test_random_layer_multipliers_and_slopes_stay_sound(p):
    twin, x, pre, splits, rng = _case(p)
    passes = LeafPasses(twin, p, False, twin.memory_budget, 8, layer_steps=0)
    values = capture(twin.interpreter, tf.constant(x[None]))
    lines = SplitRelaxedOps(values, passes.layout, tf.constant(splits, tf.float64))
    boxes = root_boxes(passes.structure, values, EPS, p, passes.arithmetic, passes.budget,
                       lines, examples=8)
    size = passes.layout.size
    checked = 0
    for index, start in zip(passes.layout.indices, passes.layout.offsets):
        z0 = values.inputs[index][0].numpy().ravel()
        n = z0.size
        eye = np.eye(n)
        lam = tf.constant(np.concatenate([eye, -eye])[None])  # rows +e_j, -e_j
        betas = rng.exponential(0.05, size=(8, 2 * n, size)) * (splits != 0)[:, None]
        for i in lines.optimizable():
            if i < index:
                shape = values.inputs[i][0].shape[1:]
                lines.set_lower_slopes(i, tf.constant(
                    rng.uniform(-0.5, 1.5, size=(8, 2 * n, *shape))))
        low = split_row_bounds(passes.structure, values, lines, index, lam,
                               tf.constant(betas), boxes.deltas, EPS, p).numpy()
        for i in lines.optimizable():
            lines.set_lower_slopes(i, None)
        z = pre[:, start:start + n] - z0
        for k in range(8):
            ok = _inside(splits[k], pre)
            if ok.any():
                truth = np.concatenate([z[ok].min(axis=0), -z[ok].max(axis=0)])
                assert np.all(low[k] <= truth + 1e-9), (index, k, low[k] - truth)
                checked += 1
    assert checked >= 12


@pytest.mark.parametrize("p", [np.inf, 2])
def test_optimized_layer_bounds_hold_the_leaves_and_are_tighter(p):
    twin, x, pre, splits, _ = _case(p, seed=1)
    tight = LeafPasses(twin, p, False, twin.memory_budget, 8, layer_steps=8)
    plain = LeafPasses(twin, p, False, twin.memory_budget, 8, layer_steps=0)
    xt, et, st = tf.constant(x[None]), tf.constant(EPS, tf.float64), tf.constant(
        splits.astype(np.float64))
    los, his, _, empty = tight.boxes(xt, et, st)
    los0, his0, _, _ = plain.boxes(xt, et, st)
    values = capture(twin.interpreter, tf.constant(x[None]))
    widths = [0.0, 0.0]
    for (lo, hi, lo0, hi0), index, start in zip(zip(los, his, los0, his0),
                                                tight.layout.indices, tight.layout.offsets):
        z0 = values.inputs[index][0].numpy().ravel()
        z = pre[:, start:start + z0.size] - z0
        for k in range(8):
            ok = _inside(splits[k], pre)
            if ok.any():
                assert not empty[k]
                assert np.all(lo[k].numpy().ravel() <= z[ok].min(axis=0) + 1e-9)
                assert np.all(hi[k].numpy().ravel() >= z[ok].max(axis=0) - 1e-9)
        widths[0] += float(np.sum(np.minimum(hi - lo, 10.0)))
        widths[1] += float(np.sum(np.minimum(hi0 - lo0, 10.0)))
    assert widths[0] < 0.99 * widths[1], widths
