"""The fast paths of the ROLL step equal the slow paths they replace.

* convolutions of one-hot directions by gathered kernel taps (`_conv_taps`)
  against the convolution of the dense one-hot tangent, also through a
  ZeroPadding that remaps the axes and with a folded per-channel scale;
* BatchNormalization folded into the kernel of the convolution / Dense before
  it against the unfolded twin (and the independent tf.GradientTape Jacobian);
* the chunked ROLL loss differentiated chunk by chunk in the forward pass
  (`precompute_gradient=True`) against the single-chunk gradient, with a
  uniform upstream gradient (one tangent pass per chunk, counted) and a
  non-uniform one (the recomputing fallback);
* gradients only into the inputs a gradient can reach (`_gradient_may_flow`);
* 16-bit tangents against float32 tangents, within stated tolerances.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile.interpreter import Interpreter
from keras_roll.compile.rules.base import NO_RECORD, Tangent
from keras_roll.roll import chunked_gradients, estimators
from keras_roll.roll import loss as roll
from keras_roll.roll.config import RollConfig
from tests.model_zoo import randomize_batch_norm

L = keras.layers


def _single_op(layer, shape):
    inp = keras.Input(shape)
    lin = keras_roll.linearize(keras.Model(inp, layer(inp)))
    (op,) = lin.program.steps[0].ops
    return op


def _one_hot_directions(shape, shared, seed=0):
    """One-hot directions with their axes (a -1, zero direction, among them)."""
    d = int(np.prod(shape))
    k = min(12, d)
    rng = np.random.default_rng(seed)
    if shared:
        axes = rng.choice(d, k, replace=False).astype("int32")
        axes[1] = -1
        v = tf.reshape(tf.one_hot(axes, d), [k, *shape])
    else:
        axes = np.stack([rng.choice(d, k, replace=False) for _ in range(3)]).astype("int32")
        axes[0, 2] = -1
        v = tf.reshape(tf.one_hot(axes, d), [3, k, *shape])
    return v, tf.constant(axes)


CONVS = {
    "conv2d_7x7_s2_valid": (lambda: L.Conv2D(5, 7, strides=2), (13, 11, 3)),
    "conv2d_3x3_s3_same": (lambda: L.Conv2D(4, 3, strides=3, padding="same"), (10, 9, 2)),
    "conv2d_dilated_same": (lambda: L.Conv2D(4, 3, padding="same", dilation_rate=2), (10, 9, 2)),
    "conv2d_1x1_s2": (lambda: L.Conv2D(4, 1, strides=2, use_bias=False), (6, 6, 3)),
    "conv2d_rect_s21": (lambda: L.Conv2D(3, (2, 4), strides=(2, 1)), (7, 8, 2)),
    "conv1d_causal_dilated": (lambda: L.Conv1D(4, 3, padding="causal", dilation_rate=2), (10, 2)),
    "conv1d_same_s2": (lambda: L.Conv1D(4, 4, strides=2, padding="same"), (11, 2)),
    "conv3d_same_s2": (lambda: L.Conv3D(2, 3, strides=2, padding="same"), (5, 6, 4, 2)),
}


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_example"])
@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_taps_equal_the_convolution_of_one_hot_tangents(name, shared):
    make, shape = CONVS[name]
    keras.utils.set_random_seed(0)
    op = _single_op(make(), shape)
    v, axes = _one_hot_directions(shape, shared)
    fast = op.tangent([Tangent(v, shared, axes=axes)], NO_RECORD, None)[0]
    slow = op.tangent([Tangent(v, shared)], NO_RECORD, None)[0]
    assert fast.shared == slow.shared == shared
    assert fast.value.shape == slow.value.shape
    np.testing.assert_allclose(fast.value.numpy(), slow.value.numpy(), rtol=0, atol=1e-6)
    assert np.abs(slow.value.numpy()).max() > 0.1  # the directions do reach the output
    # with a folded per-channel scale (BatchNormalization after the convolution)
    scale = tf.constant(np.linspace(0.5, 2.0, op.layer.filters), tf.float32)
    fast = op.tangent_scaled([Tangent(v, shared, axes=axes)], scale)
    np.testing.assert_allclose(fast.value.numpy(), slow.value.numpy() * scale.numpy(),
                               rtol=1e-6, atol=1e-6)


def test_conv_taps_do_not_apply_to_channels_first_or_dense_tangents():
    keras.utils.set_random_seed(0)
    op = _single_op(L.Conv2D(3, 3), (6, 6, 2))
    v, _ = _one_hot_directions((6, 6, 2), True)
    # no axes: the convolution itself; grouped / channels-first convolutions have no taps
    assert op.tangent([Tangent(v, True)], NO_RECORD, None)[0].axes is None
    grouped = _single_op(L.Conv2D(4, 3, groups=2), (6, 6, 2))
    assert grouped._one_hot is None


@pytest.mark.parametrize("layer, shape", [
    (L.ZeroPadding1D((1, 3)), (5, 2)),
    (L.ZeroPadding2D(((3, 1), (0, 2))), (4, 5, 3)),
    (L.ZeroPadding3D(1), (2, 3, 2, 2)),
    (L.Flatten(), (3, 4, 2)),
], ids=["pad1d", "pad2d", "pad3d", "flatten"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per_example"])
def test_layers_before_a_convolution_keep_one_hot_axes(layer, shape, shared):
    op = _single_op(layer, shape)
    v, axes = _one_hot_directions(shape, shared)
    out = op.tangent([Tangent(v, shared, axes=axes)], NO_RECORD, None)[0]
    flat = tf.reshape(out.value, [*out.value.shape[:1 if shared else 2], -1]).numpy()
    # the mapped axis is where the output's single 1 sits; -1 stays a zero direction
    want = np.where(flat.max(-1) > 0, flat.argmax(-1), -1)
    np.testing.assert_array_equal(out.axes.numpy(), want)
    assert (want == -1).sum() == 1


def _conv_bn_model(seed=0):
    """Conv-BN pairs that fold (the stem, a Dense + BN) and pairs that must not."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((9, 9, 2))
    h = L.ZeroPadding2D(1)(inp)
    h = L.Conv2D(4, 3, strides=2, use_bias=False, name="stem")(h)
    h = L.BatchNormalization(name="stem_bn")(h)  # folds into stem
    h = L.ReLU()(h)
    a = L.Conv2D(4, 3, padding="same", name="shared_out")(h)
    b = L.BatchNormalization(name="bn_b")(a)  # shared_out is also read by the Add: no fold
    h = L.ReLU()(L.Add()([a, b]))
    h = L.Conv2D(3, 1, activation="relu", name="fused_relu")(h)  # activation in the step
    h = L.BatchNormalization(name="bn_c")(h)  # no fold: the conv step has a ReLU op
    h = L.Flatten()(h)
    h = L.Dense(6, name="fc")(h)
    h = L.BatchNormalization(name="bn_d")(h)  # folds into fc
    h = L.ReLU()(h)
    return randomize_batch_norm(keras.Model(inp, L.Dense(3, name="logits")(h)), seed)


def test_batch_norm_folds_into_the_kernel_before_it():
    model = _conv_bn_model()
    lin = keras_roll.linearize(model)
    folded = {lin.program.steps[i].name for i, s in enumerate(lin.program.steps)
              if id(s) in lin.interpreter.folds}
    assert folded == {"stem", "fc"}
    x = np.random.default_rng(1).uniform(-1, 1, (3, 9, 9, 2)).astype("float32")
    fwd = lin.forward(x)
    plain = Interpreter(lin.program, "float32")
    plain.folds = {}
    d = 9 * 9 * 2
    v, axes = _one_hot_directions((9, 9, 2), False, seed=2)
    for shared, dirs, ax in [(True, tf.eye(d)[:40], tf.range(40)), (False, v, axes)]:
        dirs = tf.reshape(dirs, [*dirs.shape[:1 if shared else 2], 9, 9, 2])
        fast = lin.tangent_from_trace(fwd.trace, dirs, shared, axes=ax)
        slow = plain.tangent(fwd.trace, dirs, shared)
        scale = np.abs(slow.neurons.numpy()).max()
        np.testing.assert_allclose(fast.neurons.numpy(), slow.neurons.numpy(), rtol=1e-5,
                                   atol=1e-6 * scale)
        np.testing.assert_allclose(fast.logits.numpy(), slow.logits.numpy(), rtol=1e-5,
                                   atol=1e-6 * scale)
    # and the independent reference: the tape's Jacobian of the dense pre-activations
    sub = keras.Model(model.inputs, model.get_layer("bn_d").output)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        z = sub(xt, training=False)
    want = tape.batch_jacobian(z, xt).numpy().reshape(3, 6, d)
    got = lin.jacobian(x)
    dense_rows = slice(got.shape[1] - 6, got.shape[1])  # the last unit: ReLU after bn_d
    np.testing.assert_allclose(got[:, dense_rows], want, rtol=1e-4, atol=1e-5)


def test_folded_batch_norm_resnet_sampled_roll_equals_unfolded():
    keras.utils.set_random_seed(3)
    model = keras_roll.models.resnet18(input_shape=(16, 16, 3), classes=4)
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.moving_variance.assign(rng.uniform(0.5, 2.0, n))
            layer.gamma.assign(rng.uniform(0.5, 2.0, n))
    x = rng.uniform(0, 1, (2, 16, 16, 3)).astype("float32")
    lin = keras_roll.linearize(model)
    assert len(lin.interpreter.folds) == 20  # every convolution with its BatchNormalization
    config = RollConfig(samples=3, strata="channel", wrt="normalize")
    fwd = lin.forward(x)
    est = estimators.estimator_for(lin, tf.constant(x), config, seed=5, trace=fwd.trace)
    fast = est.sum_squares(lin, fwd.trace, 0, est.total).numpy()
    plain = Interpreter(lin.program, "float32")
    plain.folds = {}
    d = 16 * 16 * 3
    v = tf.reshape(tf.one_hot(est.axes, d), [2, est.total, 16, 16, 3])
    jvp = plain.tangent(fwd.trace, v, False, start=est.entry)  # no axes: dense convolution
    slow = tf.reduce_sum(tf.square(jvp.neurons), axis=1).numpy()
    np.testing.assert_allclose(fast, slow, rtol=1e-4, atol=1e-6 * slow.max())


# --------------------------------------------------------------------------- chunked gradient


def _small_cnn(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 2))
    h = L.Conv2D(4, 3, strides=2, use_bias=False)(inp)
    h = L.BatchNormalization()(h)
    h = L.ReLU()(h)
    h = L.Conv2D(4, 3, padding="same")(h)
    h = L.PReLU(alpha_initializer=keras.initializers.Constant(0.3))(h)
    h = L.GlobalAveragePooling2D()(h)
    return keras.Model(inp, L.Dense(3)(h))


def _roll_grads(lin, x, config, weights=None, precompute=True, function=False):
    variables = lin.model.trainable_variables

    def run(xb):
        with tf.GradientTape() as tape:
            loss = roll.loss_from_config(lin, xb, config, seed=3,
                                         precompute_gradient=precompute)
            total = tf.reduce_mean(loss) if weights is None else tf.reduce_sum(loss * weights)
        return loss, tape.gradient(total, variables)

    if function:
        run = tf.function(run, input_signature=[tf.TensorSpec([None, *x.shape[1:]])])
    loss, grads = run(tf.constant(x))
    # the logits layer has no ROLL gradient (its outputs are no neurons)
    return loss.numpy(), [np.zeros(v.shape) if g is None else g.numpy()
                          for g, v in zip(grads, variables)]


@pytest.mark.parametrize("config", [
    pytest.param(RollConfig(C=0.5), marks=pytest.mark.slow),  # the longest default test
    RollConfig(C=0.5, samples=4, strata="channel"),
], ids=["exact", "sampled"])
def test_precomputed_chunk_gradients_equal_the_single_chunk_gradient(config, monkeypatch):
    model = _small_cnn()
    x = np.random.default_rng(0).uniform(-1, 1, (4, 8, 8, 2)).astype("float32")
    whole = keras_roll.linearize(model, memory_budget=2**30)
    plan = roll.memory_plan(whole, x, samples=config.samples, strata=config.strata)
    budget = -(-plan.directions // 4) * plan.bytes_per_direction
    chunked = keras_roll.linearize(model, memory_budget=budget)
    n = roll.memory_plan(chunked, x, samples=config.samples, strata=config.strata).chunks
    assert plan.chunks == 1 and n > 1
    want_loss, want = _roll_grads(whole, x, config, precompute=False)
    scale = max(np.abs(w).max() for w in want)
    weights = tf.constant([0.1, 2.0, 0.7, 1.3])  # a non-uniform upstream: the fallback
    want_w_loss, want_w = _roll_grads(whole, x, config, weights, precompute=False)

    calls = []
    cls = type(estimators.estimator_for(whole, tf.constant(x), config, seed=3))
    original = cls.sum_squares
    monkeypatch.setattr(cls, "sum_squares",
                        lambda self, *a: calls.append(1) or original(self, *a))
    got_loss, got = _roll_grads(chunked, x, config)
    assert len(calls) == n  # every chunk once: differentiated in the forward pass
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * scale)
    calls.clear()
    got_w_loss, got_w = _roll_grads(chunked, x, config, weights)
    assert len(calls) == 2 * n  # the fallback recomputes every chunk
    np.testing.assert_allclose(got_w_loss, want_w_loss, rtol=1e-5)
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * scale)
    monkeypatch.undo()
    for w_, want_ in [(None, want), (weights, want_w)]:  # in a graph, dynamic batch
        _, got_f = _roll_grads(chunked, x, config, w_, function=True)
        for g, w in zip(got_f, want_):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * scale)


@pytest.mark.graph
def test_gradients_go_only_where_they_can_flow():
    model = _small_cnn()
    lin = keras_roll.linearize(model)
    x = tf.constant(np.random.default_rng(0).uniform(-1, 1, (2, 8, 8, 2)).astype("float32"))
    flags = {}

    @tf.function
    def graph(xb):
        fwd = lin.primal(xb)
        relu, prelu = [rec for _, rec in lin.interpreter.units(fwd.trace)]
        flags["graph"] = chunked_gradients.gradient_may_flow(
            [relu.slope, relu.z, prelu.slope, xb])
        return fwd.logits

    graph(x)
    # a ReLU's slope is a cast of z > 0; a PReLU's holds alpha, a weight
    assert flags["graph"] == [False, True, True, True]
    with tf.GradientTape():
        fwd = lin.primal(x)
        relu, prelu = [rec for _, rec in lin.interpreter.units(fwd.trace)]
        flags["eager"] = chunked_gradients.gradient_may_flow(
            [relu.slope, relu.z, prelu.slope, x])
    assert flags["eager"] == [False, True, True, False]  # x is not watched
    # no tape: nothing to differentiate
    assert chunked_gradients.gradient_may_flow([relu.z]) == [False]


# --------------------------------------------------------------------------- 16-bit tangents

# Relative error of the 16-bit sums of squares against float32 tangents: a sum of
# squares over directions and an l2 norm through 7 layers, with unit roundoffs
# 2^-11 (float16) and 2^-8 (bfloat16).
TANGENT_RTOL = {"float16": 5e-3, "bfloat16": 4e-2}


@pytest.mark.parametrize("dtype", [  # float16 tangents: the mixed-precision test below and
    "bfloat16",                        # tests/test_roll_exact.py's active factor
    pytest.param("float16", marks=pytest.mark.slow)])
def test_16_bit_tangents_match_float32_within_tolerance(dtype):
    model = _conv_bn_model(seed=1)
    x = np.random.default_rng(2).uniform(-1, 1, (4, 9, 9, 2)).astype("float32")
    kwargs = {"C": 0.5, "samples": 6, "seed": 7}
    want = roll.roll_loss(model, x, **kwargs).numpy()
    got = roll.roll_loss(model, x, tangent_dtype=dtype, **kwargs)
    assert got.dtype == tf.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=TANGENT_RTOL[dtype])
    assert not np.allclose(got.numpy(), want, rtol=1e-7, atol=0)  # it did run in 16 bits
    sq32 = roll.neuron_grad_sq(model, x, samples=6, seed=7)
    sq16 = roll.neuron_grad_sq(model, x, samples=6, seed=7, tangent_dtype=dtype)
    assert sq16.dtype == tf.float32
    np.testing.assert_allclose(tf.reduce_sum(sq16, 1), tf.reduce_sum(sq32, 1),
                               rtol=TANGENT_RTOL[dtype])


def test_mixed_precision_wrap_trains_with_16_bit_tangents():
    x = np.random.default_rng(0).uniform(-1, 1, (8, 9, 9, 2)).astype("float32")
    y = np.arange(8) % 3
    ref = _conv_bn_model(seed=4)
    try:
        keras.mixed_precision.set_global_policy("mixed_float16")
        model = _conv_bn_model(seed=4)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.set_weights(ref.get_weights())
    wrapped = {}
    for dtype in (None, "float16"):
        wrapped[dtype] = keras_roll.wrap(model, lam=1.0, C=0.5, samples=4, seed=0,
                                         tangent_dtype=dtype)
        wrapped[dtype].compile(keras.optimizers.SGD(0.0),
                               keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    layer = wrapped["float16"].get_layer("roll_regularizer")
    assert layer.get_config()["tangent_dtype"] == "float16"
    # evaluation: the same (fixed-seed) axes, float32 vs float16 tangents
    ev = {k: w.evaluate(x, y, verbose=0, return_dict=True)["roll_loss"]
          for k, w in wrapped.items()}
    assert ev["float16"] == pytest.approx(ev[None], rel=TANGENT_RTOL["float16"])
    assert ev["float16"] != ev[None]
    # a training step: chunked 16-bit tangents, differentiated in the forward pass
    logs = wrapped["float16"].fit(x, y, batch_size=8, epochs=1, verbose=0).history
    assert np.isfinite(logs["roll_loss"][0]) and logs["roll_loss"][0] > 0
    assert wrapped["float16"](x[:2], training=True).dtype == "float16"


def test_bad_tangent_dtype_is_refused():
    model = _small_cnn()
    with pytest.raises(ValueError, match="tangent_dtype"):
        roll.roll_loss(model, np.zeros((1, 8, 8, 2), "float32"), tangent_dtype="int8")
    with pytest.raises(ValueError, match="tangent_dtype"):
        keras_roll.wrap(model, tangent_dtype="half-ish")
