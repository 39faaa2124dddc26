"""robust_radius: how the methods combine, soundness probes, inputs, bad input, results.

Exactness against MILP and brute force is in tests/test_robust_exact.py. Here the
references are the float32 Keras model itself (probes inside the lower bound never
change its prediction, adversarial points do) and the methods against each other.
"""

import dataclasses
import gc
import warnings
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.robust import adversarial
from keras_roll.robust.adversarial import lp_norm, model_outputs, predict_classes
from tests.test_robust_exact import CHEAP  # a short attack, where it is not the subject

NORMS = (2, np.inf)

# The tests on the trained model's shared results run compiled (`graph`: its passes
# trace once and serve every call); those that make one call on a new model of their
# own run eagerly (cheaper than tracing it), as the default suite does.


@pytest.fixture(scope="module", autouse=True)
def _module_function_mode():
    """The module's fixtures (the trained model, its shared results) run compiled
    (conftest.py's fixture of that name would run them eagerly: the module is not
    marked `graph`, only the tests on them are)."""
    tf.config.run_functions_eagerly(False)
    yield


def _blobs(n, seed):
    centres = np.random.default_rng(0).normal(0, 1.5, size=(3, 8))
    rng = np.random.default_rng(seed + 1)
    y = rng.integers(0, 3, n)
    return (centres[y] + rng.normal(0, 1.0, size=(n, 8))).astype(np.float32), y


@pytest.fixture(scope="module")
def trained():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(24, activation="relu")(inp)
    h = keras.layers.Dense(24, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(3, activation="softmax")(h))
    x, y = _blobs(600, 0)
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy")
    model.fit(x, y, epochs=15, batch_size=64, verbose=0)
    # Six inputs: one of them is adversarial only by a hair in the float32 model, which
    # once flipped back in a batch of another size (a gap too thin for softmax outputs).
    xt, yt = _blobs(6, 1)
    return model, xt, yt


@pytest.fixture(scope="module")
def results(trained):
    model, x, y = trained
    out = {m: keras_roll.robust_radius(model, x, y, norms=NORMS, method=m, attack=CHEAP,
                                       verbose=False)
           for m in ("best", "region", "walk", "relaxation", "interval")}
    return out


@pytest.mark.graph
def test_best_combines_the_methods(results):
    best = results["best"]
    for p in NORMS:
        lo = np.maximum(results["region"].lower[p], results["relaxation"].lower[p])
        assert np.all(best.lower[p] >= lo * (1 - 2e-2))  # both within bisect_tol (1e-2)
        for m in ("region", "walk"):
            up = results[m].upper[p]
            ok = np.isfinite(up)
            assert np.all(best.upper[p][ok] <= up[ok] * (1 + 1e-3))
        assert np.all(np.isfinite(best.upper[p]))
        assert np.all(best.lower[p] <= best.upper[p])
        assert set(best.lower_method[p]) <= {"region", "decision", "relaxation", "label"}
        assert set(best.upper_method[p]) <= {"region", "walk", "attack", "search", "label"}
    # every method alone is consistent with the best bounds
    for rr in results.values():
        for p in NORMS:
            assert np.all(rr.lower[p] <= best.upper[p])
            assert np.all(~(rr.upper[p] < best.lower[p]))


@pytest.mark.graph
def test_relaxation_beats_intervals(results):
    for p in NORMS:
        relax, ibp = results["relaxation"].lower[p], results["interval"].lower[p]
        correct = results["best"].correct
        assert np.all(relax[correct] >= ibp[correct] * (1 - 2e-2))
        assert np.median(relax[correct]) > 1.5 * np.median(ibp[correct])


@pytest.mark.graph
def test_probes_inside_the_lower_bound_keep_the_prediction(trained, results):
    """Probes at 0.999 x lower (toward the adversarial point, and 200 random ones per
    input), evaluated by the float32 Keras model, never change the prediction."""
    model, x, _ = trained
    best = results["best"]
    rng = np.random.default_rng(3)
    x64 = x.astype(np.float64)
    for p in NORMS:
        ok = best.correct & (best.lower[p] > 0)
        for i in np.flatnonzero(ok):
            dirs = rng.normal(size=(200, x.shape[1]))
            if p == np.inf:
                dirs = np.sign(dirs)
            dirs = np.concatenate([dirs, (best.adversarial[p][i] - x64[i])[None]])
            dirs /= lp_norm(dirs, p)[:, None]
            pts = (x64[i] + 0.999 * best.lower[p][i] * dirs).astype(np.float32)
            assert np.all(predict_classes(model, pts) == best.predicted[i])


@pytest.mark.graph
def test_adversarial_points_change_the_prediction(trained, results):
    model, x, _ = trained
    for m in ("best", "walk", "region"):
        rr = results[m]
        for p in NORMS:
            found = np.isfinite(rr.upper[p]) & rr.correct
            pts = rr.adversarial[p][found].astype(np.float32)
            assert np.all(predict_classes(model, pts) != rr.predicted[found])
            np.testing.assert_allclose(lp_norm(pts.astype(np.float64) - x[found], p),
                                       rr.upper[p][found], rtol=1e-12)


@pytest.mark.graph
def test_labels_misclassified_inputs_get_radius_zero(trained, results):
    model, x, y = trained
    wrong = y.copy()
    wrong[0] = (results["best"].predicted[0] + 1) % 3
    rr = keras_roll.robust_radius(model, x[:3], wrong[:3], norms=(2,), method="region",
                                  verbose=False)
    assert rr.lower[2][0] == 0 and rr.upper[2][0] == 0 and rr.exact[2][0]
    assert rr.lower_method[2][0] == "label" and not rr.correct[0]
    np.testing.assert_array_equal(rr.adversarial[2][0], x[0])
    np.testing.assert_allclose(rr.lower[2][1:], results["region"].lower[2][1:3])
    assert rr.certified_accuracy(0.0, 2) == pytest.approx(np.mean(rr.correct))


@pytest.mark.graph
def test_batch_composition_does_not_change_the_bounds(trained, results):
    model, x, y = trained
    part = keras_roll.robust_radius(model, x[3:6], y[3:6], norms=NORMS, method="relaxation",
                                    verbose=False)
    for p in NORMS:
        np.testing.assert_allclose(part.lower[p], results["relaxation"].lower[p][3:6],
                                   rtol=1e-6)


@pytest.mark.graph
def test_nan_rows_get_nan_and_a_warning(trained, results):
    model, x, y = trained
    bad = x[:4].copy()
    bad[1, 2] = np.nan
    with pytest.warns(UserWarning, match="non-finite"):
        rr = keras_roll.robust_radius(model, bad, norms=(2,), method="region", verbose=False)
    assert np.isnan(rr.lower[2][1]) and np.isnan(rr.upper[2][1]) and rr.nonfinite[1]
    assert rr.predicted[1] == -1
    keep = [0, 2, 3]
    np.testing.assert_allclose(rr.lower[2][keep], results["region"].lower[2][keep])


@pytest.mark.graph
def test_streams_and_wrapped_models_give_the_same_bounds(trained, results):
    model, x, y = trained
    ds = tf.data.Dataset.from_tensor_slices((x[:5], y[:5])).batch(2)
    rr = keras_roll.robust_radius(model, ds, norms=NORMS, method="region", verbose=False)
    np.testing.assert_array_equal(rr.labels, y[:5])
    single = (xi for xi in x[:5])  # a generator of single examples
    wrapped = keras_roll.wrap(model, lam=1.0)
    rr2 = keras_roll.robust_radius(wrapped, single, norms=NORMS, method="region",
                                   batch_size=3, verbose=False)
    for p in NORMS:
        np.testing.assert_allclose(rr.lower[p], results["region"].lower[p][:5])
        np.testing.assert_allclose(rr2.lower[p], results["region"].lower[p][:5])


def test_unsupported_layers():
    keras.utils.set_random_seed(1)
    inp = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(3, 3, activation="relu", name="conv")(inp)
    h = keras.layers.MaxPooling2D(2, name="pool")(h)
    h = keras.layers.Flatten()(h)
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 1)).astype(np.float32)
    with pytest.raises(keras_roll.UnsupportedModelError, match="'pool'.*MaxPooling2D"):
        keras_roll.robust_radius(model, x, method="relaxation", verbose=False)
    with pytest.warns(UserWarning, match="'pool'"):
        rr = keras_roll.robust_radius(model, x, norms=(2,), attack=CHEAP, verbose=False)
    assert set(rr.lower_method[2]) <= {"region", "decision"}
    assert np.all(rr.lower[2] <= rr.upper[2])


@pytest.mark.graph
def test_bad_arguments(trained):
    model, x, y = trained
    cases = [
        (dict(method="exact"), ValueError, "Unknown method"),
        (dict(norms=()), ValueError, "nothing to bound"),
        (dict(norms=(3,)), ValueError, "Unsupported norm"),
        (dict(rigor="float16"), ValueError, "Unknown rigor"),
        (dict(max_regions=0), ValueError, "max_regions"),
        (dict(exact_rtol=2.0), ValueError, "exact_rtol"),
        (dict(bisect_tol=0.0), ValueError, "bisect_tol"),
        (dict(y=y[:2]), ValueError, r"y must have shape \[B\] = \(4,\)"),
        (dict(y=y[:4] + 0.5), ValueError, "integer class labels"),
        (dict(y=np.full(4, 12)), ValueError, r"y must be in \[0, 3\).*\[12, 12, 12, 12\]"),
    ]
    for kwargs, err, match in cases:
        with pytest.raises(err, match=match):
            keras_roll.robust_radius(model, x[:4], **{"verbose": False, **kwargs})
    with pytest.raises(ValueError, match="expects inputs of shape"):
        keras_roll.robust_radius(model, x[:, :5], verbose=False)
    with pytest.raises(ValueError, match="y has 3 labels but the input stream yielded 2"):
        # the input reader's check, whatever the method (the cheapest: `best` runs first)
        keras_roll.robust_radius(model, iter([x[:2]]), y=y[:3], method="interval",
                                 verbose=False)
    with pytest.raises(ValueError, match="no examples"):
        keras_roll.robust_radius(model, x[:0], verbose=False)
    inp = keras.Input((4,))
    single = keras.Model(inp, keras.layers.Dense(1, activation="sigmoid")(inp))
    with pytest.raises(ValueError, match="at least 2 classes"):
        keras_roll.robust_radius(single, np.zeros((2, 4), np.float32), verbose=False)


@pytest.mark.graph
def test_result_api(results):
    rr = results["best"]
    assert rr.lower["l2"] is rr.lower[2] and rr.upper["linf"] is rr.upper[np.inf]
    assert rr.norms == (2, np.inf) and rr.n == 6
    lines = []
    rr.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert "l2 lower" in text and "linf upper / lower" in text and "exact" in text
    assert "RobustRadius(n=6" in repr(rr)
    assert rr.certified_accuracy(0.0) == pytest.approx(np.mean(rr.correct))
    acc = [rr.certified_accuracy(e, np.inf) for e in (0.01, 0.1, 1.0)]
    assert acc == sorted(acc, reverse=True)
    with pytest.raises(ValueError, match="finite radius"):
        rr.certified_accuracy(-1.0)
    gap = rr.gap(2)
    assert np.all(gap[np.isfinite(gap)] >= 1.0)


@pytest.mark.graph
def test_rigor_float32_is_the_unguarded_bound(trained, results):
    model, x, y = trained
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        raw = keras_roll.robust_radius(model, x, y, norms=(2,), method="region",
                                       rigor="float32", verbose=False)
    guarded = results["region"]
    assert np.all(guarded.lower[2] <= raw.lower[2] * (1 + 1e-5))
    assert raw.rigor == "float32"


@pytest.mark.graph
def test_summary_counts_exact_among_correctly_classified(results):
    """A misclassified input has radius 0, exactly: the summary's exact share leaves it out."""
    rr = results["best"]
    labels = np.array(rr.predicted).copy()
    labels[0] = (labels[0] + 1) % 3
    exact = {p: np.zeros(rr.n, bool) for p in rr.norms}
    for p in rr.norms:
        exact[p][0] = True  # only the misclassified one
    lines = []
    dataclasses.replace(rr, labels=labels, exact=exact).summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert "l2: exact 0% of the correctly classified" in text, text
    assert "1 misclassified input(s), radius 0" in text


def test_model_outputs_are_the_models_and_its_cache_lets_the_model_go():
    """Adversarial points are checked by the model compiled once per model; the compiled
    function matches `model(x)` at any batch size and does not keep the model alive."""
    keras.utils.set_random_seed(2)
    inp = keras.Input((5,))
    model = keras.Model(inp, keras.layers.Dense(3, activation="softmax")(
        keras.layers.Dense(4, activation="relu")(inp)))
    for n in (1, 7):
        x = np.random.default_rng(n).normal(size=(n, 5)).astype(np.float32)
        np.testing.assert_allclose(model_outputs(model, x), model(x).numpy(), rtol=1e-6)
    ref = weakref.ref(model)
    del model, inp
    gc.collect()
    assert ref() is None


def test_softmax_ties_of_tiny_logits_never_flip_a_certified_ball():
    """Logits a few units in the last place apart tie in a float32 softmax, and argmax
    then keeps the lower class: the lower bounds leave room for the softmax's rounding
    (on this model some balls were violated before)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu")(inp)
    z = keras.layers.Dense(3, kernel_initializer=keras.initializers.RandomNormal(stddev=1e-5),
                           bias_initializer="zeros")(h)
    model = keras.Model(inp, keras.layers.Softmax()(z))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    rr = keras_roll.robust_radius(model, x, norms=(2,), method="region", verbose=False)
    assert np.sum(rr.lower[2] > 0) >= 100  # the test can fail: most balls are not empty
    d = rng.normal(size=(100, 4))
    d /= lp_norm(d, 2)[:, None]
    pts = x[:, None].astype(np.float64) + 0.999 * rr.lower[2][:, None, None] * d[None]
    got = predict_classes(model, pts.reshape(-1, 4).astype(np.float32)).reshape(200, 100)
    assert np.all(got == rr.predicted[:, None])


def test_sigmoid_outputs_warn_that_their_saturation_is_not_guarded():
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu")(inp)
    model = keras.Model(inp, keras.layers.Dense(3, activation="sigmoid")(h))
    x = np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    with pytest.warns(UserWarning, match="ends in a sigmoid.*drop the final sigmoid"):
        keras_roll.robust_radius(model, x, norms=(2,), method="region", verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unguarded: exact arithmetic, nothing to warn of
        keras_roll.robust_radius(model, x, norms=(2,), method="region", rigor="float32",
                                 verbose=False)


@pytest.mark.parametrize("push_bytes", [4, 2**24])  # one push per call, or all at once
def test_confirm_keeps_the_first_push_that_flips(monkeypatch, push_bytes):
    """A 1-D two-class model flipping at x = 1: from 0 along +1 with the crossing
    underestimated, the point is the first push `t (1 + rho) + rho 1e-6 (1 + |x|)`
    (in PUSHES order) beyond 1, by hand; a crossing never reached gives NaN."""
    monkeypatch.setattr(adversarial, "PUSH_BYTES", push_bytes)
    inp = keras.Input((1,), dtype="float64")
    model = keras.Model(inp, keras.layers.Dense(2, dtype="float64")(inp))
    model.layers[-1].set_weights([np.array([[-1.0, 1.0]]), np.array([1.0, -1.0])])
    base = np.zeros((3, 1))
    t = np.array([1.0 - 2.0**-13, 1.0 - 2.0**-6, 0.5])  # short of 1, by less and more
    pred = predict_classes(model, base)
    points, dist = adversarial.confirm(model, base, np.ones((3, 1)), t, pred, 2)
    for i in range(2):
        k = next(k for k, rho in enumerate(adversarial.PUSHES)
                 if t[i] * (1 + rho) + rho * 1e-6 > 1)
        assert k >= 2  # not the first push, nor the second
        rho = adversarial.PUSHES[k]
        np.testing.assert_allclose(points[i, 0], t[i] * (1 + rho) + rho * 1e-6, rtol=1e-15)
        assert dist[i] == points[i, 0]
    assert np.isnan(points[2, 0]) and np.isnan(dist[2])  # 0.5 (1 + 1/4) < 1
