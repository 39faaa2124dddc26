"""Margins and stability bounds (keras_roll.certification) against independent
references: plane geometry on hand-built 2-D networks, tf.GradientTape Jacobians
of Keras-visible pre-activations, pattern sampling inside the certified balls,
and the bisection search on the real network."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll import testing
from keras_roll.certification.margin_math import directional_margins, margins_from_norms
from keras_roll.certification.margins import certify, l2_margins, lp_margins
from keras_roll.certification.stability import stability_bounds
from keras_roll.geometry import dual_norm
from tests import model_zoo as zoo

NORMS = (1, 2, np.inf)

# --------------------------------------------------------------------------- helpers


def relu_net_2d(kernel, bias, second=None, dtype="float64", out=2):
    """Input(2) -> Dense('hidden', relu) [-> Dense('hidden2', relu)] -> Dense('out')."""
    kernel, bias = np.asarray(kernel, dtype), np.asarray(bias, dtype)
    inp = keras.Input((2,), dtype=dtype)
    hidden = keras.layers.Dense(kernel.shape[1], activation="relu", name="hidden", dtype=dtype)
    h = hidden(inp)
    layers = [(hidden, kernel, bias)]
    if second is not None:
        k2, b2 = np.asarray(second[0], dtype), np.asarray(second[1], dtype)
        hidden2 = keras.layers.Dense(k2.shape[1], activation="relu", name="hidden2",
                                     dtype=dtype)
        h = hidden2(h)
        layers.append((hidden2, k2, b2))
    o = keras.layers.Dense(out, name="out", dtype=dtype)
    y = o(h)
    model = keras.Model(inp, y)
    for layer, k, b in layers:
        layer.set_weights([k, b])
    rng = np.random.default_rng(1)
    o.set_weights([rng.normal(size=o.kernel.shape), np.zeros(out)])
    return model


def hit_times(x, w, b, d):
    """Positive t at which x + t d meets the line w . x' + b = 0 (inf if never)."""
    z, rate = w @ x + b, w @ d
    if rate == 0:
        return np.inf
    t = -z / rate
    return t if t > 0 else np.inf


def geometric_distance(x, w, b, p):
    """lp distance from x to the line w . x' + b = 0, by plane geometry.

    l2: length of the perpendicular to the foot point. l_inf / l1: the growing
    square / diamond first touches a line at one of its vertices, so the
    distance is the first hit along the diagonal / axis rays.
    """
    if p == 2:
        foot = x - (w @ x + b) * w / (w @ w)
        return float(np.sqrt(np.sum((foot - x) ** 2)))
    if p == np.inf:
        rays = [np.array([s1, s2], float) for s1 in (1, -1) for s2 in (1, -1)]
    else:
        rays = [np.array(r, float) for r in ((1, 0), (-1, 0), (0, 1), (0, -1))]
    return min(hit_times(x, w, b, r) for r in rays)


def preactivation_model(model, names):
    """A Keras model returning the (Keras-visible) inputs of the ReLU layers."""
    return keras.Model(model.input, [model.get_layer(n).output for n in names])


def tape_jacobian(sub, x):
    """Pre-activations [B, N] and their input Jacobian [B, N, D] by tf.GradientTape."""
    values, jac = testing.tape_jacobian(lambda t: sub(t, training=False), np.asarray(x))
    return values.astype(np.float64), jac.astype(np.float64)


def brute_margins(z, jac, p, valid=None):
    """min_j |z_j| / ||g_j||_q for ReLU neurons, by numpy (never-binding if g = 0)."""
    q = {1: np.inf, 2: 2, np.inf: 1}[p]
    gn = np.linalg.norm(jac, ord=q, axis=2)
    ok = gn > 0 if valid is None else (gn > 0) & valid
    ratio = np.where(ok, np.abs(z) / np.where(ok, gn, 1), np.inf)
    return ratio.min(1), ratio.argmin(1)


def ball_samples(rng, p, dim, n):
    """Points of the unit lp ball: n random interior points, n on the 0.999 sphere and
    the sphere's vertices (l1, l_inf)."""
    if p == 2:
        u = rng.normal(size=(2 * n, dim))
        u /= np.linalg.norm(u, axis=1, keepdims=True)
        r = np.concatenate([rng.uniform(size=n) ** (1 / dim), np.full(n, 0.999)])
        return u * r[:, None]
    if p == np.inf:
        inner = rng.uniform(-1, 1, size=(n, dim))
        corners = 0.999 * rng.choice([-1.0, 1.0], size=(n, dim))
        return np.concatenate([inner, corners])
    s = rng.exponential(size=(2 * n, dim)) * rng.choice([-1.0, 1.0], size=(2 * n, dim))
    s /= np.abs(s).sum(1, keepdims=True)
    r = np.concatenate([rng.uniform(size=n) ** (1 / dim), np.full(n, 0.999)])
    vertices = 0.999 * np.concatenate([np.eye(dim), -np.eye(dim)])
    return np.concatenate([s * r[:, None], vertices])


def steepest_unit(g, z, p):
    """Unit lp vector moving z toward 0 fastest (independent of keras_roll)."""
    s = -np.sign(z)
    if p == 2:
        return s * g / np.linalg.norm(g)
    if p == np.inf:
        return s * np.sign(g)
    u = np.zeros_like(g)
    i = np.argmax(np.abs(g))
    u[i] = s * np.sign(g[i])
    return u


# --------------------------------------------------------------------------- hand-built 2-D

LINES_W = np.array([[1.0, 2.0], [-3.0, 1.0], [0.5, -0.5]])  # rows: w_j
LINES_B = np.array([-1.0, 0.5, 2.0])
POINTS = np.array([[0.3, 0.9], [2.0, -1.0], [-1.5, 0.25], [0.1, -2.5]])


@functools.cache
def lines_net():
    """`relu_net_2d` over the three lines, built once for the tests that only read it."""
    return relu_net_2d(LINES_W.T, LINES_B)


@pytest.mark.parametrize("p", NORMS)
def test_hand_built_margins_match_plane_geometry(p):
    model = lines_net()
    cert = certify(model, POINTS, norms=NORMS, verbose=False)
    for i, x in enumerate(POINTS):
        dists = [geometric_distance(x, w, b, p) for w, b in zip(LINES_W, LINES_B)]
        assert cert.margins[p][i] == pytest.approx(min(dists), rel=1e-12)
        assert cert.binding[p][i] == ("hidden", int(np.argmin(dists)))
        assert cert.binding_index[p][i] == int(np.argmin(dists))


def test_hand_built_directional_margins():
    model = lines_net()
    rng = np.random.default_rng(0)
    dirs = rng.normal(size=(len(POINTS), 5, 2))
    dirs[:, 0] = [1.0, 0.0]
    cert = certify(model, POINTS, norms=(), directions=dirs, verbose=False)
    for i, x in enumerate(POINTS):
        for k, d in enumerate(dirs[i]):
            hits = [hit_times(x, w, b, d) for w, b in zip(LINES_W, LINES_B)]
            assert cert.directional[i, k] == pytest.approx(min(hits), rel=1e-12)
            want = int(np.argmin(hits)) if np.isfinite(min(hits)) else -1
            assert cert.directional_index[i, k] == want


def test_two_layers_hand_built():
    """hidden = relu(x); hidden2 = relu(h1 + h2 - 3.5). Inside the region of (1, 2)
    the second-layer neuron is the line x1 + x2 = 3.5; inside that of (-1, 2) the
    first unit is dead and it is the line x2 = 3.5."""
    model = relu_net_2d(np.eye(2), [0.0, 0.0], second=([[1.0], [1.0]], [-3.5]))
    cases = [
        (np.array([1.0, 2.0]), [((1, 0), 0), ((0, 1), 0), ((1, 1), -3.5)]),
        (np.array([-1.0, 2.0]), [((1, 0), 0), ((0, 1), 0), ((0, 1), -3.5)]),
    ]
    cert = certify(model, np.stack([c[0] for c in cases]), verbose=False)
    names = [("hidden", 0), ("hidden", 1), ("hidden2", 0)]
    for i, (x, lines) in enumerate(cases):
        for p in NORMS:
            dists = [geometric_distance(x, np.array(w, float), b, p) for w, b in lines]
            assert cert.margins[p][i] == pytest.approx(min(dists), rel=1e-12)
            assert cert.binding[p][i] == names[int(np.argmin(dists))]
    assert cert.margins[2][0] == pytest.approx(0.5 / np.sqrt(2), rel=1e-12)  # by hand
    assert cert.margins[2][1] == pytest.approx(1.0, rel=1e-12)


def test_neuron_on_breakpoint_gives_zero():
    model = lines_net()
    x = np.array([[1.0, 0.0]])  # z_0 = 1 + 0 - 1 = 0 exactly, g_0 = (1, 2)
    d = np.array([[[1.0, 0.0], [-1.0, 0.0]]])
    cert = certify(model, x, directions=d, verbose=False)
    for p in NORMS:
        assert cert.margins[p][0] == 0.0
        assert cert.binding[p][0] == ("hidden", 0)
    # Moving up the gradient leaves the piece z <= 0 at once; moving down stays in it,
    # so there the other two lines bind.
    assert cert.directional[0, 0] == 0.0
    others = [hit_times(x[0], w, b, d[0, 1]) for w, b in zip(LINES_W[1:], LINES_B[1:])]
    assert cert.directional[0, 1] == pytest.approx(min(others), rel=1e-12)
    assert cert.directional_index[0, 1] == 1 + int(np.argmin(others))
    cb = certify(model, x, directions=d, method="bisect", verbose=False)
    for p in NORMS:
        assert cb.margins[p][0] == pytest.approx(0.0, abs=1e-12)
    assert cb.directional[0, 0] == pytest.approx(0.0, abs=1e-12)
    assert cb.directional[0, 1] == pytest.approx(cert.directional[0, 1], rel=1e-4)


def test_zero_gradient_neurons_never_bind():
    """A unit with zero weights sits on its breakpoint (z = 0) with g = 0: 0/0 = inf."""
    kernel = np.concatenate([LINES_W.T, np.zeros((2, 1))], axis=1)
    bias = np.concatenate([LINES_B, [0.0]])
    cert = certify(relu_net_2d(kernel, bias), POINTS, verbose=False)
    ref = certify(lines_net(), POINTS, verbose=False)
    for p in NORMS:
        np.testing.assert_array_equal(cert.margins[p], ref.margins[p])
        assert np.all(cert.binding_index[p] != 3)


def test_all_neurons_constant_gives_infinite_margins():
    model = relu_net_2d(np.zeros((2, 2)), [1.0, -1.0])
    d = np.ones((2, 1, 2))
    cert = certify(model, POINTS[:2], directions=d, verbose=False)
    for p in NORMS:
        assert np.all(np.isinf(cert.margins[p]))
        assert cert.binding[p] == [None, None]
        np.testing.assert_array_equal(cert.binding_index[p], [-1, -1])
    assert np.all(np.isinf(cert.directional))
    np.testing.assert_array_equal(cert.directional_index, -1)
    cb = certify(model, POINTS[:2], directions=d, method="bisect", verbose=False)
    assert np.all(np.isinf(cb.margins[2])) and np.all(np.isinf(cb.directional))


def test_dual_norm_over_axes_and_its_gradient():
    """The one dual norm serves certificates (one axis, numpy) and CROWN (trailing axes,
    differentiated in training): numpy's norms, and tf.GradientTape's gradient of the
    plain formula, with a finite gradient at 0 for the l2 norm."""
    g = np.random.default_rng(0).normal(size=(2, 3, 4, 5))
    flat = g.reshape(2, 3, -1)
    for p, q in ((2, 2), (1, np.inf), (np.inf, 1)):
        got = dual_norm(g, p, axis=(2, 3)).numpy()
        np.testing.assert_allclose(got, np.linalg.norm(flat, ord=q, axis=-1), rtol=1e-12)
    t = tf.constant(g)
    for p, plain in ((np.inf, lambda v: tf.reduce_sum(tf.abs(v), (2, 3))),
                     (2, lambda v: tf.sqrt(tf.reduce_sum(v * v, (2, 3))))):
        w = tf.constant(np.arange(6.0).reshape(2, 3))
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(t)
            ours, ref = dual_norm(t, p, axis=(2, 3)) * w, plain(t) * w
        np.testing.assert_allclose(tape.gradient(ours, t), tape.gradient(ref, t), rtol=1e-12)
    zero = tf.zeros((1, 3))
    with tf.GradientTape() as tape:
        tape.watch(zero)
        out = dual_norm(zero, 2)
    assert out.numpy().tolist() == [0.0]
    assert np.all(np.isfinite(tape.gradient(out, zero).numpy()))


def test_pure_functions_by_hand():
    g = np.array([[3.0, -4.0], [0.0, 0.0], [1.0, 1.0]])
    assert dual_norm(g, 2).numpy().tolist() == [5.0, 0.0, np.sqrt(2.0)]
    assert dual_norm(g, 1).numpy().tolist() == [4.0, 0.0, 1.0]
    assert dual_norm(g, np.inf).numpy().tolist() == [7.0, 0.0, 2.0]
    eps, j = margins_from_norms([[1.0, 0.0, 0.5]], [[5.0, 0.0, 2.0]])
    assert eps.numpy().tolist() == [0.2] and j.numpy().tolist() == [0]
    eps, j = margins_from_norms([[1.0, 0.0, 0.5]], [[5.0, 0.0, 2.0]],
                                valid=[[False, True, True]])
    assert eps.numpy().tolist() == [0.25] and j.numpy().tolist() == [2]
    eps, j = margins_from_norms([[0.0]], [[0.0]])
    assert np.isinf(eps.numpy()[0]) and j.numpy()[0] == -1
    # rates r: above / r if r > 0, below / |r| if r < 0, never if r == 0
    e, j = directional_margins([[[2.0, -1.0, 0.0]]], [[1.0, 3.0, 0.0]], [[4.0, np.inf, 0.0]])
    assert e.numpy().tolist() == [[2.0]] and j.numpy().tolist() == [[0]]
    e, j = directional_margins([[[-2.0, 0.0]]], [[np.inf, 1.0]], [[1.0, 0.0]])
    assert np.isinf(e.numpy()[0, 0]) and j.numpy()[0, 0] == -1


# --------------------------------------------------------------------------- zoo references


@pytest.fixture(scope="module")
def mlp_case():
    model = zoo.mlp(fused=False)
    x = np.random.default_rng(0).normal(size=(6, 6)).astype("float32")
    return model, keras_roll.linearize(model), x


def test_margins_match_dense_jacobian_and_gradient_tape(mlp_case):
    model, lin, x = mlp_case
    cert = certify(lin, x, verbose=False, rigor="float32")  # the float32 twin's closed form
    sound = certify(lin, x, verbose=False)  # float64, shrunk by the rounding bound
    names = lin.neuron_names_for(x)
    # reference 1: lin.jacobian (the twin, not streamed)
    jac = lin.jacobian(x).astype(np.float64)
    n = lin.forward(x).neurons
    dist = np.minimum(n.below.numpy(), n.above.numpy()).astype(np.float64)
    # reference 2: tf.GradientTape through the Keras graph of the ReLU inputs
    z, tape_jac = tape_jacobian(preactivation_model(model, ["dense0", "dense1"]), x)
    np.testing.assert_allclose(jac, tape_jac, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dist, np.abs(z), rtol=1e-5, atol=1e-6)
    for p in NORMS:
        q = {1: np.inf, 2: 2, np.inf: 1}[p]
        gn = np.linalg.norm(jac, ord=q, axis=2)
        twin_ref = np.where(gn > 0, dist / np.where(gn > 0, gn, 1), np.inf).min(1)
        np.testing.assert_allclose(cert.margins[p], twin_ref, rtol=1e-6)
        tape_ref, tape_j = brute_margins(z, tape_jac, p)
        np.testing.assert_allclose(cert.margins[p], tape_ref, rtol=1e-4)
        np.testing.assert_allclose(sound.margins[p], tape_ref, rtol=1e-3)
        assert np.all(sound.margins[p] <= tape_ref * (1 + 1e-5))
        tape_names = [("relu0", int(j)) if j < 8 else ("relu1", int(j) - 8) for j in tape_j]
        assert cert.binding[p] == tape_names == sound.binding[p]
        assert [names[j] for j in cert.binding_index[p]] == cert.binding[p]


def test_streaming_in_small_chunks_changes_nothing_float32():
    """The default-suite part of the test below: chunks of axes and of examples give
    the same margins, bindings and bounds in the twin's own float32 arithmetic."""
    model = zoo.cnn()
    x = np.random.default_rng(3).uniform(0, 4, size=(3, 8, 8, 2)).astype("float32")
    d = np.random.default_rng(4).normal(size=(3, 4, 8, 8, 2))
    lin = keras_roll.linearize(model)
    # 3 axis chunks per batch of 2 (the slow float64 test below takes 10, at 200_000)
    small = {"batch_size": 2, "memory_budget": 800_000, "verbose": False}
    chunks = [(c[0], c[2]) for c in lin.iter_axis_chunks(x, batch_size=2,
                                                           memory_budget=800_000)]
    assert len({sl.start for sl, _ in chunks}) == 2 and len({s for _, s in chunks}) > 2
    big = certify(lin, x, directions=d, verbose=False, rigor="float32")
    got = certify(lin, x, directions=d, rigor="float32", **small)
    for p in NORMS:
        np.testing.assert_allclose(got.margins[p], big.margins[p], rtol=1e-5)
        np.testing.assert_array_equal(got.binding_index[p], big.binding_index[p])
    np.testing.assert_allclose(got.directional, big.directional, rtol=1e-5)
    sb_big = stability_bounds(lin, x, verbose=False, rigor="float32")
    sb_small = stability_bounds(lin, x, rigor="float32", **small)
    np.testing.assert_allclose(sb_small.upper, sb_big.upper, rtol=1e-5)
    np.testing.assert_allclose(sb_small.lower, sb_big.lower, rtol=1e-5)


@pytest.mark.slow  # the float64 guards over many small chunks (each costs seconds)
def test_streaming_in_small_chunks_changes_nothing():
    model = zoo.cnn()
    x = np.random.default_rng(3).uniform(0, 4, size=(3, 8, 8, 2)).astype("float32")
    d = np.random.default_rng(4).normal(size=(3, 4, 8, 8, 2))
    lin = keras_roll.linearize(model)
    chunks = [(c[0], c[2]) for c in lin.iter_axis_chunks(x, batch_size=2,
                                                           memory_budget=200_000)]
    assert len({sl.start for sl, _ in chunks}) == 2 and len({s for _, s in chunks}) > 2
    big = certify(lin, x, directions=d, verbose=False)
    small = certify(lin, x, directions=d, batch_size=2, memory_budget=200_000, verbose=False)
    for p in NORMS:
        np.testing.assert_allclose(small.margins[p], big.margins[p], rtol=1e-5)
        np.testing.assert_array_equal(small.binding_index[p], big.binding_index[p])
    np.testing.assert_allclose(small.directional, big.directional, rtol=1e-5)
    sb_big = stability_bounds(lin, x, verbose=False)
    sb_small = stability_bounds(lin, x, batch_size=2, memory_budget=200_000, verbose=False)
    np.testing.assert_allclose(sb_small.upper, sb_big.upper, rtol=1e-5)
    np.testing.assert_allclose(sb_small.lower, sb_big.lower, rtol=1e-5)
    # and the stream agrees with the dense Jacobian
    jac = lin.jacobian(x).astype(np.float64)
    n = lin.forward(x).neurons
    dist = np.minimum(n.below.numpy(), n.above.numpy()).astype(np.float64)
    gn = np.linalg.norm(jac, axis=2)
    ok = (gn > 0) & n.valid.numpy()
    ref = np.where(ok, dist / np.where(ok, gn, 1), np.inf).min(1)
    small32 = certify(lin, x, norms=(2,), batch_size=2, memory_budget=200_000, verbose=False,
                      rigor="float32")
    np.testing.assert_allclose(small32.margins[2], ref, rtol=1e-5)
    assert np.all(small.margins[2] <= ref * (1 + 1e-5))  # float64 rigor only shrinks


def test_masked_rnn_ignores_padded_steps():
    model = zoo.rnn()
    x, lengths = zoo.padded_sequences()
    lin = keras_roll.linearize(model)
    cert = certify(lin, x, verbose=False, rigor="float32")  # the float32 closed form
    valid = lin.forward(x).neurons.valid.numpy()
    assert not valid.all()  # the fixture does pad
    jac = lin.jacobian(x).astype(np.float64)
    n = lin.forward(x).neurons
    dist = np.minimum(n.below.numpy(), n.above.numpy()).astype(np.float64)
    for p in NORMS:
        q = {1: np.inf, 2: 2, np.inf: 1}[p]
        gn = np.linalg.norm(jac, ord=q, axis=2)
        ok = (gn > 0) & valid
        ref = np.where(ok, dist / np.where(ok, gn, 1), np.inf).min(1)
        np.testing.assert_allclose(cert.margins[p], ref, rtol=1e-5)
        j = cert.binding_index[p]
        assert valid[np.arange(len(j)), j].all()


# l2 by default: the l1 and l_inf margins are checked exactly against plane geometry
# (test_hand_built_margins_match_plane_geometry) and the tape (test_margins_match_dense_*)
@pytest.mark.parametrize("p", [pytest.param(1, marks=pytest.mark.slow), 2,
                               pytest.param(np.inf, marks=pytest.mark.slow)])
def test_certified_balls_are_sound_by_sampling(p):
    model = zoo.mlp(fused=False, dtype="float64", seed=2)
    sub = preactivation_model(model, ["dense0", "dense1"])
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4, 6))
    cert = certify(model, x, norms=(p,), verbose=False)
    z, jac = tape_jacobian(sub, x)
    for i in range(len(x)):
        r = cert.margins[p][i]
        assert 0 < r < np.inf
        pts = x[i] + r * ball_samples(rng, p, 6, 300)
        inside = np.concatenate([o.numpy().reshape(len(pts), -1) for o in sub(pts)], 1)
        assert np.all((inside > 0) == (z[i] > 0)), "a point of the certified ball left the region"
        j = cert.binding_index[p][i]
        u = steepest_unit(jac[i, j], z[i, j], p)
        assert np.linalg.norm(u, ord=p) == pytest.approx(1.0)
        out = np.concatenate([o.numpy().reshape(1, -1) for o in sub(x[i] + 1.01 * r * u[None])], 1)
        assert np.any((out[0] > 0) != (z[i] > 0)), "just past the radius the pattern must change"


def test_fused_and_split_activations_agree():
    fused, split = zoo.mlp(fused=True, seed=0), zoo.mlp(fused=False, seed=0)
    for a, b in zip(fused.get_weights(), split.get_weights()):
        np.testing.assert_array_equal(a, b)  # same seed, same weights
    x = np.random.default_rng(7).normal(size=(8, 6)).astype("float32")
    d = np.random.default_rng(8).normal(size=(8, 3, 6))
    cf = certify(fused, x, directions=d, verbose=False)
    cs = certify(split, x, directions=d, verbose=False)
    rename = {"dense0": "relu0", "dense1": "relu1"}
    for p in NORMS:
        np.testing.assert_allclose(cf.margins[p], cs.margins[p], rtol=1e-6)
        assert [(rename[n], u) for n, u in cf.binding[p]] == cs.binding[p]
    np.testing.assert_allclose(cf.directional, cs.directional, rtol=1e-6)


# --------------------------------------------------------------------------- bisection


@pytest.mark.parametrize("which", ["mlp", pytest.param("cnn", marks=pytest.mark.slow)])
def test_bisection_agrees_with_analytic(which):
    rng = np.random.default_rng(11)
    if which == "mlp":
        model, x = zoo.mlp(), rng.normal(size=(4, 6)).astype("float32")
    else:
        model, x = zoo.cnn(), rng.uniform(0, 4, size=(2, 8, 8, 2)).astype("float32")
    lin = keras_roll.linearize(model)
    d = rng.normal(size=(x.shape[0], 3, *x.shape[1:]))
    # The closed forms against the search, both on the float32 twin ...
    ca = certify(lin, x, directions=d, verbose=False, rigor="float32")
    cb = certify(lin, x, directions=d, method="bisect", bisect_tol=1e-5, verbose=False,
                 rigor="float32")
    sound = certify(lin, x, directions=d, verbose=False)  # ... and rigor float64 inside
    assert cb.method == "bisect"
    for p in NORMS:
        assert np.all(np.isfinite(ca.margins[p]))
        np.testing.assert_allclose(cb.margins[p], ca.margins[p], rtol=1e-3)
        assert np.all(sound.margins[p] <= cb.margins[p] * (1 + 1e-4))
        np.testing.assert_allclose(sound.margins[p], cb.margins[p], rtol=0.1)
    np.testing.assert_array_equal(cb.binding_index[2], ca.binding_index[2])
    np.testing.assert_allclose(cb.directional, ca.directional, rtol=1e-3)
    np.testing.assert_array_equal(cb.directional_index, ca.directional_index)
    sa = stability_bounds(lin, x, verbose=False, rigor="float32")
    sb = stability_bounds(lin, x, method="bisect", bisect_tol=1e-5, verbose=False,
                          rigor="float32")
    sound = stability_bounds(lin, x, verbose=False)
    assert np.all(sound.upper <= sb.upper * (1 + 1e-4) + 1e-12)
    assert np.all(sound.lower >= sb.lower * (1 + 1e-4) - 1e-12)
    for a, b in ((sa.upper, sb.upper), (sa.lower, sb.lower)):
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
        fin = np.isfinite(a)
        assert fin.mean() > 0.5
        np.testing.assert_allclose(b[fin], a[fin], rtol=1e-3)
    assert np.all(sa.upper >= 0) and np.all(sa.lower <= 0)
    assert np.mean(sa.upper_index == sb.upper_index) > 0.95


def test_stability_bounds_hand_built():
    model = lines_net()
    sb = stability_bounds(model, POINTS, verbose=False)
    assert sb.upper.shape == POINTS.shape
    for i, x in enumerate(POINTS):
        for k in range(2):
            e = np.eye(2)[k]
            up = min(hit_times(x, w, b, e) for w, b in zip(LINES_W, LINES_B))
            down = min(hit_times(x, w, b, -e) for w, b in zip(LINES_W, LINES_B))
            assert sb.upper[i, k] == pytest.approx(up, rel=1e-12)
            assert sb.lower[i, k] == pytest.approx(-down, rel=1e-12)


# --------------------------------------------------------------------------- API


def test_lp_and_l2_margins_shortcuts(mlp_case):
    _, lin, x = mlp_case
    cert = certify(lin, x, verbose=False)
    np.testing.assert_array_equal(l2_margins(lin, x), cert.margins[2])
    np.testing.assert_array_equal(lp_margins(lin, x, p="inf"), cert.margins[np.inf])


def test_summary_and_repr(mlp_case):
    _, lin, x = mlp_case
    cert = certify(lin, x, directions=np.ones((3, 6)), verbose=False)
    lines = []
    cert.summary(print_fn=lines.append)
    text = "\n".join(lines)
    for word in ("P25", "P50", "P75", "P100", "l1 ball", "l2 ball", "linf ball",
                 "directional (K=3)"):
        assert word in text
    row = next(line for line in text.splitlines() if line.startswith("l2 ball"))
    assert f"{np.percentile(cert.margins[2], 50):.4g}" in row
    assert f"{cert.margins[2].max():.4g}" in row
    assert "n=6" in repr(cert) and "analytic" in repr(cert)
    stability_bounds(lin, x, verbose=False).summary(print_fn=lines.append)
    assert "width" in lines[-1]


def test_norms_are_normalised(mlp_case):
    _, lin, x = mlp_case
    cert = certify(lin, x, norms=[2.0, "inf", 2], verbose=False)
    assert cert.norms == (2, np.inf)
    assert cert.margins[float("inf")] is cert.margins[np.inf]


@pytest.mark.parametrize("bad", [3, 0, "l3", True, [1, 5], -np.inf])
def test_bad_norms_are_rejected_with_their_value(mlp_case, bad):
    _, lin, x = mlp_case
    with pytest.raises(ValueError, match="norm"):
        certify(lin, x, norms=bad)
    with pytest.raises(ValueError) as err:
        certify(lin, x, norms=bad)
    shown = bad[-1] if isinstance(bad, list) else bad
    assert repr(shown) in str(err.value)


def test_bad_inputs(mlp_case):
    _, lin, x = mlp_case
    nan = x.copy()
    nan[1, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        certify(lin, nan)
    with pytest.raises(ValueError, match="shape"):
        certify(lin, x[:, :5])
    with pytest.raises(ValueError, match="shape"):
        stability_bounds(lin, x[None])
    with pytest.raises(ValueError, match=r"\[6, K, 6\].*\(6, 2, 5\)"):
        certify(lin, x, directions=np.ones((6, 2, 5)))
    with pytest.raises(ValueError, match="'newton'"):
        certify(lin, x, method="newton")
    with pytest.raises(ValueError, match="bisect_tol"):
        certify(lin, x, method="bisect", bisect_tol=0)
    with pytest.raises(ValueError, match="batch_size"):
        certify(lin, x, batch_size=0)
    with pytest.raises(ValueError, match="non-finite"):
        certify(lin, x, directions=np.full((6, 1, 6), np.inf))


def test_empty_input_is_an_error(mlp_case):
    _, lin, _ = mlp_case
    empty = np.zeros((0, 6), "float32")
    for run in (lambda: certify(lin, empty, directions=np.zeros((0, 2, 6)), verbose=False),
                lambda: stability_bounds(lin, empty, verbose=False),
                lambda: l2_margins(lin, empty),
                lambda: certify(lin, iter([]), verbose=False)):
        with pytest.raises(ValueError, match="no examples"):
            run()


def test_progress_bar_is_shown_when_asked(mlp_case, capsys):
    _, lin, x = mlp_case
    certify(lin, x, verbose=True)
    assert "certify" in capsys.readouterr().err
    certify(lin, x, verbose=False)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="'loud'"):
        certify(lin, x, verbose="loud")


def test_affine_model_has_a_single_unbounded_region():
    inp = keras.Input((3,))
    model = keras.Model(inp, keras.layers.Dense(2)(inp))
    x = np.arange(6, dtype="float32").reshape(2, 3)
    for method in ("analytic", "bisect"):
        cert = certify(model, x, directions=np.ones((2, 1, 3)), method=method, verbose=False)
        for p in NORMS:
            assert np.all(np.isinf(cert.margins[p])) and cert.binding[p] == [None, None]
        assert np.all(np.isinf(cert.directional))
        np.testing.assert_allclose(cert.logits, model.predict(x, verbose=0), rtol=1e-6)
        sb = stability_bounds(model, x, method=method, verbose=False)
        assert np.all(sb.upper == np.inf) and np.all(sb.lower == -np.inf)
