"""CROWN's layer bounds of a "valid" convolution's units pulled back through their
receptive fields (`keras_roll.compile.bounds.windows`) equal those of the whole
network's pull-back (every unit's rows, `windows=False, skip_stable=False`) to float64
rounding, in one chunk and in several, with and without the rounding guard, under
both rigors of `robust_radius`; every box holds the values at points sampled in the
ball; convolutions with "same" padding get windows too; a batch
normalization between convolutions keeps the windows; `crown_cost` counts them.

The subject is a small CNN with a leading `Rescaling` and three "valid" ReLU
convolutions (strides 2, 1, 1) before a dense ReLU layer, float64 weights."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll.compile.bounds.intermediate as intermediate
import keras_roll.robust.bounds as robust_bounds
from keras_roll.compile.bounds import BoundMethod, capture, crown_cost
from keras_roll.compile.bounds.crown import RelaxedOps, relaxation_refiner
from keras_roll.compile.bounds.ibp import interval_pass
from keras_roll.compile.bounds.windows import conv_windows
from keras_roll.compile.rules import Activation
from keras_roll.compile.structure import structure_of
from keras_roll.compile.twin import linearize
from keras_roll.robust.bounds import arithmetic_of

L = keras.layers
B = 2


def _cnn(padding="valid"):
    keras.utils.set_random_seed(3)
    inp = keras.Input((12, 12, 1))
    h = L.Rescaling(0.5)(inp)
    h = L.Conv2D(3, 3, strides=2, padding=padding, activation="relu")(h)
    h = L.Conv2D(4, 2, padding=padding, activation="relu")(h)
    h = L.Conv2D(3, 2, padding=padding, activation="relu")(h)
    h = L.Dense(6, activation="relu")(L.Flatten()(h))
    return keras.Model(inp, L.Dense(4)(h))


@functools.lru_cache(maxsize=2)
def _setup(padding="valid"):
    twin = linearize(_cnn(padding)).at_dtype("float64")
    x = np.random.default_rng(0).uniform(0, 1, (B, 12, 12, 1))
    values = capture(twin.interpreter, tf.convert_to_tensor(x))
    return twin, structure_of(twin.program), x, values


def _refiner(windows, skip=None):
    skip = windows if skip is None else skip
    return functools.partial(relaxation_refiner, windows=windows, skip_stable=skip)


def _boxes(eps, windows, p=np.inf, guard=False, budget=2**40, skip=None):
    """`({key: (lo, hi)}, keys)` of every activation input (numpy)."""
    twin, structure, _, values = _setup()
    keys = [n.inputs[0] for n in structure.nodes if isinstance(n.op, Activation)]
    radii = tf.fill([B], tf.constant(eps, tf.float64))
    refine = _refiner(windows, skip)(structure, values, RelaxedOps(values), radii, p, budget,
                                     B)
    boxes = interval_pass(structure, values, radii, arithmetic_of(twin, guard),
                          refine=refine).boxes
    return {k: (boxes[k].lo.numpy(), boxes[k].hi.numpy()) for k in keys}, keys


def test_windows_of_valid_convolutions_only():
    """Every convolution's units get windows (3x3, 5x5 and 7x7 of the 12x12 input); the
    dense layer's and any unit after a "same" convolution do not."""
    _, structure, _, values = _setup()
    keys = [n.inputs[0] for n in structure.nodes if isinstance(n.op, Activation)]
    plans = [conv_windows(structure, values, k) for k in keys]
    assert plans[3] is None  # the dense layer's input
    assert [v.plan[structure.input_key][1:] for v in plans[1:3]] == [((5, 5), (2, 2)),
                                                                     ((7, 7), (2, 2))]
    assert plans[0].positions == 25 and plans[0].plan[structure.input_key].size == (3, 3)
    _, same, _, same_values = _setup("same")  # "same" convolutions: windows past the border
    assert conv_windows(same, same_values, [n.inputs[0] for n in same.nodes
                                            if isinstance(n.op, Activation)][1]) is not None


@pytest.mark.parametrize("p", [np.inf, 2])
def test_windowed_bounds_are_the_dense_bounds(p):
    """Every activation input's box equals the dense pull-back's to float64 rounding
    (without the guard), in one chunk and in several (a 48 kB budget: three chunks or
    four); with the inactive units' rows skipped, where each example's rows are pulled
    back (`_same_where_pulled`)."""
    eps = 0.15 if p == np.inf else 0.6
    ref, keys = _boxes(eps, windows=False, p=p)
    _, structure, _, values = _setup()
    for budget in (2**40, 48000):
        every, _ = _boxes(eps, windows=True, p=p, budget=budget, skip=False)
        got, _ = _boxes(eps, windows=True, p=p, budget=budget)
        for k in keys:
            for side in (0, 1):
                np.testing.assert_allclose(every[k][side], ref[k][side], rtol=1e-10,
                                           atol=1e-13)
            _same_where_pulled(got[k], ref[k], values.value(structure, k).numpy())
    z = ref[keys[2]]
    assert np.any(z[0] + 1e-9 < 0) and np.any(z[1] > 1e-9)  # the ball is not trivial


def _same_where_pulled(got, ref, z0):
    """The box `got` (inactive units' rows skipped) equals `ref` (every row pulled back)
    where its own example's rows were pulled back (the units it does not prove
    inactive), and holds `ref` elsewhere with the same signs."""
    lo, hi, ref_lo, ref_hi = (np.reshape(t, (B, -1)) for t in (*got, *ref))
    z0 = np.reshape(z0, (B, -1))
    positive = z0 + hi > 0
    np.testing.assert_allclose(lo[positive], ref_lo[positive], rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(hi[positive], ref_hi[positive], rtol=1e-10, atol=1e-13)
    assert np.all(lo <= ref_lo + 1e-13) and np.all(hi >= ref_hi - 1e-13)
    for a, b in ((lo, ref_lo), (hi, ref_hi)):
        np.testing.assert_array_equal(z0 + a > 0, z0 + b > 0)
        np.testing.assert_array_equal(z0 + a < 0, z0 + b < 0)


def test_windowed_boxes_hold_sampled_values():
    """200 points sampled in the l_inf ball (with two corners) stay inside every
    activation input's box of the windowed pass with the rounding guard."""
    twin, _, x, values = _setup()
    eps = 0.15
    got, keys = _boxes(eps, windows=True, guard=True)
    u = np.random.default_rng(1).uniform(-1, 1, (200, *x.shape))
    u[0], u[1] = 1.0, -1.0
    pts = (x[None] + eps * u).reshape(-1, *x.shape[1:])
    v = capture(twin.interpreter, tf.convert_to_tensor(pts))
    structure = structure_of(twin.program)
    for k in keys:
        z = v.value(structure, k).numpy().reshape(200, B, -1)
        d = z - values.value(structure, k).numpy().reshape(1, B, -1)
        assert np.all(d >= got[k][0].reshape(1, B, -1) - 1e-12)
        assert np.all(d <= got[k][1].reshape(1, B, -1) + 1e-12)


@pytest.mark.parametrize("mode", ["strict", "float64"])
def test_robust_radius_passes_under_both_rigors(mode):
    """The compiled pass of `robust_radius` (`relaxed_margins`' function) gives the same
    lower bounds and linear form with and without windows, under the worst-case
    guard and under rigor "float64" (whose noise terms are cut into the windows), with
    the inactive units' rows skipped in the windows or not."""
    twin, _, x, _ = _setup()
    args = (tf.constant(x), tf.constant([0, 1], tf.int64), tf.constant([0.1, 0.15],
                                                                         tf.float64))
    out = {}
    saved = robust_bounds.relaxation_refiner
    for windows in (True, False):
        robust_bounds.relaxation_refiner = _refiner(windows)
        try:
            out[windows] = [t.numpy() for t in robust_bounds._bounds_fn(
                twin, BoundMethod.RELAXATION, mode, 2**26, B, None, *args, np.inf)]
        finally:
            robust_bounds.relaxation_refiner = saved
    for got, ref in zip(out[True], out[False]):
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-13)


def test_cost_counts_the_windows():
    """`crown_cost` counts the windows' work: less than the dense rows' on this CNN;
    CROWN-IBP's cost (one pull-back of the output's rows) does not change."""
    _, structure, _, values = _setup()
    crown, ibp = crown_cost(structure, values, 3, examples=B)
    saved = intermediate.conv_windows
    intermediate.conv_windows = lambda *args: None
    try:
        dense, dense_ibp = crown_cost(structure, values, 3, examples=B)
    finally:
        intermediate.conv_windows = saved
    assert ibp == dense_ibp
    assert ibp.elements < crown.elements < dense.elements


def test_batch_norm_between_convolutions():
    """A channels-last `BatchNormalization` (with moved statistics) between two "valid"
    convolutions keeps the windows, with the dense pull-back's bounds."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((9, 9, 1))
    h = L.Conv2D(3, 3, strides=2, activation="relu")(inp)
    bn = L.BatchNormalization()
    h = L.Conv2D(4, 2, activation="relu")(bn(h))
    model = keras.Model(inp, L.Dense(3)(L.Flatten()(h)))
    rng = np.random.default_rng(5)
    bn.set_weights([rng.uniform(0.5, 2, 3), rng.normal(size=3), rng.normal(size=3),
                    rng.uniform(0.5, 2, 3)])
    twin = linearize(model).at_dtype("float64")
    structure = structure_of(twin.program)
    values = capture(twin.interpreter, tf.constant(rng.uniform(0, 1, (B, 9, 9, 1))))
    key = [n.inputs[0] for n in structure.nodes if isinstance(n.op, Activation)][1]
    assert conv_windows(structure, values, key) is not None
    radii = tf.fill([B], tf.constant(0.2, tf.float64))
    got = []
    for windows, skip in ((True, False), (False, False), (True, True)):
        refine = _refiner(windows, skip)(structure, values, RelaxedOps(values), radii,
                                         np.inf, 2**40, B)
        box = interval_pass(structure, values, radii, arithmetic_of(twin, True),
                            refine=refine).boxes[key]
        got.append((box.lo.numpy(), box.hi.numpy()))
    assert np.any(got[1][0] < -1e-9)  # some unit can turn negative
    for a, b in zip(got[0], got[1]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
    _same_where_pulled(got[2], got[1], values.value(structure, key).numpy())
