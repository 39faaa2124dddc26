"""Results in the units a user chooses: `wrt=<leading Rescaling / Normalization>`.

The reference for every value is the same network *without* that layer (a Keras
model sharing the weights) fed the layer's outputs, computed independently of the
units code: its radii, counts and distortions are what `wrt=` must report on the
full model. Bad `wrt` values get a clear error from every function.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.compile.units import resolve_units
from keras_roll.roll.callbacks import MarginMonitor

NORMS = (1, 2, np.inf)
SCALE = np.float32(1 / 255)  # what Rescaling(1 / 255) multiplies by in float32


def _dense_body(seed=0):
    keras.utils.set_random_seed(seed)
    return [keras.layers.Dense(16, activation="relu", name="d0"),
            keras.layers.Dense(16, activation="relu", name="d1"),
            keras.layers.Dense(4, name="logits")]


def _apply(layers, h):
    for layer in layers:
        h = layer(h)
    return h


@pytest.fixture(scope="module")
def pair():
    """`(model 0-255 -> Rescaling(1/255) -> MLP, the MLP alone, x in 0-255, x in [0, 1])`."""
    body = _dense_body()
    inp = keras.Input((12,))
    model = keras.Model(inp, _apply(body, keras.layers.Rescaling(1 / 255, name="rescaling")(inp)))
    inner = keras.Input((12,))
    reference = keras.Model(inner, _apply(body, inner))
    x = np.random.default_rng(0).uniform(0, 255, (6, 12)).astype(np.float32)
    return model, reference, x, x * SCALE  # the float32 values the Rescaling computes


def test_resolve_units_reads_the_chain_in_float64():
    inp = keras.Input((3,))
    h = keras.layers.Rescaling(2.0, offset=-1.0, name="rs")(inp)
    h = keras.layers.Normalization(mean=0.5, variance=4.0, name="nm")(h)
    model = keras.Model(inp, keras.layers.Dense(2, activation="relu")(h))
    program = keras_roll.linearize(model).program
    assert resolve_units(program, None).is_input
    rs = resolve_units(program, "rs")
    assert (rs.scale, rs.offset) == (2.0, -1.0)
    nm = resolve_units(program, "nm")  # ((2 x - 1) - 0.5) / 2 = x - 0.75
    np.testing.assert_allclose((nm.scale, nm.offset), (1.0, -0.75), rtol=1e-7)
    assert nm.describe() == "units of 'nm' output"
    np.testing.assert_allclose(nm.point_from_units(0.25), 1.0)


# Under the default guard the full model's radii are a little smaller: the Rescaling
# rounds too, and the guard covers it.
@pytest.mark.parametrize("rigor,rtol", [("float32", 1e-5), ("float64", 1e-3)])
def test_certify_and_stable_radius_in_rescaled_units(pair, rigor, rtol):
    model, reference, x, u = pair
    cert = keras_roll.certify(model, x, norms=NORMS, rigor=rigor, wrt="rescaling",
                              verbose=False)
    ref = keras_roll.certify(reference, u, norms=NORMS, rigor=rigor, verbose=False)
    raw = keras_roll.certify(model, x, norms=NORMS, rigor=rigor, verbose=False)
    for p in NORMS:
        assert np.all(ref.margins[p] > 0)
        np.testing.assert_allclose(cert.margins[p], ref.margins[p], rtol=rtol)
        np.testing.assert_allclose(raw.margins[p], ref.margins[p] / SCALE, rtol=rtol)
    stable = keras_roll.stable_radius(model, x, norms=(2, np.inf), rigor=rigor,
                                      wrt="rescaling", verbose=False)
    for p in (2, np.inf):
        np.testing.assert_allclose(stable[p], ref.margins[p], rtol=rtol)
    lines, raw_lines = [], []
    cert.summary(print_fn=lines.append)
    raw.summary(print_fn=raw_lines.append)
    assert "units of 'rescaling' output" in lines[0]
    assert "(input units)" in raw_lines[0]
    # The boundary point is a model input: on the same hyperplane either way.
    np.testing.assert_allclose(cert.boundary_point(2), raw.boundary_point(2), rtol=1e-9)


def test_certify_reads_directions_in_the_chosen_units(pair):
    model, reference, x, u = pair
    d = np.random.default_rng(1).normal(size=(3, 12))
    cert = keras_roll.certify(model, x, norms=(), directions=d, rigor="float32",
                              wrt="rescaling", verbose=False)
    ref = keras_roll.certify(reference, u, norms=(), directions=d, rigor="float32",
                             verbose=False)
    np.testing.assert_allclose(cert.directional, ref.directional, rtol=1e-5)


def test_robust_radius_in_rescaled_units(pair):
    model, reference, x, u = pair
    kw = dict(norms=(2, np.inf), method="region", rigor="float32", verbose=False)
    rr = keras_roll.robust_radius(model, x, wrt="rescaling", **kw)
    ref = keras_roll.robust_radius(reference, u, **kw)
    raw = keras_roll.robust_radius(model, x, **kw)
    for p in (2, np.inf):
        assert np.all(ref.lower[p] > 0)
        np.testing.assert_allclose(rr.lower[p], ref.lower[p], rtol=1e-5)
        np.testing.assert_allclose(raw.lower[p] * SCALE, ref.lower[p], rtol=1e-5)
        both = np.isfinite(rr.upper[p]) & np.isfinite(ref.upper[p])
        assert both.any()
        np.testing.assert_allclose(rr.upper[p][both], ref.upper[p][both], rtol=1e-4)
        # The adversarial points stay model inputs: their distance in 0-255 pixels
        # times the scale is the reported upper bound.
        adv = rr.adversarial[p][both]
        dist = np.linalg.norm((adv - x[both]).reshape(int(both.sum()), -1),
                              ord=p, axis=1)
        np.testing.assert_allclose(dist * SCALE, rr.upper[p][both], rtol=1e-6)
        # certified_accuracy reads its threshold in the chosen units.
        eps = float(np.median(ref.lower[p]))
        assert rr.certified_accuracy(eps, p) == ref.certified_accuracy(eps, p)
    lines = []
    rr.summary(print_fn=lines.append)
    assert "units of 'rescaling' output" in lines[0]


def test_count_regions_does_not_depend_on_the_units(pair):
    model, reference, x, u = pair
    pts = np.concatenate([x, x[:2]])  # repeated points: one region each
    rc = keras_roll.count_regions(model, pts, wrt="rescaling", verbose=False)
    ref = keras_roll.count_regions(reference, np.concatenate([u, u[:2]]), verbose=False)
    raw = keras_roll.count_regions(model, pts, verbose=False)
    for other in (ref, raw):
        assert (rc.patterns, rc.jacobians) == (other.patterns, other.jacobians)
        np.testing.assert_array_equal(rc.pattern_ids, other.pattern_ids)
    assert rc.patterns == 6


def test_gradient_distortion_reads_eps_and_domain_in_the_chosen_units(pair):
    model, reference, x, u = pair
    kw = dict(mode="expected", samples=64, seed=0, verbose=False)
    eps = 0.3  # wide enough to cross regions
    res = keras_roll.gradient_distortion(model, x, eps=eps, domain=(0.0, 1.0),
                                         wrt="rescaling", **kw)
    ref = keras_roll.gradient_distortion(reference, u, eps=eps, domain=(0.0, 1.0), **kw)
    raw = keras_roll.gradient_distortion(model, x, eps=eps * 255, domain=(0.0, 255.0), **kw)
    assert np.all(ref.distortion > 0)
    # the same draws up to float32 rounding of the candidates
    np.testing.assert_allclose(res.distortion, ref.distortion, rtol=1e-3)
    # raw units: gradients with respect to 0-255 pixels, 255 times smaller
    np.testing.assert_allclose(raw.distortion / SCALE, res.distortion, rtol=1e-3)
    assert (res.eps, res.domain) == (eps, (0.0, 1.0))
    lines = []
    res.summary(print_fn=lines.append)
    assert "units of 'rescaling' output" in lines[0]


def test_distortion_domain_in_units_holds_the_inputs_own_ends(pair):
    # float32(1 / 255) is not 1 / 255: the box (0, 1) maps to (0, 254.99998) unless the
    # conversion snaps, and pixels at 255 would be refused.
    model, _, x, _ = pair
    x = x.copy()
    x[:, 0], x[:, 1] = 0.0, 255.0
    res = keras_roll.gradient_distortion(model, x, eps=8 / 256, domain=(0.0, 1.0),
                                         wrt="rescaling", mode="expected", samples=8, seed=0,
                                         verbose=False)
    assert res.domain == (0.0, 1.0) and np.all(np.isfinite(res.distortion))
    with pytest.raises(ValueError, match="outside domain"):
        keras_roll.gradient_distortion(model, x, eps=8 / 256, domain=(0.0, 0.5),
                                       wrt="rescaling", mode="expected", samples=8, seed=0)


def test_margin_monitor_in_rescaled_units(pair):
    model, reference, x, u = pair
    monitor = MarginMonitor(x, wrt="rescaling")
    monitor.set_model(model)
    ref = keras_roll.l2_margins(reference, u, rigor="float32")
    np.testing.assert_allclose(monitor.margins(), ref, rtol=1e-5)
    logs = {}
    monitor.on_epoch_end(0, logs)
    assert logs["margin_l2_p100"] == pytest.approx(float(np.max(ref)), rel=1e-5)


def _per_channel():
    inp = keras.Input((4,))
    h = keras.layers.Normalization(mean=[0.0, 0.1, 0.2, 0.3], variance=[1.0, 2.0, 3.0, 4.0],
                                   name="per_channel")(inp)
    h = keras.layers.Dense(5, activation="relu", name="hidden")(h)
    h = keras.layers.Rescaling(2.0, name="late")(h)
    return keras.Model(inp, keras.layers.Dense(3, name="out")(h))


@pytest.mark.parametrize("wrt,message", [
    ("nope", "no layer of that name"),
    ("hidden", "names a Dense, not a Rescaling or Normalization"),
    ("late", "does not lead the model"),
    ("per_channel", "not a ball"),
])
def test_bad_wrt_names_the_layer_and_what_works(wrt, message):
    model = _per_channel()
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    calls = [
        lambda: keras_roll.certify(model, x, wrt=wrt, verbose=False),
        lambda: keras_roll.stable_radius(model, x, wrt=wrt, verbose=False),
        lambda: keras_roll.robust_radius(model, x, wrt=wrt, verbose=False),
        lambda: keras_roll.count_regions(model, x, wrt=wrt, verbose=False),
        lambda: keras_roll.gradient_distortion(model, x, domain=None, samples=2, wrt=wrt),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert f"wrt={wrt!r}" in str(err.value) and "wrt=None" in str(err.value)
    monitor = MarginMonitor(x, wrt=wrt)
    monitor.set_model(model)
    with pytest.raises(ValueError, match=message):
        monitor.on_train_begin()
    with pytest.raises(TypeError, match="layer name"):
        keras_roll.certify(model, x, wrt=0, verbose=False)
