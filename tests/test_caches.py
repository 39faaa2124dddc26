"""Compiled functions and engines go with their model: every public function, called on
a model that is then dropped, lets the garbage collector free it (a notebook that
trains and inspects many models must not keep them all)."""

import gc
import weakref

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.compile.caches import cached

X = np.random.default_rng(0).uniform(0.2, 0.8, size=(3, 6)).astype(np.float32)

CALLS = {
    "certify": lambda m: keras_roll.certify(m, X, verbose=False),
    "stability_bounds": lambda m: keras_roll.stability_bounds(m, X, verbose=False),
    "count_regions": lambda m: keras_roll.count_regions(m, X, verbose=False),
    "roll_loss": lambda m: keras_roll.roll_loss(m, X),
    "integrated_gradients": lambda m: keras_roll.integrated_gradients(m, X, verbose=False),
    "riemann": lambda m: keras_roll.integrated_gradients(m, X, steps=4, verbose=False),
    "saliency": lambda m: keras_roll.saliency(m, X, radius=True, verbose=False),
    "smoothgrad": lambda m: keras_roll.smoothgrad(m, X, samples=3, seed=0, verbose=False),
    "faithfulness": lambda m: keras_roll.faithfulness(m, X, None, np.ones_like(X),
                                                      metrics=("deletion",), step_size=0.5,
                                                      verbose=False),
    "gradient_distortion": lambda m: keras_roll.gradient_distortion(
        m, X[:1], eps=0.05, mode="expected", samples=2, seed=0, verbose=False),
    "robust_radius": lambda m: keras_roll.robust_radius(m, X, norms=(2,), verbose=False),
}


def _model(activation):
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,))
    h = keras.layers.Dense(5, activation=activation)(inp)
    return keras.Model(inp, keras.layers.Dense(3)(h))


def _freed_after(calls) -> bool:
    model = _model("relu")
    for call in calls:
        call(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    return ref() is None


def test_a_dropped_model_is_freed_after_every_public_function():
    assert _freed_after(CALLS.values()), (
        "a function kept the model alive; `pytest -m slow -k dropped` names it")


@pytest.mark.slow  # the same, one function at a time: says which one keeps the model
@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_dropped_model_is_freed(name):
    assert _freed_after([CALLS[name]]), f"{name} kept the model alive"


def test_a_dropped_smooth_model_is_freed():
    """Models that are not piecewise linear take the tape path (its own engine)."""
    model = _model("tanh")
    keras_roll.saliency(model, X)
    keras_roll.integrated_gradients(model, X, steps=4, verbose=False)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_cached_builds_once_per_owner_and_key():
    class Owner:
        pass

    a, b, built = Owner(), Owner(), []
    make = lambda: built.append(1) or len(built)  # noqa: E731
    assert cached(a, "k", make) == 1 and cached(a, "k", make) == 1
    assert cached(a, "other", make) == 2 and cached(b, "k", make) == 3
    assert cached(object(), "k", make) == 4  # no __dict__: built, not kept



def test_threads_asking_at_once_get_one_make_and_one_trace():
    """Replica threads (`keras_roll.distribute.Replicas`) that ask for the same compiled
    function at once share one: one `make()`, so one trace (here `make` traces, as a
    pass compiled for a fixed signature does), while another key is built meanwhile
    (a lock per key, not one for the whole owner). Unlocked, each thread builds and
    traces its own."""
    import threading
    import time

    import tensorflow as tf

    class Owner:
        pass

    owner, traces, start = Owner(), [], threading.Barrier(4)

    def make():
        def body(x):
            traces.append(1)  # Python runs only while tracing
            return 2 * x

        fn = tf.function(body, autograph=False).get_concrete_function(
            tf.TensorSpec([], tf.float32))
        time.sleep(0.5)  # a slow build: the other threads ask meanwhile
        return fn

    got, other = [None] * 3, []

    def worker(i):
        start.wait()
        got[i] = cached(owner, "fn", make)

    def other_key():
        start.wait()
        time.sleep(0.05)  # while "fn" is being built
        began = time.monotonic()
        other.append(cached(owner, "other", lambda: "value"))
        other.append(time.monotonic() - began)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    threads.append(threading.Thread(target=other_key))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(traces) == 1, traces
    assert got[0] is got[1] is got[2] and float(got[0](tf.constant(1.5))) == 3.0
    assert other[0] == "value" and other[1] < 0.3, other  # did not wait for "fn"
