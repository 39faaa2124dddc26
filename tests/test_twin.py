"""The twin's Jacobians against independent tf.GradientTape references."""

import inspect
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.testing import tape_jacobian
from tests import model_zoo as zoo

ACTIVATION_LAYERS = (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.PReLU)


def _tape_jacobian(fn, x):
    """Values `[B, n_i]` and Jacobians `[B, n_i, D]` of each tensor of fn(x) by
    back-propagation."""
    return tape_jacobian(fn, np.asarray(x), per_output=True)


def _rows(lin, x, name):
    names = lin.neuron_names_for(x)
    return np.array([i for i, (n, _) in enumerate(names) if n == name])


def _assert_close(actual, expected, rtol=1e-5):
    scale = max(np.abs(expected).max(), 1e-12)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


def _check_activation_layers(model, x, rtol=1e-5):
    """Every activation layer's pre-activation Jacobian equals the tape's."""
    lin = keras_roll.linearize(model)
    jac = lin.jacobian(x)
    acts = [layer for layer in model.layers if isinstance(layer, ACTIVATION_LAYERS)]
    sub = keras.Model(model.inputs[0], [layer.input for layer in acts])
    values, ref = _tape_jacobian(lambda t: tf.nest.flatten(sub(t, training=False)), x)
    fwd = lin.forward(x)
    for layer, value, r in zip(acts, values, ref):
        rows = _rows(lin, x, layer.name)
        assert len(rows) == r.shape[1], layer.name
        _assert_close(jac[:, rows], r, rtol)
        _assert_close(fwd.neurons.z.numpy()[:, rows], value, rtol)
    return lin, jac


def _check_outputs(model, x, rtol=1e-5):
    lin = keras_roll.linearize(model)
    (value,), (ref,) = _tape_jacobian(lambda t: [model(t, training=False)], x)
    _assert_close(lin.output_jacobian(x), ref, rtol)
    _assert_close(lin(x).numpy().reshape(value.shape), value, rtol)


def test_mlp_matches_tape():
    x = np.random.default_rng(0).normal(size=(5, 6)).astype("float32")
    model = zoo.mlp(fused=False)
    _check_activation_layers(model, x)
    lin = keras_roll.linearize(model)
    assert lin.output_link == "softmax"
    logits = keras.Model(model.inputs[0], model.get_layer("logits").output)
    # The softmax is folded: the output Jacobian is the Jacobian of the logits.
    (value,), (ref,) = _tape_jacobian(lambda t: [tf.math.log(logits(t))], x)
    sm = tf.nn.log_softmax(lin(x)).numpy()
    _assert_close(sm, value)


def test_float64_model_matches_tape_tightly():
    x = np.random.default_rng(1).normal(size=(4, 6))
    model = zoo.mlp(fused=False, dtype="float64")
    lin, jac = _check_activation_layers(model, x, rtol=1e-12)
    assert jac.dtype == np.float64 and lin.dtype == "float64"


def test_cnn_with_batchnorm_and_pooling_matches_tape():
    rng = np.random.default_rng(2)
    x = rng.uniform(0, 4, size=(3, 8, 8, 2)).astype("float32")
    model = zoo.cnn()
    lin, jac = _check_activation_layers(model, x)
    _check_outputs(model, x)
    # Max-pool neurons: v_winner - v_k for each 2x2 window, by numpy on the tape Jacobian.
    pool = model.get_layer("maxpool")
    sub = keras.Model(model.inputs[0], pool.input)
    (pv,), (pj,) = _tape_jacobian(lambda t: [sub(t, training=False)], x)
    pv = pv.reshape(3, 8, 8, 4)
    pj = pj.reshape(3, 8, 8, 4, -1)
    rows = _rows(lin, x, "maxpool")
    names = [lin.neuron_names_for(x)[r][1] for r in rows]
    fwd = lin.forward(x)
    valid = fwd.neurons.valid.numpy()[:, rows]
    got_z = fwd.neurons.z.numpy()[:, rows]
    checked = 0
    for b in range(3):
        for col, (ho, wo, w, c) in enumerate(names):
            window = [(2 * ho + i, 2 * wo + j) for i in range(2) for j in range(2)]
            vals = [pv[b, h, v, c] for h, v in window]
            win = window[int(np.argmax(vals))]
            other = window[w]
            if win == other:
                assert not valid[b, col]
                continue
            assert valid[b, col]
            assert got_z[b, col] == pytest.approx(pv[b][win][c] - pv[b][other][c], abs=1e-5)
            ref = pj[b][win][c] - pj[b][other][c]
            np.testing.assert_allclose(jac[b, rows[col]], ref, atol=1e-5 * np.abs(pj).max())
            checked += 1
    assert checked > 50


def test_residual_relu6_prelu_matches_tape():
    x = np.random.default_rng(3).normal(scale=8.0, size=(3, 6, 6, 3)).astype("float32")
    model = zoo.residual()
    _, jac = _check_activation_layers(model, x)
    _check_outputs(model, x)
    # ReLU6 saturates somewhere: both breakpoints are exercised.
    z = keras.Model(model.inputs[0], model.get_layer("relu6").input)(x).numpy()
    assert (z > 6).any() and (z < 0).any() and ((z > 0) & (z < 6)).any()


def test_nested_models_are_inlined():
    x = np.random.default_rng(4).normal(size=(4, 5)).astype("float32")
    model = zoo.nested()
    lin = keras_roll.linearize(model)
    assert [n for n, _ in lin.neuron_names][::3][:2] == ["block/inner_relu"] * 2
    _check_outputs(model, x)
    inner = model.get_layer("block")
    seq = model.get_layer("seq")
    a = keras.Model(inner.inputs[0], inner.get_layer("inner_relu").input)
    values, ref = _tape_jacobian(lambda t: [a(t)], x)
    jac = lin.jacobian(x)
    _assert_close(jac[:, :6], ref[0])
    s = keras.Sequential([seq.get_layer("seq_dense")])
    values, ref = _tape_jacobian(lambda t: [s(inner(t))], x)
    _assert_close(jac[:, 6:], ref[0])


def _rnn_reference(model, x, leaky):
    """A SimpleRNN written out by hand: pre-activations of every step."""
    layer = model.get_layer("rnn")
    cell = layer.cell
    act = (lambda z: tf.nn.leaky_relu(z, 0.2)) if leaky else tf.nn.relu
    head = model.get_layer("logits")

    def fn(xt):
        mask = tf.reduce_any(tf.not_equal(xt, 0.0), axis=-1)
        h = tf.zeros((xt.shape[0], cell.units))
        zs, hs = [], []
        for t in range(xt.shape[1]):
            z = xt[:, t] @ cell.kernel + h @ cell.recurrent_kernel + cell.bias
            h = tf.where(mask[:, t, None], act(z), h)
            zs.append(z)
            hs.append(h)
        if layer.return_sequences:
            m = tf.cast(mask, h.dtype)[..., None]
            pooled = tf.reduce_sum(tf.stack(hs, 1) * m, 1) / tf.reduce_sum(m, 1)
        else:
            pooled = h
        return [tf.stack(zs, 1), head(pooled)]

    return fn


@pytest.mark.parametrize("activation,sequences", [("relu", False), ("leaky", True)])
def test_simple_rnn_with_masked_variable_length_input(activation, sequences):
    model = zoo.rnn(activation, return_sequences=sequences)
    x, lengths = zoo.padded_sequences()
    (z, out), (zj, oj) = _tape_jacobian(_rnn_reference(model, x, activation == "leaky"), x)
    _assert_close(model(x).numpy(), out)  # the hand-written reference is the model
    lin = keras_roll.linearize(model)
    _assert_close(lin(x).numpy(), out)
    _assert_close(lin.output_jacobian(x), oj)
    fwd = lin.forward(x)
    jac = lin.jacobian(x)
    valid = fwd.neurons.valid.numpy()
    steps = np.arange(x.shape[1])
    expected_valid = np.repeat(steps[None, :] < lengths[:, None], 6, axis=1)
    np.testing.assert_array_equal(valid, expected_valid)
    # Padded steps create no neurons; the others match the hand-written recurrence.
    _assert_close(np.where(valid[..., None], jac, 0), np.where(valid[..., None], zj, 0))
    _assert_close(np.where(valid, fwd.neurons.z.numpy(), 0), np.where(valid, z, 0))


@pytest.mark.parametrize("backwards", [False, True])
def test_rnn_directions_along_late_steps_start_the_loop_late(backwards):
    """The recurrence skips the steps before the first nonzero input tangent (its
    state tangent is zero there): directions along late steps only, padded steps
    only (zero after the Masking layer) and no direction at all, against tape
    Jacobians of the Keras model (the hand-written recurrence for the neurons)."""
    model = zoo.rnn("relu")
    if backwards:
        inp = keras.Input((5, 3))
        h = keras.layers.SimpleRNN(6, activation="relu", go_backwards=True, name="rnn")(
            keras.layers.Masking(0.0)(inp))
        model = keras.Model(inp, keras.layers.Dense(2, name="logits")(h))
    x, lengths = zoo.padded_sequences()
    lin = keras_roll.linearize(model)
    eye = np.eye(15, dtype="float32").reshape(15, 5, 3)
    late, padded = eye[9:], eye[12:]  # steps 3-4; step 4 is padding in all but two
    x_short = np.where(np.arange(5)[None, :, None] < 4, x, 0.0)  # every step 4 padded
    for xs, v in ((x, late), (x_short, padded), (x, np.zeros_like(late))):
        (_, ref) = _tape_jacobian(lambda t: [model(t)], xs)
        want = np.einsum("bld,kd->bkl", ref[0], v.reshape(len(v), -1))
        _assert_close(lin.jvp(xs, v).logits.numpy(), want)
    if not backwards:  # every neuron, against the hand-written recurrence
        _, (zj, _) = _tape_jacobian(_rnn_reference(model, x, False), x)
        valid = lin.forward(x).neurons.valid.numpy()
        got = lin.jvp(x, late).neurons.numpy()
        want = np.einsum("bnd,kd->bkn", zj, late.reshape(len(late), -1))
        _assert_close(np.where(valid[:, None], got, 0), np.where(valid[:, None], want, 0))


def test_fused_and_split_activations_give_the_same_jacobian():
    x = np.random.default_rng(5).normal(size=(4, 6)).astype("float32")
    fused = keras_roll.linearize(zoo.mlp(fused=True, seed=7)).jacobian(x)
    split = keras_roll.linearize(zoo.mlp(fused=False, seed=7)).jacobian(x)
    np.testing.assert_allclose(fused, split, rtol=1e-6, atol=1e-7)


def test_jvp_equals_jacobian_times_direction_shared_and_per_example():
    rng = np.random.default_rng(6)
    x = rng.uniform(0, 4, size=(2, 8, 8, 2)).astype("float32")
    lin = keras_roll.linearize(zoo.cnn())
    jac = lin.jacobian(x)
    ojac = lin.output_jacobian(x)
    v = rng.normal(size=(2, 3, 8, 8, 2)).astype("float32")
    got = lin.jvp(x, v)
    expect = np.einsum("bnd,bkd->bkn", jac, v.reshape(2, 3, -1))
    _assert_close(got.neurons.numpy(), expect)
    _assert_close(got.logits.numpy(), np.einsum("bld,bkd->bkl", ojac, v.reshape(2, 3, -1)))
    shared = lin.jvp(x, v[0])
    _assert_close(shared.neurons.numpy(), np.einsum("bnd,kd->bkn", jac, v[0].reshape(3, -1)))


def test_small_memory_budget_streams_the_same_jacobian():
    rng = np.random.default_rng(7)
    x = rng.uniform(0, 4, size=(3, 8, 8, 2)).astype("float32")
    model = zoo.cnn()
    full = keras_roll.linearize(model).jacobian(x)
    lin = keras_roll.linearize(model, memory_budget=200_000)
    chunks = list(lin.iter_axis_chunks(x))
    assert len(chunks) > 4  # several example and direction chunks
    for _sl, _fwd, _start, _k, jvp in chunks:
        assert jvp.neurons.numpy().nbytes <= 200_000
    _assert_close(lin.jacobian(x), full, rtol=1e-6)


def test_weights_are_read_at_call_time():
    x = np.random.default_rng(8).normal(size=(3, 6)).astype("float32")
    model = zoo.mlp(fused=True)
    lin = keras_roll.linearize(model)
    before = lin.jacobian(x)
    dense = model.get_layer("dense0")
    dense.kernel.assign(dense.kernel * 2.0)
    after = lin.jacobian(x)
    np.testing.assert_allclose(after[:, :8], 2 * before[:, :8], rtol=1e-6)


def test_every_other_supported_layer_matches_tape():
    x = np.random.default_rng(9).normal(size=(3, 12, 4)).astype("float32")
    model = zoo.kitchen_sink()
    _check_activation_layers(model, x)
    _check_outputs(model, x)
    lin = keras_roll.linearize(model)
    names = {n for n, _ in lin.neuron_names}
    assert {"maxpool1d", "gmax"} <= names


def test_neuron_names_follow_program_order_and_numpy_indexing():
    lin = keras_roll.linearize(zoo.cnn())
    names = lin.neuron_names
    # relu0 acts on the 8x8x4 BatchNorm output: row 5 is position (0, 1), channel 1.
    assert names[5] == ("relu0", (0, 1, 1))
    assert names[256][0] == "maxpool"  # 4x4 windows of 4 elements, 4 channels
    assert lin.num_neurons((8, 8, 2)) == len(names) == 256 + 4 * 4 * 4 * 4 + 4 * 4 * 4 + 5
    for j in (0, 5, 255, 256, 300, len(names) - 1):
        assert lin.neuron_name(j, (8, 8, 2)) == names[j]
    with pytest.raises(IndexError, match="out of range"):
        lin.neuron_name(len(names), (8, 8, 2))


def test_units_expose_pre_activations_masks_and_argmax():
    x = np.random.default_rng(10).uniform(0, 4, size=(2, 8, 8, 2)).astype("float32")
    model = zoo.cnn()
    lin = keras_roll.linearize(model)
    units = lin.units(lin.forward(x))
    assert list(units) == ["relu0", "maxpool", "leaky", "relu1"]
    z = keras.Model(model.inputs[0], model.get_layer("relu0").input)(x).numpy()
    np.testing.assert_allclose(units["relu0"]["z"].numpy(), z, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(units["relu0"]["slope"].numpy(), (z > 0).astype("float32"))
    np.testing.assert_array_equal(units["leaky"]["slope"].numpy() == 1.0,
                                  units["leaky"]["z"].numpy() > 0)
    pool_in = keras.Model(model.inputs[0], model.get_layer("maxpool").input)(x).numpy()
    windows = pool_in.reshape(2, 4, 2, 4, 2, 4).transpose(0, 1, 3, 2, 4, 5).reshape(2, 4, 4, 4, 4)
    np.testing.assert_array_equal(units["maxpool"]["argmax"].numpy(), windows.argmax(axis=3))


def test_one_hot_directions_through_flatten_gather_rows_and_stay_exact():
    keras.utils.set_random_seed(12)
    inp = keras.Input((7, 4))
    h = keras.layers.Flatten()(inp)
    h = keras.layers.Dense(5, activation="relu", name="hidden")(h)
    model = keras.Model(inp, keras.layers.Dense(2, name="out")(h))
    lin = keras_roll.linearize(model)
    x = np.random.default_rng(12).normal(size=(3, 7, 4)).astype("float32")
    kernel = model.get_layer("hidden").kernel.numpy()
    np.testing.assert_allclose(lin.jacobian(x), np.broadcast_to(kernel.T, (3, 5, 28)), rtol=1e-6)
    # Per-example sampled axes (with a padding direction, -1) through the gather path.
    axes = tf.constant([[3, 27, -1], [0, 5, 9], [1, 1, 2]])
    v = tf.reshape(tf.one_hot(axes, 28), (3, 3, 7, 4))
    fwd = lin.forward(x)
    got = lin.tangent_from_trace(fwd.trace, v, False, axes=axes).neurons.numpy()
    dense = lin.tangent_from_trace(fwd.trace, v, False).neurons.numpy()
    np.testing.assert_allclose(got, dense, rtol=1e-6)
    np.testing.assert_allclose(got[0, 2], 0.0)


@pytest.mark.graph
def test_passes_traced_in_a_user_tf_function_skip_autograph():
    """`Linearized.primal` / `tangent_from_trace` inside a tf.function with autograph on
    run as written (autograph would rewrite the interpreter and every rule, seconds
    per first trace): the interpreter is called from twin.py, not from converted code."""
    from unittest import mock

    from keras_roll.compile.interpreter import Interpreter

    lin = keras_roll.linearize(zoo.mlp(seed=0))
    callers = []

    def recorder(method):
        def wrapped(self, *args, **kwargs):
            callers.append(inspect.currentframe().f_back.f_code.co_filename)
            return method(self, *args, **kwargs)
        return wrapped

    with mock.patch.object(Interpreter, "primal", recorder(Interpreter.primal)), \
            mock.patch.object(Interpreter, "tangent", recorder(Interpreter.tangent)):
        @tf.function  # autograph on, as users write it
        def step(x):
            fwd = lin.primal(x)
            return lin.tangent_from_trace(fwd.trace, x[:, None], shared=False).neurons

        x = np.random.default_rng(0).normal(size=(2, lin.input_shape[0])).astype("float32")
        got = step(tf.constant(x)).numpy()
    assert [os.path.basename(f) for f in callers] == ["twin.py", "twin.py"]
    np.testing.assert_allclose(got[:, 0], np.einsum("bnd,bd->bn", lin.jacobian(x), x),
                               rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- affine prefix


def _prefix_cnn():
    keras.utils.set_random_seed(3)
    inp = keras.Input((6, 6, 2), dtype="float64")
    h = keras.layers.Rescaling(0.5, offset=-0.1, dtype="float64")(inp)
    h = keras.layers.Conv2D(3, 3, dtype="float64", bias_initializer="random_normal")(h)
    h = keras.layers.BatchNormalization(dtype="float64")(h)
    h = keras.layers.ReLU(dtype="float64")(h)
    h = keras.layers.MaxPooling2D(dtype="float64")(h)
    h = keras.layers.Flatten(dtype="float64")(h)
    return keras.Model(inp, keras.layers.Dense(4, dtype="float64")(h))


def test_affine_prefix_ends_at_the_first_op_with_a_pattern():
    model = _prefix_cnn()
    model.layers[3].set_weights([w + 0.3 for w in model.layers[3].get_weights()])  # BN
    lin = keras_roll.linearize(model)
    prefix = lin.affine_prefix
    # Rescaling, the convolution, BatchNormalization; the ReLU layer has a pattern.
    assert [op.layer for op in prefix.ops] == model.layers[1:4]
    assert (prefix.start, prefix.start_op) == (3, 0)
    x = np.random.default_rng(0).normal(size=(5, 6, 6, 2))
    u = prefix.apply(x, "float64")
    cut = keras.Model(model.inputs[0], model.layers[3].output)
    np.testing.assert_allclose(u, cut(x, training=False), rtol=1e-12, atol=1e-12)
    entered = lin.interpreter.primal(u, start=prefix.start, start_op=prefix.start_op)
    np.testing.assert_allclose(entered.logits, lin.forward(x).logits, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(entered.logits, model(x), rtol=1e-12, atol=1e-12)
    # The transpose is the adjoint of the linear part: <A^T g, v> = <g, A v>.
    g = np.random.default_rng(1).normal(size=u.shape)
    v = np.random.default_rng(2).normal(size=x.shape)
    linear_v = cut(v, training=False) - cut(np.zeros_like(v), training=False)
    lhs = np.sum(prefix.transpose(tf.constant(g), x).numpy() * v)
    np.testing.assert_allclose(lhs, np.sum(g * linear_v), rtol=1e-10)


def test_affine_prefix_inside_a_step_and_where_there_is_none():
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,))
    dense = keras.layers.Dense(4, activation="relu")
    out = keras.layers.Dense(2)(dense(inp))
    prefix = keras_roll.linearize(keras.Model(inp, out)).affine_prefix
    assert [op.layer for op in prefix.ops] == [dense] and (prefix.start, prefix.start_op) == (0, 1)
    # The input read twice (a residual from it), or an activation first: no prefix.
    h = keras.layers.Dense(5)(inp)
    res = keras.Model(inp, keras.layers.Dense(2)(keras.layers.ReLU()(keras.layers.Add()([inp, h]))))
    assert keras_roll.linearize(res).affine_prefix is None
    first = keras.Model(inp, keras.layers.Dense(2)(keras.layers.ReLU()(inp)))
    assert keras_roll.linearize(first).affine_prefix is None
