"""CROWN's layer bounds with a prior (`keras_roll.compile.bounds.priors`): the bounds of
a pass over a larger ball around the same inputs, handed to a pass over a smaller one.

Checked against the pass without a prior and against points sampled in the ball (the
Keras model's own pre-activations and logits, in float64): the margins' lower bounds
and roots are those of the pass without a prior, every refined interval holds the
sampled pre-activations, and the store never hands a probe the bounds of a smaller
ball (they would not hold on its own)."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest

from keras_roll.compile.bounds.priors import PriorStore
from keras_roll.compile.twin import linearize
from keras_roll.robust.bounds import relaxed_margins
from tests.model_zoo import float64_layers

L = keras.layers
B = 3


def _cnn():
    keras.utils.set_random_seed(7)
    inp = keras.Input((8, 8, 1))
    c1 = L.Conv2D(4, 3, strides=2, padding="same")(inp)
    c2 = L.Conv2D(6, 3, strides=2, padding="same")(L.ReLU()(c1))
    d = L.Dense(12)(L.Flatten()(L.ReLU()(c2)))
    out = L.Dense(4)(L.ReLU()(d))
    return keras.Model(inp, out), keras.Model(inp, [c1, c2, d, out])


@functools.lru_cache(maxsize=1)
def _setup():
    with float64_layers():
        model, parts = _cnn()
    twin = linearize(model).at_dtype("float64")
    x = np.random.default_rng(1).uniform(0, 1, (B, 8, 8, 1))
    pred = np.argmax(model(x).numpy(), axis=1)
    return twin, parts, x, pred


def test_store_hands_the_smallest_larger_ball():
    store = PriorStore(2)
    assert store.get(np.arange(2), np.ones(2)) is None  # nothing kept yet
    store.add(np.array([0, 1]), np.array([2.0, 1.0]), np.array([[1.0, 2.0], [3.0, 4.0]]))
    store.add(np.array([0]), np.array([1.5]), np.array([[5.0, 6.0]]))
    got = store.get(np.array([0, 0, 1, 1]), np.array([1.0, 1.8, 1.0, 1.2]))
    np.testing.assert_array_equal(got[0], [5.0, 6.0])  # 1.5 >= 1.0, the smallest
    np.testing.assert_array_equal(got[1], [1.0, 2.0])  # only 2.0 holds at 1.8
    np.testing.assert_array_equal(got[2], [3.0, 4.0])
    assert np.isnan(got[3]).all()  # a smaller ball's bounds never hold on a larger


@pytest.mark.slow
def test_prior_keeps_the_bounds_and_holds_the_samples():
    twin, parts, x, pred = _setup()
    eps = np.array([0.02, 0.05, 0.08])
    big = relaxed_margins(twin, x, pred, 1.5 * eps, np.inf, guard=True)
    plain = relaxed_margins(twin, x, pred, eps, np.inf, guard=True)
    held = relaxed_margins(twin, x, pred, eps, np.inf, guard=True, prior=big.boxes)
    np.testing.assert_allclose(held.lower, plain.lower, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(held.root(), plain.root(), rtol=1e-12)
    # every refined interval (relative to x) holds the pre-activations of sampled points
    rng = np.random.default_rng(2)
    at_x = [t.numpy().reshape(B, -1) for t in parts(x)]
    for _ in range(20):
        pts = x + eps[:, None, None, None] * rng.choice([-1.0, 1.0], x.shape)
        outs = [t.numpy().reshape(B, -1) for t in parts(pts)]
        at = 0
        for z, z0 in zip(outs[:3], at_x[:3]):
            n = z.shape[1]
            lo, hi = held.boxes[:, at:at + n], held.boxes[:, at + n:at + 2 * n]
            assert np.all(z - z0 >= lo - 1e-9) and np.all(z - z0 <= hi + 1e-9)
            # within the prior's intervals (intersected in), and no wider than without
            assert np.all(lo >= big.boxes[:, at:at + n])
            assert np.all(hi <= big.boxes[:, at + n:at + 2 * n])
            at += 2 * n
        logits = outs[3]
        others = np.array([[j for j in range(4) if j != c] for c in pred])
        margins = logits[np.arange(B), pred][:, None] - np.take_along_axis(logits, others, 1)
        assert np.all(margins >= held.lower - 1e-9)


def test_example_rows_bound_each_examples_own_units():
    """`example_rows` with an exact 'pull-back' (the functional's value on a known
    vector `v` per example): every example's asked-for bounds are set, whatever the
    chunk size, and any other is either untouched or a valid bound."""
    import tensorflow as tf

    from keras_roll.compile.bounds.priors import example_rows

    rng = np.random.default_rng(3)
    v = rng.normal(size=(3, 7))
    need_lo = rng.uniform(size=(3, 7)) < 0.4
    need_hi = rng.uniform(size=(3, 7)) < 0.5
    need_lo[2] = need_hi[2] = False  # an example with no row at all

    def bounds_of(eye):  # [B, m, n] -> [B, m]: exact for a linear unit
        return tf.einsum("bmn,bn->bm", eye, tf.constant(v))

    for k in (1, 2, 16):
        lo, hi = example_rows(bounds_of, tf.constant(need_lo), tf.constant(need_hi), k,
                              tf.fill([3, 7], tf.constant(-np.inf, tf.float64)),
                              tf.fill([3, 7], tf.constant(np.inf, tf.float64)))
        lo, hi = lo.numpy(), hi.numpy()
        np.testing.assert_allclose(lo[need_lo], v[need_lo], rtol=1e-15)
        np.testing.assert_allclose(hi[need_hi], v[need_hi], rtol=1e-15)
        # the rows that fill a chunk are other units' (valid bounds), or none
        assert np.all((lo == -np.inf) | np.isclose(lo, v, rtol=1e-15))
        assert np.all((hi == np.inf) | np.isclose(hi, v, rtol=1e-15))
