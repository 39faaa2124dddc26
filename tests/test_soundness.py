"""Certified balls under floating-point rounding and the boundary point.

Models are trained briefly, then biases are shifted so that chosen neurons sit
at 1e-5 .. 1e-7 from their breakpoint at chosen inputs. Every certified ball is
probed at 0.999 x its radius along the steepest direction of every neuron (the
dual-norm maximiser toward its breakpoint, for l2, l_inf and l1) and along
random directions; each probe is rounded to float32 (the model's input dtype)
and kept only if the rounded point is still inside the ball. The activation
pattern at every probe is evaluated

* in float64 (the float64 twin: exact arithmetic up to ~1e-16), and
* by the Keras model itself in its own dtype (float32; float16 under mixed
  precision), from its Keras-visible pre-activations and max-pooling inputs,

and compared with the exact pattern at the centre: `rigor="float64"` (the
probabilistic guard) and `rigor="strict"` (the worst-case one) must give zero
violations. `rigor="float32"` violates on the same set-up, so the test can
fail. A naturally trained float32 MLP (generated data) shows the point of the
default: it certifies most inputs where "strict" certifies few. The noise pass
behind the default is checked against `sum J^2 e^2` from tf.GradientTape
Jacobians of explicit re-implementations (an MLP and a SimpleRNN).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.geometry import steepest_directions

NORMS = (1, 2, np.inf)
OFFSETS = (3e-4, 1e-4, 3e-5, 1e-5, 3e-6, 1e-6, 3e-7, 1e-7)
# Inputs in [0, 1/64]: float32 resolves steps of ~1e-9 there, so probes at radii of
# ~1e-7 survive the rounding to float32 (in [0, 1] they would round back to x).
SCALE = 1.0 / 64


# --------------------------------------------------------------------------- models


def _train_briefly(model, x, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, model.output_shape[-1], size=len(x))
    model.compile(keras.optimizers.SGD(0.05),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    return model


def mlp(dtype_policy=None, seed=0):
    keras.utils.set_random_seed(seed)
    kw = {} if dtype_policy is None else {"dtype": dtype_policy}
    inp = keras.Input((40,))
    h = keras.layers.Normalization(mean=0.4 * SCALE, variance=(0.3 * SCALE) ** 2, name="norm",
                                   **kw)(inp)
    for i, width in enumerate((48, 32)):
        h = keras.layers.Dense(width, name=f"dense{i}", **kw)(h)
        h = keras.layers.ReLU(name=f"relu{i}", **kw)(h) if i == 0 else \
            keras.layers.LeakyReLU(0.1, name=f"relu{i}", **kw)(h)
    out = keras.layers.Dense(4, name="logits", dtype="float32")(h)
    return keras.Model(inp, out, name="mlp")


def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Rescaling(1 / SCALE, offset=-0.5, name="scale")(inp)
    h = keras.layers.Conv2D(6, 3, padding="same", name="conv")(h)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.ReLU(name="relu0")(h)
    h = keras.layers.MaxPooling2D(2, name="pool")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(24, name="dense0")(h)
    h = keras.layers.ReLU(name="relu1")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    return keras.Model(inp, out, name="cnn")


def _units(model):
    """Keras-visible unit inputs: ReLU / LeakyReLU layers and max pooling."""
    return [layer for layer in model.layers
            if isinstance(layer, (keras.layers.ReLU, keras.layers.LeakyReLU,
                                  keras.layers.MaxPooling2D))]


def _exact_z(model, x, layer):
    """The input of `layer` at `x`, in float64 (the float64 twin's forward pass)."""
    lin = keras_roll.linearize(model).at_dtype("float64")
    fwd = lin.forward(x)
    rows = lin.layout(x.shape[1:]).rows(layer.name)
    return fwd.neurons.z.numpy()[:, rows]


SOURCES = {"mlp": {"relu0": "dense0", "relu1": "dense1"},
           "cnn": {"relu0": "conv", "relu1": "dense0"}}


def place_neurons_near_zero(model, x, rng):
    """Shifts biases so that one neuron per example and ReLU layer sits 1e-5 .. 1e-7
    above or below 0 at the examples `x`."""
    for unit_name, source_name in SOURCES[model.name].items():
        unit, source = model.get_layer(unit_name), model.get_layer(source_name)
        bias = np.array(source.bias.numpy(), np.float64)
        channels = bias.shape[0]
        scale = np.ones(channels)  # dz / d bias
        if source_name == "conv":  # a BatchNormalization between conv and ReLU
            bn = model.get_layer("bn")
            scale = bn.gamma.numpy() / np.sqrt(bn.moving_variance.numpy() + bn.epsilon)
        for e in range(min(len(x), channels)):  # one channel each: no shift moves another
            z = _exact_z(model, x, unit).reshape(len(x), -1, channels)
            c = (3 * e + 1) % channels if channels % 3 else e
            pos = rng.integers(z.shape[1])
            offset = OFFSETS[e % len(OFFSETS)] * (1 if e % 2 else -1)
            bias[c] += (offset - z[e, pos, c]) / scale[c]  # z is affine in the bias
            source.bias.assign(bias.astype("float32"))
    return model


# --------------------------------------------------------------------------- patterns


def keras_patterns(model, x):
    """The activation pattern the Keras model itself computes, per unit, flattened:
    `z > 0` for ReLU-family inputs, the first maximum of every pooling window."""
    units = _units(model)
    sub = keras.Model(model.input, [u.input for u in units])
    outs = sub(x, training=False)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    pats = {}
    for unit, value in zip(units, outs):
        v = np.asarray(keras.ops.convert_to_numpy(value))
        if isinstance(unit, keras.layers.MaxPooling2D):
            b, h, w, c = v.shape
            win = v.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 2, 4, 5)
            win = win.reshape(b, h // 2, w // 2, 4, c)
            first = np.argmax(win, axis=3)  # ties: the first maximum, as the twin
            pats[unit.name] = np.eye(4, dtype=np.int64)[first].transpose(0, 1, 2, 4, 3)
            pats[unit.name] = pats[unit.name].reshape(b, -1)
        else:
            pats[unit.name] = (v.reshape(len(v), -1) > 0).astype(np.int64)
    return pats


def twin_patterns(lin, x):
    """The same patterns from a twin's forward pass (its `piece` per unit)."""
    fwd = lin.forward(x)
    piece = fwd.neurons.piece.numpy()
    layout = lin.layout(x.shape[1:])
    return {u.name: piece[:, u.start:u.stop] for u in layout.units}, fwd.neurons.valid.numpy()


def probe_points(lin64, x, cert, rng, random_dirs=8):
    """`(points [M, ...] float32, example [M], norm [M])`: 0.999 x radius along the
    steepest direction of every neuron and along random directions, rounded to
    float32 and kept only inside the ball."""
    jac = lin64.jacobian(x).astype(np.float64)  # [B, N, D]
    fwd = lin64.forward(x)
    below, above = fwd.neurons.below.numpy(), fwd.neurons.above.numpy()
    valid = fwd.neurons.valid.numpy()
    flat = x.reshape(len(x), -1).astype(np.float64)
    pts, owner, norm = [], [], []
    for p in NORMS:
        r = cert.margins[p]
        for e in range(len(x)):
            if not (np.isfinite(r[e]) and r[e] > 0):
                continue
            sel = valid[e] & np.any(jac[e] != 0, axis=1) & np.isfinite(
                np.minimum(below[e], above[e]))
            g = jac[e, sel]
            sign = np.where(above[e, sel] <= below[e, sel], 1.0, -1.0)
            u = steepest_directions(g, p, sign)
            rand = rng.normal(size=(random_dirs, flat.shape[1]))
            rand /= np.linalg.norm(rand, ord=p, axis=1, keepdims=True)
            u = np.concatenate([u, rand])
            cand = (flat[e] + 0.999 * r[e] * u).astype(np.float32)
            inside = np.linalg.norm(cand.astype(np.float64) - flat[e], ord=p, axis=1) <= r[e]
            pts.append(cand[inside])
            owner.append(np.full(int(inside.sum()), e))
            norm.append(np.full(int(inside.sum()), p))
    return (np.concatenate(pts).reshape(-1, *x.shape[1:]), np.concatenate(owner),
            np.concatenate(norm))


def violations(model, x, points, owner):
    """Probes whose pattern differs from the exact one at their centre: `(float64
    twin, Keras model itself)` counts."""
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    ref, valid = twin_patterns(lin64, x)
    at64, _ = twin_patterns(lin64, points)
    own = keras_patterns(model, points)
    bad64 = np.zeros(len(points), bool)
    bad_own = np.zeros(len(points), bool)
    for name, pat in ref.items():
        layout = lin64.layout(x.shape[1:])
        rows = layout.rows(name)
        v = valid[owner][:, rows]
        bad64 |= np.any((at64[name] != pat[owner]) & v, axis=1)
        bad_own |= np.any((own[name] != pat[owner]) & v, axis=1)
    return int(bad64.sum()), int(bad_own.sum())


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def near_zero_mlp():
    rng = np.random.default_rng(0)
    x_train = rng.uniform(0, SCALE, size=(256, 40)).astype("float32")
    model = _train_briefly(mlp(), x_train, 0)
    x = rng.uniform(0, SCALE, size=(24, 40)).astype("float32")
    return place_neurons_near_zero(model, x[:16], rng), x  # 8 examples left as they are


@pytest.fixture(scope="module")
def near_zero_cnn():
    rng = np.random.default_rng(1)
    x_train = rng.uniform(0, SCALE, size=(128, 8, 8, 2)).astype("float32")
    model = _train_briefly(cnn(), x_train, 1)
    bn = model.get_layer("bn")
    bn.moving_mean.assign(rng.normal(0, 0.2, 6))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, 6))
    x = rng.uniform(0, SCALE, size=(12, 8, 8, 2)).astype("float32")
    return place_neurons_near_zero(model, x[:6], rng), x


def _near_zero_count(model, x):
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    z = np.abs(lin64.forward(x).neurons.z.numpy())
    return int(np.sum((z > 0) & (z <= 2e-5)))


@pytest.mark.parametrize("rigor", ["float64", "strict"])
@pytest.mark.parametrize("which", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
def test_guarded_rigors_have_no_violations(which, rigor, near_zero_mlp, near_zero_cnn):
    model, x = near_zero_mlp if which == "mlp" else near_zero_cnn
    assert _near_zero_count(model, x) >= 6  # the set-up does place neurons near 0
    cert = keras_roll.certify(model, x, verbose=False, rigor=rigor)
    assert cert.rigor == rigor and cert.evaluation == "float32"
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    points, owner, _ = probe_points(lin64, x, cert, np.random.default_rng(2))
    assert len(points) > 1000  # most probes round into the ball
    assert violations(model, x, points, owner) == (0, 0)


def test_float32_rigor_violates_on_the_same_setup(near_zero_mlp):
    """Without the rounding bound some balls are broken: the test above can fail."""
    model, x = near_zero_mlp
    cert32 = keras_roll.certify(model, x, verbose=False, rigor="float32")
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    points, owner, _ = probe_points(lin64, x, cert32, np.random.default_rng(2), random_dirs=0)
    bad64, bad_own = violations(model, x, points, owner)
    assert bad64 + bad_own > 0
    # ... and the guarded radii are smaller exactly there, by about the rounding error;
    # the default is never below "strict" (it also takes the worst-case guard), up to
    # the float64 rounding of the reverse-mode norms of its candidates (1e-10 relative).
    strict = keras_roll.certify(model, x, verbose=False, rigor="strict")
    cert = keras_roll.certify(model, x, verbose=False)
    for p in NORMS:
        for c in (cert, strict):
            assert np.all(c.margins[p] <= cert32.margins[p] * (1 + 1e-4) + 1e-9)
        assert np.all(cert.margins[p] >= strict.margins[p] * (1 - 1e-9))


def small_mlp(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, name="dense0")(inp)
    h = keras.layers.ReLU(name="relu0")(h)
    h = keras.layers.Dense(6, name="dense1")(h)
    h = keras.layers.ReLU(name="relu1")(h)
    return keras.Model(inp, keras.layers.Dense(3, name="logits", dtype="float32")(h))


def test_mixed_precision_certifies_the_float16_network():
    """Under mixed_float16 the bound uses float16's unit roundoff (about 8000 x
    float32's): the Keras model's own float16 evaluation stays on the pattern inside
    every ball. Radii shrink by a few % of each neuron's magnitude."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = small_mlp(seed=3)
    finally:
        keras.config.set_dtype_policy(previous)
    x = np.random.default_rng(3).uniform(-1, 1, size=(16, 4)).astype("float32")
    cert32 = keras_roll.certify(model, x, verbose=False, rigor="float32")
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    for rigor in ("float64", "strict"):
        cert = keras_roll.certify(model, x, verbose=False, rigor=rigor)
        assert cert.evaluation == "float16 (mixed precision)"
        assert np.all(cert.margins[2] <= cert32.margins[2])
        assert np.median(cert.margins[2] / cert32.margins[2]) < 0.99  # float16 rounding shows
        lines = []
        cert.summary(print_fn=lines.append)
        assert any("float16" in line for line in lines)
        assert np.sum(cert.margins[2] > 0) >= 4
        points, owner, _ = probe_points(lin64, x, cert, np.random.default_rng(4),
                                        random_dirs=64)
        assert len(points) > 300
        assert violations(model, x, points, owner) == (0, 0)
    # The float32 twin's radii are broken by the float16 evaluation (so this can fail).
    points, owner, _ = probe_points(lin64, x, cert32, np.random.default_rng(4), random_dirs=64)
    assert violations(model, x, points, owner)[1] > 0


@pytest.mark.slow
@pytest.mark.parametrize("rigor", ["float64", "strict"])
def test_rounding_bound_covers_the_models_own_error(near_zero_cnn, rigor):
    """At the centre, |z computed by the model - z in float64| <= the bound, per neuron
    (the probabilistic one of rigor 'float64' too)."""
    model, x = near_zero_cnn
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    fwd = lin64.forward(x)
    err = keras_roll.certification.margins.rounding_errors(lin64, fwd, rigor)
    assert (err.strict_at_x is not None) == (rigor == "float64")
    layout = lin64.layout(x.shape[1:])
    sub = keras.Model(model.input, [model.get_layer(n).input for n in ("relu0", "relu1")])
    for name, own in zip(("relu0", "relu1"), sub(x)):
        rows = layout.rows(name)
        diff = np.abs(own.numpy().reshape(len(x), -1) - fwd.neurons.z.numpy()[:, rows])
        assert np.all(diff <= err.at_x[:, rows])
        assert np.max(diff / err.at_x[:, rows]) > 1e-4  # the bound is not vacuous


# --------------------------------------------------------------------------- natural nets


def blob_images(rng, n, classes=10, side=28):
    """MNIST-like generated data: per class three Gaussian blobs at fixed places,
    jittered, scaled and on a noisy background, in [0, 1]; `(x [n, side^2], y)`."""
    yy, xx = np.mgrid[:side, :side] / side
    centres = np.random.default_rng(0).uniform(0.2, 0.8, size=(classes, 3, 2))
    y = rng.integers(classes, size=n)
    c = centres[y] + rng.normal(0, 0.04, size=(n, 1, 2))  # [n, 3, 2]
    img = np.exp(-((yy - c[..., 0, None, None]) ** 2 + (xx - c[..., 1, None, None]) ** 2)
                 / 0.01).sum(1)
    img = img * rng.uniform(0.7, 1.0, size=(n, 1, 1)) + rng.uniform(0, 0.1, size=img.shape)
    return np.clip(img, 0, 1).reshape(n, -1).astype("float32"), y


@pytest.fixture(scope="module")
def natural_mlp():
    """A 784-64x3-10 float32 ReLU MLP trained normally (3 epochs of Adam on 3000
    generated images: no neuron placed anywhere), and 16 new test images."""
    x, y = blob_images(np.random.default_rng(0), 3000)
    keras.utils.set_random_seed(0)
    inp = keras.Input((784,))
    h = keras.layers.Normalization(mean=float(x.mean()), variance=float(x.var()),
                                   name="norm")(inp)
    for i in range(3):
        h = keras.layers.Dense(64, name=f"dense{i}")(h)
        h = keras.layers.ReLU(name=f"relu{i}")(h)
    model = keras.Model(inp, keras.layers.Dense(10, name="logits")(h), name="natural")
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=3, batch_size=64, verbose=0)
    return model, blob_images(np.random.default_rng(1), 16)[0]


@pytest.mark.slow
def test_default_rigor_certifies_a_naturally_trained_float32_mlp(natural_mlp):
    """The point of the probabilistic guard: on a normally trained float32 network the
    default certifies most inputs (the worst-case 'strict' far fewer), within a few %
    of the exact radii, and no probe at 0.999 x radius changes the pattern, in
    float64 or in the model's own float32 evaluation."""
    model, x = natural_mlp
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    exact = keras_roll.certify(lin64, x, verbose=False, rigor="float32")  # unguarded
    cert = keras_roll.certify(model, x, verbose=False)
    strict = keras_roll.certify(model, x, verbose=False, rigor="strict")
    assert np.all(exact.margins[2] > 0)
    for p in NORMS:
        assert np.mean(cert.margins[p] > 0) >= 0.75
        assert np.sum(strict.margins[p] > 0) < np.sum(cert.margins[p] > 0)
        assert np.all(cert.margins[p] >= strict.margins[p] * (1 - 1e-9))
        assert np.all(cert.margins[p] <= exact.margins[p])
        live = cert.margins[p] > 0
        assert np.median(cert.margins[p][live] / exact.margins[p][live]) > 0.9
    for c in (cert, strict):
        points, owner, _ = probe_points(lin64, x, c, np.random.default_rng(5))
        assert len(points) > (3000 if c is cert else 0)
        assert violations(model, x, points, owner) == (0, 0)


@pytest.mark.slow
def test_default_rigor_holds_inside_a_simple_rnn():
    """A ReLU-family SimpleRNN: its step sums and activations round inside the layer.
    Probes at 0.999 x radius keep the sign of every step's pre-activation in the
    model's own evaluation (read off its leaky_relu outputs) and in float64."""
    model = _tiny_rnn(seed=9)
    x = np.random.default_rng(9).uniform(0, SCALE, size=(8, 4, 3)).astype("float32")
    cert = keras_roll.certify(model, x, verbose=False)
    cert32 = keras_roll.certify(model, x, verbose=False, rigor="float32")
    assert np.all(cert.margins[2] > 0) and np.all(cert.margins[2] <= cert32.margins[2])
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    points, owner, _ = probe_points(lin64, x, cert, np.random.default_rng(9), random_dirs=32)
    assert len(points) > 1000
    ref = lin64.forward(x).neurons.piece.numpy()
    at64 = lin64.forward(points).neurons.piece.numpy()
    sub = keras.Model(model.input, model.get_layer("rnn").output)
    own = (sub(points).numpy().reshape(len(points), -1) > 0).astype(ref.dtype)
    assert not np.any(at64 != ref[owner])
    assert not np.any(own != ref[owner])


@pytest.mark.slow
@pytest.mark.parametrize("key", ["dense", "conv1d", "conv2d", "conv3d", "rnn"])
def test_default_guard_on_every_registered_layer_class(key):
    """The conformance models hold every registered class: the noise pass runs on
    them all, its guard covers the model's own error at the centre, per neuron, and
    the default never certifies less than 'strict' (it takes both guards)."""
    from tests import test_rule_conformance as conformance

    model, x = conformance.MODELS[key]()
    lin = keras_roll.linearize(model)
    lin64 = lin.at_dtype("float64")
    fwd = lin64.forward(x)
    err = keras_roll.certification.margins.rounding_errors(lin64, fwd)
    valid = fwd.neurons.valid.numpy()
    diff = np.abs(lin.forward(x).neurons.z.numpy() - fwd.neurons.z.numpy())
    assert np.all((diff <= err.at_x) | ~valid)
    assert np.max(np.where(valid, diff / err.at_x, 0)) > 1e-3  # not vacuous
    cert = keras_roll.certify(model, x, verbose=False)
    strict = keras_roll.certify(model, x, verbose=False, rigor="strict")
    for p in NORMS:
        assert np.all(cert.margins[p] >= strict.margins[p] * (1 - 1e-9))


# ------------------------------------------------------------------- boundary points


@pytest.mark.parametrize("p", [pytest.param(1, marks=pytest.mark.slow), 2,
                               pytest.param(np.inf, marks=pytest.mark.slow)])
def test_boundary_point_is_where_the_pattern_changes(p):
    """Along the binding direction the pattern holds at 0.99 x radius and changes at
    1.01 x radius (float64 model: the rounding bound is ~1e-13 relative)."""
    keras.utils.set_random_seed(5)
    inp = keras.Input((6,), dtype="float64")
    h = keras.layers.Dense(16, activation="relu", dtype="float64")(inp)
    h = keras.layers.Dense(12, activation="relu", dtype="float64")(h)
    model = keras.Model(inp, keras.layers.Dense(3, dtype="float64")(h))
    x = np.random.default_rng(6).normal(size=(8, 6))
    cert = keras_roll.certify(model, x, norms=(p,), verbose=False)
    u = cert.binding_direction(p)
    np.testing.assert_allclose(np.linalg.norm(u, ord=p, axis=1), 1.0, rtol=1e-12)
    point = cert.boundary_point(p)
    r = cert.margins[p]
    np.testing.assert_allclose(np.linalg.norm(point - x, ord=p, axis=1), r, rtol=1e-9)
    lin = keras_roll.linearize(model)
    ref = lin.forward(x).neurons.piece.numpy()
    inside = lin.forward(x + 0.99 * r[:, None] * u).neurons.piece.numpy()
    outside = lin.forward(x + 1.01 * r[:, None] * u).neurons.piece.numpy()
    assert np.all(np.all(inside == ref, axis=1))
    assert not np.any(np.all(outside == ref, axis=1))
    # The binding neuron is the one that flips.
    flipped = np.argmax(outside != ref, axis=1)
    assert np.all(flipped == cert.binding_index[p])


def test_boundary_point_of_a_float32_model_under_both_rigors(near_zero_mlp):
    """Rigor float64 and strict on every example (the binding hyperplane lies just beyond
    the shrunk radius); float32 only on the examples without neurons placed near zero,
    where float32 is accurate enough (near zero it is not: the test above)."""
    model, x_all = near_zero_mlp
    lin = keras_roll.linearize(model).at_dtype("float64")
    for rigor, x in (("float64", x_all), ("strict", x_all), ("float32", x_all[16:])):
        ref = lin.forward(x).neurons.piece.numpy()
        cert = keras_roll.certify(model, x, norms=(2,), verbose=False, rigor=rigor)
        u, r = cert.binding_direction("l2"), cert.margins["l2"]
        t = np.linalg.norm(cert.boundary_point(2) - x, axis=1)
        live = r > 0
        assert live.sum() >= len(x) // 3
        # float32: the radius comes from float32 neurons, the boundary from float64 ones.
        tol = 1e-3 if rigor == "float32" else 1e-4
        assert np.all(t[live] >= r[live] * (1 - tol))
        inside = lin.forward(x + 0.99 * r[:, None] * u).neurons.piece.numpy()
        beyond = lin.forward(x + 1.01 * t[:, None] * u).neurons.piece.numpy()
        assert np.all(np.all(inside == ref, axis=1)[live])
        assert not np.any(np.all(beyond == ref, axis=1)[live])


def test_binding_direction_without_kept_inputs_needs_x():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2)])
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    cert = keras_roll.certify(model, x, verbose=False)
    cert.attach_source(cert._source[0], None)
    with pytest.raises(ValueError, match="pass"):
        cert.binding_direction(2)
    np.testing.assert_allclose(cert.binding_direction(2, x=x),
                               keras_roll.certify(model, x, verbose=False).binding_direction(2))
    with pytest.raises(ValueError, match="examples"):
        cert.binding_direction(2, x=x[:2])


# --------------------------------------------------------------------------- the noise pass

U32, ETA32 = 2.0**-24, 2.0**-126


def _tiny_mlp(seed=7):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,))
    h = keras.layers.Dense(6, name="dense0")(inp)
    h = keras.layers.ReLU(name="relu0")(h)
    h = keras.layers.Dense(5, name="dense1")(h)
    h = keras.layers.LeakyReLU(0.1, name="relu1")(h)
    return keras.Model(inp, keras.layers.Dense(3, name="logits")(h))


def _explicit_variances(model, x, l1):
    """`(V0, V1)`, `[B, N]`: `sum_lk J_j<-lk^2 e_lk^2` from dense Jacobians of a float64
    re-implementation with a perturbation added to every rounded op output
    (`tf.GradientTape`), and the local scales written out from the weights."""
    import tensorflow as tf

    d0, d1 = model.get_layer("dense0"), model.get_layer("dense1")
    w0, b0 = (np.asarray(v.numpy(), np.float64) for v in (d0.kernel, d0.bias))
    w1, b1 = (np.asarray(v.numpy(), np.float64) for v in (d1.kernel, d1.bias))
    x = np.asarray(x, np.float64)
    shift = ETA32 / U32

    def unit(n):
        return np.sqrt(n) * U32

    # Values at x, slopes, and the local scales of the three rounded outputs:
    # dense0 (4 + 2 roundings), dense1 (6 + 2), the LeakyReLU's multiplication (3).
    z0 = x @ w0 + b0
    s0 = (z0 > 0).astype(np.float64)
    a0 = z0 * s0
    z1 = a0 @ w1 + b1
    s1 = np.where(z1 > 0, 1.0, 0.1)
    l1_z0, l1_z1 = l1[:, :6], l1[:, 6:]
    e0 = [unit(6) * ((np.abs(x) + shift) @ np.abs(w0) + np.abs(b0)) + np.sqrt(6) * ETA32,
          unit(8) * ((np.abs(a0) + shift) @ np.abs(w1) + np.abs(b1)) + np.sqrt(8) * ETA32,
          unit(3) * np.abs(s1 * z1) + np.sqrt(3) * ETA32]
    pr_x = np.ones_like(x)  # ||grad x_i||_1 = 1
    pr_a0 = s0 * l1_z0  # the known gradient norms of the neurons
    pr_z1 = np.minimum(pr_a0 @ np.abs(w1), l1_z1)
    e1 = [unit(6) * (pr_x @ np.abs(w0)), unit(8) * (pr_a0 @ np.abs(w1)), unit(3) * s1 * pr_z1]

    deltas = [tf.Variable(np.zeros_like(e)) for e in e0]
    xt = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        n0 = xt @ w0 + b0 + deltas[0]
        h0 = tf.nn.relu(n0)
        n1 = h0 @ w1 + b1 + deltas[1]
        _ = tf.nn.leaky_relu(n1, 0.1) + deltas[2]  # only later layers would read it
        neurons = tf.concat([n0, n1], axis=1)
    out = []
    for e in (e0, e1):
        v = np.zeros(neurons.shape)
        for delta, scale in zip(deltas, e):
            jac = tape.batch_jacobian(neurons, delta)
            jac = np.zeros(neurons.shape + delta.shape[1:]) if jac is None else jac.numpy()
            v += np.einsum("bjk,bk->bj", jac**2, scale**2)
        out.append(v)
    return out


def test_noise_pass_estimates_sum_of_squared_jacobians_times_local_errors():
    """The noise pass's `sigma^2` against `sum_lk J^2 e^2` from tf.GradientTape Jacobians
    (both tracks: at x, and the growth per radius with known gradient norms). With
    4096 Gaussian samples the estimate's relative standard deviation is 2.2 %."""
    from keras_roll.rounding.noise import noise_bound

    model = _tiny_mlp()
    x = np.random.default_rng(7).normal(size=(5, 4)).astype("float32")
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    fwd = lin64.forward(x)
    jac = lin64.jacobian(x).astype(np.float64)  # [B, N, D]
    l1 = np.abs(jac).sum(-1)
    v0, v1 = _explicit_variances(model, x, l1)
    nb = noise_bound(lin64, fwd, l1=l1, samples=4096)
    assert np.all(v0[:, :6] > 0) and np.all(v1 > 0)
    np.testing.assert_allclose(nb.sigma_at_x**2, v0, rtol=0.12)
    np.testing.assert_allclose(nb.sigma_per_radius**2, v1, rtol=0.12)
    # A different seed of the same pass gives a different estimate: the test can fail.
    nb_few = noise_bound(lin64, fwd, l1=l1, samples=2)
    assert not np.allclose(nb_few.sigma_at_x**2, v0, rtol=0.12, atol=0)
    # The rigorous term bounds the float64 twin's own error (reference: 80-bit
    # long double, 2^-64 relative), and is within a few orders of it.
    ld = np.longdouble
    d0, d1 = model.get_layer("dense0"), model.get_layer("dense1")
    z0 = x.astype(ld) @ d0.kernel.numpy().astype(ld) + d0.bias.numpy().astype(ld)
    z1 = np.maximum(z0, 0) @ d1.kernel.numpy().astype(ld) + d1.bias.numpy().astype(ld)
    err = np.abs(fwd.neurons.z.numpy().astype(ld) - np.concatenate([z0, z1], 1))
    assert np.all(err <= nb.exact_at_x)
    assert np.max(err / nb.exact_at_x) > 1e-3


def _tiny_rnn(seed=8):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4, 3))
    h = keras.layers.SimpleRNN(5, activation=keras.activations.leaky_relu,
                               return_sequences=True, name="rnn")(inp)
    h = keras.layers.Flatten()(h)
    return keras.Model(inp, keras.layers.Dense(2, name="logits")(h))


def _explicit_rnn_variances(model, x, l1):
    """`(V0, V1)` of a SimpleRNN's neurons `z_t` (see `_explicit_variances`): noise on
    every step's sum (`F + units + 3` roundings) and on its leaky_relu (3)."""
    import tensorflow as tf

    cell = model.get_layer("rnn").cell
    k, u, b = (np.asarray(v.numpy(), np.float64) for v in (cell.kernel, cell.recurrent_kernel,
                                                            cell.bias))
    x = np.asarray(x, np.float64)
    batch, steps, feats = x.shape
    units = u.shape[0]
    n = feats + units + 3
    shift = ETA32 / U32
    l1 = l1.reshape(batch, steps, units)
    h = np.zeros((batch, units))
    pr_h = np.zeros((batch, units))
    scales = {"z0": [], "h0": [], "z1": [], "h1": []}
    for t in range(steps):
        z = x[:, t] @ k + h @ u + b
        s = np.where(z > 0, 1.0, 0.2)
        m1 = np.ones((batch, feats)) @ np.abs(k) + pr_h @ np.abs(u)
        pr_z = np.minimum(m1, l1[:, t])
        scales["z0"].append(np.sqrt(n) * U32 * ((np.abs(x[:, t]) + shift) @ np.abs(k)
                                                + (np.abs(h) + shift) @ np.abs(u) + np.abs(b))
                            + np.sqrt(n) * ETA32)
        scales["h0"].append(np.sqrt(3) * U32 * np.abs(s * z) + np.sqrt(3) * ETA32)
        scales["z1"].append(np.sqrt(n) * U32 * m1)
        scales["h1"].append(np.sqrt(3) * U32 * s * pr_z)
        h, pr_h = s * z, s * pr_z
    dz = tf.Variable(np.zeros((batch, steps, units)))
    dh = tf.Variable(np.zeros((batch, steps, units)))
    with tf.GradientTape(persistent=True) as tape:
        hh = tf.zeros((batch, units), tf.float64)
        zs = []
        for t in range(steps):
            z = tf.constant(x[:, t]) @ k + hh @ u + b + dz[:, t]
            zs.append(z)
            hh = tf.nn.leaky_relu(z, 0.2) + dh[:, t]
        neurons = tf.concat(zs, axis=1)  # processing order, [B, T * units]
    jz = tape.batch_jacobian(neurons, dz).numpy()
    jh = tape.batch_jacobian(neurons, dh).numpy()
    out = []
    for track in "01":
        ez = np.stack(scales["z" + track], 1)
        eh = np.stack(scales["h" + track], 1)
        out.append(np.einsum("bjtk,btk->bj", jz**2, ez**2)
                   + np.einsum("bjtk,btk->bj", jh**2, eh**2))
    return out


@pytest.mark.slow
def test_noise_pass_of_a_simple_rnn_against_tape_jacobians():
    """Inside a SimpleRNN every step's sum and activation round: the pass injects noise
    inside the recursion, checked against the explicit unrolled network."""
    from keras_roll.rounding.noise import noise_bound

    model = _tiny_rnn()
    x = np.random.default_rng(8).normal(size=(3, 4, 3)).astype("float32")
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    fwd = lin64.forward(x)
    l1 = np.abs(lin64.jacobian(x).astype(np.float64)).sum(-1)
    v0, v1 = _explicit_rnn_variances(model, x, l1)
    nb = noise_bound(lin64, fwd, l1=l1, samples=4096)
    assert np.all(v0 > 0) and np.all(v1[:, 5:] > 0)
    np.testing.assert_allclose(nb.sigma_at_x**2, v0, rtol=0.12)
    np.testing.assert_allclose(nb.sigma_per_radius**2, v1, rtol=0.12)


# --------------------------------------------------------------------------- huge inputs

SCALES = (1.0, 1e10, 1e20, 1e30, 1e34, 1e35, 3e35, 1e36, 3e36, 1e37, 1e38)
BUDGET = 64 * 2**20  # bytes of tangents per chunk: keras_roll's default fixed budget


def _exact_fc(model, x):
    """`(z [B, N], J [B, N, D])` of a `keras_roll.models.fc` MLP in float64 numpy,
    independently of keras_roll: the exact neurons and their input gradients."""
    norm = next(lyr for lyr in model.layers if isinstance(lyr, keras.layers.Normalization))
    mean = np.asarray(norm.mean, np.float64).reshape(-1)
    std = np.sqrt(np.asarray(norm.variance, np.float64).reshape(-1))
    h = (x.astype(np.float64) - mean) / std
    zs, grads, g, s = [], [], None, None
    for layer in [lyr for lyr in model.layers if isinstance(lyr, keras.layers.Dense)][:-1]:
        w = layer.kernel.numpy().astype(np.float64)
        z = h @ w + layer.bias.numpy().astype(np.float64)
        if s is None:  # the first layer's gradients: W^T diag(1 / std), for every example
            g = np.broadcast_to((w / std[:, None]).T, (len(x), *w.T.shape))
        else:  # W^T diag(relu'(z_prev)) g_prev
            g = np.matmul(w.T[None], s[:, :, None] * g)
        zs.append(z)
        grads.append(g)
        s = (z > 0).astype(np.float64)
        h = z * s
    return np.concatenate(zs, 1), np.concatenate(grads, 1)


def _exact_margins(dist, grads):
    out = {}
    for p, q in ((1, np.inf), (2, 2), (np.inf, 1)):
        gn = np.linalg.norm(grads, ord=q, axis=2)
        out[p] = np.where(gn > 0, dist / np.where(gn > 0, gn, 1.0), np.inf).min(1)
    return out


@pytest.fixture(scope="module")
def huge_inputs():
    keras.utils.set_random_seed(11)
    model = keras_roll.models.fc(depth=3, width=100, classifier_activation=None)
    x0 = np.random.default_rng(11).uniform(0, 1, size=(3, 784))
    x = np.concatenate([(s * x0).astype("float32") for s in SCALES])
    scale = np.repeat(SCALES, len(x0))
    z, grads = _exact_fc(model, x)
    return model, x, scale, _exact_margins(np.abs(z), grads), grads, z


def test_huge_inputs_never_enlarge_a_radius(huge_inputs):
    """Inputs scaled by 1 .. 1e38 on a 784-100x3-10 MLP: the default guard's radius never
    exceeds the exact margin (float64 numpy, independent of keras_roll); where the guard
    cannot represent its bound (the model's float32 evaluation, or the guard's own
    arithmetic, overflows) the radius is NaN with a warning. The same holds for the
    saliency radii (`stable_radius`), and `count_regions` refuses what it cannot bound.
    A fixed memory budget: "auto" would time its candidate chunks first, twice the
    cost of the certificate here."""
    model, x, scale, exact, _, _ = huge_inputs
    with pytest.warns(UserWarning, match="non-finite"):
        cert = keras_roll.certify(model, x, verbose=False, memory_budget=BUDGET)
    nan = cert.nonfinite
    assert not nan[scale <= 1e30].any() and nan[scale >= 1e38].all()
    for p in NORMS:
        r = cert.margins[p]
        assert np.all(np.isnan(r) == nan)
        assert np.all(r[~nan] <= exact[p][~nan] * (1 + 1e-9))
        assert np.sum(r[~nan] > 0) >= 3  # the test can fail: radii are not all 0
    with pytest.warns(UserWarning, match="non-finite"):
        radius = keras_roll.stable_radius(model, x, norms=(2,), verbose=False,
                                          memory_budget=BUDGET)[2]
    np.testing.assert_array_equal(np.isnan(radius), nan)
    assert np.all(radius[~nan] <= exact[2][~nan] * (1 + 1e-9))
    with pytest.raises(ValueError, match="non-finite|overflow"):
        keras_roll.count_regions(model, x[nan], verbose=False)


@pytest.mark.slow
def test_huge_inputs_never_enlarge_a_stability_bound(huge_inputs):
    """The stability bounds along every input axis of the huge inputs the guard can
    represent stay below the exact first breakpoint along that axis."""
    model, x, scale, _, grads, z = huge_inputs
    lin = keras_roll.linearize(model)
    with pytest.warns(UserWarning, match="non-finite"):
        nan = keras_roll.certify(lin, x, norms=(2,), verbose=False).nonfinite
    ok = np.flatnonzero(~nan & (scale >= 1e34))  # the huge ones the guard represents
    assert ok.size
    sb = keras_roll.stability_bounds(lin, x[ok], verbose=False)
    upper = _exact_axis_margins(z[ok], grads[ok])
    assert np.all(sb.upper.reshape(len(ok), -1) <= upper * (1 + 1e-9))


def _exact_axis_margins(z, grads):
    """`[B, D]` exact margins along `+e_k`: the first breakpoint (0) a neuron reaches."""
    toward = -np.where(z > 0, 1.0, -1.0)[:, :, None] * grads  # rate toward the breakpoint
    dist = np.abs(z)[:, :, None]
    return np.where(toward > 0, dist / np.where(toward > 0, toward, 1.0), np.inf).min(1)
