"""Honest errors and no silent wrong answers.

One section per kind of bad input or surprising case. References are independent
of the code under test where one applies: `tf.GradientTape`, results on plain
arrays, hand counts.
"""

from __future__ import annotations

import logging
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll import UnsupportedModelError
from tests import model_zoo as zoo


def small_mlp(seed=0, in_dim=5, widths=(7, 6), out=3, dtype="float32"):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((in_dim,), dtype=dtype)
    h = inp
    for i, w in enumerate(widths):
        h = keras.layers.Dense(w, activation="relu", name=f"dense{i}", dtype=dtype)(h)
    return keras.Model(inp, keras.layers.Dense(out, name="logits", dtype=dtype)(h))


@pytest.fixture(scope="module")
def mlp_case():
    model = small_mlp()
    x = np.random.default_rng(0).normal(size=(9, 5)).astype("float32")
    return model, x


# -------------------------------------------- training-mode layers inside the model


def _with(layer_call):
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, activation="relu", name="hidden")(inp)
    h = layer_call(h)
    return keras.Model(inp, keras.layers.Dense(2, name="logits")(h))


@pytest.mark.parametrize("make, name", [
    (lambda: keras.layers.Dropout(0.5, name="mc_dropout"), "mc_dropout"),
    (lambda: keras.layers.BatchNormalization(name="batch_stats"), "batch_stats"),
    (lambda: keras.layers.GaussianNoise(0.1, name="noise"), "noise"),
])
def test_layers_forced_into_training_mode_are_refused(make, name):
    """`layer(h, training=True)` is random or batch-dependent at inference."""
    model = _with(lambda h: make()(h, training=True))
    x = np.random.default_rng(0).normal(size=(4, 4)).astype("float32")
    a, b = model(x).numpy(), model(x).numpy()  # Keras runs the layer in training mode
    if name != "batch_stats":
        assert not np.allclose(a, b)  # independent evidence: the model itself is random
    else:  # batch statistics: an example's output depends on the rest of the batch
        assert not np.allclose(a[:1], model(x[:2]).numpy()[:1])
    for fn in (keras_roll.linearize, lambda m: keras_roll.certify(m, x, verbose=False)):
        with pytest.raises(UnsupportedModelError, match=f"'{name}'.*training=True"):
            fn(model)
    # Called with training=False (or nothing), the same layer is fine.
    keras_roll.linearize(_with(lambda h: make()(h, training=False)))
    keras_roll.linearize(_with(lambda h: make()(h)))


# ------------------------------------------------ non-finite and overflowing inputs


@pytest.mark.parametrize("rigor", ["float64", "strict", "float32"])
def test_overflowing_input_gets_nan_margins_and_a_warning(mlp_case, rigor):
    """a finite input of 3e38 overflows float32; its margins are NaN."""
    model, x = mlp_case
    big = x.copy()
    big[2] = 3e38
    with pytest.warns(UserWarning, match="non-finite"):
        cert = keras_roll.certify(model, big, verbose=False, rigor=rigor)
    assert np.isnan(model(big).numpy()[2]).any() or rigor != "float32"
    assert cert.nonfinite.tolist() == [i == 2 for i in range(len(x))]
    ref = keras_roll.certify(model, np.delete(x, 2, 0), verbose=False, rigor=rigor)
    # float32 matmuls may round differently for another batch size (oneDNN blocking).
    rtol = 1e-5 if rigor == "float32" else 0.0
    for p in (1, 2, np.inf):
        assert np.isnan(cert.margins[p][2]) and cert.binding[p][2] is None
        np.testing.assert_allclose(np.delete(cert.margins[p], 2), ref.margins[p], rtol=rtol)
    with pytest.warns(UserWarning, match="non-finite"):
        sb = keras_roll.stability_bounds(model, big, verbose=False, rigor=rigor)
    assert np.isnan(sb.upper[2]).all() and np.isfinite(sb.upper[0]).any()
    with pytest.raises(ValueError, match="non-finite"):
        keras_roll.count_regions(model, big, verbose=False, rigor=rigor)


@pytest.mark.graph
def test_roll_loss_is_nan_for_nan_rows_inside_tf_function(mlp_case):
    """inside tf.function (no eager check) a NaN row gets a NaN loss, the
    others are unchanged, and TerminateOnNaN stops training on it."""
    model, x = mlp_case
    bad = x.copy()
    bad[1, 0] = np.nan
    loss = tf.function(lambda t: keras_roll.roll_loss(model, t))(tf.constant(bad)).numpy()
    ref = keras_roll.roll_loss(model, np.delete(x, 1, 0)).numpy()
    assert np.isnan(loss[1])
    np.testing.assert_allclose(np.delete(loss, 1), ref, rtol=1e-6)
    big = x.copy()
    big[3] = 3e38
    with pytest.warns(UserWarning, match="non-finite"):
        eager = keras_roll.roll_loss(model, big).numpy()
    assert np.isnan(eager[3]) and np.isfinite(np.delete(eager, 3)).all()
    # fit: the loss turns NaN and TerminateOnNaN stops after the first batch.
    wrapped = keras_roll.wrap(small_mlp(seed=1))
    wrapped.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    y = np.zeros(len(x), int)
    hist = wrapped.fit(big, y, batch_size=len(x), epochs=3, verbose=0,
                       callbacks=[keras.callbacks.TerminateOnNaN()])
    assert len(hist.history["loss"]) == 1 and np.isnan(hist.history["loss"][0])


# ----------------------------------------------------------------------- tiny gamma


def test_tiny_gamma_keeps_the_largest_bracket(mlp_case):
    """gamma=1e-9 keeps one neuron (the docstring's promise), not none."""
    model, x = mlp_case
    lin = keras_roll.linearize(model)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:  # reference: the tape's Jacobian of the neurons
        tape.watch(xt)
        z = lin.primal(xt).neurons.z
    jac = tape.batch_jacobian(z, xt).numpy()
    bracket = (jac**2).sum(-1) + np.maximum(0.0, 1.0 - np.abs(z.numpy()))
    loss = keras_roll.roll_loss(model, x, C=1.0, gamma=1e-9).numpy()
    np.testing.assert_allclose(loss, bracket.max(axis=1), rtol=1e-5)
    assert np.all(loss > 0)


# ------------------------------------------------------ Normalization and retracing


# Each statistic and each ROLL once by default; the other two pairs in `make test-all`.
@pytest.mark.parametrize("stats, samples", [
    ("adapted", None), ("given", 3),
    pytest.param("adapted", 3, marks=pytest.mark.slow),
    pytest.param("given", None, marks=pytest.mark.slow),
])
def test_fit_with_normalization_and_a_partial_last_batch(stats, samples):
    """Normalization inside the model, 130 = 2 x 64 + 2 examples (a retrace
    with a dynamic batch), exact and sampled ROLL: one epoch trains."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, size=(130, 12)).astype("float32")
    y = rng.integers(0, 3, size=130)
    keras.utils.set_random_seed(0)
    inp = keras.Input((12,))
    if stats == "adapted":
        norm = keras.layers.Normalization(name="normalize")
        norm.adapt(x)
    else:
        norm = keras.layers.Normalization(mean=0.5, variance=1 / 12, name="normalize")
    h = keras.layers.Dense(16, activation="relu")(norm(inp))
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    wrapped = keras_roll.wrap(model, samples=samples, seed=0)
    wrapped.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = wrapped.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert np.isfinite(hist.history["loss"][0]) and np.isfinite(hist.history["roll_loss"][0])
    # The twin's Normalization is the layer's own function, in float32 and float64.
    lin = keras_roll.linearize(model)
    sub = keras.Model(inp, norm.output)
    step = lin.program.steps[0]
    for dtype in ("float32", "float64"):
        out, _ = step.ops[0].forward([tf.constant(x[:5], dtype)], None)
        assert out.dtype == dtype
        np.testing.assert_allclose(out.numpy(), sub(x[:5]).numpy(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------- wrapped models


def test_wrapped_models_are_unwrapped_everywhere(mlp_case):
    """certify, stability_bounds, count_regions, roll_loss and wrap accept
    a model made by wrap and work on its plain model."""
    model, x = mlp_case
    wrapped = keras_roll.wrap(model, lam=1.0)
    for fn in (lambda m: keras_roll.certify(m, x, verbose=False).margins[2],
               lambda m: keras_roll.stability_bounds(m, x, verbose=False).upper,
               lambda m: keras_roll.count_regions(m, x, verbose=False).pattern_ids,
               lambda m: keras_roll.roll_loss(m, x).numpy(),
               lambda m: keras_roll.lp_margins(m, x)):
        np.testing.assert_array_equal(fn(wrapped), fn(model))
    rewrapped = keras_roll.wrap(wrapped, lam=3.0)
    assert keras_roll.unwrap(rewrapped) is model
    assert keras_roll.linearize(wrapped) is keras_roll.linearize(model)


# --------------------------------------------------------------- streams of batches


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, size):
        super().__init__()
        self.x, self.size = x, size

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, i):
        return self.x[i * self.size:(i + 1) * self.size], np.zeros(self.size)


@pytest.mark.graph
@pytest.mark.parametrize("kind", [
    "x", "xyw", "unbatched", "generator", "pydataset",
    # (x, y) tuples: "xyw" (a longer tuple) and "generator" (yields pairs) cover them
    pytest.param("xy", marks=pytest.mark.slow),
])
def test_streams_of_batches_give_the_array_results(mlp_case, kind):
    """tf.data, generators and PyDatasets are certified batch by batch."""
    model, x = mlp_case
    y, w = np.zeros(len(x)), np.ones(len(x))
    ds = tf.data.Dataset
    streams = {
        "x": lambda: ds.from_tensor_slices(x).batch(4),
        "xy": lambda: ds.from_tensor_slices((x, y)).batch(4),
        "xyw": lambda: ds.from_tensor_slices((x, y, w)).batch(2),
        "unbatched": lambda: ds.from_tensor_slices((x, y)),
        "generator": lambda: ((x[i:i + 4], y[i:i + 4]) for i in range(0, len(x), 4)),
        "pydataset": lambda: _Batches(x, 4),
    }
    ref = keras_roll.certify(model, x, verbose=False)
    cert = keras_roll.certify(model, streams[kind](), verbose=False)
    for p in (1, 2, np.inf):
        np.testing.assert_allclose(cert.margins[p], ref.margins[p], rtol=1e-12)
        assert cert.binding[p] == ref.binding[p]
    np.testing.assert_allclose(cert.boundary_point(2), ref.boundary_point(2), rtol=1e-9)
    if kind != "x":  # the other readers share certify's `read_batches`: one stream suffices
        return
    sb = keras_roll.stability_bounds(model, streams[kind](), verbose=False)
    np.testing.assert_allclose(sb.upper, keras_roll.stability_bounds(model, x, verbose=False).upper)
    rc = keras_roll.count_regions(model, streams[kind](), verbose=False)
    rc_ref = keras_roll.count_regions(model, x, verbose=False)
    assert (rc.patterns, rc.jacobians, rc.n) == (rc_ref.patterns, rc_ref.jacobians, rc_ref.n)
    np.testing.assert_array_equal(rc.pattern_ids, rc_ref.pattern_ids)
    np.testing.assert_allclose(keras_roll.lp_margins(model, streams[kind]()), ref.margins[2],
                               rtol=1e-12)


def test_stream_with_shared_directions_and_a_progress_bar(mlp_case, capsys):
    model, x = mlp_case
    d = np.random.default_rng(1).normal(size=(2, 5))
    ref = keras_roll.certify(model, x, directions=d, verbose=False)
    cert = keras_roll.certify(model, tf.data.Dataset.from_tensor_slices(x).batch(4),
                              directions=d, verbose=True)
    np.testing.assert_allclose(cert.directional, ref.directional, rtol=1e-12)
    assert "certify" in capsys.readouterr().err
    with pytest.raises(ValueError, match="shared"):
        keras_roll.certify(model, tf.data.Dataset.from_tensor_slices(x).batch(4),
                           directions=np.ones((len(x), 2, 5)))
    with pytest.raises(ValueError, match="shape"):
        keras_roll.certify(model, tf.data.Dataset.from_tensor_slices(x[:, :3]).batch(4))


def test_margin_monitor_reads_datasets_and_generators(mlp_case):
    model, x = mlp_case
    want = keras_roll.l2_margins(model, x, rigor="float32")
    for x_val in (tf.data.Dataset.from_tensor_slices((x, np.zeros(len(x)))).batch(4),
                  (x[i:i + 2] for i in range(0, len(x), 2))):
        monitor = keras_roll.MarginMonitor(x_val)
        monitor.set_model(model)
        # float32 twin: batches of 4 or 2 may round differently from one batch of 8.
        np.testing.assert_allclose(monitor.margins(), want, rtol=1e-5)
        np.testing.assert_allclose(monitor.margins(), want, rtol=1e-5)  # read twice
        logs = {}
        monitor.on_epoch_end(0, logs)
        assert logs["margin_l2_p50"] == pytest.approx(np.percentile(want, 50, method="nearest"),
                                                      rel=1e-5)


# ----------------------------------------------------------------- masked sequences


def test_masked_models_say_which_coordinates_the_ball_covers():
    """`Certificate.mask` (True at unpadded steps) and the summary's note."""
    model = zoo.rnn()
    x, lengths = zoo.padded_sequences()
    cert = keras_roll.certify(model, x, verbose=False, rigor="float32")  # the mask: any rigor
    expected = np.arange(x.shape[1])[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_array_equal(cert.mask, expected)
    lines = []
    cert.summary(print_fn=lines.append)
    assert any("padded steps stay at the mask value" in line for line in lines)
    # The gradients (so the margins) ignore the padded coordinates: moving them does
    # not enter the l2 radius.
    lin = keras_roll.linearize(model).at_dtype("float64")
    jac = lin.jacobian(x).reshape(len(x), -1, *x.shape[1:])
    assert np.all(jac[~np.broadcast_to(expected[:, None, :, None], jac.shape)] == 0)
    assert keras_roll.certify(small_mlp(), np.zeros((2, 5), "float32"),
                              verbose=False).mask is None
    assert "padded steps" in keras_roll.certify.__doc__


# ---------------------------------------------------------------------- return types


def test_return_types_numpy_for_analysis_tensors_for_training(mlp_case):
    """analysis results are numpy, functions used in training give tensors."""
    model, x = mlp_case
    lin = keras_roll.linearize(model)
    cert = keras_roll.certify(model, x, directions=np.ones((2, 5)), verbose=False)
    for value in (*cert.margins.values(), *cert.binding_index.values(), cert.directional,
                  cert.logits, cert.nonfinite, lin.jacobian(x), lin.output_jacobian(x),
                  keras_roll.stability_bounds(model, x, verbose=False).upper,
                  keras_roll.count_regions(model, x, verbose=False).pattern_ids,
                  keras_roll.lp_margins(model, x), cert.boundary_point(2)):
        assert isinstance(value, np.ndarray)
    for value in (keras_roll.roll_loss(model, x), lin.jvp(x, np.ones((2, 5))).neurons,
                  lin.forward(x).logits):
        assert tf.is_tensor(value)
    for cls in (keras_roll.Certificate, keras_roll.StabilityBounds, keras_roll.RegionCount):
        assert "numpy" in cls.__doc__


# ------------------------------------------------------------------------- norm keys


def test_norm_keys_accept_every_spelling(mlp_case):
    model, x = mlp_case
    cert = keras_roll.certify(model, x, verbose=False)
    for spelling, p in (("l1", 1), ("l2", 2), ("linf", np.inf), ("inf", np.inf), (1, 1),
                        (2, 2), (2.0, 2), (np.inf, np.inf), (float("inf"), np.inf)):
        assert cert.margins[spelling] is cert.margins[p]
        assert cert.binding[spelling] is cert.binding[p]
        assert spelling in cert.margins
    assert "l3" not in cert.margins
    with pytest.raises(KeyError, match="l1"):
        cert.margins["l3"]
    only = keras_roll.certify(model, x, norms=("l2",), verbose=False)
    with pytest.raises(KeyError, match="not certified"):
        only.margins["linf"]
    assert only.margins.get("linf") is None


# --------------------------------- nothing to certify, fractional budgets, retracing


def test_nothing_to_certify_and_fractional_budgets_are_refused(mlp_case):
    model, x = mlp_case
    with pytest.raises(ValueError, match="nothing to certify"):
        keras_roll.certify(model, x, norms=())
    keras_roll.certify(model, x, norms=(), directions=np.ones((1, 5)), verbose=False)
    for fn in (lambda: keras_roll.certify(model, x, memory_budget=0.5),
               lambda: keras_roll.stability_bounds(model, x, memory_budget=0.5),
               lambda: keras_roll.count_regions(model, x, memory_budget=0.5),
               lambda: keras_roll.linearize(model, memory_budget=0.5)):
        with pytest.raises(ValueError, match="0.5"):
            fn()
    for bad in ("float16", "Float64", 64):  # the message names all three rigors (None: the default)
        with pytest.raises(ValueError, match="rigor=.*'float64'.*'strict'.*'float32'"):
            keras_roll.certify(model, x, rigor=bad)
    for fn in (keras_roll.stability_bounds, keras_roll.count_regions, keras_roll.lp_margins):
        with pytest.raises(ValueError, match="'strict'"):
            fn(model, x, rigor="exact")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.graph
def test_no_retracing_warnings_across_batch_sizes_and_models():
    """TensorFlow warns about "retracing" when one function traces often;
    every twin's functions trace a few times only, per twin."""
    handler = _Records()
    tf.get_logger().addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for seed in range(3):  # TensorFlow used to count all twins' traces together
                model = small_mlp(seed=seed, widths=(6,))  # one hidden layer: quicker traces
                for b in (1, 8, 13):
                    xb = np.random.default_rng(b).normal(size=(b, 5)).astype("float32")
                    keras_roll.certify(model, xb, verbose=False)
    finally:
        tf.get_logger().removeHandler(handler)
    assert not [m for m in handler.messages if "retracing" in m]


# --------------------------------------------------------------- directional margins


def test_directional_margins_are_in_units_of_t(mlp_case):
    """along `x + t d` the margin scales as 1 / ||d||."""
    model, x = mlp_case
    d = np.random.default_rng(2).normal(size=(3, 5))
    a = keras_roll.certify(model, x, norms=(), directions=d, verbose=False, rigor="float32")
    b = keras_roll.certify(model, x, norms=(), directions=4 * d, verbose=False,
                           rigor="float32")
    np.testing.assert_allclose(b.directional, a.directional / 4, rtol=1e-6)
    assert "units of `t`" in keras_roll.certify.__doc__


# --------------------------------------------------------------------------- other cases


def test_empty_batch_jacobians_have_every_axis():
    model = small_mlp()
    lin = keras_roll.linearize(model)
    empty = np.zeros((0, 5), "float32")
    assert lin.jacobian(empty).shape == (0, 13, 5)  # N = 7 + 6 neurons
    assert lin.output_jacobian(empty).shape == (0, 3, 5)
