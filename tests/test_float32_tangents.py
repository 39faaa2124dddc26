"""The default certificate's float32 tangent pass and its rigorous bound.

* The error bound of `keras_roll.rounding.tangent_error` holds: the float32
  gradient norms lie within it of the exact ones, which come from
  `tf.GradientTape` Jacobians of the float64 twin's own neurons (reverse mode
  through the primal pass, independent of the tangent rules), on an MLP and on
  a CNN with BatchNormalization folded into a convolution, max pooling and an
  average-pooled residual branch; and it is tight enough on shallow networks.
* `exact_norms` (reverse mode through the tangent map) equals the tape too.
* Certificates without an l1 norm skip the float32 pass's `max |g|` and still
  equal the float64 pass.
* The input norms of an op after a ReLU, taken from the ReLU's neuron norms times
  its 0/1 slopes, equal a direct reduction of that op's input tangents.
* The default certificate equals the float64 pass of every neuron (radii to
  float64 rounding plus the guard's growth term from upper norm brackets,
  binding neurons exactly), including zero radii decided without gradients,
  models whose tangents cannot be bounded (SimpleRNN) and examples with too
  many candidates.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.certification import guarded_norms as gnorms
from keras_roll.certification.gradient_norms import iter_gradient_norms
from keras_roll.certification.margin_math import margins_from_norms, neuron_arrays
from keras_roll.compile.interpreter import cast_records, propagate
from keras_roll.compile.rules.base import Tangent
from keras_roll.rounding import tangent_error
from keras_roll.rounding.exact_norms import exact_norms
from keras_roll.rounding.guard import guard_for
from keras_roll.rounding.tangent_error import tangent_norms
from keras_roll.testing import tape_jacobian

NORMS = (1, 2, np.inf)


@pytest.fixture(autouse=True)
def small_models_take_the_float32_path(monkeypatch):
    """These models have fewer input axes than the float32 path's threshold: lower it."""
    monkeypatch.setattr(gnorms, "MIN_AXES", 0)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((30,))
    h = keras.layers.Normalization(mean=0.5, variance=0.09)(inp)
    for i in range(3):
        h = keras.layers.Dense(40, activation="relu", name=f"d{i}")(h)
    return keras.Model(inp, keras.layers.Dense(5, name="logits")(h))


def cnn(seed=1):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(6, 3, padding="same", name="conv")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.ReLU(name="relu0")(h)
    a = keras.layers.MaxPooling2D(2, name="pool")(h)
    b = keras.layers.AveragePooling2D(2, name="avg")(h)
    h = keras.layers.Add()([a, keras.layers.Conv2D(6, 1, name="mix")(b)])
    h = keras.layers.LeakyReLU(0.1, name="relu1")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(12, activation="relu", name="dense")(h)
    model = keras.Model(inp, keras.layers.Dense(3, name="logits")(h))
    bn = model.get_layer("bn")
    rng = np.random.default_rng(seed)
    bn.moving_mean.assign(rng.normal(0, 0.2, 6))
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, 6))
    bn.gamma.assign(rng.uniform(0.5, 1.5, 6))
    return model


_CASES = {}


def case_of(name):
    """The model and inputs of a case, built once per module (their compiled passes too)."""
    if name not in _CASES:
        rng = np.random.default_rng(0)
        if name == "mlp":
            _CASES[name] = (mlp(), rng.uniform(0, 1, (6, 30)).astype("float32"))
        else:
            _CASES[name] = (cnn(), rng.uniform(0, 1, (4, 8, 8, 2)).astype("float32"))
    return _CASES[name]


def tape_norms(lin64, x):
    """`(l2, linf, l1)` `[B, N]` of every neuron's gradient: tf.GradientTape through the
    float64 twin's primal pass."""
    _, jac = tape_jacobian(lambda t: lin64.primal(t).neurons.z, np.asarray(x, np.float64))
    a = np.abs(jac)
    return np.sqrt((a * a).sum(-1)), a.max(-1), a.sum(-1)


@pytest.mark.parametrize("case", [pytest.param("cnn", marks=pytest.mark.slow), "mlp"])
def test_float32_norms_lie_within_their_bound(case):
    model, x = case_of(case)
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    fwd = lin64.forward(x)
    ref = tape_norms(lin64, x)
    tn = tangent_norms(lin64, fwd, memory_budget=200_000)  # several chunks of axes
    assert np.all(tn.finite)
    valid = fwd.neurons.valid.numpy()
    for got, err, want in zip(tn.norms, tn.error, ref):
        diff = np.abs(got - want)
        assert np.all((diff <= err) | ~valid)
        live = valid & (want > 0)
        assert np.max(diff[live] / err[live]) > 1e-4  # the bound is not vacuous
        assert np.median(err[live] / want[live]) < 0.05  # and tight on a shallow net


def test_exact_norms_equal_the_tape():
    model, x = case_of("cnn")
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    fwd = lin64.forward(x)
    ref = tape_norms(lin64, x)
    rows = np.array([[0, 5, 400, -1], [7, 7, -1, -1], [100, 3, 2, 1], [-1, -1, -1, -1]])
    got = exact_norms(lin64, fwd, rows)
    for g, want in zip(got, ref):
        for e in range(len(x)):
            r = rows[e][rows[e] >= 0]
            np.testing.assert_allclose(g[e, :r.size], want[e, r], rtol=1e-12, atol=1e-300)
            assert np.all(g[e, r.size:] == 0)


class _DirectNorms(tangent_error.NormsTransform):
    """Reduces every op input itself (no norms carried over from a ReLU)."""

    def _norms(self, t):
        return tangent_error._reduce(t)


@pytest.mark.parametrize("case", ["cnn", "mlp"])
def test_norms_after_a_relu_equal_a_direct_reduction(case):
    model, x = case_of(case)
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    trace = lin64.forward(x).trace
    trace32 = cast_records(trace, tf.float32)
    d = int(np.prod(x.shape[1:]))
    dirs = tf.reshape(tf.eye(d, dtype=tf.float32), (d, *x.shape[1:]))
    got = []
    for cls in (tangent_error.NormsTransform, _DirectNorms):
        transform = cls(lin64.interpreter.folds)
        propagate(lin64.program, transform, Tangent(dirs, True), trace32)
        got.append((transform.input_norms, transform.neuron_norms))
    assert any(getattr(op, "binary_slopes", False)
               for step in lin64.program.steps for op in step.ops)
    shared, direct = (tf.nest.flatten(g) for g in got)
    assert [a is None for a in shared] == [b is None for b in direct]
    assert sum(a is not None for a in shared) > 0
    for a, b in zip(shared, direct):
        if a is not None:
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def float64_pass(model, x):
    """Margins and binding rows from the float64 pass of every neuron (forward mode)."""
    twin = keras_roll.linearize(model).at_dtype("float64")
    guard = guard_for("float64")
    out = {p: ([], []) for p in NORMS}
    for _, fwd, gn in iter_gradient_norms(twin, x):
        err = guard.errors(twin, fwd, l1=gn.l1)
        below, above, valid, _ = neuron_arrays(fwd)
        for p in NORMS:
            eps, j = margins_from_norms(np.minimum(below, above), gn.dual(p), valid,
                                        *err.terms())
            out[p][0].append(np.asarray(eps))
            out[p][1].append(np.asarray(j))
    return {p: (np.concatenate(e), np.concatenate(j)) for p, (e, j) in out.items()}


def assert_same_certificate(cert, ref, norms=NORMS):
    for p in norms:
        eps, j = ref[p]
        np.testing.assert_array_equal(cert.binding_index[p], j)
        np.testing.assert_array_equal(cert.margins[p] == 0, eps == 0)
        live = eps > 0
        assert np.all(cert.margins[p] <= eps * (1 + 1e-9))
        np.testing.assert_allclose(cert.margins[p][live], eps[live], rtol=2e-3)


@pytest.mark.parametrize("case", [pytest.param("cnn", marks=pytest.mark.slow), "mlp"])
def test_default_certificate_equals_the_float64_pass(case):
    model, x = case_of(case)
    cert = keras_roll.certify(model, x, verbose=False)
    assert_same_certificate(cert, float64_pass(model, x))


def test_certificates_without_l1_skip_the_max_norm(monkeypatch):
    """l2 and l_inf certificates need no `max |g|` (the dual norm of l1 balls): the
    float32 pass skips it, and the margins are still those of the float64 pass."""
    model, x = case_of("mlp")
    calls = []

    def spy(twin, fwd, budget=None, with_max=True):
        calls.append(with_max)
        return tangent_norms(twin, fwd, budget, with_max)

    monkeypatch.setattr(gnorms, "tangent_norms", spy)
    cert = keras_roll.certify(model, x, norms=(2, np.inf), verbose=False)
    assert calls and not any(calls)
    assert_same_certificate(cert, float64_pass(model, x), norms=(2, np.inf))


def test_zero_radii_are_decided_without_gradients(monkeypatch):
    """Neurons placed within the guard of their breakpoint: radius 0, the binding neuron
    the float64 pass picks, and no float32 tangent pass for those examples."""
    model, x = case_of("mlp")
    lin64 = keras_roll.linearize(model).at_dtype("float64")
    rows = lin64.layout(x.shape[1:]).rows("d1")
    z = lin64.forward(x).neurons.z.numpy()[:, rows]
    bias = model.get_layer("d1").bias
    saved = bias.numpy()
    b = saved.astype(np.float64)
    b[3] -= z[0, 3] - 1e-9  # neuron 3 of example 0 at ~1e-9 from its breakpoint
    bias.assign(b.astype("float32"))
    seen = []
    monkeypatch.setattr(gnorms, "tangent_norms",
                        lambda twin, fwd, *args: seen.append(int(fwd.trace.input.shape[0]))
                        or tangent_norms(twin, fwd, *args))
    try:
        cert = keras_roll.certify(model, x, verbose=False)
        ref = float64_pass(model, x)
    finally:
        bias.assign(saved)
    assert cert.margins[2][0] == 0 and ref[2][0][0] == 0
    assert sum(seen) == int(np.sum(ref[2][0] > 0)) < len(x)
    assert_same_certificate(cert, ref)


def test_too_many_candidates_fall_back_to_float64(monkeypatch):
    model, x = case_of("mlp")
    monkeypatch.setattr(gnorms, "MAX_CANDIDATES", 0)
    cert = keras_roll.certify(model, x, verbose=False)
    assert_same_certificate(cert, float64_pass(model, x))


@pytest.mark.slow
def test_models_whose_tangents_cannot_be_bounded_use_float64():
    keras.utils.set_random_seed(4)
    inp = keras.Input((5, 3))
    h = keras.layers.SimpleRNN(4, activation="relu", return_sequences=True)(inp)
    model = keras.Model(inp, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
    x = np.random.default_rng(4).normal(size=(3, 5, 3)).astype("float32")
    cert = keras_roll.certify(model, x, verbose=False)
    assert_same_certificate(cert, float64_pass(model, x))
