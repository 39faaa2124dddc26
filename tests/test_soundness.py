"""Certified balls under floating-point rounding (issue #6, items 1, 5 and 12).

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

and compared with the exact pattern at the centre: `rigor="float64"` must give
zero violations. `rigor="float32"` violates on the same set-up, so the test
can fail.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.bisection import steepest_directions

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


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_float64_rigor_has_no_violations(which, near_zero_mlp, near_zero_cnn):
    model, x = near_zero_mlp if which == "mlp" else near_zero_cnn
    assert _near_zero_count(model, x) >= 6  # the set-up does place neurons near 0
    cert = keras_roll.certify(model, x, verbose=False)
    assert cert.rigor == "float64" and cert.evaluation == "float32"
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
    # ... and the sound radii are smaller exactly there, by about the rounding error.
    cert = keras_roll.certify(model, x, verbose=False)
    for p in NORMS:
        assert np.all(cert.margins[p] <= cert32.margins[p] * (1 + 1e-4) + 1e-9)


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
    every ball (item 5). Radii shrink by a few % of each neuron's magnitude."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = small_mlp(seed=3)
    finally:
        keras.config.set_dtype_policy(previous)
    x = np.random.default_rng(3).uniform(-1, 1, size=(16, 4)).astype("float32")
    cert = keras_roll.certify(model, x, verbose=False)
    cert32 = keras_roll.certify(model, x, verbose=False, rigor="float32")
    assert cert.evaluation == "float16 (mixed precision)"
    assert np.all(cert.margins[2] <= cert32.margins[2])
    assert np.median(cert.margins[2] / cert32.margins[2]) < 0.99  # float16 rounding shows
    lines = []
    cert.summary(print_fn=lines.append)
    assert any("float16" in line for line in lines)
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    assert np.sum(cert.margins[2] > 0) >= 4
    points, owner, _ = probe_points(lin64, x, cert, np.random.default_rng(4), random_dirs=64)
    assert len(points) > 300
    assert violations(model, x, points, owner) == (0, 0)
    # The float32 twin's radii are broken by the float16 evaluation (so this can fail).
    points, owner, _ = probe_points(lin64, x, cert32, np.random.default_rng(4), random_dirs=64)
    assert violations(model, x, points, owner)[1] > 0


def test_float64_rigor_bound_covers_the_models_own_error(near_zero_cnn):
    """At the centre, |z computed by the model - z in float64| <= the bound, per neuron."""
    model, x = near_zero_cnn
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    fwd = lin64.forward(x)
    err = keras_roll.margins.rounding_errors(lin64, fwd)
    layout = lin64.layout(x.shape[1:])
    sub = keras.Model(model.input, [model.get_layer(n).input for n in ("relu0", "relu1")])
    for name, own in zip(("relu0", "relu1"), sub(x)):
        rows = layout.rows(name)
        diff = np.abs(own.numpy().reshape(len(x), -1) - fwd.neurons.z.numpy()[:, rows])
        assert np.all(diff <= err.at_x[:, rows])
        assert np.max(diff / err.at_x[:, rows]) > 1e-4  # the bound is not vacuous


# --------------------------------------------------------------------------- item 12


@pytest.mark.parametrize("p", NORMS)
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
    """Rigor float64 on every example (the binding hyperplane lies just beyond the
    shrunk radius); float32 only on the examples without neurons placed near zero,
    where float32 is accurate enough (near zero it is not: the test above)."""
    model, x_all = near_zero_mlp
    lin = keras_roll.linearize(model).at_dtype("float64")
    for rigor, x in (("float64", x_all), ("float32", x_all[16:])):
        ref = lin.forward(x).neurons.piece.numpy()
        cert = keras_roll.certify(model, x, norms=(2,), verbose=False, rigor=rigor)
        u, r = cert.binding_direction("l2"), cert.margins["l2"]
        t = np.linalg.norm(cert.boundary_point(2) - x, axis=1)
        live = r > 0
        assert live.sum() >= len(x) // 3
        assert np.all(t[live] >= r[live] * (1 - 1e-4))
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
