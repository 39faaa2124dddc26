"""Faithfulness metrics on models where the right answer is known: for a linear model
the exact attribution w * x has the best Deletion and Insertion curves of all orders
and a MuFidelity of 1; curves against a numpy recomputation of the removals."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.attribution.faithfulness import faithfulness


def _linear(dtype="float64", d=12, classes=3, seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((d,), dtype=dtype)
    logits = keras.layers.Dense(classes, dtype=dtype,
                                bias_initializer=keras.initializers.RandomNormal())(inp)
    probs = keras.layers.Activation("softmax", dtype=dtype)(logits)
    model = keras.Model(inp, probs)
    w, b = model.layers[1].get_weights()
    return model, w, b


@pytest.fixture(scope="module")
def linear():
    model, w, b = _linear()
    x = np.random.default_rng(0).uniform(0.1, 1, (4, 12))
    y = np.array([0, 1, 2, 1])
    return model, w, b, x, y


def _deletion_by_hand(w, b, x, y, attr, fractions, insertion=False):
    """The logit of class y after setting the top-k features (by attr) to 0."""
    out = []
    for xi, yi, ai in zip(x, y, attr):
        order = np.argsort(-ai, kind="stable")
        row = []
        for frac in fractions:
            k = int(round(frac * len(xi)))
            keep = np.zeros(len(xi), bool)
            keep[order[:k]] = True
            z = np.where(keep, xi, 0.0) if insertion else np.where(keep, 0.0, xi)
            row.append(z @ w[:, yi] + b[yi])
        out.append(row)
    return np.array(out)


def test_curves_are_the_logits_after_the_removals(linear):
    model, w, b, x, y = linear
    exact = w[:, y].T * x  # integrated gradients of a linear model from a zero baseline
    f = faithfulness(model, x, y, exact, step_size=0.25, score="logit", seed=0, verbose=False)
    np.testing.assert_allclose(f.fractions, [0, 0.25, 0.5, 0.75, 1.0])
    for kind, ins in (("deletion", False), ("insertion", True)):
        want = _deletion_by_hand(w, b, x, y, exact, f.fractions, insertion=ins)
        np.testing.assert_allclose(f.curves[kind], want, rtol=1e-12)
        np.testing.assert_allclose(f.scores[kind], np.trapezoid(want, f.fractions, axis=1),
                                   rtol=1e-12)


def test_the_exact_attribution_is_the_most_faithful(linear):
    model, w, b, x, y = linear
    exact = w[:, y].T * x
    kw = dict(step_size=1 / 12, score="logit", samples=64, seed=1, verbose=False)
    best = faithfulness(model, x, y, exact, **kw)
    np.testing.assert_allclose(best.scores["mufidelity"], 1.0, rtol=1e-12)
    rng = np.random.default_rng(2)
    for _ in range(10):
        noise = rng.normal(size=x.shape)
        other = faithfulness(model, x, y, noise, **kw)
        assert np.all(best.scores["deletion"] <= other.scores["deletion"] + 1e-12)
        assert np.all(best.scores["insertion"] >= other.scores["insertion"] - 1e-12)
    worse = faithfulness(model, x, y, rng.normal(size=x.shape), **kw)
    assert np.nanmean(worse.scores["mufidelity"]) < 0.6
    assert best.mean()["deletion"] < worse.mean()["deletion"]


def test_model_score_is_the_model_output(linear):
    model, _, _, x, y = linear
    attr = np.random.default_rng(3).normal(size=x.shape)
    f = faithfulness(model, x, y, attr, metrics="deletion", step_size=0.5, verbose=False)
    order = np.argsort(-attr, axis=1, kind="stable")
    for i in range(len(x)):
        z = x[i].copy()
        z[order[i, :6]] = 0.0
        probs = model(np.stack([x[i], z])).numpy()[:, y[i]]
        np.testing.assert_allclose(f.curves["deletion"][i, :2], probs, rtol=1e-12)
    assert set(f.scores) == {"deletion"} and f.score_kind == "model"


def test_pixels_are_removed_with_all_their_channels():
    keras.utils.set_random_seed(0)
    inp = keras.Input((2, 2, 2))
    out = keras.layers.Dense(1)(keras.layers.Flatten()(inp))
    model = keras.Model(inp, out)
    x = np.arange(1, 9, dtype="float32").reshape(1, 2, 2, 2)
    attr = np.zeros_like(x)
    attr[0, 1, 0] = [5.0, -1.0]  # pixel (1, 0) first (sum 4), then pixel (0, 1) (sum 2)
    attr[0, 0, 1] = [1.0, 1.0]
    f = faithfulness(model, x, 0, attr, metrics="deletion", step_size=0.25, baseline=-1.0,
                     verbose=False)
    first = x.copy()
    first[0, 1, 0] = -1.0
    second = first.copy()
    second[0, 0, 1] = -1.0
    np.testing.assert_allclose(f.curves["deletion"][0, :3],
                               model(np.concatenate([x, first, second])).numpy()[:, 0],
                               rtol=1e-6)


def test_bad_arguments(linear):
    model, _, _, x, y = linear
    attr = np.ones_like(x)
    cases = [(dict(metrics=("deletion", "pic")), "metrics must be"),
             (dict(step_size=0.0), "step_size must be"),
             (dict(step_size=2.0), "fractions of the features"),
             (dict(score="probability"), "score must be"),
             (dict(attributions=attr[:, :3]), "attributions must be"),
             (dict(seed=-1), "seed must be"),
             (dict(baseline=np.zeros(3)), "baseline must be")]
    for change, msg in cases:
        args = dict(attributions=attr)
        args.update(change)
        with pytest.raises(ValueError, match=msg):
            faithfulness(model, x, y, **args)
    with pytest.raises(TypeError, match="batch_size"):
        faithfulness(model, x, y, attr, batchsize=3)
    assert keras_roll.faithfulness is faithfulness


# ---------------------------------------------------------------------- the figure and the example


def test_plot_faithfulness_draws_one_curve_per_result(linear, tmp_path):
    model, w, _, x, y = linear
    exact = w[:, y].T * x
    results = {name: faithfulness(model, x, y, a, metrics=("deletion", "insertion"),
                                  step_size=0.25, verbose=False)
               for name, a in (("exact", exact), ("reversed", -exact))}
    path = tmp_path / "f.png"
    fig = keras_roll.plots.plot_faithfulness(results, title="linear", path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = fig.axes
    assert len(axes) == 2 and [len(ax.lines) for ax in axes] == [2, 2]
    np.testing.assert_allclose(axes[0].lines[0].get_ydata(),
                               results["exact"].curves["deletion"].mean(axis=0))
    with pytest.raises(ValueError, match="no mufidelity curve"):
        keras_roll.plots.plot_faithfulness(results, metrics=("mufidelity",))
    with pytest.raises(ValueError, match="at least one"):
        keras_roll.plots.plot_faithfulness({})


def test_mnist_example_scores_the_table1_models(tmp_path):
    import dataclasses
    import json

    from examples.common.data import Data
    from examples.mnist import explanations, train
    from examples.mnist.configs import default

    config = dataclasses.replace(default.get_config(), width=8, depth=1, faithfulness=6)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (10, 784)).astype("float32")
    data = Data((x, None), (x, None), (x, rng.integers(0, 3, 10)), "digits", 3, None)
    (tmp_path / "runs").mkdir()
    rows = []
    for tag, lam in (("vanilla", None), ("roll_a", 1.0)):
        model = train.build_model(dataclasses.replace(config, seed=len(rows)), 784, 3)
        model.save_weights(tmp_path / "runs" / f"{tag}.weights.h5")
        rows.append({"tag": tag, "lam": lam, "C": 1.0, "gamma": 100.0, "estimator": "exact"})
    summary = {"same_acc": {"tag": "roll_a"}, "acc_minus_1": {"tag": "roll_a"}}
    md, figure = explanations.faithfulness_table(
        rows, summary, data, config, tmp_path, lambda: train.build_model(config, 784, 3))
    table = (tmp_path / "faithfulness.md").read_text()
    assert md == table and "| Vanilla |" in table and "ROLL at same accuracy" in table
    assert "1 % less" not in table  # the same model selected twice is shown once
    assert figure.read_bytes()[:4] == b"\x89PNG"
    stored = json.loads((tmp_path / "faithfulness.json").read_text())["rows"]
    vanilla = train.build_model(config, 784, 3)
    vanilla.load_weights(tmp_path / "runs" / "vanilla.weights.h5")
    ig = keras_roll.integrated_gradients(vanilla, x[:6], verbose=False)
    want = faithfulness(vanilla, x[:6], ig.labels, ig.maps, seed=config.seed,
                        step_size=explanations.STEP_SIZE, verbose=False).mean()
    assert stored[0]["deletion"] == pytest.approx(want["deletion"], rel=1e-6)
    assert stored[0]["mufidelity"] == pytest.approx(want["mufidelity"], rel=1e-6)
