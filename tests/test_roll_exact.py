"""Exact ROLL in fewer directions: a first Dense layer's Gram factor, valid steps only.

The factored path pushes `H1` directions from the output of a first Dense layer
with `H1 < D` units instead of the `D` input axes (`keras_roll.roll.factored`);
with a ReLU after that layer, each example's `|S|` directions of its active
units from the ReLU's output (`keras_roll.roll.active_factor`); behind a leading
Masking layer the packed path (`skip_padded_steps=True`) pushes one direction
per example and valid input axis (`keras_roll.roll.exact.PackedAxes`).
References: the input-axes path (`fewest_directions=False`), `tf.GradientTape`
Jacobians with Eq. 9 in numpy / TensorFlow (tests/test_roll.py, including a
hand-written masked SimpleRNN), and the closed forms `d tr(R G R^T) / dW = 2 W G`
and `d sum_b tr(V_b A_b V_b^T) / dW = 2 W sum_b M_b A_b M_b` for the factors'
custom gradients.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.roll import exact as exact_paths
from keras_roll.roll import loss as roll
from keras_roll.roll.active_factor import active_factor, first_activation, spread_directions
from keras_roll.roll.buckets import buckets_apply
from keras_roll.roll.config import RollConfig
from keras_roll.roll.entry import tangent_entry
from keras_roll.roll.estimators import estimator_for
from keras_roll.roll.exact import ActiveFactorAxes, ExactAxes, FactoredAxes, PackedAxes
from keras_roll.roll.factored import factored_entry, gram_factor
from tests import model_zoo as zoo
from tests.test_fast_paths import TANGENT_RTOL
from tests.test_roll import (
    _reference_grads,
    _tf_dense_groups,
    _tf_rnn_groups,
    mlp_groups,
    reference_loss,
    rnn_groups,
)

D, H = 24, 9


def mlp(first=(), fused=False, width=H, input_shape=(D,), seed=1, act="relu"):
    """[first layers] -> Dense(width) -> ReLU (`act="leaky"`: LeakyReLU) -> Dense(6) ->
    LeakyReLU -> Dense(3)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input(input_shape)
    h = inp
    for kind in first:
        if kind == "norm":
            h = keras.layers.Normalization(mean=0.3, variance=4.0, name="norm")(h)
        elif kind == "scale":
            scale = np.linspace(0.5, 2.0, int(np.prod(h.shape[1:]))).astype("float32")
            h = keras.layers.Rescaling(scale.reshape(h.shape[1:]), offset=0.1, name="scale")(h)
        elif kind == "flatten":
            h = keras.layers.Flatten(name="flat")(h)
    fused_act = "leaky_relu" if act == "leaky" else "relu"
    h = keras.layers.Dense(width, activation=fused_act if fused else None, name="d0")(h)
    if not fused:
        h = (keras.layers.LeakyReLU(0.3) if act == "leaky" else keras.layers.ReLU())(h)
    h = keras.layers.Dense(6, name="d1")(h)
    h = keras.layers.LeakyReLU(0.2, name="l1")(h)
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax", name="out")(h))


@pytest.fixture(params=[True, False], ids=["active units", "H1 rows"])
def compact(request, monkeypatch):
    """Both ways of ActiveFactorAxes: each example's active units (always, whatever the
    number of active units) or the H1 rows of the whole Gram factor (never compact)."""
    monkeypatch.setattr(exact_paths, "COMPACT_FRACTION", 1.0 if request.param else -1.0)
    return request.param


def _x(shape=(5, D), seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _loss_and_grads(model, x, **kwargs):
    with tf.GradientTape() as tape:
        loss = roll.roll_loss(model, x, **kwargs)
        total = tf.reduce_mean(loss)
    grads = tape.gradient(total, model.trainable_variables)
    return loss.numpy(), [np.zeros(v.shape) if g is None else g.numpy()
                          for g, v in zip(grads, model.trainable_variables)]


def _assert_same(a, b, rtol=1e-6):
    (la, ga), (lb, gb) = a, b
    np.testing.assert_allclose(la, lb, rtol=rtol)
    scale = max(np.abs(g).max() for g in ga)
    for u, v in zip(ga, gb):
        np.testing.assert_allclose(u, v, rtol=10 * rtol, atol=rtol * scale)


def _compiled_step(lin, config, shape):
    """A compiled training step: `(mean ROLL loss, its gradients)` for inputs of `shape`
    (None: a dynamic axis)."""
    variables = lin.model.trainable_variables

    def run(xb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(roll.loss_from_config(lin, xb, config,
                                                        precompute_gradient=True))
        return loss, tape.gradient(loss, variables)

    return tf.function(run, input_signature=[tf.TensorSpec(shape)], autograph=False)


@contextlib.contextmanager
def _eagerly():
    """Every `tf.function` runs eagerly inside (a reference beside a compiled step)."""
    previous = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(True)
    try:
        yield
    finally:
        tf.config.run_functions_eagerly(previous)


def _eager_step(lin, config):
    """The step of `_compiled_step` with every function run eagerly: the reference of a
    compiled step, without a second graph to trace (a variable the loss does not reach
    gets zeros, as in the graph)."""
    step = _compiled_step(lin, config, None)

    def run(xb):
        with _eagerly():
            loss, grads = step(tf.constant(xb))
        return loss, [tf.zeros_like(v) if g is None else g
                      for g, v in zip(grads, lin.model.trainable_variables)]

    return run


def _estimator(model, x, config=None):
    lin = keras_roll.linearize(model)
    x = tf.constant(x)
    return estimator_for(lin, x, config or RollConfig(), None, trace=lin.primal(x).trace)


@pytest.mark.parametrize("first, fused, wrt, act", [
    # a split ReLU without a prefix: the fused one after a prefix and the split one with
    # wrt (below); a prefix of two layers: test_flatten_before_the_dense_layer_is_factored
    pytest.param((), False, None, "relu", marks=pytest.mark.slow),
    (("norm",), True, None, "relu"),
    (("norm",), False, "norm", "relu"),
    pytest.param(("norm", "scale"), False, None, "relu", marks=pytest.mark.slow),
    pytest.param((), False, None, "leaky", marks=pytest.mark.slow),  # the fused one below
    (("norm",), True, None, "leaky"),
])
def test_factored_loss_and_gradients_equal_the_input_axes(first, fused, wrt, act, compact):
    model = mlp(first, fused, act=act)
    x = _x()
    est = _estimator(model, x, RollConfig(wrt=wrt))
    if act == "relu":  # each example's active units: fewer directions than H1
        assert isinstance(est, ActiveFactorAxes) and bool(est.compact) is compact
        assert 0 < int(est.total) < H if compact else int(est.total) == H
    else:
        assert isinstance(est, FactoredAxes) and est.total == H
    for kwargs in ({"C": 0.5}, {"C": 0.5, "gamma": 60.0}):
        new = _loss_and_grads(model, x, wrt=wrt, **kwargs)
        old = _loss_and_grads(model, x, wrt=wrt, fewest_directions=False, **kwargs)
        _assert_same(new, old)


@pytest.mark.graph  # faster compiled
def test_factored_loss_and_gradients_match_the_tape_reference(compact):
    model = mlp()
    x = _x()
    names = ["d0", "d1"]
    want = reference_loss(mlp_groups(model, x, names), 0.7, 50.0)
    got, grads = _loss_and_grads(model, x, C=0.7, gamma=50.0)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    ref = _reference_grads(model, x, lambda m, xb: mlp_groups(m, xb, names),
                           _tf_dense_groups(names), 0.7, 50.0)
    scale = max(np.abs(g).max() for g in ref)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * scale)


def test_flatten_before_the_dense_layer_is_factored():
    model = mlp(("scale", "flatten"), input_shape=(4, 6))
    x = _x((3, 4, 6))
    lin = keras_roll.linearize(model)
    assert factored_entry(lin.program, 0).units == H
    _assert_same(_loss_and_grads(model, x, C=0.5),
                 _loss_and_grads(model, x, C=0.5, fewest_directions=False))


@pytest.mark.graph
@pytest.mark.slow  # a chunked compiled step, either way: test_compiled_step_decides_...
@pytest.mark.parametrize("gamma", [100.0, 70.0])
def test_chunked_and_training_steps_equal_one_chunk(gamma, compact):
    """Several chunks of factor rows: recomputed in backprop (gamma < 100) or differentiated
    in the forward pass (a training step, gamma = 100), inside a dynamic-batch graph."""
    model = mlp(("norm",))
    x = _x((6, D))
    whole = keras_roll.linearize(model)
    plan = roll.memory_plan(whole, x)
    k = int(_estimator(model, x).total)  # the most active first-layer units of an example
    assert plan.directions == k and plan.chunks == 1 and k >= 3 and (k < H) is compact
    chunked = keras_roll.linearize(model, memory_budget=-(-k // 3) * plan.bytes_per_direction)
    assert roll.memory_plan(chunked, x).chunks == 3

    config = RollConfig(C=0.5, gamma=gamma)
    (la, ga) = _eager_step(whole, config)(x)
    (lb, gb) = _compiled_step(chunked, config, [None, D])(x)
    np.testing.assert_allclose(lb.numpy(), la.numpy(), rtol=1e-6)
    for u, v in zip(ga, gb):
        np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.graph
def test_compiled_step_decides_the_factor_per_batch_in_chunks():
    """One compiled training step (a dynamic batch, chunks of two directions) meets
    batches whose largest number of active units is small (each example's active units)
    and large (the H1 factor rows): the graph decides per batch, and the loss and
    gradients equal the input axes' (run eagerly), batch after batch."""
    model = mlp(("norm",))
    rows = _x((40, D), seed=3)
    kernel, bias = (w.numpy() for w in model.get_layer("d0").weights)
    low = rows[((rows - 0.3) / 2.0 @ kernel + bias > 0).sum(1) <= 3]  # 3 active units at most
    batches = [low[:4], np.concatenate([low[:2], 0.6 - low[:2]]), rows[:1]]  # 0.6 - x: the others
    assert [bool(_estimator(model, xb).compact) for xb in batches[:2]] == [True, False]
    whole = keras_roll.linearize(model)
    budget = 2 * roll.memory_plan(whole, batches[0]).bytes_per_direction
    chunked = keras_roll.linearize(model, memory_budget=budget)
    assert [roll.memory_plan(chunked, xb).chunks for xb in batches[:2]] == [2, 5]
    fast = _compiled_step(chunked, RollConfig(C=0.5), [None, D])
    slow = _eager_step(whole, RollConfig(C=0.5, fewest_directions=False))
    for xb in batches:
        (la, ga), (lb, gb) = fast(xb), slow(xb)
        np.testing.assert_allclose(la.numpy(), lb.numpy(), rtol=1e-6)
        for u, v in zip(ga, gb):
            np.testing.assert_allclose(u.numpy(), v.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("build", [
    lambda: mlp(width=D),  # H1 = D: nothing to gain
    lambda: mlp(("norm",), width=D + 3),
    lambda: keras.Sequential([keras.Input((6, 4)), keras.layers.Dense(2, name="d"),
                              keras.layers.ReLU(), keras.layers.Flatten(),
                              keras.layers.Dense(3)]),  # Dense per position
])
def test_other_models_keep_the_input_axes(build):
    model = build()
    lin = keras_roll.linearize(model)
    x = tf.zeros((2, *model.input_shape[1:]))
    assert factored_entry(lin.program, tangent_entry(lin.program, None)) is None
    assert isinstance(estimator_for(lin, x, RollConfig(), None), ExactAxes)


def test_input_read_twice_keeps_the_input_axes():
    inp = keras.Input((D,))
    h = keras.layers.ReLU()(keras.layers.Dense(4)(inp))
    skip = keras.layers.Dense(4)(inp)
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Add()([h, skip])))
    assert factored_entry(keras_roll.linearize(model).program, 0) is None


def test_rank_deficient_and_zero_kernels(compact):
    model = mlp()
    kernel = model.get_layer("d0").kernel
    w = kernel.numpy()
    w[:, 3] = 0.0  # a dead unit
    w[:, 5] = 2.0 * w[:, 4]  # two parallel units
    kernel.assign(w)
    x = _x()
    _assert_same(_loss_and_grads(model, x, C=0.5),
                 _loss_and_grads(model, x, C=0.5, fewest_directions=False), rtol=2e-6)
    kernel.assign(np.zeros_like(w))
    loss, grads = _loss_and_grads(model, x, C=0.0)
    np.testing.assert_array_equal(loss, 0.0)
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_non_finite_kernel_gives_a_nan_loss(compact):
    model = mlp()
    w = model.get_layer("d0").kernel.numpy()
    w[0, 0] = np.nan
    model.get_layer("d0").kernel.assign(w)
    with pytest.warns(UserWarning, match=r"non-finite neurons or logits .* ROLL loss is NaN"):
        loss = roll.roll_loss(model, _x(), C=0.0)
    assert np.all(np.isnan(loss.numpy()))


def test_gram_factor_and_its_gradient():
    rng = np.random.default_rng(3)
    w = tf.constant(rng.normal(size=(30, 8)))
    g = rng.normal(size=(8, 8))
    g = tf.constant(g + g.T)
    with tf.GradientTape() as tape:
        tape.watch(w)
        r = gram_factor(w)
        loss = tf.linalg.trace(tf.matmul(tf.matmul(r, g), r, transpose_b=True))
    np.testing.assert_allclose(tf.matmul(r, r, transpose_a=True).numpy(),
                               tf.matmul(w, w, transpose_a=True).numpy(), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(tape.gradient(loss, w).numpy(), (2.0 * w @ g).numpy(),
                               rtol=1e-9, atol=1e-9)


def _masked_gram_reference(w, active):
    """`M_b W^T W M_b` for every example (numpy, float64)."""
    m = active.astype(np.float64)
    gram = w.T @ w
    return m[:, :, None] * gram[None] * m[:, None, :]


@pytest.mark.parametrize("rows", [
    [[1, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]],  # none, all active
    [[0, 0, 0, 0, 0, 0]],  # no active unit anywhere: one zero direction
    [[0, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 1]],
])
def test_active_factor_and_its_gradient(rows):
    rng = np.random.default_rng(4)
    active = np.array(rows, bool)
    w = tf.constant(rng.normal(size=(20, active.shape[1])))
    a = rng.normal(size=(len(rows), active.shape[1], active.shape[1]))
    a = tf.constant(a + np.swapaxes(a, 1, 2))
    with tf.GradientTape() as tape:
        tape.watch(w)
        lower, rows = active_factor(w, tf.constant(active))
        v = spread_directions(lower, rows)  # [B, K, H1]
        loss = tf.reduce_sum(tf.linalg.trace(tf.matmul(tf.matmul(v, a), v, transpose_b=True)))
    assert v.shape[1] == max(1, active.sum(axis=1).max())
    # Every example's directions span its active units only and give M W^T W M.
    np.testing.assert_array_equal(np.abs(v.numpy()).sum(axis=1)[~active], 0.0)
    np.testing.assert_allclose(tf.matmul(v, v, transpose_a=True).numpy(),
                               _masked_gram_reference(w.numpy(), active), rtol=1e-9, atol=1e-9)
    m = active.astype(np.float64)
    want = 2.0 * w.numpy() @ (m[:, :, None] * a.numpy() * m[:, None, :]).sum(axis=0)
    np.testing.assert_allclose(tape.gradient(loss, w).numpy(), want, rtol=1e-9, atol=1e-9)


def test_first_activation_is_a_relu_right_after_the_dense_layer():
    def program(model):
        return keras_roll.linearize(model).program

    assert first_activation(program(mlp()), 0) == (1, 0)
    assert first_activation(program(mlp(fused=True)), 0) == (0, 1)
    assert first_activation(program(mlp(act="leaky")), 0) is None
    assert first_activation(program(mlp(fused=True, act="leaky")), 0) is None
    inp = keras.Input((D,))
    u = keras.layers.Dense(4)(inp)
    both = keras.layers.Add()([keras.layers.ReLU()(u), u])  # the layer's output read twice
    model = keras.Model(inp, keras.layers.Dense(2)(both))
    assert first_activation(program(model), 0) is None
    x = _x()
    assert isinstance(_estimator(model, x), FactoredAxes)
    _assert_same(_loss_and_grads(model, x, C=0.5),
                 _loss_and_grads(model, x, C=0.5, fewest_directions=False))


@pytest.mark.parametrize("dtype", [  # bfloat16 tangents: tests/test_fast_paths.py
    pytest.param("bfloat16", marks=pytest.mark.slow), "float16"])
def test_active_factor_with_16_bit_tangents(dtype, compact):
    model = mlp()
    x = _x()
    est = _estimator(model, x, RollConfig(tangent_dtype=dtype))
    assert isinstance(est, ActiveFactorAxes) and bool(est.compact) is compact
    want = roll.roll_loss(model, x, C=0.5, fewest_directions=False).numpy()
    got = roll.roll_loss(model, x, C=0.5, tangent_dtype=dtype).numpy()
    np.testing.assert_allclose(got, want, rtol=TANGENT_RTOL[dtype])


@pytest.mark.graph
@pytest.mark.slow  # both ways in one compiled step: test_compiled_step_decides_the_factor_...
@pytest.mark.parametrize("fraction", [1.0, -1.0], ids=["active units", "H1 rows"])
def test_active_factor_in_a_compiled_step_with_a_dynamic_batch(fraction, monkeypatch):
    """The number of directions is decided in the graph; the loss and gradients equal
    the input axes', batch after batch of different activity."""
    monkeypatch.setattr(exact_paths, "COMPACT_FRACTION", fraction)
    model = mlp()
    lin = keras_roll.linearize(model)
    fast = _compiled_step(lin, RollConfig(C=0.5), [None, D])
    slow = _eager_step(lin, RollConfig(C=0.5, fewest_directions=False))
    for seed, b in [(0, 5), (1, 7), (2, 1)]:
        x = _x((b, D), seed) * np.float32(1.0 + seed)
        (la, ga), (lb, gb) = fast(x), slow(x)
        np.testing.assert_allclose(la.numpy(), lb.numpy(), rtol=1e-6)
        for u, v in zip(ga, gb):
            np.testing.assert_allclose(u.numpy(), v.numpy(), rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------- padded steps


@pytest.fixture(scope="module")
def sequences():
    x, lengths = zoo.padded_sequences(batch=4, steps=5)
    assert len(set(lengths.tolist())) > 1
    return x, lengths


def test_packed_rows_are_the_valid_axes(sequences):
    x, lengths = sequences
    model = zoo.rnn()
    lin = keras_roll.linearize(model)
    fwd = lin.primal(tf.constant(x))
    default = estimator_for(lin, tf.constant(x), RollConfig(), None, trace=fwd.trace)
    assert isinstance(default, ExactAxes)  # every input axis unless asked
    est = estimator_for(lin, tf.constant(x), RollConfig(skip_padded_steps=True), None,
                        trace=fwd.trace)
    assert isinstance(est, PackedAxes)
    channels = x.shape[-1]
    want = [(b, t * channels + c) for b, n in enumerate(lengths) for t in range(n)
            for c in range(channels)]
    rows = list(zip(est.example.numpy()[:-1].tolist(), est.axis.numpy()[:-1].tolist()))
    assert rows == want and int(est.total) == len(want)
    plan = roll.memory_plan(model, x, skip_padded_steps=True)
    assert (plan.examples, plan.directions) == (1, len(want))
    assert roll.memory_plan(model, x).directions == x[0].size


@pytest.mark.parametrize("activation", ["relu", "leaky"])
def test_packed_loss_and_gradients_match_the_reference(sequences, activation):
    x, _ = sequences
    model = zoo.rnn(activation)
    leaky = activation == "leaky"
    want = reference_loss(rnn_groups(model, x, leaky=leaky), 0.5, 60.0)
    got, grads = _loss_and_grads(model, x, C=0.5, gamma=60.0, skip_padded_steps=True)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    _assert_same((got, grads), _loss_and_grads(model, x, C=0.5, gamma=60.0))
    if not leaky:
        ref = _reference_grads(model, x, rnn_groups, _tf_rnn_groups, 0.5, 60.0)
        scale = max(np.abs(g).max() for g in ref)
        for g, r in zip(grads, ref):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.graph
@pytest.mark.parametrize("gamma", [100.0, pytest.param(70.0, marks=pytest.mark.slow)])
def test_packed_rows_in_chunks_and_in_a_training_graph(sequences, gamma):
    """Rows in several chunks, planned in the graph (the number of rows depends on the
    data): the same loss and gradients as one chunk, gamma = 100 (differentiated in
    the forward pass) and gamma < 100 (recomputed)."""
    x, _ = sequences
    model = zoo.rnn()
    whole = keras_roll.linearize(model)
    plan = roll.memory_plan(whole, x, skip_padded_steps=True)
    chunked = keras_roll.linearize(model, memory_budget=7 * plan.bytes_per_direction)
    assert roll.memory_plan(chunked, x, skip_padded_steps=True).chunks > 3

    def step(lin, gamma):
        config = RollConfig(C=0.5, gamma=gamma, skip_padded_steps=True)
        return _compiled_step(lin, config, [None, *x.shape[1:]])

    with _eagerly():  # the reference: no graphs to trace
        ref = _loss_and_grads(model, x, C=0.5, gamma=gamma, fewest_directions=False)
    loss, grads = step(chunked, gamma)(x)
    np.testing.assert_allclose(loss.numpy(), ref[0].mean(), rtol=1e-6)
    for g, r in zip(grads, ref[1]):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # ~18 s of tracing; packed rows in a training graph: the test above
def test_packed_rows_under_a_fixed_input_signature():
    """A training graph with a fixed batch size and a model with a variable time axis:
    the loops over chunks of packed rows keep their shapes, with the loss and gradients
    of every axis."""
    keras.utils.set_random_seed(0)
    model = keras_roll.models.scornn_classifier((None, 3), units=4, classes=2)
    x = np.zeros((3, 4, 3), np.float32)
    x[:, :2] = np.random.default_rng(0).normal(size=(3, 2, 3))
    variables = model.trainable_variables
    lin = keras_roll.linearize(model)

    def step(skip):
        return _compiled_step(lin, RollConfig(C=1.0, skip_padded_steps=skip), x.shape)

    def arrays(loss, grads):
        return loss.numpy(), [np.zeros(v.shape) if g is None else g.numpy()
                              for g, v in zip(grads, variables)]

    _assert_same(arrays(*step(True)(x)), arrays(*step(False)(x)), rtol=1e-5)


def test_sequences_without_padding_and_an_all_padding_example():
    model = zoo.rnn()
    x = np.random.default_rng(4).normal(size=(3, 5, 3)).astype("float32")
    x[1] = 0.0  # no valid step at all: no neuron, a loss of 0
    got, grads = _loss_and_grads(model, x, C=0.5, skip_padded_steps=True)
    _assert_same((got, grads), _loss_and_grads(model, x, C=0.5))
    assert got[1] == 0.0


def variable_rnn(return_sequences=False, zero_output_for_mask=False, time=None, seed=0):
    """`zoo.rnn` with a variable time axis: Masking -> SimpleRNN -> Dense."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((time, 3))
    h = keras.layers.Masking(0.0)(inp)
    h = keras.layers.SimpleRNN(6, activation="relu", return_sequences=return_sequences,
                               zero_output_for_mask=zero_output_for_mask, name="rnn")(h)
    if return_sequences:
        h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inp, keras.layers.Dense(2, name="logits")(h))


@pytest.mark.parametrize("build, applies", [
    (variable_rnn, True),
    (lambda: variable_rnn(time=6), False),  # a fixed time axis
    (lambda: variable_rnn(return_sequences=True), False),  # reads every step
    (lambda: variable_rnn(zero_output_for_mask=True), False),  # the last output may be 0
])
def test_length_buckets_apply_to_a_last_state_recurrent_layer(build, applies):
    program = keras_roll.linearize(build()).program
    assert buckets_apply(program, RollConfig(skip_padded_steps=True), 0) is applies
    assert buckets_apply(program, RollConfig(), 0) is applies  # every input axis, cropped
    assert not buckets_apply(program, RollConfig(samples=2), 0)


@pytest.fixture(scope="module")
def bucket_case():
    model = variable_rnn()
    x, _ = zoo.padded_sequences(batch=7, steps=6, seed=2)
    x[3] = 0.0  # an example without a valid step
    return model, x


def test_length_buckets_give_the_same_loss_and_gradients(bucket_case):
    """Seven sequences of lengths 2..6 (one all padding) in four buckets, eagerly: against
    the input axes and the tape."""
    model, x = bucket_case
    want = reference_loss(rnn_groups(model, x), 0.5, 60.0)
    got, grads = _loss_and_grads(model, x, C=0.5, gamma=60.0, skip_padded_steps=True)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    _assert_same((got, grads), _loss_and_grads(model, x, C=0.5, gamma=60.0))


def _whole_batch(monkeypatch):
    """Exact ROLL without length buckets (the batch run whole, as before them)."""
    monkeypatch.setattr(roll, "buckets_apply", lambda *args: False)


def test_the_default_path_in_length_buckets_gives_the_whole_batch_loss(bucket_case,
                                                                       monkeypatch):
    """Every input axis, cropped in buckets (the default): the tape's loss, and the loss
    and gradients of the whole padded batch pushed along every axis."""
    model, x = bucket_case
    want = reference_loss(rnn_groups(model, x), 0.5, 60.0)
    got = _loss_and_grads(model, x, C=0.5, gamma=60.0)
    np.testing.assert_allclose(got[0], want, rtol=2e-6)
    with monkeypatch.context() as m:
        _whole_batch(m)
        whole = _loss_and_grads(model, x, C=0.5, gamma=60.0)
    _assert_same(got, whole)


@pytest.mark.graph
@pytest.mark.slow  # about 40 s: the padded batch is cut and the full one run whole, compiled
def test_a_training_graph_cuts_a_padded_batch_and_runs_a_full_one_whole(monkeypatch):
    """In a graph the cut is a `tf.cond` on the batch's lengths: the same loss and
    gradients as the whole batch, for a padded batch (cut) and an unpadded one (whole)."""
    model = variable_rnn()
    lin = keras_roll.linearize(model)
    padded, _ = zoo.padded_sequences(batch=8, steps=8, seed=3)
    full = np.random.default_rng(4).normal(size=(8, 8, 3)).astype("float32")
    step = _compiled_step(lin, RollConfig(C=0.5), [None, None, 3])
    with monkeypatch.context() as m:
        _whole_batch(m)
        whole = _compiled_step(lin, RollConfig(C=0.5), [None, None, 3])
        whole.get_concrete_function()
    for xb in (padded, full):
        got, want = step(tf.constant(xb)), whole(tf.constant(xb))
        np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-6)
        for g, r in zip(got[1], want[1]):
            np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_length_buckets_in_a_training_graph(bucket_case):
    """A dynamic batch and time axis, and two examples: two empty buckets."""
    model, x = bucket_case
    lin = keras_roll.linearize(model)
    variables = model.trainable_variables

    @tf.function(input_signature=[tf.TensorSpec([None, None, 3])], autograph=False)
    def step(xb):
        with tf.GradientTape() as tape:
            config = RollConfig(C=0.5, skip_padded_steps=True)
            loss = roll.loss_from_config(lin, xb, config, precompute_gradient=True)
            total = tf.reduce_mean(loss)
        return loss, tape.gradient(total, variables)

    for xb in (x, x[:2]):
        ref_loss, ref_grads = _loss_and_grads(model, xb, C=0.5)
        loss, grads = step(tf.constant(xb))
        np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-6)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g.numpy(), r, rtol=1e-5, atol=1e-7)
