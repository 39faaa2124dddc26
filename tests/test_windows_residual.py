"""CROWN's layer bounds through receptive fields on a residual CNN (the layers of
`keras_roll.models.resnet18`, small): "same" convolutions at strides 1 and 2, explicit
zero padding before a "valid" convolution, batch normalizations, a "valid" average
pooling and residual `Add`s (one with a strided 1x1 shortcut). Every activation
input's box equals the dense pull-back's (every unit's rows through the whole
network, `windows=False`; every unit's rows in both) to 1e-10, under l_inf and l2, in one
chunk and in several; 300 points sampled in the ball stay inside every box.

The windows' locality comes from the rules (`Op.local`): a layer without it (here the
dense head) keeps the dense rows."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_roll.compile.bounds import capture
from keras_roll.compile.bounds.crown import RelaxedOps, relaxation_refiner
from keras_roll.compile.bounds.ibp import interval_pass
from keras_roll.compile.bounds.windows import conv_windows
from keras_roll.compile.rules import Activation
from keras_roll.compile.structure import structure_of
from keras_roll.compile.twin import linearize
from keras_roll.robust.bounds import arithmetic_of

L = keras.layers
B = 2
SHAPE = (16, 16, 2)


def _bn(h, rng):
    bn = L.BatchNormalization()
    out = bn(h)
    c = int(h.shape[-1])
    bn.set_weights([rng.uniform(0.5, 2, c), rng.normal(size=c), rng.normal(size=c) * 0.1,
                    rng.uniform(0.5, 2, c)])
    return out


def _resnet():
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(8)
    inp = keras.Input(SHAPE)
    h = L.Rescaling(0.5)(inp)
    a = L.ReLU()(_bn(L.Conv2D(4, 3, strides=2, padding="same")(h), rng))        # 5x5
    h = L.ReLU()(_bn(L.Conv2D(4, 3)(L.ZeroPadding2D(1)(a)), rng))
    h = L.ReLU()(L.Add()([_bn(L.Conv2D(4, 3, padding="same")(h), rng), a]))
    r = L.Conv2D(5, 3, strides=2, padding="same", activation="relu")(h)          # 3x3
    r = L.Conv2D(5, 3, padding="same")(r)
    r = L.ReLU()(L.Add()([r, L.Conv2D(5, 1, strides=2)(h)]))
    r = L.AveragePooling2D(2, strides=1)(r)                                      # 2x2
    return keras.Model(inp, L.Dense(3)(L.Flatten()(L.Dense(4, activation="relu")(r))))


@functools.lru_cache(maxsize=1)
def _setup():
    twin = linearize(_resnet()).at_dtype("float64")
    x = np.random.default_rng(0).uniform(0, 1, (B, *SHAPE))
    structure = structure_of(twin.program)
    return twin, structure, x, capture(twin.interpreter, tf.convert_to_tensor(x))


def _keys(structure):
    return [n.inputs[0] for n in structure.nodes if isinstance(n.op, Activation)]


def _boxes(eps, windows, p, budget=2**40, guard=False):
    twin, structure, _, values = _setup()
    radii = tf.fill([B], tf.constant(eps, tf.float64))
    refine = relaxation_refiner(structure, values, RelaxedOps(values), radii, p, budget, B,
                                windows=windows, skip_stable=False)
    boxes = interval_pass(structure, values, radii, arithmetic_of(twin, guard),
                          refine=refine).boxes
    return {k: (boxes[k].lo.numpy(), boxes[k].hi.numpy()) for k in _keys(structure)}


def test_residual_units_get_windows():
    """The units of the first four convolutions get windows, through the padding, the
    strides and the first residual Add (the fifth's windows would be larger than the
    image); the dense head's do not (a Dense on images is not local)."""
    _, structure, _, values = _setup()
    views = [conv_windows(structure, values, k) for k in _keys(structure)]
    assert all(v is not None for v in views[:4]) and views[4] is None and views[5] is None
    first = views[0].plan[structure.input_key]  # "same" at stride 2 pads after the image
    assert (first.start, first.size, first.stride) == ((0, 0), (3, 3), (2, 2))
    third = views[2].plan[structure.input_key]  # past both borders
    assert (third.start, third.size) == ((-4, -4), (11, 11))


@pytest.mark.parametrize("p, eps", [(np.inf, 0.04),
                                    pytest.param(2, 0.25, marks=pytest.mark.slow)])
def test_residual_windows_equal_the_dense_bounds(p, eps):
    """The boxes equal the dense pull-back's to 1e-10 in one chunk and in several (a
    4 MiB budget: two or three chunks a layer), and some units are unstable."""
    ref = _boxes(eps, False, p)
    for budget in (2**40, 2**22):
        got = _boxes(eps, True, p, budget)
        for k, (lo, hi) in ref.items():
            np.testing.assert_allclose(got[k][0], lo, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(got[k][1], hi, rtol=1e-10, atol=1e-12)
    lo, hi = ref[_keys(_setup()[1])[4]]
    assert np.any(lo < -1e-9) and np.any(hi > 1e-9)


def test_residual_windows_hold_sampled_points():
    """300 points in the l_inf ball (two of them corners) stay inside every activation
    input's box of the windowed pass under the rounding guard."""
    twin, structure, x, values = _setup()
    eps = 0.04
    got = _boxes(eps, True, np.inf, budget=2**22, guard=True)
    u = np.random.default_rng(1).uniform(-1, 1, (300, *x.shape))
    u[0], u[1] = 1.0, -1.0
    v = capture(twin.interpreter, tf.convert_to_tensor((x[None] + eps * u).reshape(
        -1, *SHAPE)))
    for k, (lo, hi) in got.items():
        d = (v.value(structure, k).numpy().reshape(300, B, -1)
             - values.value(structure, k).numpy().reshape(1, B, -1))
        assert np.all(d >= lo.reshape(1, B, -1) - 1e-12)
        assert np.all(d <= hi.reshape(1, B, -1) + 1e-12)
