"""CROWN's layer bounds pull back rows only for the units whose interval holds a
breakpoint, and the upper rows of the positive ones (`relaxation_refiner(skip_stable=True)`,
the default): the final bounds are
those of the pass that pulls back every unit's rows, the open units' bounds are equal,
every box holds the values at points sampled in the ball, and a ball so small that no
unit is open (no row pulled back at all) still gives sound bounds.

The subject is a small strided CNN (two ReLU conv layers and a dense ReLU layer), as
`benchmarks.cnn_models` has them, with float64 weights and the rounding guard."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll.compile.bounds.methods as methods
from keras_roll.compile.bounds import BoundMethod, capture, lower_bounds
from keras_roll.compile.bounds.crown import RelaxedOps, open_units, relaxation_refiner
from keras_roll.compile.bounds.ibp import interval_pass
from keras_roll.compile.bounds.priors import prior_open
from keras_roll.compile.rules import Activation
from keras_roll.compile.structure import structure_of
from keras_roll.compile.twin import linearize
from keras_roll.robust.bounds import arithmetic_of

L = keras.layers
B = 3


def _cnn():
    keras.utils.set_random_seed(5)
    inp = keras.Input((8, 8, 1))
    h = L.Conv2D(4, 3, strides=2, padding="same", activation="relu")(inp)
    h = L.Conv2D(6, 3, strides=2, padding="same", activation="relu")(h)
    h = L.Dense(12, activation="relu")(L.Flatten()(h))
    return keras.Model(inp, L.Dense(4)(h))


@functools.lru_cache(maxsize=1)
def _setup():
    twin = linearize(_cnn()).at_dtype("float64")
    x = np.random.default_rng(0).uniform(0, 1, (B, 8, 8, 1))
    return twin, structure_of(twin.program), x


def _rows():
    eye = np.eye(4)
    return tf.constant((eye[1:] - eye[:1])[None])


def _lower(eps, skip, budget=2**40, p=np.inf, guard=True):
    twin, structure, x = _setup()
    values = capture(twin.interpreter, tf.convert_to_tensor(x))
    saved = methods.relaxation_refiner
    methods.relaxation_refiner = functools.partial(relaxation_refiner, skip_stable=skip)
    try:
        return lower_bounds(structure, values, _rows(), tf.fill([B], eps), p,
                            BoundMethod.RELAXATION, arithmetic_of(twin, guard=guard),
                            budget, B).numpy()
    finally:
        methods.relaxation_refiner = saved


def _boxes(eps, skip, guard=False):
    twin, structure, x = _setup()
    values = capture(twin.interpreter, tf.convert_to_tensor(x))
    lines = RelaxedOps(values)
    refine = relaxation_refiner(structure, values, lines, tf.fill([B], eps), np.inf, 2**40,
                                B, skip_stable=skip)
    boxes = interval_pass(structure, values, tf.fill([B], eps), arithmetic_of(twin, guard),
                          refine=refine).boxes
    acts = [(i, n) for i, n in enumerate(structure.nodes) if isinstance(n.op, Activation)]
    return boxes, acts, lines


# l2 slow: the same skipping of stable units as l_inf, with another dual norm in the
# first layer's bound (test_alpha_crown's l2 cases cover that norm by default).
@pytest.mark.parametrize("p", [np.inf, pytest.param(2, marks=pytest.mark.slow)])
def test_final_bounds_are_those_of_every_row(p):
    """Without rounding terms, the margins' lower bounds with stable units skipped are
    those of the pass that pulls back every unit's rows (to float64 rounding), in one
    chunk and in several. With the rounding guard, a stable unit's wider interval
    widens the rounding bounds that scale with it: the bounds are looser by at most
    1e-6 (the margins are about 1e-2 here; the guard's terms about 1e-6), and equal
    where every later interval is looser than CROWN's bounds."""
    eps = 0.05
    got = _lower(eps, skip=True, budget=4096, p=p, guard=False)  # several chunks
    np.testing.assert_allclose(got, _lower(eps, skip=False, p=p, guard=False),
                               rtol=1e-10, atol=1e-13)
    got, ref = _lower(eps, skip=True, p=p), _lower(eps, skip=False, p=p)
    assert np.all(got >= ref - 1e-6), got - ref


def test_open_units_keep_their_bounds_and_every_box_holds_sampled_values():
    """Some units are stable and some open; the open ones' boxes equal the all-rows
    pass's, and 200 points sampled in the l_inf ball (with its corners) stay inside
    every activation input's box (with the rounding guard: the twin rounds)."""
    eps = 0.08
    twin, structure, x = _setup()
    ref, acts, _ = _boxes(eps, skip=False)
    got, _, lines = _boxes(eps, skip=True)
    keys = [n.inputs[0] for _, n in acts]
    opened = 0
    for (i, node), key in zip(acts, keys):
        lower, upper = (m.numpy() for m in open_units(node, lines, i, got[key]))
        assert lower.sum() <= upper.sum() <= lower.size
        opened += lower.size - lower.sum()  # stable units: no lower row
        # the units of a convolution (windows) pull back each example's own rows
        own = [m.numpy() for m in prior_open(lines.values.inputs[i][0], got[key])]
        for side, mask in (("lo", own[0]), ("hi", own[1])):
            np.testing.assert_allclose(np.reshape(getattr(got[key], side), (B, -1))[mask],
                                       np.reshape(getattr(ref[key], side), (B, -1))[mask],
                                       rtol=1e-12, atol=1e-14)
    assert opened > 0  # some units are skipped
    got, _, _ = _boxes(eps, skip=True, guard=True)
    u = np.random.default_rng(1).uniform(-1, 1, (200, *x.shape))
    u[0], u[1] = 1.0, -1.0
    for j in range(0, 200, 50):
        pts = (x[None] + eps * u[j:j + 50]).reshape(-1, *x.shape[1:])
        v = capture(twin.interpreter, tf.convert_to_tensor(pts))
        for (i, _), key in zip(acts, keys):
            z = v.inputs[i][0].numpy().reshape(50, B, -1)
            z0 = capture(twin.interpreter, tf.convert_to_tensor(x)).inputs[i][0].numpy()
            d = z - z0.reshape(1, B, -1)
            assert np.all(d >= got[key].lo.numpy().reshape(1, B, -1) - 1e-12)
            assert np.all(d <= got[key].hi.numpy().reshape(1, B, -1) + 1e-12)


def test_no_open_unit_pulls_back_no_row_and_stays_sound():
    """At a tiny radius every unit is stable: no row is pulled back (the loop runs no
    chunk), and the bounds hold at the ball's corners and equal the all-rows pass's."""
    twin, structure, x = _setup()
    eps = 1e-7
    got = _lower(eps, skip=True)
    np.testing.assert_allclose(got, _lower(eps, skip=False), rtol=1e-9, atol=1e-14)
    boxes, acts, lines = _boxes(eps, skip=True)
    assert all(not open_units(n, lines, i, boxes[n.inputs[0]])[0].numpy().any()
               for i, n in acts)
    f0 = twin.primal(x).logits.numpy()
    for s in (1.0, -1.0):
        f = twin.primal(x + s * eps).logits.numpy()
        d = (f - f0)[:, 1:] - (f - f0)[:, :1]
        assert np.all(d >= got - 1e-12)
