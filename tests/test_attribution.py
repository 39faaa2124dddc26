"""Saliency, its certified radius, and exact integrated gradients, against
tf.GradientTape gradients of the Keras model, hand-computed networks and a
brute-force scan of activation patterns along the path."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.attribution import (
    integrated_gradients,
    postprocess_saliency,
    saliency,
    stable_radius,
)


def _model(dtype="float64", in_dim=8, width=12, out=3, seed=0, bias_std=0.5):
    keras.utils.set_random_seed(seed)
    bias = keras.initializers.RandomNormal(stddev=bias_std)
    inp = keras.Input((in_dim,), dtype=dtype)
    h = keras.layers.Dense(width, activation="relu", bias_initializer=bias, dtype=dtype)(inp)
    h = keras.layers.Dense(width, bias_initializer=bias, dtype=dtype)(h)
    h = keras.layers.LeakyReLU(0.1, dtype=dtype)(h)
    logits = keras.layers.Dense(out, bias_initializer=bias, dtype=dtype)(h)
    probs = keras.layers.Activation("softmax", dtype=dtype)(logits)
    return keras.Model(inp, probs), keras.Model(inp, logits)


def _tape_gradients(logits_model, x, y):
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        sel = tf.reduce_sum(tf.gather(logits_model(xt), y, axis=1, batch_dims=1))
    return tape.gradient(sel, xt).numpy()


@pytest.fixture(scope="module")
def setup():
    model, logits_model = _model()
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, size=(4, 8))
    y = np.array([0, 1, 2, 1])
    return model, logits_model, x, y


# ---------------------------------------------------------------------- saliency


def test_saliency_is_the_tape_gradient_of_the_label_logit(setup):
    model, logits_model, x, y = setup
    sal = saliency(model, x, y)
    np.testing.assert_allclose(sal.gradient, _tape_gradients(logits_model, x, y), rtol=1e-12)
    assert sal.maps is sal.gradient and not sal.postprocessed
    np.testing.assert_array_equal(sal.labels, y)
    pred = logits_model(x).numpy().argmax(axis=1)
    np.testing.assert_array_equal(saliency(model, x).labels, pred)


def test_exported_from_keras_roll():
    assert keras_roll.saliency is saliency and keras_roll.stable_radius is stable_radius
    assert keras_roll.integrated_gradients is integrated_gradients
    assert keras_roll.gradient_distortion.__module__ == "keras_roll.attribution.distortion"
    assert {"Saliency", "IntegratedGradients", "Distortion", "plots"} <= set(keras_roll.__all__)


def test_single_sigmoid_output_takes_binary_labels():
    keras.utils.set_random_seed(3)
    inp = keras.Input((4,), dtype="float64")
    h = keras.layers.Dense(5, activation="relu", dtype="float64",
                           bias_initializer=keras.initializers.RandomNormal(stddev=0.5))(inp)
    logit = keras.layers.Dense(1, dtype="float64")(h)
    model = keras.Model(inp, keras.layers.Activation("sigmoid", dtype="float64")(logit))
    logits_model = keras.Model(inp, logit)
    x = np.random.default_rng(0).uniform(-1, 1, (3, 4))
    g = _tape_gradients(logits_model, x, np.zeros(3, int))
    sal = saliency(model, x, np.array([1, 0, 1]))
    np.testing.assert_allclose(sal.gradient, g * np.array([[1.0], [-1.0], [1.0]]))
    np.testing.assert_array_equal(sal.labels, [1, 0, 1])
    pred = (logits_model(x).numpy()[:, 0] > 0).astype(int)
    np.testing.assert_array_equal(saliency(model, x).labels, pred)
    ig = integrated_gradients(model, x, np.array([0, 1, 0]), verbose=False)
    np.testing.assert_array_equal(ig.labels, [0, 1, 0])
    np.testing.assert_allclose(ig.f_x, logits_model(x).numpy()[:, 0] * [-1, 1, -1])


def test_postprocess_follows_appendix_k():
    g = np.zeros((1, 2, 2, 2))
    g[0, :, :, 0] = [[1.0, -4.0], [2.0, 0.5]]
    g[0, :, :, 1] = [[1.0, 1.0], [-5.0, 0.5]]
    g_copy = g.copy()
    # sum over channels: [[2, -3], [-3, 1]]; |.|: [[2, 3], [3, 1]]; p99 of {1, 2, 3, 3} = 3
    want = np.array([[[2 / 3, 1.0], [1.0, 1 / 3]]])
    np.testing.assert_allclose(postprocess_saliency(g), want)
    np.testing.assert_array_equal(g, g_copy)
    # values above the 99th percentile (99.01 for 1, 2, ..., 100) are clipped to 1
    v = -np.arange(1.0, 101.0)[None]
    out = postprocess_saliency(v)
    np.testing.assert_allclose(out[0], np.minimum(np.arange(1.0, 101.0) / 99.01, 1.0))
    assert out[0, -1] == 1.0 and out[0, -2] < 1.0
    assert postprocess_saliency(np.zeros((2, 3))).max() == 0.0
    assert postprocess_saliency(g, channel_axis=None).shape == (1, 2, 2, 2)
    with pytest.raises(ValueError, match="channel_axis"):
        postprocess_saliency(g, channel_axis=5)


def test_saliency_postprocess_on_images():
    keras.utils.set_random_seed(0)
    inp = keras.Input((5, 5, 3))
    h = keras.layers.Conv2D(4, 3, activation="relu",
                            bias_initializer=keras.initializers.RandomNormal(stddev=0.2))(inp)
    out = keras.layers.Dense(2)(keras.layers.Flatten()(h))
    model = keras.Model(inp, out)
    x = np.random.default_rng(0).uniform(0, 1, (2, 5, 5, 3)).astype("float32")
    sal = saliency(model, x, np.array([0, 1]), postprocess=True)
    assert sal.maps.shape == (2, 5, 5) and sal.postprocessed
    assert sal.maps.min() >= 0 and sal.maps.max() == 1.0
    np.testing.assert_allclose(sal.maps, postprocess_saliency(sal.gradient))


def test_radius_certifies_an_unchanged_saliency_map(setup):
    model, logits_model, x, y = setup
    sal = saliency(model, x, y, radius=True, verbose=False)
    cert = keras_roll.certify(model, x, norms=(2, np.inf), verbose=False)
    for p in (2, np.inf):
        np.testing.assert_array_equal(sal.radius[p], cert.margins[p])
    np.testing.assert_array_equal(stable_radius(model, x, verbose=False)[2], cert.margins[2])
    rng = np.random.default_rng(1)
    for i in range(len(x)):
        r2, rinf = sal.radius[2][i], sal.radius[np.inf][i]
        assert 0 < r2 < np.inf
        u = rng.normal(size=(200, x.shape[1]))
        inside_l2 = x[i] + 0.999 * r2 * u / np.linalg.norm(u, axis=1, keepdims=True)
        inside_linf = x[i] + 0.999 * rinf * rng.uniform(-1, 1, size=(200, x.shape[1]))
        for pts in (inside_l2, inside_linf):
            g = _tape_gradients(logits_model, pts, np.full(200, y[i]))
            np.testing.assert_allclose(g, np.broadcast_to(sal.gradient[i], g.shape),
                                       rtol=1e-9, atol=1e-12)
    # beyond the margin, along the binding direction, the map changes for some example
    far = x + 3 * sal.radius[np.inf][:, None] * np.sign(rng.normal(size=x.shape))
    assert not np.allclose(_tape_gradients(logits_model, far, y), sal.gradient)


# ---------------------------------------------------------------------- integrated gradients


def test_exact_integrated_gradients_are_complete_in_float64(setup):
    model, logits_model, x, y = setup
    ig = integrated_gradients(model, x, y, verbose=False)
    f = lambda z: np.take_along_axis(logits_model(z).numpy(), y[:, None], 1)[:, 0]
    gap = f(x) - f(np.zeros_like(x))
    np.testing.assert_allclose(ig.maps.sum(axis=1), gap, rtol=1e-6)
    np.testing.assert_allclose(ig.delta, ig.maps.sum(axis=1) - gap, atol=1e-12)
    np.testing.assert_allclose(ig.f_x, f(x), rtol=1e-12)
    assert np.all(ig.regions >= 4)  # the paths really cross regions
    assert ig.method == "exact" and "IntegratedGradients(n=4" in repr(ig)


def test_region_count_matches_a_brute_force_scan(setup):
    model, _, x, y = setup
    baseline = np.full(x.shape[1], 0.1)
    ig = integrated_gradients(model, x, y, baseline=baseline, verbose=False)
    lin = keras_roll.linearize(model)
    ts = np.linspace(0, 1, 40001)[1:]
    for i in range(len(x)):
        pts = baseline + ts[:, None] * (x[i] - baseline)
        n = lin.forward(pts).neurons
        pattern = np.where(n.valid.numpy(), n.piece.numpy(), -1)
        assert ig.regions[i] == 1 + np.any(pattern[1:] != pattern[:-1], axis=1).sum()


def test_exact_matches_a_fine_tape_midpoint_sum(setup):
    model, logits_model, x, y = setup
    ig = integrated_gradients(model, x, y, verbose=False)
    k = 20000
    alphas = (np.arange(k) + 0.5) / k
    want = np.zeros_like(x)
    for i in range(len(x)):
        g = _tape_gradients(logits_model, alphas[:, None] * x[i], np.full(k, y[i]))
        want[i] = x[i] * g.mean(axis=0)
    err = np.abs(ig.maps - want).max() / np.abs(want).max()
    assert err < 1e-4


def _analytic_walk(model, x, y):
    """An independent region-splitting walk of `_model`'s network in numpy float64 from
    the zero baseline: the breakpoints of the first layer along `t x` are roots of
    affine functions, those of the second layer roots of an affine function on each
    interval between them; each region's gradient is the product of the weights and
    its pattern. Returns `(attributions, regions)`."""
    (w1, b1), (w2, b2), (w3, _) = [model.get_layer(index=i).get_weights() for i in (1, 2, 4)]
    alpha = -float(model.get_layer(index=3)(np.array([[-1.0]])).numpy()[0, 0])  # as computed

    def pre(t, xi):  # the two layers' pre-activations at t x
        z1 = t[:, None] * (xi @ w1) + b1
        return z1, np.maximum(z1, 0) @ w2 + b2

    attributions, regions = np.zeros_like(x), np.zeros(len(x), int)
    for i, xi in enumerate(x):
        roots = -b1 / (xi @ w1)
        edges = np.unique(np.r_[0.0, roots[(roots > 0) & (roots < 1)], 1.0])
        cuts = [edges]
        for a, b in zip(edges[:-1], edges[1:]):
            za, zb = pre(np.array([a, b]), xi)[1]
            t2 = a + (b - a) * za / (za - zb)  # z2 affine on [a, b]
            cuts.append(t2[(t2 > a) & (t2 < b)])
        edges = np.unique(np.concatenate(cuts))
        mid = (edges[:-1] + edges[1:]) / 2
        z1, z2 = pre(mid, xi)
        m1, m2 = (z1 > 0).astype(float), np.where(z2 > 0, 1.0, alpha)
        grads = np.einsum("dh,rh,hk,rk->rd", w1, m1, w2, m2 * w3[:, y[i]])
        attributions[i] = xi * (np.diff(edges) @ grads)
        pattern = np.concatenate([m1, m2], axis=1)
        regions[i] = 1 + np.any(pattern[1:] != pattern[:-1], axis=1).sum()
    return attributions, regions


def test_exact_matches_an_independent_region_splitting_walk(setup):
    model, _, x, y = setup
    ig = integrated_gradients(model, x, y, verbose=False)
    want, regions = _analytic_walk(model, x, y)
    np.testing.assert_allclose(ig.maps, want, rtol=0, atol=1e-12 * np.abs(want).max())
    np.testing.assert_array_equal(ig.regions, regions)


def test_riemann_sum_converges_to_the_exact_integral(setup):
    model, _, x, y = setup
    exact = integrated_gradients(model, x, y, verbose=False).maps
    errors = []
    for k in (4, 40, 400, 4000):
        approx = integrated_gradients(model, x, y, steps=k, verbose=False)
        assert approx.regions is None and approx.method == "riemann"
        errors.append(np.abs(approx.maps - exact).max())
    assert errors[-1] < 1e-3 * np.abs(exact).max()
    assert errors[0] > errors[1] > errors[2] > errors[3]


def _hand_model(dtype="float64"):
    """f(x) = relu(x1) + 2 relu(x2) + relu(x1 - 0.5): boundaries x1 = 0, x2 = 0, x1 = 0.5."""
    inp = keras.Input((2,), dtype=dtype)
    h = keras.layers.Dense(3, activation="relu", dtype=dtype)(inp)
    out = keras.layers.Dense(1, dtype=dtype)(h)
    model = keras.Model(inp, out)
    model.layers[1].set_weights([np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]),
                                 np.array([0.0, 0.0, -0.5])])
    model.layers[2].set_weights([np.array([[1.0], [2.0], [1.0]]), np.zeros(1)])
    return model


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_paths_on_and_along_region_boundaries(dtype):
    model = _hand_model(dtype)
    y = np.zeros(3, int)
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.5, 0.0]], dtype)
    # 1: from (-1, 0) along x2 = 0, across x1 = 0 and x1 = 0.5; 2: starting on the
    # corner (0, 0), along x2 = 0; 3: from (0, 0) to the boundary x1 = 0.5
    base = np.array([[-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype)
    ig = integrated_gradients(model, x, y, baseline=base, verbose=False)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == "float64" else dict(rtol=1e-5, atol=1e-5)
    # by hand: d1 * integral of df/dx1 over t: 2 * (0 * 1/2 + 1 * 1/4 + 2 * 1/4) = 1.5;
    # 1 * (1 * 1/2 + 2 * 1/2) = 1.5; 0.5 * 1 = 0.5; no attribution to x2 (relu'(0) = 0)
    np.testing.assert_allclose(ig.maps, [[1.5, 0.0], [1.5, 0.0], [0.5, 0.0]], **tol)
    np.testing.assert_array_equal(ig.regions, [3, 2, 1])
    np.testing.assert_allclose(ig.delta, 0.0, atol=tol["atol"])
    # the zero baseline of a bias-free first layer: every neuron starts on its breakpoint
    same = integrated_gradients(model, x[1:2], y[:1], verbose=False)
    np.testing.assert_allclose(same.maps, [[1.5, 0.0]], **tol)
    # a path of length zero
    zero = integrated_gradients(model, x[:1], y[:1], baseline=x[0], verbose=False)
    np.testing.assert_array_equal(zero.maps, [[0.0, 0.0]])


def test_many_regions_and_the_region_cap(setup):
    model, _, x, y = setup
    ig = integrated_gradients(model, x[:1], y[:1], verbose=False)
    with pytest.raises(RuntimeError, match="raise max_regions"):
        integrated_gradients(model, x[:1], y[:1], max_regions=int(ig.regions[0]) - 2,
                             verbose=False)


def test_float32_conv_model_is_nearly_complete():
    keras.utils.set_random_seed(0)
    bias = keras.initializers.RandomNormal(stddev=0.1)
    inp = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(3, 3, activation="relu", bias_initializer=bias)(inp)
    h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.Dense(6, activation="relu", bias_initializer=bias)(keras.layers.Flatten()(h))
    model = keras.Model(inp, keras.layers.Dense(2, activation="softmax")(h))
    x = np.random.default_rng(2).uniform(0, 1, (2, 6, 6, 1)).astype("float32")
    ig = integrated_gradients(model, x, np.array([0, 1]), verbose=True)
    assert ig.maps.shape == x.shape and np.all(ig.regions >= 2)
    np.testing.assert_allclose(ig.delta, 0, atol=1e-4 * np.abs(ig.f_x - ig.f_baseline).max())


def test_bad_input_names_the_argument(setup):
    model, _, x, y = setup
    cases = [
        (dict(y=np.array([0, 1, 3, 1])), r"y must be in \[0, 3\)"),
        (dict(y=y[None, :]), r"y must have shape.*y.reshape\(-1\)"),
        (dict(x=np.where(np.eye(4, 8, dtype=bool), np.nan, x)),
         "Rows 0, 1, 2, 3 of x hold non-finite"),
        (dict(baseline=np.zeros(5)), "baseline must be a number, shaped like"),
        (dict(baseline=np.full(8, np.nan)), "Rows 0, 1, 2, 3 of baseline hold non-finite"),
        (dict(steps=0), "steps must be"),
        (dict(max_regions=0), "max_regions must be"),
        (dict(verbose="yes"), "verbose must be"),
    ]
    for change, message in cases:
        args = dict(x=x, y=y)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            integrated_gradients(model, **args)
    with pytest.raises(ValueError, match="y must have shape"):
        saliency(model, x, y[:2])
    with pytest.raises(ValueError, match=r"expects inputs of shape \(batch, 8\), got x of"):
        saliency(model, x[:, :3], y)


def test_inputs_are_not_modified(setup):
    model, _, x, y = setup
    x0, y0 = x.copy(), y.copy()
    base = np.full(x.shape, 0.2)
    b0 = base.copy()
    integrated_gradients(model, x, y, baseline=base, verbose=False)
    integrated_gradients(model, x, y, baseline=base, steps=3, verbose=False)
    saliency(model, x, y, postprocess=True, radius=True)  # computes the certificate too
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(base, b0)


def _plane_model(dtype):
    """z0 = 0.3 x1 + 0.7 x2 + 0.1 is the hyperplane the test paths run in."""
    inp = keras.Input((2,), dtype=dtype)
    h = keras.layers.Dense(3, activation="relu", dtype=dtype)(inp)
    model = keras.Model(inp, keras.layers.Dense(1, dtype=dtype)(h))
    model.layers[1].set_weights([np.array([[0.3, 1.0, -0.5], [0.7, 0.2, 0.4]]),
                                 np.array([0.1, -0.3, 0.2])])
    model.layers[2].set_weights([np.array([[1.5], [-1.0], [2.0]]), np.array([0.0])])
    return model


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_path_inside_a_relu_hyperplane_takes_the_limit_from_below(dtype):
    model = _plane_model(dtype)
    normal = np.array([0.3, 0.7]) / np.hypot(0.3, 0.7)
    b1 = np.array([0.2, 0.9, -1.4])
    base = np.stack([b1, (-0.1 - 0.3 * b1) / 0.7], axis=1)  # on the plane z0 = 0
    x = base + np.array([0.7, -0.3]) * np.array([[1.3], [2.1], [-2.6]])  # along it
    y = np.zeros(3, int)
    z0 = keras.Model(model.inputs[0], model.layers[1].output)
    assert np.any(z0(np.concatenate([base, x]).astype(dtype)).numpy()[:, 0] != 0)  # noise
    ig = integrated_gradients(model, x.astype(dtype), y, baseline=base.astype(dtype),
                              verbose=False)
    delta = 3e-3 if dtype == "float32" else 1e-7
    side = {}
    for s in (-1, 1):  # the same path moved off the plane, below and above it
        shift = s * delta * normal
        side[s] = integrated_gradients(model, (x + shift).astype(dtype), y,
                                       baseline=(base + shift).astype(dtype),
                                       verbose=False).maps
    tol = 1e-2 if dtype == "float32" else 1e-6
    np.testing.assert_allclose(ig.maps, side[-1], atol=tol)
    assert np.abs(side[1] - side[-1]).max() > 0.5  # the two limits differ per input
    np.testing.assert_allclose(ig.delta, 0.0, atol=10 * tol)
