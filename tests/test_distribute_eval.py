"""Evaluation over devices: the five calls under a `tf.distribute` strategy, and
the many-worker recipe (shards joined by the results' `concat`).

* Two replicas against one device: in this process, the calls of
  `tests/eval_calls.py` on a tiny MLP split over two replicas that are two threads on
  the one device there is (`Replicas.of` made to return them: the executor's
  slicing, threads, shared progress bar and joins, as under a two-device
  `MirroredStrategy`), against no strategy. The slow test runs them under a real
  `MirroredStrategy` of two logical devices, which must be configured before
  TensorFlow initialises: in a fresh interpreter (`tests/_eval_distribute.py`,
  compiled functions as graphs, the MLP and a tiny CNN, about 40 s of CPU) that
  saves every per-example array of both runs; the test compares them. Every example is
  computed from itself alone, but a replica computes it in a batch of another
  size, where a matmul or convolution kernel may round differently in the last
  bit. Certificates and lower radii (float64) agree to a relative 1e-12 (bitwise
  in the runs observed); the attack's upper radii (float32 steps) and gradients
  (float32: the saliency maps, the distortion's l1 of float32 gradients, the exact
  integral's float32 segments on the CNN) to a relative 1e-5 (observed: a few
  float32 ulps); a Riemann integral's completeness gap, a difference of float32 sums,
  to a relative 1e-5 of the attributions' l1 norm. Labels, region counts, binding
  neurons and changed predictions must agree exactly.
* In this process (one device): the executor's slicing, the strategy checks,
  `OneDeviceStrategy` against no strategy, and the recipe: each of the five
  results of interleaved shards `x[w::2]`, joined by `concat`, against one call
  on the whole input.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.distribute import Replicas, split_batch
from keras_roll.inputs import Batch
from keras_roll.options import RunOptions
from tests import eval_calls, model_zoo
from tests.scripts import run_script

FLOAT32_RTOL = 1e-5  # float32 gradients computed in batches of another size
FLOAT64_RTOL = 1e-12  # float64 certificates: the same, up to a kernel's rounding
# the attack's upper bounds: a local search whose float32 steps, rounded differently on
# a batch of another size, may settle in another local optimum (the search's precision)
ATTACK_RTOL = 1e-3


def _run(out, *flags):
    run_script("_eval_distribute.py", out, *flags, timeout=900)
    with np.load(out, allow_pickle=False) as data:
        return dict(data)


def _pairs(arrays, other):
    pairs = [(k, k.replace("/one/", f"/{other}/")) for k in sorted(arrays) if "/one/" in k]
    return [(k, j) for k, j in pairs if j in arrays]


def _check_runs(arrays, models=("mlp",)):
    pairs = _pairs(arrays, "two")
    every = {"certify", "robust_radius", "saliency", "integrated_exact",
             "integrated_riemann", "distortion_expected", "distortion_max"}
    for model in models:
        assert {k.split("/")[0] for k, _ in pairs if f"/{model}/" in k} == every, model
    for one, two in pairs + _pairs(arrays, "scope"):
        a, b = arrays[one], arrays[two]
        assert a.shape == b.shape and a.shape[0] == 5, (two, a.shape, b.shape)
        if a.dtype.kind not in "fc":
            np.testing.assert_array_equal(a, b, err_msg=two)
            continue
        upper = one.split("/")[0] == "robust_radius" and "/upper" in one
        float64 = one.split("/")[0] in ("certify", "robust_radius") and not upper
        rtol = ATTACK_RTOL if upper else FLOAT64_RTOL if float64 else FLOAT32_RTOL
        scale = np.nanmax(np.abs(a)) if a.size else 0.0
        if one.endswith("/delta"):  # a difference of sums rounds relative to its terms
            maps = arrays[one.replace("/delta", "/maps")]
            scale = np.max(np.sum(np.abs(maps.reshape(len(maps), -1)), axis=1))
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * scale, err_msg=two)
    # the check can fail: the runs computed something, with finite radii
    for model in models:
        assert np.isfinite(arrays[f"certify/{model}/one/margins[2]"]).all()
        assert (arrays[f"certify/{model}/one/margins[inf]"] > 0).any()


def test_two_replicas_give_the_one_device_results(monkeypatch):
    model, x, domain = eval_calls.models()["mlp"]
    runs = {"one": eval_calls.calls(model, x, domain)}
    device = tf.config.list_logical_devices("CPU")[0].name
    monkeypatch.setattr(Replicas, "of", classmethod(lambda cls, strategy=None: cls((device,) * 2)))
    assert Replicas.of(None).count == 2
    runs["two"] = eval_calls.calls(model, x, domain)
    _check_runs({f"{call}/mlp/{run}/{field}": value for run, results in runs.items()
                 for call, values in results.items() for field, value in values.items()})


@pytest.mark.slow
def test_two_replicas_give_the_one_device_results_on_every_call_of_the_cnn(tmp_path):
    arrays = _run(tmp_path / "runs.npz", "--full")
    _check_runs(arrays, ("mlp", "cnn"))


# ----------------------------------------------------------------- the executor


def test_slices_cover_the_examples_in_order():
    two = Replicas(("/cpu:0", "/cpu:1"))
    assert two.slices(5) == [slice(0, 3), slice(3, 5)]
    assert two.slices(1) == [slice(0, 1)]  # the second replica gets nothing
    assert Replicas(("a", "b", "c")).slices(7) == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert Replicas().slices(4) == [slice(0, 4)]


def test_map_runs_each_slice_on_its_device_and_keeps_the_order():
    one = "/job:localhost/replica:0/task:0/device:CPU:0"
    replicas = Replicas((one, one))  # two replicas on the one device there is here
    x = np.arange(7.0)

    def work(sl):
        t = tf.constant(x[sl]) * 2.0
        return t.device, t.numpy()

    parts = replicas.map(work, len(x))
    assert [d for d, _ in parts] == [one, one]
    np.testing.assert_array_equal(np.concatenate([v for _, v in parts]), 2 * x)


def test_the_default_strategy_costs_nothing():
    replicas = Replicas.of(None)
    assert replicas.devices == () and replicas.count == 1
    batch = Batch(tf.zeros([3, 2]), None, None, slice(0, 3))
    assert replicas.map_batch(lambda b: b, batch) == [batch]  # the batch itself, no copy
    bar = object()
    assert replicas.serial(bar) is bar


def test_split_batch_keeps_labels_directions_and_positions():
    batch = Batch(tf.reshape(tf.range(12.0), [4, 3]), np.arange(4), np.zeros((4, 2, 3)),
                  slice(10, 14))
    part = split_batch(batch, slice(1, 3))
    np.testing.assert_array_equal(part.x.numpy(), batch.x.numpy()[1:3])
    np.testing.assert_array_equal(part.y, [1, 2])
    assert part.directions.shape == (2, 2, 3) and part.index == slice(11, 13)
    shared = Batch(batch.x, np.array(2), None, batch.index)  # one class for every example
    assert split_batch(shared, slice(0, 1)).y == 2


def test_serial_runs_one_call_at_a_time():
    calls = []
    replicas = Replicas(("/cpu:0", "/cpu:0"))
    record = replicas.serial(calls.append)
    replicas.map(lambda sl: [record(i) for i in range(sl.start, sl.stop)], 50)
    assert sorted(calls) == list(range(50))


# ------------------------------------------------------------------ the option


def test_strategy_option_is_checked():
    with pytest.raises(ValueError, match="strategy must be a tf.distribute.Strategy.*'mirrored'"):
        RunOptions(strategy="mirrored")
    with pytest.raises(ValueError, match="CentralStorageStrategy is not supported.*concat"):
        RunOptions(strategy=tf.distribute.experimental.CentralStorageStrategy())
    assert RunOptions().strategy is None
    default = tf.distribute.get_strategy()
    assert RunOptions(strategy=default).strategy is default
    assert Replicas.of(default).devices == ()


def test_functions_on_one_device_refuse_the_strategy():
    model = model_zoo.mlp(fused=True)
    x = np.zeros((2, 6), "float32")
    with pytest.raises(TypeError, match="stability_bounds.*strategy"):
        keras_roll.stability_bounds(model, x, strategy=tf.distribute.get_strategy())
    with pytest.raises(TypeError, match="lp_margins.*strategy"):
        keras_roll.lp_margins(model, x, strategy=tf.distribute.get_strategy())


def test_one_device_strategy_gives_the_same_certificate():
    model = model_zoo.mlp(fused=True)
    x = np.random.default_rng(1).uniform(0, 1, (5, 6)).astype("float32")
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    assert Replicas.of(strategy).count == 1 and Replicas.of(strategy).devices
    plain = keras_roll.certify(model, x, verbose=False)
    placed = keras_roll.certify(model, x, verbose=False, strategy=strategy)
    for p in (1, 2, np.inf):
        np.testing.assert_array_equal(placed.margins[p], plain.margins[p])  # same batches


# ------------------------------------------------------------ the worker recipe


@pytest.fixture(scope="module")
def recipe():
    rng = np.random.default_rng(2)
    model = model_zoo.mlp(fused=True)
    x = rng.uniform(0, 1, (7, 6)).astype("float32")
    y = np.arange(7) % 3
    order = np.concatenate([np.arange(7)[w::2] for w in range(2)])  # the shards' order
    return model, x, y, order


def _shards(call, recipe, pickled=True):
    model, x, y, order = recipe
    parts = [call(model, x[w::2], y[w::2]) for w in range(2)]
    if pickled:  # as a worker would send it
        parts = [pickle.loads(pickle.dumps(p)) for p in parts]
    return type(parts[0]).concat(parts), call(model, x, y), order


def test_recipe_certificate(recipe):
    joined, whole, order = _shards(lambda m, x, y: keras_roll.certify(m, x, verbose=False),
                                   recipe)
    for p in (1, 2, np.inf):
        np.testing.assert_allclose(joined.margins[p], whole.margins[p][order], rtol=FLOAT64_RTOL)
        np.testing.assert_array_equal(joined.binding_index[p], whole.binding_index[p][order])
    np.testing.assert_allclose(joined.logits, whole.logits[order], rtol=FLOAT32_RTOL)


def test_recipe_robust_radius(recipe):
    joined, whole, order = _shards(
        lambda m, x, y: keras_roll.robust_radius(m, x, y, method="region", verbose=False),
        recipe)  # the join does not depend on the method: the fast one
    for p in (2, np.inf):
        np.testing.assert_allclose(joined.lower[p], whole.lower[p][order], rtol=FLOAT64_RTOL)
        np.testing.assert_allclose(joined.upper[p], whole.upper[p][order], rtol=FLOAT64_RTOL)
    np.testing.assert_array_equal(joined.labels, whole.labels[order])


def test_recipe_saliency(recipe):
    joined, whole, order = _shards(
        lambda m, x, y: keras_roll.saliency(m, x, y, radius=True, verbose=False), recipe)
    np.testing.assert_allclose(joined.maps, whole.maps[order], rtol=FLOAT32_RTOL)
    np.testing.assert_array_equal(joined.labels, whole.labels[order])
    np.testing.assert_allclose(joined.radius[2], whole.radius[2][order], rtol=FLOAT64_RTOL)
    assert joined.postprocessed is False and joined.n == 7


def test_recipe_integrated_gradients(recipe):
    joined, whole, order = _shards(
        lambda m, x, y: keras_roll.integrated_gradients(m, x, y, verbose=False), recipe)
    np.testing.assert_allclose(joined.maps, whole.maps[order], rtol=FLOAT32_RTOL, atol=1e-9)
    np.testing.assert_array_equal(joined.regions, whole.regions[order])
    np.testing.assert_allclose(joined.f_x, whole.f_x[order], rtol=FLOAT32_RTOL)


def test_recipe_distortion(recipe):
    model, x, y, _ = recipe

    def run(xs, ys, seed):
        return keras_roll.gradient_distortion(model, xs, ys, eps=0.1, samples=4, seed=seed,
                                              verbose=False)

    parts = [run(x[w::2], y[w::2], 10 + w) for w in range(2)]
    joined = keras_roll.Distortion.concat([pickle.loads(pickle.dumps(p)) for p in parts])
    np.testing.assert_array_equal(joined.distortion,
                                  np.concatenate([p.distortion for p in parts]))
    # each shard's part is that worker's own call: its draws depend on its seed alone
    np.testing.assert_array_equal(joined.distortion[:4], run(x[0::2], y[0::2], 10).distortion)
    assert joined.seed is None and joined.n == 7  # no one seed reproduces the join
    assert keras_roll.Distortion.concat([parts[0], parts[0]]).seed == parts[0].seed
    other = keras_roll.gradient_distortion(model, x[:2], y[:2], eps=0.2, samples=4, seed=10,
                                           verbose=False)
    with pytest.raises(ValueError, match="different runs.*eps=0.2"):
        keras_roll.Distortion.concat([parts[0], other])


def test_concat_refuses_mixed_runs(recipe):
    model, x, y, _ = recipe
    exact = keras_roll.integrated_gradients(model, x[:2], y[:2], verbose=False)
    riemann = keras_roll.integrated_gradients(model, x[:2], y[:2], steps=4, verbose=False)
    with pytest.raises(ValueError, match="regions is None in part 1"):
        keras_roll.IntegratedGradients.concat([exact, riemann])
    with pytest.raises(ValueError, match="needs at least one"):
        keras_roll.Saliency.concat([])
    with pytest.raises(ValueError, match="part 1 is a IntegratedGradients"):
        keras_roll.Saliency.concat([keras_roll.saliency(model, x[:2]), exact])
