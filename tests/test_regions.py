"""Tests of keras_roll.certification.regions.count_regions (Lee et al., ICLR 2019, Lemma 7) on a
hand-made point set with known regions and against GradientTape references."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.certification.regions import count_regions
from tests import model_zoo as zoo

# Hidden units of the hand-built network (z_j = w_j . x + b_j, ReLU):
#   n0: x1            n1: x2            n2: x1 + x2 - 10 (its output weights are 0)
#   n3: 0 (zero weights and bias: always on its breakpoint, but with zero gradient)
HIDDEN_W = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
HIDDEN_B = np.array([0.0, 0.0, -10.0, 0.0])
OUT_W = np.array([[1.0, 2.0], [3.0, -1.0], [0.0, 0.0], [5.0, 5.0]])

POINTS = {
    "A": (1.0, 1.0),    # pattern 1100
    "B": (2.0, 3.0),    # 1100, same region as A
    "C": (-1.0, 1.0),   # 0100
    "D": (1.0, -1.0),   # 1000
    "E": (6.0, 6.0),    # 1110: another region, but n2 does not reach the output
    "G": (-1.0, -1.0),  # 0000: Jacobian 0
    "F": (0.0, 2.0),    # on the line x1 = 0 (z0 = 0 with gradient (1, 0)); pattern 0100
}


def hand_net():
    inp = keras.Input((2,), dtype="float64")
    hidden = keras.layers.Dense(4, activation="relu", name="hidden", dtype="float64")
    out = keras.layers.Dense(2, name="out", dtype="float64")
    model = keras.Model(inp, out(hidden(inp)))
    hidden.set_weights([HIDDEN_W.T, HIDDEN_B])
    out.set_weights([OUT_W, np.zeros(2)])
    return model


def points(names):
    return np.array([POINTS[n] for n in names])


def test_hand_made_regions_with_a_boundary_point():
    names = list(POINTS)
    with pytest.warns(UserWarning, match="1 of 7 points lie on a linear-region boundary"):
        rc = count_regions(hand_net(), points(names), verbose=False)
    ids = dict(zip(names, rc.pattern_ids))
    jac = dict(zip(names, rc.jacobian_ids))
    # patterns 1100 (A, B), 0100 (C, F), 1000, 1110, 0000
    assert rc.patterns == 5
    # Jacobians: E shares A's (n2 has zero output weights)
    assert rc.jacobians == 4
    assert rc.on_boundary == 1 and not rc.bounds_hold
    assert rc.n == 7
    np.testing.assert_array_equal(rc.boundary, [n == "F" for n in names])
    assert ids["A"] == ids["B"] and ids["C"] == ids["F"]
    assert len({ids[n] for n in "ACDEG"}) == 5
    assert jac["A"] == jac["B"] == jac["E"] and jac["C"] == jac["F"]
    assert len({jac[n] for n in "ACDG"}) == 4
    np.testing.assert_array_equal(rc.pattern_ids, [0, 0, 1, 2, 3, 4, 1])  # first appearance


def test_same_region_counts_once_and_no_boundary_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rc = count_regions(hand_net(), points("ABAB"), verbose=False)
    assert (rc.patterns, rc.jacobians, rc.on_boundary) == (1, 1, 0)
    assert rc.bounds_hold
    rc = count_regions(hand_net(), points("AE"), verbose=False)
    assert (rc.patterns, rc.jacobians) == (2, 1)  # different patterns, equal Jacobians


def test_random_projections_give_the_same_count():
    x = points("ABCDEG")
    exact = count_regions(hand_net(), x, verbose=False)  # D = 2 <= 16: exact Jacobians
    for seed in range(3):
        proj = count_regions(hand_net(), x, projections=1, seed=seed, verbose=False)
        assert (proj.patterns, proj.jacobians) == (exact.patterns, exact.jacobians) == (5, 4)


def _greedy_classes(rows, atol):
    """Classes of rows equal up to atol (sup norm), by plain pairwise comparison."""
    reps, ids = [], []
    for r in rows:
        for c, rep in enumerate(reps):
            if np.max(np.abs(r - rep)) <= atol:
                ids.append(c)
                break
        else:
            ids.append(len(reps))
            reps.append(r)
    return np.array(ids)


def _same_partition(a, b):
    return np.array_equal(a[:, None] == a[None, :], b[:, None] == b[None, :])


def test_zoo_mlp_against_gradient_tape():
    model = zoo.mlp(fused=False, seed=3)
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(6, 6))
    x = (centers[rng.integers(0, 6, size=40)] + 0.05 * rng.normal(size=(40, 6)))
    x = x.astype("float32")
    pre = keras.Model(model.input, [model.get_layer(n).output for n in ("dense0", "dense1")])
    signs = np.concatenate([o.numpy() > 0 for o in pre(x)], axis=1)
    _, brute_patterns = np.unique(signs, axis=0, return_inverse=True)
    hidden = keras.Model(model.input, model.get_layer("relu1").output)
    xt = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        h = hidden(xt)
    dh = tape.batch_jacobian(h, xt).numpy().astype(np.float64)  # [B, 7, 6]
    kernel = model.get_layer("logits").kernel.numpy().astype(np.float64)  # [7, 3]
    jac = np.einsum("bhd,hl->bld", dh, kernel).reshape(len(x), -1)
    brute_jac = _greedy_classes(jac, 1e-5 * np.abs(jac).max())

    rc = count_regions(model, x, verbose=False)
    assert rc.patterns == len(np.unique(brute_patterns)) > 3
    assert _same_partition(rc.pattern_ids, brute_patterns.ravel())
    assert rc.jacobians == len(np.unique(brute_jac))
    assert _same_partition(rc.jacobian_ids, brute_jac)
    assert rc.on_boundary == 0
    small = count_regions(keras_roll.linearize(model), x, batch_size=7, projections=3,
                          memory_budget=10_000, verbose=False)
    assert (small.patterns, small.jacobians) == (rc.patterns, rc.jacobians)
    np.testing.assert_array_equal(small.pattern_ids, rc.pattern_ids)


def test_max_pooling_winner_is_part_of_the_pattern():
    """Inputs (a, b) -> max(a, b): swapping which input wins changes the pattern."""
    inp = keras.Input((2, 1))
    out = keras.layers.Flatten()(keras.layers.GlobalMaxPooling1D()(inp))
    model = keras.Model(inp, keras.layers.Dense(1)(out))
    x = np.array([[[1.0], [0.0]], [[2.0], [-1.0]], [[0.0], [1.0]]], "float32")
    rc = count_regions(model, x, verbose=False)
    assert (rc.patterns, rc.jacobians, rc.on_boundary) == (2, 2, 0)
    np.testing.assert_array_equal(rc.pattern_ids, [0, 0, 1])
    with pytest.warns(UserWarning, match="boundary"):
        tie = count_regions(model, np.array([[[1.0], [1.0]]], "float32"), verbose=False)
    assert tie.on_boundary == 1


def test_summary_and_repr():
    with pytest.warns(UserWarning):
        rc = count_regions(hand_net(), points(list(POINTS)), verbose=False)
    lines = []
    rc.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert "Lemma 7" in text
    assert any(line.startswith("#CLR lower bound") and line.rstrip().endswith(" 4")
               for line in text.splitlines())
    assert any(line.startswith("#CLR upper bound") and line.rstrip().endswith(" 5")
               for line in text.splitlines())
    assert "not guaranteed" in text
    assert repr(rc) == "RegionCount(n=7, jacobians=4 <= #CLR <= patterns=5, on_boundary=1)"


def test_bad_and_empty_inputs():
    model = hand_net()
    with pytest.raises(ValueError, match="no examples"):
        count_regions(model, np.zeros((0, 2)), verbose=False)
    with pytest.raises(ValueError, match="non-finite"):
        count_regions(model, np.array([[np.nan, 1.0]]))
    with pytest.raises(ValueError, match="shape"):
        count_regions(model, np.zeros((3, 3)))
    with pytest.raises(ValueError, match="-0.5"):
        count_regions(model, points("AB"), rtol=-0.5)
    with pytest.raises(ValueError, match="projections"):
        count_regions(model, points("AB"), projections=0)


def test_affine_model_is_one_region():
    inp = keras.Input((3,))
    model = keras.Model(inp, keras.layers.Dense(2)(inp))
    rc = count_regions(model, np.random.default_rng(0).normal(size=(5, 3)), verbose=False)
    assert (rc.patterns, rc.jacobians, rc.on_boundary, rc.n) == (1, 1, 0, 5)
