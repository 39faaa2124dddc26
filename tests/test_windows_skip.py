"""The receptive-field windows pull back each example's own rows only
(`keras_roll.compile.bounds.windows.ConvWindows.bounds`' `need`, the rows
`priors.stable_skip` names): the margins' lower bounds and their linear form are those
of the windows that pull back every row, on random CNNs ("valid" and "same"
convolutions), with and without a prior, under the worst-case guard and rigor
"float64"; the skipped units' boxes still hold the Keras pre-activations of points
sampled in the ball; an affine value's `+e_j` rows alone give both bounds, bit for bit.

The subjects are small float64 CNNs (a `Rescaling`, two ReLU convolutions, a dense ReLU
layer) with random weights and biases, so that some units are stable and some open."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll.compile.bounds.crown as crown
from keras_roll.compile.bounds import capture
from keras_roll.compile.bounds.crown import RelaxedOps, relaxation_refiner
from keras_roll.compile.bounds.ibp import interval_pass
from keras_roll.compile.bounds.windows import conv_windows
from keras_roll.compile.rules import Activation
from keras_roll.compile.structure import structure_of
from keras_roll.compile.twin import linearize
from keras_roll.robust.bounds import arithmetic_of, relaxed_margins
from tests.model_zoo import float64_layers

L = keras.layers
B = 3


def _cnn(seed: int, padding: str):
    keras.utils.set_random_seed(seed)
    with float64_layers():
        inp = keras.Input((10, 10, 1))
        h = L.Rescaling(0.5)(inp)
        c1 = L.Conv2D(4, 3, strides=2, padding=padding, bias_initializer="random_normal")(h)
        c2 = L.Conv2D(5, 2, padding=padding, bias_initializer="random_normal")(L.ReLU()(c1))
        d = L.Dense(8, bias_initializer="random_normal")(L.Flatten()(L.ReLU()(c2)))
        out = L.Dense(3)(L.ReLU()(d))
        return keras.Model(inp, out), keras.Model(inp, [c1, c2, d])


@functools.lru_cache(maxsize=4)
def _setup(seed: int, padding: str):
    model, parts = _cnn(seed, padding)
    x = np.random.default_rng(seed).uniform(0, 1, (B, 10, 10, 1))
    pred = np.argmax(model(x).numpy(), axis=1)
    # one twin per variant: each compiles its own pass
    return linearize(model).at_dtype("float64"), _clone(model), parts, x, pred


def _clone(model):
    copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return linearize(copy).at_dtype("float64")


def _margins(twin, x, pred, eps, guard, skip: bool, prior=None):
    """`relaxed_margins` with the windows' inactive rows skipped (`skip`) or all pulled
    back (`stable_skip` answering None while the pass traces)."""
    saved = crown.stable_skip
    if not skip:
        crown.stable_skip = lambda *args: None
    try:
        return relaxed_margins(twin, x, pred, eps, np.inf, guard=guard, prior=prior)
    finally:
        crown.stable_skip = saved


@pytest.mark.parametrize("seed,padding,guard", [(0, "valid", True), (1, "same", "float64"),
                                                (2, "valid", "float64")])
def test_skipped_rows_keep_the_margins_bounds(seed, padding, guard):
    """The margins' lower bounds, offsets and slopes with the inactive rows skipped
    equal those of every row (no looser: a skipped unit's lines are its piece, exact,
    whatever its bounds, its output 0), at a radius and again with the larger ball's
    prior; the second convolution has inactive (skipped), active and open units."""
    twin, other, _, x, pred = _setup(seed, padding)
    eps = np.array([0.05, 0.1, 0.2])
    out = {}
    for skip, t in ((True, twin), (False, other)):
        big = _margins(t, x, pred, 1.5 * eps, guard, skip)
        out[skip] = (big, _margins(t, x, pred, eps, guard, skip, prior=big.boxes))
    for a, b in zip(out[True], out[False]):
        for field in ("lower", "offset", "slope"):
            np.testing.assert_allclose(getattr(a, field), getattr(b, field), rtol=1e-12,
                                       atol=1e-14)
        assert np.all(a.lower >= b.lower)
    # the second convolution's units: some stable (skipped), some open
    structure = structure_of(twin.program)
    values = capture(twin.interpreter, tf.constant(x))
    acts = [i for i, n in enumerate(structure.nodes) if isinstance(n.op, Activation)]
    at = 2 * int(np.prod(values.inputs[acts[0]][0].shape[1:]))
    n = int(np.prod(values.inputs[acts[1]][0].shape[1:]))
    z0 = values.inputs[acts[1]][0].numpy().reshape(B, -1)
    boxes = out[True][1].boxes
    lo, hi = z0 + boxes[:, at:at + n], z0 + boxes[:, at + n:at + 2 * n]
    assert np.any((lo < 0) & (hi > 0)) and np.any(hi <= 0) and np.any(lo >= 0)


@pytest.mark.parametrize("seed,padding", [(0, "valid"), (1, "same")])
def test_skipped_units_boxes_hold_sampled_pre_activations(seed, padding):
    """With the inactive rows skipped and a larger ball's prior, every refined interval
    holds the Keras pre-activations (float64 model) of 200 points sampled in the l_inf
    ball, its corners among them, under the worst-case guard."""
    twin, _, parts, x, pred = _setup(seed, padding)
    eps = np.array([0.1, 0.15, 0.2])
    big = relaxed_margins(twin, x, pred, 1.5 * eps, np.inf, guard=True)
    held = relaxed_margins(twin, x, pred, eps, np.inf, guard=True, prior=big.boxes)
    u = np.random.default_rng(seed + 5).uniform(-1, 1, (200, *x.shape))
    u[0], u[1] = 1.0, -1.0
    u[2:40] = np.sign(u[2:40])
    at_x = [t.numpy().reshape(B, -1) for t in parts(x)]
    outs = [t.numpy().reshape(200, B, -1)
            for t in parts((x[None] + eps[None, :, None, None, None] * u).reshape(-1, 10, 10, 1))]
    at = 0
    for z, z0 in zip(outs, at_x):
        n = z0.shape[1]
        lo, hi = held.boxes[:, at:at + n], held.boxes[:, at + n:at + 2 * n]
        assert np.all(z - z0 >= lo - 1e-12) and np.all(z - z0 <= hi + 1e-12)
        at += 2 * n


def test_affine_rows_give_both_bounds():
    """The first convolution's units are affine in the input: their `+e_j` rows alone
    (`affine=True`, upper = -lower) give the bounds that pulling back both signs gives,
    bit for bit, with the rounding guard; the second convolution's windows, asked for
    some rows only, bound those rows as when asked for all and leave the others at
    -inf / inf."""
    twin, _, _, x, _ = _setup(0, "valid")
    structure = structure_of(twin.program)
    values = capture(twin.interpreter, tf.constant(x))
    radii = tf.fill([B], tf.constant(0.1, tf.float64))
    acts = [(i, n) for i, n in enumerate(structure.nodes) if isinstance(n.op, Activation)]
    seen = {}

    def refine(node, index, box, boxes, deltas):
        view = conv_windows(structure, values, node.inputs[0])
        if view is not None:
            pull = crown._window_pull(view.windowed, node.inputs[0], np.inf,
                                      crown.RoundingLoss)
            args = (lines.lines, deltas, radii, 2**40, B, pull)
            n = view.positions * view.channels
            some = tf.constant(np.random.default_rng(index).uniform(size=(B, n)) < 0.3)
            seen[index] = [[t.numpy() for t in view.bounds(*args)],
                           [t.numpy() for t in view.bounds(*args, need=(some, ~some))],
                           some.numpy()]
            if index == acts[0][0]:
                seen[index].append([t.numpy() for t in view.bounds(*args, affine=True)])
        return inner(node, index, box, boxes, deltas)

    lines = RelaxedOps(values)
    inner = relaxation_refiner(structure, values, lines, radii, np.inf, 2**40, B)
    interval_pass(structure, values, radii, arithmetic_of(twin, True), refine=refine)
    (first, _), (second, _) = acts[0], acts[1]
    for got, want in zip(seen[first][3], seen[first][0]):
        np.testing.assert_array_equal(got, want)
    (lo, hi), (slo, shi), some = seen[second][:3]
    assert 0 < some.sum() < some.size
    np.testing.assert_array_equal(slo[some], lo[some])
    np.testing.assert_array_equal(shi[~some], hi[~some])
    assert np.all(slo[~some] == -np.inf) and np.all(shi[some] == np.inf)
