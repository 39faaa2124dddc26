"""Gradient distortion (Table 4): exactness inside the region, the genetic algorithm's
set and seeding, against tf.GradientTape gradients of the Keras model itself."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.attribution.distortion import gradient_distortion, sampling_box
from keras_roll.attribution.genetic import PopulationStore, ranking_keys
from keras_roll.attribution.gradients import LogitGradients
from keras_roll.compile.chunking import plan_directions


def _model(dtype="float64", in_dim=10, width=16, out=4, seed=0, link="softmax"):
    """A ReLU MLP with random biases (several regions near the data) and a folded link."""
    keras.utils.set_random_seed(seed)
    bias = keras.initializers.RandomNormal(stddev=0.3)
    inp = keras.Input((in_dim,), dtype=dtype)
    h = keras.layers.Dense(width, activation="relu", bias_initializer=bias, dtype=dtype)(inp)
    h = keras.layers.Dense(width, activation="relu", bias_initializer=bias, dtype=dtype)(h)
    logits = keras.layers.Dense(out, bias_initializer=bias, dtype=dtype, name="logits")(h)
    outputs = keras.layers.Activation(link, dtype=dtype)(logits) if link else logits
    return keras.Model(inp, outputs), keras.Model(inp, logits)


def _data(n=4, in_dim=10, dtype="float64", seed=1):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.2, 0.8, size=(n, in_dim)).astype(dtype)
    return x, rng.integers(0, 4, size=n)


def _tape_gradients(logits_model, x, y):
    """Independent reference: input gradient of logit y by tf.GradientTape."""
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        out = logits_model(xt)
        sel = tf.reduce_sum(tf.gather(out, y, axis=1, batch_dims=1))
    return tape.gradient(sel, xt).numpy(), out.numpy()


@pytest.fixture(scope="module")
def setup():
    model, logits_model = _model()
    x, y = _data()
    return model, logits_model, x, y


def test_zero_below_the_certified_linf_margin(setup):
    model, _, x, y = setup
    margin = keras_roll.certify(model, x, norms=(np.inf,), verbose=False).margins[np.inf]
    eps = 0.9 * float(margin.min())
    assert eps > 0
    for mode in ("expected", "max"):
        res = gradient_distortion(model, x, y, eps=eps, mode=mode, samples=300,
                                  population=120, generations=3, seed=0, verbose=False)
        np.testing.assert_array_equal(res.distortion, np.zeros(len(x)))
    # and clearly positive once the ball leaves the region
    res = gradient_distortion(model, x, y, eps=0.3, mode="expected", samples=300, seed=0,
                              verbose=False)
    assert np.all(res.distortion > 1e-3)


def test_values_match_tape_gradients_of_the_model(setup):
    model, logits_model, x, y = setup
    seen = []
    res = gradient_distortion(model, x, y, eps=0.2, mode="max", population=60, generations=2,
                              seed=3, verbose=False,
                              callback=lambda ex, c, d: seen.append((ex, c, d)))
    ex = np.concatenate([s[0] for s in seen])
    cands = np.concatenate([s[1] for s in seen])
    dist = np.concatenate([s[2] for s in seen])
    assert len(cands) == res.evaluations * len(x) == len(x) * (60 + 2 * 45)
    g_ref, logits_ref = _tape_gradients(logits_model, x, y)
    g, logits = _tape_gradients(logits_model, cands, y[ex])
    want = np.abs(g - g_ref[ex]).sum(axis=1)
    np.testing.assert_allclose(dist, want, rtol=1e-9, atol=1e-12)
    # the result is the largest distortion evaluated, at its point
    for i in range(len(x)):
        mine = ex == i
        assert res.distortion[i] == dist[mine].max()
        np.testing.assert_allclose(
            np.abs(_tape_gradients(logits_model, res.points[i:i + 1], y[i:i + 1])[0]
                   - g_ref[i]).sum(), res.distortion[i], rtol=1e-9, atol=1e-12)
    pred_at_points = logits_model(res.points).numpy().argmax(axis=1)
    np.testing.assert_array_equal(res.changed, pred_at_points != logits_ref.argmax(axis=1))
    changed = logits.argmax(axis=1) != logits_ref.argmax(axis=1)[ex]
    frac = np.array([changed[ex == i].mean() for i in range(len(x))])
    np.testing.assert_allclose(res.changed_fraction, frac)


def test_expected_mode_is_the_mean_over_uniform_draws(setup):
    model, logits_model, x, y = setup
    seen = []
    res = gradient_distortion(model, x, y, eps=0.15, mode="expected", samples=250, seed=5,
                              verbose=False, callback=lambda ex, c, d: seen.append((ex, c)))
    ex = np.concatenate([s[0] for s in seen])
    cands = np.concatenate([s[1] for s in seen])
    g_ref, _ = _tape_gradients(logits_model, x, y)
    g, _ = _tape_gradients(logits_model, cands, y[ex])
    dist = np.abs(g - g_ref[ex]).sum(axis=1)
    want = np.array([dist[ex == i].mean() for i in range(len(x))])
    np.testing.assert_allclose(res.distortion, want, rtol=1e-9)
    assert np.bincount(ex).tolist() == [250] * len(x)
    assert res.points is None and res.changed is None
    # uniform: the draws fill the box (mean near its centre, spread like U[-eps, eps])
    off = cands - x[ex]
    assert abs(off.mean()) < 0.01 and abs(off.std() - 0.15 / np.sqrt(3)) < 0.01


def test_max_is_at_least_expected(setup):
    model, _, x, y = setup
    kw = dict(eps=0.2, seed=0, verbose=False)
    mean = gradient_distortion(model, x, y, mode="expected", samples=400, **kw)
    worst = gradient_distortion(model, x, y, mode="max", population=100, generations=4, **kw)
    assert np.all(worst.distortion >= mean.distortion)
    assert np.all(worst.distortion > 0)


@pytest.mark.parametrize("mode", ["expected", "max"])
def test_every_candidate_stays_in_the_set(mode):
    model, _ = _model(dtype="float32")
    x, y = _data(dtype="float32")
    x[0, :3] = [0.0, 1.0, 0.01]  # on and next to the domain's faces
    eps = 0.05
    seen = []
    res = gradient_distortion(model, x, y, eps=eps, mode=mode, samples=200, population=80,
                              generations=3, seed=1, verbose=False,
                              callback=lambda ex, c, d: seen.append((ex, c)))
    ex = np.concatenate([s[0] for s in seen])
    cands = np.concatenate([s[1] for s in seen]).astype(np.float64)
    assert cands.dtype == np.float64 and len(cands) == len(x) * res.evaluations
    x64 = x.astype(np.float64)
    assert np.all(np.abs(cands - x64[ex]) <= eps)
    assert np.all((cands >= 0.0) & (cands <= 1.0))
    if mode == "max":
        # the crossover extrapolates (a in [-0.25, 1.25]): the projection is active
        lo, hi, _ = sampling_box(x, eps, (0.0, 1.0))
        assert np.mean((cands == lo[ex]) | (cands == hi[ex])) > 0.01
        pts = res.points.astype(np.float64)
        assert np.all(np.abs(pts - x64) <= eps) and np.all((pts >= 0) & (pts <= 1))


def test_domain_clipping_is_honoured():
    model, _ = _model(dtype="float64")
    x, y = _data()
    x[:, 0] = 0.0
    seen = {}

    def run(domain, key):
        seen[key] = []
        gradient_distortion(model, x, y, eps=0.1, domain=domain, mode="max", population=50,
                            generations=2, seed=0, verbose=False,
                            callback=lambda ex, c, d: seen[key].append(c))
        return np.concatenate(seen[key])

    free = run(None, "none")
    assert free[:, 0].min() < 0  # no box: candidates leave [0, 1]
    boxed = run((0.0, 1.0), "box")
    assert boxed[:, 0].min() >= 0
    low = np.full(x.shape[1], 0.0)
    low[1] = x[:, 1].min()  # per-coordinate bounds: coordinate 1 may not go below x
    high = np.full(x.shape[1], 0.85)
    per_coord = run((low, high), "array")
    assert per_coord[:, 1].min() >= low[1] and per_coord.max() <= 0.85
    lo, hi, dom = sampling_box(x, 0.1, (low, high))
    assert np.all(lo >= low) and np.all(hi <= high) and np.all(lo <= x) and np.all(x <= hi)
    assert isinstance(dom[0], np.ndarray) and dom[1] == 0.85


@pytest.mark.graph
def test_seed_reproduces_a_run_bit_for_bit(setup):
    model, _, x, y = setup
    kw = dict(eps=0.2, mode="max", population=64, generations=3, verbose=False)
    a = gradient_distortion(model, x, y, seed=7, **kw)
    b = gradient_distortion(model, x, y, seed=7, **kw)
    c = gradient_distortion(model, x, y, seed=8, **kw)
    np.testing.assert_array_equal(a.distortion, b.distortion)
    np.testing.assert_array_equal(a.points, b.points)
    np.testing.assert_array_equal(a.changed, b.changed)
    assert not np.array_equal(a.points, c.points)
    # an unseeded run records the entropy that reproduces it
    d = gradient_distortion(model, x, y, seed=None, **kw)
    e = gradient_distortion(model, x, y, seed=d.seed, **kw)
    np.testing.assert_array_equal(d.points, e.points)
    # expected mode: examples draw from their own streams, independent of batching
    # and chunking
    kw = dict(eps=0.2, mode="expected", samples=200, seed=4, verbose=False)
    whole = gradient_distortion(model, x, y, **kw)
    part = gradient_distortion(model, x[:2], y[:2], memory_budget=20_000, **kw)
    np.testing.assert_allclose(part.distortion, whole.distortion[:2], rtol=1e-12)


def test_sigmoid_output_takes_binary_labels():
    model, logits_model = _model(out=1, link="sigmoid")
    x, _ = _data()
    y = np.array([0, 1, 1, 0])
    kw = dict(eps=0.2, mode="expected", samples=100, seed=0, verbose=False)
    res = gradient_distortion(model, x, y, **kw)
    flipped = gradient_distortion(model, x, 1 - y, **kw)
    np.testing.assert_allclose(res.distortion, flipped.distortion)  # l1 of -g is l1 of g
    with pytest.raises(ValueError, match="y must be 0 or 1"):
        gradient_distortion(model, x, np.array([0, 1, 2, 0]), **kw)


def test_default_label_is_the_prediction(setup):
    model, logits_model, x, _ = setup
    pred = logits_model(x).numpy().argmax(axis=1)
    kw = dict(eps=0.2, mode="expected", samples=100, seed=0, verbose=False)
    np.testing.assert_array_equal(gradient_distortion(model, x, None, **kw).distortion,
                                  gradient_distortion(model, x, pred, **kw).distortion)


def test_bad_input_names_the_argument(setup):
    model, _, x, y = setup
    kw = dict(samples=10, verbose=False)
    cases = [
        (dict(y=y[None, :]), "y must have shape"),
        (dict(y=y[:3]), "y must have shape"),
        (dict(y=np.array([0, 1, 4, 0])), r"y must be in \[0, 4\)"),
        (dict(y=np.array([0, -1, 2, 0])), "y must be"),
        (dict(y=np.array([0.5, 1, 2, 0])), "y must hold integer"),
        (dict(eps=0.0), "eps must be"),
        (dict(eps=-0.1), "eps must be"),
        (dict(eps=float("nan")), "eps must be"),
        (dict(x=x + 1.0), "x lies outside domain"),
        (dict(x=np.where(np.eye(4, 10, dtype=bool), np.nan, x)),
         "Rows 0, 1, 2, 3 of x hold non-finite"),
        (dict(x=x[:, :5]), r"expects inputs of shape \(batch, 10\), got x of shape"),
        (dict(domain=(1.0, 0.0)), "domain must satisfy low < high"),
        (dict(domain=(0.0,)), "domain must be a"),
        (dict(mode="mean"), "mode must be"),
        (dict(samples=0), "samples must be"),
        (dict(population=0, mode="max"), "population must be"),
        (dict(generations=-1, mode="max"), "generations must be"),
        (dict(seed=-3), "seed must be"),
        (dict(memory_budget=0), "memory_budget must be"),
        (dict(verbose="loud"), "verbose must be"),
    ]
    for change, message in cases:
        args = dict(x=x, y=y, **kw)
        args.update(change)
        with pytest.raises(ValueError, match=message):
            gradient_distortion(model, **args)


def test_inputs_are_not_modified(setup):
    model, _, x, y = setup
    x0, y0 = x.copy(), y.copy()
    low, high = np.zeros(x.shape[1]), np.ones(x.shape[1])
    lo0, hi0 = low.copy(), high.copy()
    for mode in ("expected", "max"):
        gradient_distortion(model, x, y, domain=(low, high), mode=mode, samples=50,
                            population=20, generations=2, seed=0, verbose=False)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(low, lo0)
    np.testing.assert_array_equal(high, hi0)


def test_conv_model_and_summary(capsys):
    keras.utils.set_random_seed(0)
    bias = keras.initializers.RandomNormal(stddev=0.1)
    inp = keras.Input((6, 6, 2))
    h = keras.layers.Rescaling(2.0, offset=-1.0)(inp)  # normalisation inside the model
    h = keras.layers.Conv2D(3, 3, activation="relu", bias_initializer=bias)(h)
    h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.Flatten()(h)
    logits = keras.layers.Dense(3)(h)
    model = keras.Model(inp, logits)
    x = np.random.default_rng(0).uniform(0, 1, (3, 6, 6, 2)).astype("float32")
    y = np.array([0, 1, 2])
    seen = []
    res = gradient_distortion(model, x, y, eps=0.1, mode="max", population=40, generations=2,
                              seed=0, verbose=True, callback=lambda ex, c, d: seen.append((c, d)))
    assert res.points.shape == x.shape and res.points.dtype == np.float32
    cands = np.concatenate([c for c, _ in seen])
    g, _ = _tape_gradients(model, cands[:20], np.repeat(y, 20)[:20])
    g0, _ = _tape_gradients(model, x[:1], y[:1])
    want = np.abs(g - g0).reshape(20, -1).sum(axis=1)
    np.testing.assert_allclose(np.concatenate([d for _, d in seen])[:20], want,
                               rtol=1e-4, atol=1e-5)
    print(res.summary())
    out = capsys.readouterr().out
    assert "max l1 (GA)" in out and "Prediction changed" in out and "P50" in out
    assert "Distortion(n=3, mode='max'" in repr(res)


# ---------------------------------------------------------------------- chunked populations


def _whole_array_search(model, x, y, eps, population, generations, seed, memory_budget):
    """gradient_distortion(mode="max") as computed before populations were stored in
    chunks: both populations as whole [g, population, d] arrays, the same seeds,
    groups and evaluation chunks (kept here as the reference of the chunked search)."""
    engine = LogitGradients.of(model)
    lo, hi, _ = sampling_box(x, eps, (0.0, 1.0))
    b, ex_shape = len(x), x.shape[1:]
    d = int(np.prod(ex_shape))
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(b)]
    chunk = engine.chunk_size(ex_shape, memory_budget, total=b * population)
    index, sign = np.asarray(y, np.int32), np.ones(b)

    def evaluate(cands, owner, ref):
        out = [engine.distortion(cands[i:i + chunk], owner[i:i + chunk], ref)
               for i in range(0, len(cands), chunk)]
        return np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])

    keep = max(1, int(np.floor(0.25 * population + 0.5)))
    children = population - keep
    budget = 4 * (memory_budget or engine.lin.memory_budget)
    group = max(1, plan_directions(b, population * d * x.itemsize, budget)[0])
    dist, points = np.zeros(b), np.empty_like(x)
    for g0 in range(0, b, group):
        ex = np.arange(g0, min(b, g0 + group))
        g = ex.size
        ref = engine.reference(x[ex], index[ex], sign[ex])
        low, high = lo[ex].reshape(g, 1, d), hi[ex].reshape(g, 1, d)
        pop = np.empty((g, population, d), x.dtype)
        for e in range(g):
            u = streams[ex[e]].random((population, d))
            l64 = low[e].astype(np.float64)
            pop[e] = (l64 + u * (high[e].astype(np.float64) - l64)).astype(x.dtype)
        np.clip(pop, low, high, out=pop)
        score, _ = evaluate(pop.reshape(-1, *ex_shape), np.repeat(np.arange(g), population), ref)
        score = score.reshape(g, population)
        nxt = np.empty_like(pop)
        for _ in range(generations):
            order = np.argsort(-score, axis=1, kind="stable")[:, :keep]
            score = np.take_along_axis(score, order, axis=1)
            for e in range(g):
                surv = nxt[e, :keep]
                np.take(pop[e], order[e], axis=0, out=surv)
                rng = streams[ex[e]]
                i = rng.integers(0, keep, size=children)
                j = rng.integers(0, keep, size=children)
                a = rng.uniform(-0.25, 1.25, size=(children, 1)).astype(x.dtype)
                kids, other = nxt[e, keep:], surv[j]
                np.subtract(surv[i], other, out=kids)
                kids *= a
                kids += other
            np.clip(nxt[:, keep:], low, high, out=nxt[:, keep:])
            k_score, _ = evaluate(nxt[:, keep:].reshape(-1, *ex_shape),
                                  np.repeat(np.arange(g), children), ref)
            pop, nxt = nxt, pop
            score = np.concatenate([score, k_score.reshape(g, children)], axis=1)
        best = np.argmax(score, axis=1)
        dist[ex] = score[np.arange(g), best]
        points[ex] = pop[np.arange(g), best].reshape(g, *ex_shape)
    return dist, points


# In memory (every other search of this file) and in a temporary file; compiled: its
# many small chunks take ten times longer eagerly.
@pytest.mark.graph
@pytest.mark.parametrize("memory_budget", [pytest.param(None, marks=pytest.mark.slow), 300])
def test_chunked_populations_reproduce_the_whole_array_search_bit_for_bit(memory_budget,
                                                                          monkeypatch):
    model, _ = _model(dtype="float32")
    x, y = _data(n=3, dtype="float32")
    kw = dict(eps=0.2, population=40, generations=3, seed=11)
    kinds = []
    init = PopulationStore.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        kinds.append(self.arrays is not None)

    monkeypatch.setattr(PopulationStore, "__init__", spy)
    res = gradient_distortion(model, x, y, mode="max", verbose=False,
                              memory_budget=memory_budget, **kw)
    # 40 x 10 float32 per population: one group in memory, or one file per example
    assert kinds == ([True] if memory_budget is None else [False] * 3)
    dist, points = _whole_array_search(model, x, y, memory_budget=memory_budget, **kw)
    np.testing.assert_array_equal(res.distortion, dist)
    np.testing.assert_array_equal(res.points, points)


def test_ranking_keys_tie_scores_apart_only_by_float32_rounding():
    ulp = 2.0**-23
    score = np.array([[1.0, 1.0 + ulp, 0.5, 1.0 - 2 * ulp, 0.75 + 4 * ulp, 0.75],
                      [-3.0, 2.0 + 8 * ulp, 2.0, 0.0, -3.0 * (1 + ulp), 2.0 - ulp]])
    order = np.argsort(-ranking_keys(score), axis=1, kind="stable")
    # within a few float32 ulps: tied, in the order of the rows (the earlier first)
    np.testing.assert_array_equal(order, [[0, 1, 3, 4, 5, 2], [1, 2, 5, 3, 0, 4]])
    assert np.argsort(-score[0], kind="stable")[0] == 1  # the raw scores rank the noise
    # scores apart by more than the rounding keep their order
    spread = np.random.default_rng(0).permutation(np.linspace(-2.0, 5.0, 400))[None]
    np.testing.assert_array_equal(np.argsort(-ranking_keys(spread), axis=1, kind="stable"),
                                  np.argsort(-spread, axis=1, kind="stable"))


def test_population_store_in_a_file_reads_what_it_wrote():
    rng = np.random.default_rng(0)
    stores = [PopulationStore(2, 7, 5, "float32", in_memory=m) for m in (True, False)]
    data = rng.normal(size=(2, 2, 7, 5)).astype("float32")
    for store in stores:
        for slot in (0, 1):
            for e in (0, 1):
                store.write(slot, e, 0, data[slot, e, :4])
                store.write(slot, e, 4, data[slot, e, 4:])
    rows = np.array([6, 0, 3, 3])
    for slot in (0, 1):
        for e in (0, 1):
            for store in stores:
                np.testing.assert_array_equal(store.read(slot, e, rows), data[slot, e, rows])
                np.testing.assert_array_equal(store.read(slot, e, slice(2, 5)),
                                              data[slot, e, 2:5])
    assert stores[1].arrays is None and stores[1].files is not None
    for store in stores:
        store.close()
