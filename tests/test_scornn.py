"""Tests of keras_roll.layers.ScoRNN, its rule and the Japanese Vowels model.

Independent references: `W` from numpy in float64 (`numpy.linalg.solve`) and,
where gradients must flow, from an explicit inverse in TensorFlow; the paper's
closed-form Cayley update for the gradient of `A`; a hand-written masked
recurrence differentiated by `tf.GradientTape`; Eq. 9 of Lee et al. in numpy;
the bisection search on the real network.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.layers import CayleyInitializer, ScoRNN
from keras_roll.models.rnn import scornn_classifier
from keras_roll.roll import loss as roll
from keras_roll.testing import tape_jacobian
from tests import model_zoo as zoo

LEAKY = keras.activations.leaky_relu

# --------------------------------------------------------------------------- references


def numpy_w(cell) -> np.ndarray:
    """`(I + A)^-1 (I - A) D` in float64 numpy from the raw variables."""
    n = cell.units
    a = np.zeros((n, n))
    a[np.triu_indices(n, 1)] = np.asarray(cell.skew.numpy(), np.float64)
    a = a - a.T
    eye = np.eye(n)
    return np.linalg.solve(eye + a, eye - a) @ np.diag(cell.diagonal.numpy().astype(np.float64))


def tf_w(cell, dtype=tf.float64):
    """The same W, differentiable in the weights, by an explicit inverse:
    `W = (2 (I + A)^-1 - I) D` with A built from one-hot basis matrices."""
    n = cell.units
    rows, cols = np.triu_indices(n, 1)
    basis = np.zeros((len(rows), n, n))
    basis[np.arange(len(rows)), rows, cols] = 1.0
    basis[np.arange(len(rows)), cols, rows] = -1.0
    a = tf.tensordot(tf.cast(cell.skew, dtype), tf.constant(basis, dtype), 1)
    eye = tf.eye(n, dtype=dtype)
    return (2.0 * tf.linalg.inv(eye + a) - eye) * tf.cast(cell.diagonal, dtype)[None]


def recurrence(layer, x, w, leaky=True):
    """Hand-written masked recurrence in processing order (reversed if
    go_backwards): pre-activations `[B, T, U]`, states `[B, T, U]`, step mask."""
    cell = layer.cell
    dtype = x.dtype
    mask = tf.reduce_any(tf.not_equal(x, 0.0), axis=-1)
    if layer.go_backwards:
        x, mask = tf.reverse(x, [1]), tf.reverse(mask, [1])
    w = tf.cast(w, dtype)
    h = tf.zeros([x.shape[0], cell.units], dtype)
    zs, hs = [], []
    for t in range(x.shape[1]):
        z = x[:, t] @ tf.cast(cell.kernel, dtype) + h @ w + tf.cast(cell.bias, dtype)
        a = tf.nn.leaky_relu(z, 0.2) if leaky else tf.nn.relu(z)
        h = tf.where(mask[:, t, None], a, h)
        zs.append(z)
        hs.append(h)
    return tf.stack(zs, 1), tf.stack(hs, 1), mask


def preactivation_jacobian(layer, x, w, leaky=True):
    """Flattened pre-activations `[B, T*U]`, their input Jacobian `[B, T*U, D]` and
    the validity of every neuron (unpadded steps), by tf.GradientTape."""
    _, _, mask = recurrence(layer, tf.constant(x), w, leaky)
    flat, jac = tape_jacobian(lambda t: recurrence(layer, t, w, leaky)[0], x)
    valid = np.repeat(mask.numpy(), layer.units, axis=1)
    return flat, jac, valid


def eq9(z, jac, valid, C, gamma):
    """ROLL (Eq. 9) per example in numpy: mean of the top ceil(gamma % of valid)
    brackets `||g_j||^2 + C max(0, 1 - |z_j|)` (LeakyReLU/ReLU: breakpoint 0)."""
    bracket = np.sum(jac.astype(np.float64) ** 2, -1) + C * np.maximum(0.0, 1.0 - np.abs(z))
    out, masks, counts = [], np.zeros(z.shape), []
    for i, (row, ok) in enumerate(zip(bracket, valid)):
        keep = math.ceil(Fraction(str(gamma)) * int(ok.sum()) / 100)
        order = np.argsort(-np.where(ok, row, -np.inf), kind="stable")[:keep]
        masks[i, order] = 1.0
        counts.append(keep)
        out.append(row[order].mean())
    return np.array(out), masks, np.array(counts, np.float64)


def assert_close(actual, expected, rtol=1e-5):
    scale = max(np.abs(expected).max(), 1e-12)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


# --------------------------------------------------------------------------- models


def scornn_model(units=5, rho=2, steps=5, channels=3, sequences=False, backwards=False,
                 activation=LEAKY, dtype="float32", seed=0, masking=True, zero_output=False):
    """[Masking ->] ScoRNN 'rnn' [-> masked average] -> Dense 'logits', generic weights."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((steps, channels), dtype=dtype)
    h = keras.layers.Masking(0.0, dtype=dtype)(inp) if masking else inp
    h = ScoRNN(units, activation=activation, num_negative_ones=rho,
               return_sequences=sequences, go_backwards=backwards,
               zero_output_for_mask=zero_output, kernel_initializer="glorot_uniform",
               skew_initializer=keras.initializers.RandomNormal(stddev=0.5),
               bias_initializer=keras.initializers.RandomNormal(stddev=0.3),
               name="rnn", dtype=dtype)(h)
    if sequences:
        h = keras.layers.GlobalAveragePooling1D(dtype=dtype)(h)
    out = keras.layers.Dense(3, name="logits", dtype=dtype)(h)
    return keras.Model(inp, out)


def orthogonality_error(w) -> float:
    w = np.asarray(w, np.float64)
    return float(np.abs(w.T @ w - np.eye(len(w))).max())


# --------------------------------------------------------------------------- W


@pytest.mark.parametrize("rho", [0, 3])
def test_recurrent_matrix_is_the_scaled_cayley_transform(rho):
    model = scornn_model(units=7, rho=rho)
    layer = model.get_layer("rnn")
    cell = layer.cell
    assert cell.skew.shape == (21,) and cell.skew.trainable
    assert not cell.diagonal.trainable
    np.testing.assert_array_equal(cell.diagonal.numpy(), [1.0] * (7 - rho) + [-1.0] * rho)
    a = cell.skew_matrix().numpy()
    np.testing.assert_array_equal(a, -a.T)  # skew-symmetric by construction
    w = layer.recurrent_matrix().numpy()
    np.testing.assert_allclose(w, numpy_w(cell), atol=2e-6)
    np.testing.assert_array_equal(cell.recurrent_kernel.numpy(), w)
    assert orthogonality_error(w) < 1e-5
    assert np.linalg.det(w.astype(np.float64)) == pytest.approx((-1.0) ** rho, abs=1e-5)


def test_cayley_initializer_spreads_rotation_angles_over_a_quarter_turn():
    init = CayleyInitializer(seed=3)
    np.testing.assert_array_equal(init((2016,)).numpy(), init((2016,)).numpy())
    layer = ScoRNN(64, skew_initializer=init)
    layer.build((None, None, 2))
    angles = np.angle(np.linalg.eigvals(numpy_w(layer.cell)))
    # Paper: eigenvalues exp(+-i theta_j), theta_j ~ U[0, pi/2].
    assert np.all(np.abs(angles) <= np.pi / 2 + 1e-6)
    theta = np.sort(angles[angles > 1e-9])
    assert len(theta) == 32
    np.testing.assert_allclose(np.sort(-angles[angles < -1e-9]), theta, atol=1e-9)
    assert abs(theta.mean() - np.pi / 4) < 0.25 and theta.max() - theta.min() > 0.8
    with pytest.raises(ValueError, match="n \\(n - 1\\) / 2"):
        init((11,))


def test_gradient_of_skew_is_the_papers_cayley_update():
    """Autodiff through the solve equals Helfrich et al.'s dL/dA = V^T - V,
    V = (I + A)^-T G (D + W^T), on the upper triangle."""
    layer = ScoRNN(6, num_negative_ones=2,
                   skew_initializer=keras.initializers.RandomNormal(stddev=0.7, seed=1))
    layer.build((None, None, 2))
    cell = layer.cell
    g = np.random.default_rng(0).normal(size=(6, 6))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.constant(g, tf.float32) * layer.recurrent_matrix())
    got = tape.gradient(loss, cell.skew).numpy()
    a = cell.skew_matrix().numpy().astype(np.float64)
    w, d = numpy_w(cell), np.diag(cell.diagonal.numpy().astype(np.float64))
    v = np.linalg.solve((np.eye(6) + a).T, g @ (d + w.T))
    np.testing.assert_allclose(got, (v.T - v)[np.triu_indices(6, 1)], rtol=1e-4, atol=1e-5)


class _Orthogonality(keras.callbacks.Callback):
    def __init__(self, layer, every=50):
        super().__init__()
        self.layer, self.every, self.errors = layer, every, []

    def on_train_batch_end(self, batch, logs=None):
        if batch % self.every == 0:
            self.errors.append(orthogonality_error(self.layer.recurrent_matrix().numpy()))


@pytest.mark.graph
@pytest.mark.parametrize("lr", [pytest.param(1e-3, marks=pytest.mark.slow), 0.1])
def test_w_stays_orthogonal_through_amsgrad_training(lr):
    model = scornn_classifier((8, 4), units=16, classes=2, num_negative_ones=3,
                              mask_value=None, seed=0)
    layer = model.get_layer("scornn")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8, 4)).astype("float32")
    y = (x[:, :4, 0].sum(1) > x[:, 4:, 1].sum(1)).astype("int32")
    w0 = layer.recurrent_matrix().numpy()
    model.compile(keras.optimizers.Adam(lr, amsgrad=True), "sparse_categorical_crossentropy")
    monitor = _Orthogonality(layer)
    reps = 300 * 16 // len(x)
    model.fit(np.tile(x, (reps, 1, 1)), np.tile(y, reps), batch_size=16, epochs=1,
              shuffle=False, verbose=0, callbacks=[monitor])
    w = layer.recurrent_matrix().numpy()
    assert len(monitor.errors) == 6 and max(monitor.errors) < 1e-5
    assert orthogonality_error(w) < 1e-5
    assert np.abs(w - w0).max() > (0.05 if lr < 0.01 else 0.5)  # W did move
    assert np.linalg.det(w.astype(np.float64)) == pytest.approx(-1.0, abs=1e-4)


# --------------------------------------------------------------------------- twin


@pytest.mark.parametrize("sequences,backwards,leaky,zero_output", [
    # the last state (forwards, backwards): what the two sequence cases read at every step
    pytest.param(False, False, True, False, marks=pytest.mark.slow),
    (True, False, True, True), (True, True, False, False),
    pytest.param(False, True, True, False, marks=pytest.mark.slow)])
def test_twin_matches_tape_on_masked_variable_length_batch(sequences, backwards, leaky,
                                                           zero_output):
    model = scornn_model(sequences=sequences, backwards=backwards, zero_output=zero_output,
                         activation=LEAKY if leaky else "relu")
    layer = model.get_layer("rnn")
    x, lengths = zoo.padded_sequences(batch=4, steps=5, channels=3)
    assert len(set(lengths.tolist())) > 1
    w = numpy_w(layer.cell)
    # The hand-written recurrence is the Keras layer.
    _, hs, steps = recurrence(layer, tf.constant(x), w, leaky)
    hs = hs.numpy()
    if zero_output:  # padded steps output zeros instead of the carried state
        hs = np.where(steps.numpy()[..., None], hs, 0.0)
    keras_out = keras.Model(model.input, layer.output)(x).numpy()
    assert_close(keras_out, hs if sequences else hs[:, -1])

    lin = keras_roll.linearize(model)
    fwd = lin.forward(x)
    z, zj, valid = preactivation_jacobian(layer, x, w, leaky)
    np.testing.assert_array_equal(fwd.neurons.valid.numpy(), valid)
    assert not valid.all()
    assert_close(np.where(valid, fwd.neurons.z.numpy(), 0), np.where(valid, z, 0))
    jac = lin.jacobian(x)
    assert_close(np.where(valid[..., None], jac, 0), np.where(valid[..., None], zj, 0))
    # logits and their Jacobian against the Keras model itself
    out, oj = tape_jacobian(lambda t: model(t), x)
    assert_close(lin(x).numpy(), out)
    assert_close(lin.output_jacobian(x), oj)
    assert lin.neuron_name(7, x.shape[1:]) == ("rnn", (1, 2))


def test_non_piecewise_linear_or_stateful_variants_are_refused_at_linearization():
    model = scornn_model(activation="tanh")
    model(np.ones((2, 5, 3), "float32"))  # the layer itself runs any activation
    with pytest.raises(keras_roll.UnsupportedModelError, match="'rnn' \\(ScoRNN\\).*tanh"):
        keras_roll.linearize(model)
    inp = keras.Input(batch_shape=(2, 4, 2))
    out = ScoRNN(3, stateful=True, name="stateful")(inp)
    with pytest.raises(keras_roll.UnsupportedModelError, match="stateful=True"):
        keras_roll.linearize(keras.Model(inp, keras.layers.Dense(2)(out)))
    layer = ScoRNN(3, return_state=True, name="stated")
    layer(keras.Input((4, 2)))
    with pytest.raises(keras_roll.UnsupportedModelError, match="return_state=True"):
        keras_roll.compile.rules.compile_layer(layer)


@pytest.mark.parametrize("kwargs,match", [
    ({"units": 0}, "units must be an integer >= 1"),
    ({"units": 4, "num_negative_ones": 5}, "num_negative_ones must be an integer in \\[0, 4\\]"),
    ({"units": 4, "num_negative_ones": -1}, "got -1"),
    ({"units": 4, "num_negative_ones": 1.5}, "got 1.5"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScoRNN(**kwargs)


# --------------------------------------------------------------------------- saving


def test_keras_save_load_round_trip(tmp_path):
    model = scornn_model(sequences=True, backwards=True, rho=3)
    x, _ = zoo.padded_sequences(batch=4, steps=5, channels=3)
    path = os.path.join(tmp_path, "scornn.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    layer, twin = model.get_layer("rnn"), loaded.get_layer("rnn")
    assert type(twin) is ScoRNN
    assert (twin.units, twin.num_negative_ones, twin.go_backwards, twin.return_sequences) == (
        5, 3, True, True)
    assert twin.activation is LEAKY
    np.testing.assert_array_equal(twin.recurrent_matrix().numpy(),
                                  layer.recurrent_matrix().numpy())
    np.testing.assert_array_equal(twin.cell.diagonal.numpy(), layer.cell.diagonal.numpy())
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    np.testing.assert_allclose(keras_roll.linearize(loaded).jacobian(x),
                               keras_roll.linearize(model).jacobian(x), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- ROLL


def test_roll_loss_and_its_weight_gradient_match_the_reference():
    model = scornn_model(units=4, steps=5, channels=3, seed=2)
    layer = model.get_layer("rnn")
    x, _ = zoo.padded_sequences(batch=4, steps=5, channels=3, seed=1)
    z, jac, valid = preactivation_jacobian(layer, x, numpy_w(layer.cell))
    for gamma in (100.0, 40.0):
        want, _, _ = eq9(z, jac, valid, C=0.7, gamma=gamma)
        got = roll.roll_loss(model, x, C=0.7, gamma=gamma).numpy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5, err_msg=f"gamma={gamma}")

    # d mean(Eq. 9) / d weights; the selection is a constant (reference: tape + inverse).
    _, mask, counts = eq9(z, jac, valid, C=0.7, gamma=40.0)
    variables = model.trainable_variables
    with tf.GradientTape() as outer:
        xt = tf.constant(x, tf.float64)
        with tf.GradientTape() as inner:
            inner.watch(xt)
            zt, _, _ = recurrence(layer, xt, tf_w(layer.cell))
            flat = tf.reshape(zt, [x.shape[0], -1])
        jt = inner.batch_jacobian(flat, xt)
        sq = tf.reduce_sum(tf.reshape(jt, [x.shape[0], flat.shape[1], -1]) ** 2, -1)
        bracket = sq + 0.7 * tf.nn.relu(1.0 - tf.abs(flat))
        loss = tf.reduce_mean(tf.reduce_sum(bracket * mask, 1) / counts)
    want = [np.zeros(v.shape) if g is None else g.numpy()
            for g, v in zip(outer.gradient(loss, variables), variables)]
    skew = [i for i, v in enumerate(variables) if v.name == "skew"][0]
    assert np.abs(want[skew]).max() > 1e-3
    plan = roll.memory_plan(keras_roll.linearize(model), x)
    budget = -(-plan.directions // 3) * plan.bytes_per_direction
    chunked = keras_roll.linearize(model, memory_budget=budget)
    assert roll.memory_plan(chunked, x).chunks > 1  # the recomputing custom gradient
    for lin in (keras_roll.linearize(model), chunked):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(roll.roll_loss(lin, x, C=0.7, gamma=40.0))
        got = tape.gradient(loss, variables)
        scale = max(np.abs(w).max() for w in want)
        for g, w, v in zip(got, want, variables):
            np.testing.assert_allclose(np.zeros(v.shape) if g is None else g.numpy(), w,
                                       rtol=1e-4, atol=2e-5 * scale, err_msg=v.path)


@pytest.mark.parametrize("samples", [pytest.param(None, marks=pytest.mark.slow), 4])
def test_wrapped_classifier_fits_exact_and_sampled_roll(samples):
    model = scornn_classifier((6, 3), units=8, classes=3, num_negative_ones=2, seed=1)
    layer = model.get_layer("scornn")
    x, _ = zoo.padded_sequences(batch=32, steps=6, channels=3, seed=4)
    y = np.random.default_rng(2).integers(0, 3, size=32)
    wrapped = keras_roll.wrap(model, lam=0.5, C=1.0, samples=samples, seed=0)
    if samples is None:  # lr 0: the logged regularizer is Eq. 9 on the whole batch
        wrapped.compile(keras.optimizers.SGD(0.0), "sparse_categorical_crossentropy")
        hist = wrapped.fit(x, y, batch_size=32, epochs=1, verbose=0).history
        z, jac, valid = preactivation_jacobian(layer, x, numpy_w(layer.cell))
        want = eq9(z, jac, valid, C=1.0, gamma=100.0)[0].mean()
        assert hist["roll_loss"][0] == pytest.approx(want, rel=1e-5)
    skew0 = layer.cell.skew.numpy().copy()
    wrapped.compile(keras.optimizers.Adam(1e-2, amsgrad=True), "sparse_categorical_crossentropy")
    hist = wrapped.fit(x, y, batch_size=16, epochs=3, verbose=0).history
    assert np.all(np.isfinite(hist["roll_loss"])) and np.all(np.isfinite(hist["loss"]))
    assert np.abs(layer.cell.skew.numpy() - skew0).max() > 1e-3
    assert orthogonality_error(layer.recurrent_matrix().numpy()) < 1e-5
    assert keras_roll.unwrap(wrapped) is model


# --------------------------------------------------------------------------- certify


def test_certify_agrees_with_bisection():
    # Full-length sequences: bisection perturbs every frame, and a padded frame
    # that stops being padding would change the mask (see keras_roll.certify).
    model = scornn_model(units=4, steps=4, channels=2, dtype="float64", seed=5)
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, 4, 2))
    d = rng.normal(size=(2, 2, 4, 2))
    lin = keras_roll.linearize(model)
    ca = keras_roll.certify(lin, x, directions=d, verbose=False)
    cb = keras_roll.certify(lin, x, directions=d, method="bisect", bisect_tol=1e-6,
                            verbose=False)
    for p in (1, 2, np.inf):
        assert np.all(np.isfinite(ca.margins[p])) and np.all(ca.margins[p] > 0)
        np.testing.assert_allclose(cb.margins[p], ca.margins[p], rtol=1e-4)
        np.testing.assert_array_equal(cb.binding_index[p], ca.binding_index[p])
    np.testing.assert_allclose(cb.directional, ca.directional, rtol=1e-4)
    assert ca.binding[2][0][0] == "rnn"
