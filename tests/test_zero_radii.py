"""Zero radii explained: `Certificate.zero_cause` and the causes in `summary()`.

Each case is built so that the cause is known independently: the tied window
is read from the Keras model's own pooling input, the near-breakpoint neuron's
pre-activation is computed exactly by hand (2^-24 from float32 weights), and
the neuron at its breakpoint is exactly 0 by construction.
"""

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll import ZeroCause


@pytest.fixture(scope="module")
def flat_cnn():
    """Conv(relu, positive weights and bias) -> MaxPooling2D(2) -> Dense on images
    with a flat background: every flat window is a tie, no ReLU is at 0."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((10, 10, 1))
    conv = keras.layers.Conv2D(2, 3, activation="relu", name="conv",
                               kernel_initializer=keras.initializers.RandomUniform(0.1, 0.5),
                               bias_initializer=keras.initializers.Constant(1.0))
    pool = keras.layers.MaxPooling2D(2, name="pool")
    h = pool(conv(inp))
    model = keras.Model(inp, keras.layers.Dense(3, name="out")(keras.layers.Flatten()(h)))
    x = np.full((4, 10, 10, 1), 0.5, np.float32)  # a blob in a corner of 3 of them
    x[1:, :3, :3, 0] = np.random.default_rng(0).uniform(0, 1, size=(3, 3, 3))
    features = keras.Model(inp, conv.output)(x).numpy()  # what the pool compares
    return model, x, features


@pytest.mark.parametrize("rigor", ["float32", "float64", "strict"])
def test_max_pooling_ties_are_named(flat_cnn, rigor):
    model, x, features = flat_cnn
    cert = keras_roll.certify(model, x, rigor=rigor, verbose=False)
    for p in (1, 2, np.inf):
        assert np.all(cert.margins[p] == 0)
        assert all(c is ZeroCause.MAX_POOL_TIE for c in cert.zero_cause[p])
        for i, (layer, (r, c, w, ch)) in enumerate(cert.binding[p]):
            assert layer == "pool"
            window = features[i, 2 * r:2 * r + 2, 2 * c:2 * c + 2, ch].reshape(-1)
            assert window[w] == window.max()  # the named element ties with the winner
            assert np.sum(window == window.max()) >= 2
    lines = []
    cert.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert ("Zero radii: 4 of 4 (l1, l2, linf) from a tie between equal maxima of a "
            "max-pooling window (in pool: 4); remedy: average pooling") in text
    assert text.count("Zero radii") == 1  # one line per cause, every norm in it


def test_average_pooling_removes_the_ties(flat_cnn):
    model, x, _ = flat_cnn
    inp = keras.Input(x.shape[1:])
    h = keras.layers.AveragePooling2D(2)(model.get_layer("conv")(inp))
    avg = keras.Model(inp, model.get_layer("out")(keras.layers.Flatten()(h)))
    cert = keras_roll.certify(avg, x, verbose=False)
    assert np.all(cert.margins[2] > 0)
    assert all(c is ZeroCause.NONE for c in cert.zero_cause[2])


def _near_breakpoint_mlp(dtype):
    """x = (1, 1, 1); hidden neuron 0 is z = 1 + 1 - 1 - (1 - 2^-24) = 2^-24 exactly
    (float32 weights), far inside float32 rounding of magnitudes ~3; the others
    are 0.5 or more from their breakpoints."""
    inp = keras.Input((3,), dtype=dtype)
    hidden = keras.layers.Dense(3, activation="relu", name="hidden", dtype=dtype)
    out = keras.layers.Dense(2, name="out", dtype=dtype)
    model = keras.Model(inp, out(hidden(inp)))
    kernel = np.array([[1.0, 0.5, -0.25], [1.0, 0.25, 0.5], [-1.0, 0.25, 0.5]])
    bias = np.array([-(1.0 - 2.0**-24), 0.0, 0.0])
    hidden.set_weights([kernel.astype(dtype), bias.astype(dtype)])
    out.set_weights([np.ones((3, 2), dtype), np.zeros(2, dtype)])
    return model, np.ones((1, 3), dtype), kernel, bias


def test_a_neuron_within_the_rounding_guard_is_named():
    model, x, kernel, bias = _near_breakpoint_mlp("float32")
    z = x[0].astype(np.float64) @ kernel + bias  # exact here: small integers and 2^-24
    assert z[0] == 2.0**-24 and np.all(np.abs(z[1:]) >= 0.5)
    for rigor in ("float64", "strict"):
        cert = keras_roll.certify(model, x, rigor=rigor, verbose=False)
        for p in (1, 2, np.inf):
            assert cert.margins[p][0] == 0
            assert cert.zero_cause[p][0] is ZeroCause.ROUNDING_GUARD
            assert cert.binding[p][0] == ("hidden", 0)
        lines = []
        cert.summary(print_fn=lines.append)
        text = "\n".join(lines)
        assert "within the rounding guard of its breakpoint (in hidden: 1)" in text
        assert "rigor='float32'" in text and "float64 model" in text
    # The remedies: exact arithmetic gives the hand-computed margin ...
    exact = keras_roll.certify(model, x, rigor="float32", verbose=False)
    want = np.min(np.abs(z) / np.linalg.norm(kernel, axis=0))
    np.testing.assert_allclose(exact.margins[2][0], want, rtol=1e-6)
    assert exact.zero_cause[2][0] is ZeroCause.NONE
    # ... and a float64 model a guard small enough for 2^-24.
    model64, x64, _, _ = _near_breakpoint_mlp("float64")
    cert64 = keras_roll.certify(model64, x64, verbose=False)
    assert 0 < cert64.margins[2][0] <= want
    assert cert64.zero_cause[2][0] is ZeroCause.NONE


def test_a_neuron_exactly_at_its_breakpoint_is_named():
    model, x, _, _ = _near_breakpoint_mlp("float32")
    hidden = model.get_layer("hidden")
    k, b = hidden.get_weights()
    b[0] = -1.0  # z_0 = 1 + 1 - 1 - 1 = 0 exactly
    hidden.set_weights([k, b])
    for rigor in ("float32", "float64"):
        cert = keras_roll.certify(model, x, rigor=rigor, verbose=False)
        assert cert.margins[2][0] == 0
        assert cert.zero_cause[2][0] is ZeroCause.AT_BREAKPOINT
        assert cert.binding[2][0] == ("hidden", 0)


def test_causes_survive_batching_and_concatenation(flat_cnn):
    model, x, _ = flat_cnn
    whole = keras_roll.certify(model, x, verbose=False)
    parts = [keras_roll.certify(model, x[:1], verbose=False),
             keras_roll.certify(model, x[1:], verbose=False)]
    joined = keras_roll.Certificate.concat(parts)
    for p in whole.norms:
        np.testing.assert_array_equal(joined.margins[p], whole.margins[p])
        assert list(joined.zero_cause[p]) == list(whole.zero_cause[p])
        assert joined.binding[p] == whole.binding[p]
    stream = keras_roll.certify(model, (x[i:i + 2] for i in range(0, 4, 2)), verbose=False)
    assert list(stream.zero_cause[2]) == list(whole.zero_cause[2])
