"""MMR's tangent pass in chunks of input axes (a large CNN's step within its budget).

On a small residual CNN (a convolution, a residual Add, ReLU, Dense), a tiny
`memory_budget` splits the `D` input axes into several chunks (counted through the
chunked custom gradient). For l1, l2 and l_inf:

* the distances equal nested `tf.GradientTape`s' (every neuron's and logit's input
  gradient by `batch_jacobian`, its dual norm);
* the regularizer equals the MMR of those distances, and its weight gradient that of
  the one-pass term (a large budget; tested against central differences in
  tests/test_regularizers.py);
* (slow) in a `tf.function` whose batch is None, the chunks planned in the graph give
  the same term and gradient.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.regularizers.mmr import MMRTerm, mmr_distances
from keras_roll.roll import chunks

K_B, K_D, GAMMA_B, GAMMA_D = 6, 2, 3.0, 4.0
SMALL_BUDGET = 400_000  # bytes: several chunks of the 72 input axes for 3 examples


def residual_cnn():
    keras.utils.set_random_seed(1)
    conv = dict(padding="same", dtype="float64",
                bias_initializer=keras.initializers.RandomNormal(0, 0.2))
    inp = keras.Input((6, 6, 2), dtype="float64")
    a = keras.layers.Conv2D(3, 3, name="c1", **conv)(inp)
    r = keras.layers.ReLU(dtype="float64", name="r1")(a)
    b = keras.layers.Conv2D(3, 3, name="c2", **conv)(r)
    s = keras.layers.Add(dtype="float64")([a, b])
    h = keras.layers.ReLU(dtype="float64", name="r2")(s)
    flat = keras.layers.Flatten(dtype="float64")(h)
    out = keras.layers.Dense(4, dtype="float64", name="logits")(flat)
    return keras.Model(inp, out), keras.Model(inp, [a, s, out])


@pytest.fixture(scope="module")
def case():
    model, probe = residual_cnn()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 6, 6, 2))
    y = np.array([0, 2, 3], np.int32)
    return model, probe, x, y


def tape_terms(probe, x, y, p):
    """`(d_B [B, N], d_D [B, L], MMR [B])` from nested-tape input gradients."""
    q = {1: np.inf, 2: 2, np.inf: 1}[p]
    xt = tf.constant(x)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(xt)
        a, s, logits = probe(xt)
        z = tf.concat([tf.reshape(a, [3, -1]), tf.reshape(s, [3, -1])], axis=1)
    jz = tf.reshape(tape.batch_jacobian(z, xt), [3, z.shape[1], -1])
    jl = tf.reshape(tape.batch_jacobian(logits, xt), [3, logits.shape[1], -1])

    def norm(g):
        return tf.norm(g, ord=q, axis=-1)

    d_b = tf.abs(z) / norm(jz)
    own = tf.gather(jl, y, axis=1, batch_dims=1)
    margin = tf.gather(logits, y, axis=1, batch_dims=1)[:, None] - logits
    label = tf.one_hot(y, 4) > 0
    d_d = margin / tf.where(label, tf.ones_like(margin), norm(own[:, None] - jl))
    d_d = tf.where(label, tf.constant(np.inf, tf.float64), d_d)

    def hinge(d, k, gamma):
        smallest = -tf.math.top_k(-d, k=k).values
        return tf.reduce_mean(tf.nn.relu(1.0 - smallest / gamma), axis=1)

    return d_b, d_d, hinge(d_b, K_B, GAMMA_B) + hinge(d_d, K_D, GAMMA_D)


@pytest.fixture
def chunk_counter(monkeypatch):
    calls = []
    real = chunks.chunked_sum_squares

    def counted(*args, **kwargs):
        calls.append(args[6])  # the number of chunks
        return real(*args, **kwargs)

    monkeypatch.setattr(chunks, "chunked_sum_squares", counted)
    return calls


@pytest.mark.parametrize("p", [1, 2, np.inf])
def test_chunked_mmr_equals_tapes_and_one_pass(case, chunk_counter, p):
    model, probe, x, y = case
    config = keras_roll.MMRConfig(p=p, k_B=K_B, k_D=K_D, gamma_B=GAMMA_B, gamma_D=GAMMA_D)
    ref_b, ref_d, ref = tape_terms(probe, x, y, p)
    ref = tf.reduce_mean(ref)

    dist = mmr_distances(keras_roll.linearize(model, memory_budget=SMALL_BUDGET),
                         tf.constant(x), tf.constant(y), float(p))
    assert chunk_counter and int(chunk_counter[-1]) >= 3, chunk_counter
    np.testing.assert_allclose(np.sort(dist.boundary.numpy(), 1), np.sort(ref_b.numpy(), 1),
                               rtol=1e-10)
    np.testing.assert_allclose(dist.decision.numpy(), ref_d.numpy(), rtol=1e-10)

    losses, grads = [], []
    for budget in (SMALL_BUDGET, 2**30):
        lin = keras_roll.linearize(model, memory_budget=budget)
        with tf.GradientTape() as tape:
            term = MMRTerm(lin, config)
            losses.append(tf.reduce_mean(term(x, y, training=True).per_example))
        grads.append(tape.gradient(losses[-1], model.trainable_variables))
    assert float(ref) > 0.05  # the hinges are active
    for loss in losses:
        assert float(loss) == pytest.approx(float(ref), rel=1e-10)
    for g, r in zip(*grads):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-10, atol=1e-14)
    assert max(float(tf.reduce_max(tf.abs(g))) for g in grads[0]) > 1e-3


@pytest.mark.slow  # 8 CPU s: tracing both branches of the planned chunks
@pytest.mark.graph
def test_chunks_planned_in_a_graph_with_a_dynamic_batch(case):
    """A `tf.function` whose batch is None plans the chunks in the graph: the same term
    and weight gradient as eagerly, for the l1 maximum."""
    model, _, x, y = case
    config = keras_roll.MMRConfig(p=1, k_B=K_B, k_D=K_D, gamma_B=GAMMA_B, gamma_D=GAMMA_D)
    term = MMRTerm(keras_roll.linearize(model, memory_budget=SMALL_BUDGET), config)

    def loss_and_grads(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(term(xb, yb, training=True).per_example)
        return loss, tape.gradient(loss, model.trainable_variables)

    spec = [tf.TensorSpec([None, 6, 6, 2], tf.float64), tf.TensorSpec([None], tf.int32)]
    graph = tf.function(loss_and_grads, input_signature=spec)
    got, got_grads = graph(tf.constant(x), tf.constant(y))
    ref, ref_grads = loss_and_grads(tf.constant(x), tf.constant(y))
    assert float(got) == pytest.approx(float(ref), rel=1e-12)
    for g, r in zip(got_grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-10, atol=1e-14)
