"""Tests of the ROLL regularizer (keras_roll.roll.loss) and MarginMonitor.

Every expected value comes from an independent reference: `tf.GradientTape`
Jacobians of the pre-activations of Keras sub-models (numpy for the max-pooling
differences, a hand-written TF recurrence for SimpleRNN), and Eq. 9 written
out in numpy.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
from fractions import Fraction

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.regularizers.base import evaluating
from keras_roll.roll import loss as roll
from keras_roll.roll.callbacks import MarginMonitor
from keras_roll.roll.config import RollConfig
from keras_roll.roll.estimators import estimator_for
from keras_roll.testing import tape_jacobian
from tests import model_zoo as zoo

# --------------------------------------------------------------------------- models


def mlp_prelu(seed=0):
    """Dense -> PReLU -> Dense -> LeakyReLU -> Dense (softmax): slopes are weights."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((5,))
    h = keras.layers.Dense(7, name="d0")(inp)
    h = keras.layers.PReLU(alpha_initializer=keras.initializers.Constant(0.3), name="p0")(h)
    h = keras.layers.Dense(6, name="d1")(h)
    h = keras.layers.LeakyReLU(0.1, name="l1")(h)
    out = keras.layers.Dense(3, activation="softmax", name="logits")(h)
    return keras.Model(inp, out, name="mlp_prelu")


def toy_mlp(seed=0, width=32, depth=3):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((2,))
    h = inp
    for i in range(depth):
        h = keras.layers.Dense(width, name=f"d{i}")(h)
        h = keras.layers.ReLU(name=f"r{i}")(h)
    out = keras.layers.Dense(2, name="logits")(h)
    return keras.Model(inp, out, name="toy")


# --------------------------------------------------------------------------- references


def _jacobian(model, outputs, x):
    """Flattened values `[B, n]` and input Jacobians `[B, n, D]` of `outputs`."""
    sub = keras.Model(model.inputs, outputs)
    return tape_jacobian(lambda t: sub(t, training=False), x, per_output=True)


class Group:
    """Neurons of one unit: values z, distances to the breakpoints, gradients, validity."""

    def __init__(self, dist, jac, valid=None):
        self.dist = dist
        self.sq = np.sum(jac.astype(np.float64) ** 2, axis=-1)
        self.valid = np.ones(dist.shape, bool) if valid is None else valid


def relu_group(z, jac, breakpoints=(0.0,)):
    dist = np.min([np.abs(z - b) for b in breakpoints], axis=0)
    return Group(dist, jac)


def maxpool_group(a, ja, pool=2):
    """Neurons of a (pool x pool, stride pool, valid) max pool: v_winner - v_k."""
    b, h, w, c = a.shape
    d = ja.shape[-1]
    ja = ja.reshape(b, h, w, c, d)
    dists, sqs, valids = [], [], []
    for i in range(h // pool):
        for j in range(w // pool):
            win = a[:, i * pool:(i + 1) * pool, j * pool:(j + 1) * pool, :].reshape(b, -1, c)
            jw = ja[:, i * pool:(i + 1) * pool, j * pool:(j + 1) * pool].reshape(b, -1, c, d)
            winner = np.argmax(win, axis=1)  # [b, c], first maximum in row-major order
            for k in range(pool * pool):
                top = np.take_along_axis(win, winner[:, None], 1)[:, 0]
                jtop = np.take_along_axis(jw, winner[:, None, :, None], 1)[:, 0]
                dists.append(top - win[:, k])
                sqs.append(np.sum((jtop - jw[:, k]).astype(np.float64) ** 2, -1))
                valids.append(winner != k)
    g = Group(np.concatenate(dists, 1), np.zeros((b, 1, 1)))
    g.sq = np.concatenate(sqs, 1)
    g.valid = np.concatenate(valids, 1)
    return g


def reference_loss(groups, C, gamma):
    """Eq. 9 in numpy: mean of the top ceil(gamma/100 * n_valid) brackets."""
    dist = np.concatenate([g.dist for g in groups], 1)
    sq = np.concatenate([g.sq for g in groups], 1)
    valid = np.concatenate([g.valid for g in groups], 1)
    bracket = sq + C * np.maximum(0.0, 1.0 - dist)
    out = []
    for row, ok in zip(bracket, valid):
        vals = np.sort(row[ok])[::-1]
        keep = math.ceil(Fraction(str(gamma)) * len(vals) / 100)
        out.append(vals[:keep].mean() if keep else 0.0)
    return np.array(out)


def selection_mask(groups, C, gamma):
    """The neurons Eq. 9 keeps (numpy), `[B, N]` 0/1, and the counts."""
    dist = np.concatenate([g.dist for g in groups], 1)
    sq = np.concatenate([g.sq for g in groups], 1)
    valid = np.concatenate([g.valid for g in groups], 1)
    bracket = np.where(valid, sq + C * np.maximum(0.0, 1.0 - dist), -np.inf)
    mask = np.zeros(bracket.shape)
    counts = []
    for i, row in enumerate(bracket):
        keep = math.ceil(Fraction(str(gamma)) * int(valid[i].sum()) / 100)
        mask[i, np.argsort(-row, kind="stable")[:keep]] = 1.0
        counts.append(keep)
    return mask, np.array(counts, np.float64)


def mlp_groups(model, x, names, breakpoints=None):
    zs, js = _jacobian(model, [model.get_layer(n).output for n in names], x)
    breakpoints = breakpoints or [(0.0,)] * len(names)
    return [relu_group(z, j, bp) for z, j, bp in zip(zs, js, breakpoints)]


def cnn_groups(model, x):
    layers = ["bn0", "relu0", "dw", "dense"]
    zs, js = _jacobian(model, [model.get_layer(n).output for n in layers], x)
    a = zs[1].reshape(x.shape[0], 8, 8, 4)
    return [relu_group(zs[0], js[0]), maxpool_group(a, js[1]), relu_group(zs[2], js[2]),
            relu_group(zs[3], js[3])]


def rnn_reference(model, x, leaky=False):
    """Hand-written masked SimpleRNN: pre-activations `[B, T, U]`, logits, step mask."""
    layer = model.get_layer("rnn")
    cell = layer.cell
    dense = model.get_layer("logits")
    x = tf.convert_to_tensor(x)
    mask = tf.reduce_any(tf.not_equal(x, 0.0), axis=-1)
    h = tf.zeros([x.shape[0], cell.units])
    zs = []
    for t in range(x.shape[1]):
        z = tf.matmul(x[:, t], cell.kernel) + tf.matmul(h, cell.recurrent_kernel) + cell.bias
        a = tf.nn.leaky_relu(z, 0.2) if leaky else tf.nn.relu(z)
        h = tf.where(mask[:, t, None], a, h)
        zs.append(z)
    logits = tf.matmul(h, dense.kernel) + dense.bias
    return tf.stack(zs, 1), logits, mask


def rnn_groups(model, x, leaky=False):
    z, _, mask = rnn_reference(model, tf.constant(x), leaky)
    flat, jac = tape_jacobian(lambda t: rnn_reference(model, t, leaky)[0], x)
    valid = np.repeat(mask.numpy(), z.shape[-1], axis=1)
    return [Group(np.abs(flat), jac, valid)]


def _rng_x(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


CASES = {
    "mlp": (lambda: zoo.mlp(fused=False), (4, 6),
            lambda m, x: mlp_groups(m, x, ["dense0", "dense1"])),
    "mlp_prelu": (mlp_prelu, (4, 5), lambda m, x: mlp_groups(m, x, ["d0", "d1"])),
    "cnn": (zoo.cnn, (3, 8, 8, 2), cnn_groups),
    "residual": (zoo.residual, (3, 6, 6, 3),
                 lambda m, x: mlp_groups(m, x, ["conv_a", "add"], [(0.0, 6.0), (0.0,)])),
    "rnn": (zoo.rnn, None, rnn_groups),
    "rnn_leaky": (lambda: zoo.rnn("leaky"), None, lambda m, x: rnn_groups(m, x, leaky=True)),
}


def case_inputs(name, shape):
    if shape is None:
        x, lengths = zoo.padded_sequences(batch=4)
        assert len(set(lengths.tolist())) > 1  # variable lengths -> n_valid differs
        return x
    x = _rng_x(shape)
    if name == "cnn":
        x = np.abs(x) * 4.0  # the cnn rescales [0, 4] images to [-0.5, 0.5]
    if name == "residual":
        x = x * 6.0  # push conv_a past the ReLU6 breakpoint at 6 for some units
    return x


# --------------------------------------------------------------------------- value tests


def test_rnn_reference_reproduces_keras():
    for leaky in (False, True):
        model = zoo.rnn("leaky" if leaky else "relu")
        x, _ = zoo.padded_sequences(batch=4)
        _, logits, _ = rnn_reference(model, x, leaky)
        np.testing.assert_allclose(logits.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_roll_loss_matches_jacobian_reference(name):
    build, shape, groups_fn = CASES[name]
    model = build()
    x = case_inputs(name, shape)
    groups = groups_fn(model, x)
    if name == "residual":  # some units sit near the upper ReLU6 breakpoint
        conv_a = _jacobian(model, [model.get_layer("conv_a").output], x)[0][0]
        assert np.any(np.abs(conv_a - 6.0) < 1.0)
    for gamma in (100.0, 50.0, 5.0):
        want = reference_loss(groups, C=0.7, gamma=gamma)
        got = roll.roll_loss(model, x, C=0.7, gamma=gamma).numpy()
        assert got.shape == (x.shape[0],) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5, err_msg=f"gamma={gamma}")


def test_gamma_selection_counts_valid_neurons_per_example():
    # With C large the hinge dominates; 5 % of few valid neurons keeps a single one.
    model = zoo.rnn()
    x, lengths = zoo.padded_sequences(batch=4)
    groups = rnn_groups(model, x)
    n_valid = groups[0].valid.sum(1)
    np.testing.assert_array_equal(n_valid, lengths * 6)
    want = reference_loss(groups, C=0.0, gamma=5.0)
    top1 = [np.max(g[v]) for g, v in zip(groups[0].sq, groups[0].valid)]
    two = [np.sort(g[v])[-2:].mean() for g, v in zip(groups[0].sq, groups[0].valid)]
    expected = np.where(np.ceil(0.05 * n_valid) == 1, top1, two)
    np.testing.assert_allclose(want, expected, rtol=1e-6)
    np.testing.assert_allclose(roll.roll_loss(model, x, C=0.0, gamma=5.0).numpy(), want,
                               rtol=2e-5)


def test_return_logits_are_pre_softmax_outputs():
    model = zoo.mlp(fused=True)
    x = _rng_x((3, 6))
    loss, logits = roll.roll_loss(model, x, return_logits=True)
    np.testing.assert_allclose(tf.nn.softmax(logits).numpy(), model(x).numpy(), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(loss.numpy(), roll.roll_loss(model, x).numpy())


def test_sample_all_axes_is_exact():
    """Sampling all D axes (or all axes of every channel) without replacement is exact."""
    model = zoo.cnn()
    x = case_inputs("cnn", (2, 8, 8, 2))
    want = reference_loss(cnn_groups(model, x), C=1.0, gamma=100.0)
    np.testing.assert_allclose(roll.roll_loss(model, x, samples=128, seed=3).numpy(), want,
                               rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(
        roll.roll_loss(model, x, samples=64, strata="channel", seed=3).numpy(), want,
        rtol=2e-5, atol=1e-5)


# --------------------------------------------------------------------------- sampling


def _sampled(model, x, copies, **kwargs):
    """One call on `copies` tiled copies of x: independent draws per row."""
    tiled = np.tile(x, (copies,) + (1,) * (x.ndim - 1))
    out = roll.roll_loss(model, tiled, **kwargs).numpy()
    return out.reshape(copies, x.shape[0]).astype(np.float64)


@pytest.mark.parametrize("case,kwargs", [
    ("mlp", {"samples": 2}),
    ("mlp", {"samples": 3, "estimator": "gaussian"}),
    ("mlp", {"samples": 2, "estimator": "rademacher"}),
    pytest.param("cnn", {"samples": 5}, marks=pytest.mark.slow),  # the mlp's twin
    ("cnn", {"samples": 3, "strata": "channel"}),
])
def test_sampled_loss_is_unbiased(case, kwargs):
    build, shape, groups_fn = CASES[case]
    model = build()
    x = case_inputs(case, shape)
    exact = reference_loss(groups_fn(model, x), C=1.0, gamma=100.0)
    draws = _sampled(model, x, 300 if case == "cnn" else 600, seed=11, **kwargs)
    mean = draws.mean(0)
    se = draws.std(0, ddof=1) / np.sqrt(draws.shape[0])
    assert np.all(se > 0), "the estimate should vary between draws"
    np.testing.assert_array_less(np.abs(mean - exact), 4 * se + 1e-6)


@pytest.mark.graph
@pytest.mark.parametrize("case,kwargs", [
    ("mlp", {"samples": 2}),
    # shared axes per channel: test_shared_axes_are_the_same_for_every_example
    pytest.param("cnn", {"samples": 3, "strata": "channel"}, marks=pytest.mark.slow),
])
def test_shared_axes_are_unbiased_per_example(case, kwargs):
    build, shape, groups_fn = CASES[case]
    model = build()
    x = case_inputs(case, shape)
    exact = reference_loss(groups_fn(model, x), C=1.0, gamma=100.0)
    lin = keras_roll.linearize(model)
    fn = tf.function(lambda s: roll.roll_loss(lin, x, share_axes=True, seed=s, **kwargs),
                     autograph=False)
    draws = np.stack([fn(tf.constant([i, 17])).numpy() for i in range(300)]).astype(np.float64)
    se = draws.std(0, ddof=1) / np.sqrt(draws.shape[0])
    assert np.all(se > 0)
    np.testing.assert_array_less(np.abs(draws.mean(0) - exact), 4 * se + 1e-6)


def test_shared_axes_are_the_same_for_every_example():
    model = zoo.cnn()
    one = case_inputs("cnn", (1, 8, 8, 2))
    x = np.repeat(one, 6, axis=0)
    shared = roll.roll_loss(model, x, samples=4, share_axes=True, seed=1).numpy()
    own = roll.roll_loss(model, x, samples=4, seed=1).numpy()
    np.testing.assert_allclose(shared, shared[0], rtol=1e-6)
    assert np.ptp(own) > 1e-3 * abs(own[0])
    want = reference_loss(cnn_groups(model, one), C=1.0, gamma=100.0)
    np.testing.assert_allclose(
        roll.roll_loss(model, one, samples=64, strata="channel", share_axes=True).numpy(),
        want, rtol=2e-5, atol=1e-5)


def test_seed_makes_sampling_reproducible():
    model = zoo.mlp(fused=False)
    x = _rng_x((4, 6))
    a = roll.roll_loss(model, x, samples=2, seed=5).numpy()
    b = roll.roll_loss(model, x, samples=2, seed=5).numpy()
    c = roll.roll_loss(model, x, samples=2, seed=6).numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    f = tf.function(lambda t, s: roll.roll_loss(model, t, samples=2, seed=s))
    np.testing.assert_allclose(f(x, tf.constant([5, 0])).numpy(), a, rtol=1e-6)


def _probe_variance(kernel, estimator, samples, copies=400):
    inp = keras.Input((kernel.shape[0],))
    h = keras.layers.Dense(kernel.shape[1], name="d0")(inp)
    h = keras.layers.ReLU()(h)
    model = keras.Model(inp, keras.layers.Dense(2)(h))
    model.get_layer("d0").kernel.assign(kernel)
    x = _rng_x((2, kernel.shape[0]), seed=1)
    draws = _sampled(model, x, copies, samples=samples, estimator=estimator, seed=2, C=0.0)
    return draws.var(0).mean()


def test_random_probes_beat_axes_when_gradients_are_concentrated():
    """Where each estimator wins: concentrated gradients favour probes, spread ones axes."""
    rng = np.random.default_rng(0)
    sparse = np.zeros((64, 8), np.float32)
    sparse[:2] = rng.normal(size=(2, 8))  # every neuron depends on 2 of 64 inputs
    assert _probe_variance(sparse, "rademacher", 4) < 0.01 * _probe_variance(sparse, "axes", 4)
    assert _probe_variance(sparse, "gaussian", 4) < 0.2 * _probe_variance(sparse, "axes", 4)
    spread = np.sign(rng.normal(size=(64, 8))).astype(np.float32)  # |g_i| all equal
    assert _probe_variance(spread, "axes", 4) < 1e-6
    assert _probe_variance(spread, "rademacher", 4) > 1.0


# --------------------------------------------------------------------------- masked steps


def _rnn_estimators(kwargs, seeds):
    """The sampled axes drawn for the padded sequences, one estimator per seed."""
    model = zoo.rnn()
    x, lengths = zoo.padded_sequences(batch=4)
    lin = keras_roll.linearize(model)
    xt = lin.check_input(x)
    trace = lin.primal(xt).trace
    config = RollConfig(**kwargs)
    return lengths, [estimator_for(lin, xt, config, seed, trace=trace) for seed in seeds]


@pytest.mark.parametrize("kwargs", [{"samples": 4}, {"samples": 8},
                                    {"samples": 3, "strata": "channel"}])
def test_masked_sampling_draws_only_valid_steps(kwargs):
    channels, k = 3, kwargs["samples"]
    lengths, ests = _rnn_estimators(kwargs, range(40))
    hits = np.zeros((4, 5 * channels))
    for est in ests:
        axes = est.axes.numpy()
        for i, (row, n) in enumerate(zip(axes, lengths)):
            live = row[row >= 0]
            assert np.all(live // channels < n), (row, n)  # never a padded step
            assert len(set(live.tolist())) == len(live)   # without replacement
            if "strata" in kwargs:
                assert len(live) == channels * min(k, n)
                for c in range(channels):  # k per channel, in that channel
                    assert np.sum(live % channels == c) == min(k, n)
            else:
                assert len(live) == min(k, n * channels)
            hits[i, live] += 1
    # every valid axis gets drawn (the draw is over all of them, not a fixed subset)
    for i, n in enumerate(lengths):
        assert np.all(hits[i, :n * channels] > 0) and np.all(hits[i, n * channels:] == 0)
    scale = ests[0].scale(tf.float32).numpy().ravel()
    per_group = lengths if "strata" in kwargs else lengths * channels
    np.testing.assert_allclose(scale, per_group / np.minimum(k, per_group), rtol=1e-6)


@pytest.mark.parametrize("kwargs", [{"samples": 4}, {"samples": 3, "strata": "channel"}])
def test_masked_sampling_is_unbiased(kwargs):
    model = zoo.rnn()
    x, lengths = zoo.padded_sequences(batch=4)
    exact = reference_loss(rnn_groups(model, x), C=1.0, gamma=100.0)
    draws = _sampled(model, x, 600, seed=21, **kwargs)
    se = draws.std(0, ddof=1) / np.sqrt(draws.shape[0])
    # examples with at most k valid steps per channel are computed exactly
    exact_rows = (lengths <= kwargs["samples"]) if "strata" in kwargs else np.zeros(4, bool)
    assert np.all(se[~exact_rows] > 0)
    np.testing.assert_array_less(np.abs(draws.mean(0) - exact), 4 * se + 1e-5 * exact)


# --------------------------------------------------------------------------- gradients


def _reference_grads(model, x, groups_fn, tf_groups, C, gamma):
    """d mean(Eq. 9) / dW with GradientTape Jacobians; the selection is a constant."""
    mask, counts = selection_mask(groups_fn(model, x), C, gamma)
    with tf.GradientTape() as outer:
        dist, sq = tf_groups(model, x)
        bracket = sq + C * tf.nn.relu(1.0 - dist)
        loss = tf.reduce_mean(tf.reduce_sum(bracket * mask, 1) / counts)
    grads = outer.gradient(loss, model.trainable_variables)
    return [np.zeros(v.shape) if g is None else g.numpy()
            for g, v in zip(grads, model.trainable_variables)]


def _tf_dense_groups(names, breakpoints=None):
    def fn(model, x):
        sub = keras.Model(model.inputs, [model.get_layer(n).output for n in names])
        xt = tf.constant(x)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(xt)
            zs = sub(xt)
            zs = [tf.reshape(z, [x.shape[0], -1]) for z in zs]
        dists, sqs = [], []
        for i, z in enumerate(zs):
            jac = tf.reshape(tape.batch_jacobian(z, xt), [x.shape[0], z.shape[1], -1])
            bps = (breakpoints or {}).get(i, (0.0,))
            dists.append(tf.reduce_min(tf.stack([tf.abs(z - b) for b in bps]), 0))
            sqs.append(tf.reduce_sum(jac**2, -1))
        return tf.cast(tf.concat(dists, 1), tf.float64), tf.cast(tf.concat(sqs, 1), tf.float64)

    return fn


def _tf_rnn_groups(model, x):
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        z, _, _ = rnn_reference(model, xt)
        flat = tf.reshape(z, [x.shape[0], -1])
    jac = tf.reshape(tape.batch_jacobian(flat, xt), [x.shape[0], flat.shape[1], -1])
    return tf.cast(tf.abs(flat), tf.float64), tf.cast(tf.reduce_sum(jac**2, -1), tf.float64)


GRAD_CASES = {
    "mlp_prelu": ("mlp_prelu", _tf_dense_groups(["d0", "d1"])),
    "residual": ("residual", _tf_dense_groups(["conv_a", "add"], {0: (0.0, 6.0)})),
    "rnn": ("rnn", _tf_rnn_groups),
}


@pytest.mark.parametrize("name", [
    "mlp_prelu", "residual",
    # the RNN's weight gradient against the tape, by default in
    # tests/test_roll_exact.py::test_packed_loss_and_gradients_match_the_reference
    pytest.param("rnn", marks=pytest.mark.slow)])
def test_weight_gradient_matches_reference(name):
    """Eager, eager in chunks (custom gradient) and a dynamic-batch tf.function (tf.cond)."""
    case, tf_groups = GRAD_CASES[name]
    build, shape, groups_fn = CASES[case]
    model = build()
    x = case_inputs(case, shape)
    gamma = 50.0
    want = _reference_grads(model, x, groups_fn, tf_groups, C=0.7, gamma=gamma)
    scale = max(np.max(np.abs(w)) for w in want)
    assert scale > 0
    whole = keras_roll.linearize(model)
    # four chunks: the chunked, recomputing path
    plan = roll.memory_plan(whole, x)
    budget = -(-plan.directions // 4) * plan.bytes_per_direction
    chunked = keras_roll.linearize(model, memory_budget=budget)
    assert roll.memory_plan(whole, x).chunks == 1 and roll.memory_plan(chunked, x).chunks > 1

    def grads(lin):
        def run(xb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(roll.roll_loss(lin, xb, C=0.7, gamma=gamma))
            return tape.gradient(loss, model.trainable_variables)
        return run

    dynamic = tf.function(grads(chunked), input_signature=[tf.TensorSpec([None, *x.shape[1:]])])
    for label, fn in [("eager", grads(whole)), ("chunked", grads(chunked)),
                      ("dynamic", dynamic)]:
        got = [np.zeros(v.shape) if g is None else g.numpy()
               for g, v in zip(fn(x), model.trainable_variables)]
        for g, w, v in zip(got, want, model.trainable_variables):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5 * scale,
                                       err_msg=f"{label}: {v.path}")
    if name == "mlp_prelu":  # the PReLU slope is a weight of the tangent map
        alpha = [i for i, v in enumerate(model.trainable_variables) if "alpha" in v.path][0]
        assert np.max(np.abs(want[alpha])) > 1e-4


# --------------------------------------------------------------------------- memory


def conv_net(size, seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(4, 3, strides=2, name="c0")(inp)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Conv2D(4, 3, strides=2, name="c1")(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inp, keras.layers.Dense(3)(h), name=f"conv{size}")


@pytest.mark.parametrize("kwargs", [
    {"gamma": 50.0},
    {"samples": 5, "strata": "channel", "seed": 4},
])
def test_chunked_loss_and_gradient_equal_single_chunk(kwargs):
    model = conv_net(9)
    x = _rng_x((3, 9, 9, 3))
    plan_kwargs = {k: v for k, v in kwargs.items() if k not in ("gamma", "seed")}
    whole = roll.memory_plan(model, x, **plan_kwargs)
    assert whole.chunks == 1
    budget = -(-whole.directions // 3) * whole.bytes_per_direction  # three chunks
    small = keras_roll.linearize(model, memory_budget=budget)
    plan = roll.memory_plan(small, x, **plan_kwargs)
    assert plan.chunks == 3 and plan.per_chunk * plan.bytes_per_direction <= budget

    def loss_and_grads(fn):
        with tf.GradientTape() as tape:  # outside the tf.function, if any
            loss = fn(x)
            total = tf.reduce_sum(loss)
        grads = tape.gradient(total, model.trainable_variables)
        return loss.numpy(), [np.zeros(v.shape) if g is None else g.numpy()
                              for g, v in zip(grads, model.trainable_variables)]

    want, want_g = loss_and_grads(lambda t: roll.roll_loss(model, t, **kwargs))
    dynamic = tf.function(lambda t: roll.roll_loss(small, t, **kwargs),
                          input_signature=[tf.TensorSpec([None, 9, 9, 3])])
    for fn in (lambda t: roll.roll_loss(small, t, **kwargs), dynamic):
        got, got_g = loss_and_grads(fn)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        scale = max(np.max(np.abs(w)) for w in want_g)
        assert scale > 0
        for g, w in zip(got_g, want_g):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * scale)


@pytest.mark.graph
def test_large_input_is_chunked_and_errors_point_to_samples():
    model = conv_net(299)
    x = _rng_x((2, 299, 299, 3))
    # A fixed budget: memory_budget="auto" would time exact ROLL over 268,203 axes
    # (the probe itself is tested in tests/test_roll_auto.py).
    plan = roll.memory_plan(model, x, memory_budget=2**26)
    assert plan.directions == 299 * 299 * 3
    assert plan.chunks > 1 and plan.per_chunk * plan.bytes_per_direction <= plan.memory_budget
    tiny = keras_roll.linearize(model, memory_budget=2**20)
    assert not roll.memory_plan(tiny, x).fits
    with pytest.raises(MemoryError, match="samples="):
        roll.roll_loss(tiny, x)
    dynamic = tf.function(lambda t: roll.roll_loss(tiny, t),
                          input_signature=[tf.TensorSpec([None, 299, 299, 3])])
    with pytest.raises(tf.errors.InvalidArgumentError, match="samples="):
        dynamic(x)
    # the paper's stratified estimate works at this size (1 axis per channel here)
    approx = roll.roll_loss(model, x[:1], samples=1, strata="channel", seed=0).numpy()
    assert approx.shape == (1,) and np.isfinite(approx).all()


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs,word", [
    ({"lam": -1.0}, "lam=-1.0"),
    ({"C": -0.5}, "C=-0.5"),
    ({"gamma": 0.0}, "gamma=0.0"),
    ({"gamma": 120}, "gamma=120"),
    ({"samples": 0}, "samples=0"),
    ({"samples": 7}, "samples=7"),
    ({"samples": 2.5}, "samples=2.5"),
    ({"strata": "pixel", "samples": 1}, "strata='pixel'"),
    ({"strata": "channel", "samples": 1}, "strata='channel'"),
    ({"estimator": "sobol", "samples": 1}, "estimator='sobol'"),
    ({"estimator": "gaussian"}, "estimator='gaussian'"),
    ({"share_axes": True}, "share_axes=True"),
    ({"share_axes": 1, "samples": 2}, "share_axes=1"),
])
def test_bad_hyperparameters_raise(kwargs, word):
    model = zoo.mlp(fused=False)  # D = 6, rank-1 input (no channels)
    with pytest.raises(ValueError) as err:
        keras_roll.wrap(model, **kwargs)
    assert word in str(err.value)
    if "lam" not in kwargs:
        with pytest.raises(ValueError) as err:
            roll.roll_loss(model, _rng_x((2, 6)), **kwargs)
        assert word in str(err.value)


def test_strata_bound_is_per_channel():
    model = zoo.cnn()
    with pytest.raises(ValueError, match="samples=65"):
        keras_roll.wrap(model, samples=65, strata="channel")
    keras_roll.wrap(model, samples=64, strata="channel")


def test_unsupported_model_is_refused():
    inp = keras.Input((4,))
    out = keras.layers.Dense(2, activation="tanh")(inp)
    out = keras.layers.Dense(2)(out)
    with pytest.raises(keras_roll.UnsupportedModelError, match="tanh"):
        keras_roll.wrap(keras.Model(inp, out))


# --------------------------------------------------------------------------- wrap / fit


def _compile(model, lr=0.05):
    model.compile(keras.optimizers.SGD(lr),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=False))


def test_wrap_shares_weights_predicts_like_model_and_unwraps():
    model = zoo.mlp(fused=False)
    wrapped = keras_roll.wrap(model, lam=1.0)
    x = _rng_x((5, 6))
    assert keras_roll.unwrap(wrapped) is model
    assert keras_roll.unwrap(model) is model
    assert {id(v) for v in wrapped.trainable_variables} == {
        id(v) for v in model.trainable_variables}
    np.testing.assert_allclose(wrapped.predict(x, verbose=0), model.predict(x, verbose=0))


def test_fit_adds_lam_times_reference_loss_and_reports_it():
    model = zoo.mlp(fused=False)
    x = _rng_x((32, 6), seed=4)
    y = (x[:, 0] > 0).astype("int32")
    groups = mlp_groups(model, x, ["dense0", "dense1"])
    reg = reference_loss(groups, C=1.0, gamma=50.0).mean()
    ce = keras.losses.sparse_categorical_crossentropy(y, model(x)).numpy().mean()
    wrapped = keras_roll.wrap(model, lam=2.0, gamma=50.0)
    _compile(wrapped, lr=0.0)  # weights stay put: every batch sees the same model
    hist = wrapped.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    assert hist["roll_loss"][0] == pytest.approx(reg, rel=1e-5)
    assert hist["loss"][0] == pytest.approx(ce + 2.0 * reg, rel=1e-5)
    # evaluate computes the training objective by default (on_eval=None) ...
    ev = wrapped.evaluate(x, y, verbose=0, return_dict=True, batch_size=8)
    assert ev["roll_loss"] == pytest.approx(reg, rel=1e-5)
    assert ev["loss"] == pytest.approx(ce + 2.0 * reg, rel=1e-5)
    # ... and not at all with on_eval=False (the earlier default)
    off = keras_roll.wrap(model, lam=2.0, gamma=50.0, on_eval=False)
    _compile(off, lr=0.0)
    ev = off.evaluate(x, y, verbose=0, return_dict=True)
    assert ev["loss"] == pytest.approx(ce, rel=1e-5) and np.isnan(ev["roll_loss"])
    on_eval = keras_roll.wrap(model, lam=2.0, gamma=50.0, on_eval=True)
    _compile(on_eval, lr=0.0)
    ev = on_eval.evaluate(x, y, verbose=0, return_dict=True, batch_size=8)
    assert ev["roll_loss"] == pytest.approx(reg, rel=1e-5)
    assert ev["loss"] == pytest.approx(ce + 2.0 * reg, rel=1e-5)


@pytest.mark.parametrize("on_eval,in_predict,in_evaluate", [
    (None, False, True), (True, True, True), (False, False, False)])
def test_on_eval_decides_where_inference_computes_roll(on_eval, in_predict, in_evaluate):
    model = zoo.mlp(fused=False)
    x = _rng_x((6, 6), seed=2)
    wrapped = keras_roll.wrap(model, lam=2.0, on_eval=on_eval)
    assert isinstance(wrapped, keras_roll.RollModel)
    out = wrapped(x, training=False)  # what predict_step runs
    np.testing.assert_allclose(out.numpy(), model(x).numpy(), rtol=1e-6, atol=1e-7)
    assert bool(wrapped.losses) == in_predict
    with evaluating():  # what RollModel.test_step runs
        out = wrapped(x, training=False)
    np.testing.assert_allclose(out.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert bool(wrapped.losses) == in_evaluate
    if in_evaluate:
        want = 2.0 * reference_loss(mlp_groups(model, x, ["dense0", "dense1"]), 1.0, 100.0)
        assert float(wrapped.losses[0]) == pytest.approx(want.mean(), rel=1e-5)
    _compile(wrapped)
    layer = wrapped.get_layer("roll_regularizer")
    layer.roll_tracker.reset_state()
    wrapped.predict(x, verbose=0)
    assert float(layer.roll_tracker.count.numpy()) == (len(x) if in_predict else 0)


def test_validation_loss_is_the_training_objective():
    model = zoo.mlp(fused=False)
    x = _rng_x((24, 6), seed=4)
    y = (x[:, 0] > 0).astype("int32")
    xv = _rng_x((10, 6), seed=5)
    yv = (xv[:, 1] > 0).astype("int32")
    reg_v = reference_loss(mlp_groups(model, xv, ["dense0", "dense1"]), C=1.0, gamma=50.0)
    ce_v = keras.losses.sparse_categorical_crossentropy(yv, model(xv)).numpy()
    wrapped = keras_roll.wrap(model, lam=2.0, gamma=50.0)
    _compile(wrapped, lr=0.0)
    hist = wrapped.fit(x, y, validation_data=(xv, yv), batch_size=8, epochs=2,
                       verbose=0).history
    assert hist["val_roll_loss"] == pytest.approx([reg_v.mean()] * 2, rel=1e-5)
    assert hist["val_loss"] == pytest.approx([ce_v.mean() + 2.0 * reg_v.mean()] * 2, rel=1e-5)


def test_sampled_validation_uses_a_fixed_seed():
    model = zoo.mlp(fused=False)
    x = _rng_x((32, 6), seed=6)
    y = (x[:, 0] > 0).astype("int32")
    exact = reference_loss(mlp_groups(model, x, ["dense0", "dense1"]), 1.0, 100.0).mean()
    for seed in (None, 3):
        wrapped = keras_roll.wrap(model, lam=1.0, samples=2, seed=seed)
        _compile(wrapped, lr=0.0)  # the weights stay put
        hist = wrapped.fit(x, y, validation_data=(x, y), batch_size=32, epochs=3,
                           verbose=0).history
        train, val = hist["roll_loss"], hist["val_roll_loss"]
        assert len(set(train)) == 3, train  # fresh axes every training step
        assert val == pytest.approx([val[0]] * 3, rel=1e-7), val  # the same every epoch
        assert val[0] != pytest.approx(exact, rel=1e-3)  # a sampled estimate
        again = wrapped.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
        assert again["roll_loss"] == pytest.approx(val[0], rel=1e-7)


def test_save_load_roundtrip_keeps_training(tmp_path):
    model = mlp_prelu()
    wrapped = keras_roll.wrap(model, lam=0.5, C=0.8, gamma=60.0, samples=3, seed=7)
    _compile(wrapped)
    x = _rng_x((24, 5), seed=2)
    y = (x[:, 1] > 0).astype("int32")
    layer = [la for la in wrapped.layers if isinstance(la, keras_roll.RollRegularizer)][0]
    layer._step.assign(3)  # as after three training steps
    path = os.path.join(tmp_path, "wrapped.keras")
    wrapped.save(path)
    loaded = keras.models.load_model(path)
    layer = [la for la in loaded.layers if isinstance(la, keras_roll.RollRegularizer)][0]
    assert (layer.lam, layer.C, layer.gamma, layer.samples, layer.seed) == (0.5, 0.8, 60.0, 3, 7)
    assert int(layer._step.numpy()) == 3  # the seed sequence goes on where it stopped
    np.testing.assert_allclose(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0),
                               rtol=1e-6)
    before = [v.numpy() for v in keras_roll.unwrap(loaded).trainable_variables]
    hist = loaded.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    assert len(hist["roll_loss"]) == 2 and np.all(np.isfinite(hist["roll_loss"]))
    after = [v.numpy() for v in keras_roll.unwrap(loaded).trainable_variables]
    assert any(not np.allclose(a, b) for a, b in zip(before, after))


def _rewrite_keras_config(path, edit):
    """Applies `edit(config_dict)` to the config.json inside a .keras zip."""
    with zipfile.ZipFile(path) as zf:
        entries = {name: zf.read(name) for name in zf.namelist()}
    config = json.loads(entries["config.json"])
    edit(config)
    entries["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)


def _layer_configs(node, class_name):
    if isinstance(node, dict):
        if node.get("class_name") == class_name:
            yield node["config"]
        for value in node.values():
            yield from _layer_configs(value, class_name)
    elif isinstance(node, list):
        for value in node:
            yield from _layer_configs(value, class_name)


def test_files_of_the_earlier_wrap_load_evaluate_and_train(tmp_path):
    """The earlier `wrap` saved a plain Functional around the layer, whose config had
    no `wrt` and `on_eval=False`: such files load, keep their behaviour (no ROLL in
    evaluate), train, unwrap, and `wrap(unwrap(old))` gives the new behaviour."""
    model = zoo.mlp(fused=False)
    layer = keras_roll.RollRegularizer(model, lam=2.0, gamma=50.0, name="roll_regularizer")
    inp = keras.Input((6,))
    path = os.path.join(tmp_path, "old.keras")
    keras.Model(inp, layer(inp), name="old_roll").save(path)

    def as_before(config):
        assert config["class_name"] == "Functional"
        (layer_config,) = _layer_configs(config, "RollRegularizer")
        del layer_config["wrt"]
        layer_config["on_eval"] = False

    _rewrite_keras_config(path, as_before)
    loaded = keras.models.load_model(path)
    assert not isinstance(loaded, keras_roll.RollModel)
    plain = keras_roll.unwrap(loaded)
    reg_layer = loaded.get_layer("roll_regularizer")
    assert reg_layer.wrt is None and reg_layer.on_eval is False
    x = _rng_x((16, 6), seed=8)
    y = (x[:, 0] > 0).astype("int32")
    _compile(loaded, lr=0.0)
    ev = loaded.evaluate(x, y, verbose=0, return_dict=True)
    assert np.isnan(ev["roll_loss"])
    hist = loaded.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    reg = reference_loss(mlp_groups(plain, x, ["dense0", "dense1"]), 1.0, 50.0).mean()
    assert hist["roll_loss"][0] == pytest.approx(reg, rel=1e-5)
    upgraded = keras_roll.wrap(plain, lam=2.0, gamma=50.0)
    _compile(upgraded, lr=0.0)
    ev = upgraded.evaluate(x, y, verbose=0, return_dict=True)
    assert ev["roll_loss"] == pytest.approx(reg, rel=1e-5)


def test_mixed_precision_loss_is_float32_and_matches():
    x = _rng_x((4, 5), seed=3)
    ref_model = mlp_prelu()
    want = roll.roll_loss(ref_model, x, gamma=50.0).numpy()
    try:
        keras.mixed_precision.set_global_policy("mixed_float16")
        model = mlp_prelu()
        assert model.get_layer("d0").compute_dtype == "float16"
        model.set_weights(ref_model.get_weights())
        got = roll.roll_loss(model, x, gamma=50.0)
        assert got.dtype == tf.float32
        lin = keras_roll.linearize(model)
        fwd = lin.forward(x)
        jvp = lin.jvp(x, np.eye(5, dtype="float32"))
        assert fwd.neurons.z.dtype == tf.float32 and jvp.neurons.dtype == tf.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
        wrapped = keras_roll.wrap(model, lam=2.0, gamma=50.0)
        out = wrapped(x, training=True)  # what fit runs: the regularizer adds its loss
        assert out.dtype == "float16"
        (added,) = wrapped.losses
        assert added.dtype == tf.float32
        assert float(added) == pytest.approx(2.0 * float(want.mean()), rel=1e-5)
    finally:
        keras.mixed_precision.set_global_policy("float32")


# --------------------------------------------------------------------------- training


def moons(n, seed):
    rng = np.random.default_rng(seed)
    t = rng.uniform(0, np.pi, n)
    label = rng.integers(0, 2, n)
    x = np.stack([np.cos(t), np.sin(t)], 1)
    x[label == 1] = np.stack([1 - np.cos(t[label == 1]), 0.5 - np.sin(t[label == 1])], 1)
    x += rng.normal(0, 0.1, x.shape)
    return x.astype("float32"), label.astype("int32")


def reference_l2_margins(model, x, names):
    zs, js = _jacobian(model, [model.get_layer(n).output for n in names], x)
    z = np.concatenate(zs, 1)
    g = np.linalg.norm(np.concatenate(js, 1), axis=-1)
    ratio = np.where(g > 0, np.abs(z) / np.where(g > 0, g, 1.0), np.inf)
    return ratio.min(1)


def _train_toy(lam, x, y, epochs, callbacks=()):
    model = toy_mlp(seed=1)
    target = keras_roll.wrap(model, lam=lam, C=1.0) if lam else model
    target.compile(keras.optimizers.Adam(0.01),
                   keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=["accuracy"])
    hist = target.fit(x, y, epochs=epochs, batch_size=50, verbose=0, shuffle=True,
                      callbacks=list(callbacks))
    return model, hist.history


TOY_NEURONS = ["d0", "d1", "d2"]


@pytest.mark.graph
def test_roll_training_enlarges_margins_on_two_moons():
    x, y = moons(200, seed=0)
    plain, h0 = _train_toy(0.0, x, y, epochs=15)
    monitor = MarginMonitor(x, every=5)  # on the wrapped model: unwraps it
    robust, h1 = _train_toy(1.0, x, y, epochs=15, callbacks=[monitor])
    assert h0["accuracy"][-1] > 0.9 and h1["accuracy"][-1] > 0.9
    m0 = np.median(reference_l2_margins(plain, x, TOY_NEURONS))
    margins = reference_l2_margins(robust, x, TOY_NEURONS)
    m1 = np.median(margins)
    assert m1 > 2.5 * m0, (m0, m1)
    assert len(h1["margin_l2_p50"]) == 3 and len(h1["roll_loss"]) == 15
    assert h1["margin_l2_p50"][-1] == pytest.approx(
        np.percentile(margins, 50, method="nearest"), rel=1e-4)


def test_margin_monitor_logs_reference_percentiles(tmp_path):
    x, y = moons(120, seed=1)
    x_val = x[:40]
    log_dir = os.path.join(tmp_path, "tb")
    monitor = MarginMonitor(x_val, every=2, log_dir=log_dir)
    model, hist = _train_toy(0.0, x, y, epochs=4, callbacks=[monitor])
    keys = [f"margin_l2_p{q}" for q in (25, 50, 75, 100)]
    for key in keys:
        assert len(hist[key]) == 2  # epochs 2 and 4
    want = np.percentile(reference_l2_margins(model, x_val, TOY_NEURONS),
                         [25, 50, 75, 100], method="nearest")
    np.testing.assert_allclose([hist[k][-1] for k in keys], want, rtol=1e-4)
    events = [os.path.join(log_dir, f) for f in os.listdir(log_dir)]
    written = {}
    for event in tf.compat.v1.train.summary_iterator(events[0]):
        for value in event.summary.value:
            assert value.metadata.plugin_data.plugin_name == "scalars"
            written[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
    assert sorted(written) == sorted((k, s) for k in keys for s in (1, 3))
    np.testing.assert_allclose([written[(k, 3)] for k in keys], want, rtol=1e-4)
    with pytest.raises(ValueError, match="every=0"):
        MarginMonitor(x_val, every=0)


def test_wrapped_training_output_reuses_the_twin_forward_only_when_equivalent():
    """Without dropout / BatchNorm the training output comes from the twin's forward
    pass (no second forward); it must equal the model's own output."""
    x = np.random.default_rng(11).normal(size=(5, 4)).astype("float32")
    keras.utils.set_random_seed(3)
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, activation="relu")(inp)
    plain = keras.Model(inp, keras.layers.Dense(3, activation="softmax")(h))
    wrapped = keras_roll.wrap(plain, lam=1.0)
    assert keras_roll.linearize(plain).inference_equals_training
    np.testing.assert_allclose(wrapped(x, training=True).numpy(), plain(x).numpy(),
                               rtol=1e-6, atol=1e-7)
    keras.utils.set_random_seed(3)
    h = keras.layers.Dropout(0.5)(keras.layers.Dense(6, activation="relu")(inp))
    noisy = keras.Model(inp, keras.layers.Dense(3)(h))
    assert not keras_roll.linearize(noisy).inference_equals_training
    out = keras_roll.wrap(noisy, lam=1.0)(x, training=True).numpy()
    assert not np.allclose(out, noisy(x, training=False).numpy())  # dropout was applied
