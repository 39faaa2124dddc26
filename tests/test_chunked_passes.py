"""Bound passes run chunk by chunk in one traced loop: the same bounds and gradients as
one chunk (the reference: no loop at all), a graph whose size does not depend on the
number of chunks, and bounds that hold at sampled points.

The subject is a small CNN with a residual Add, whose two ReLU layers have 144 units
each: with `examples` examples per call and `fit` rows of functionals per chunk, the
budget is `fit * examples * 24 * 144` bytes (`crown.py`'s estimate: three float64
copies of the widest value per row), which cuts the `2 * 144` rows of the second layer
into `ceil(288 / fit)` chunks. The first layer's input is affine in the model input:
only its `144` rows of `+I` are pulled back, shared by the batch (one example's memory),
in `ceil(144 / (fit * examples))` chunks."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_roll.compile.bounds import BoundMethod, capture, lower_bounds
from keras_roll.compile.bounds.crown import RelaxedOps, affine_in_input, relaxation_refiner
from keras_roll.compile.bounds.ibp import interval_pass
from keras_roll.compile.chunking import map_chunks
from keras_roll.compile.rules import Activation
from keras_roll.compile.structure import structure_of
from keras_roll.compile.twin import linearize
from keras_roll.robust.bounds import arithmetic_of

L = keras.layers
EPS = 0.05
WIDEST = 6 * 6 * 4  # units of each ReLU layer (and the widest value)
B = 2


def _residual_cnn():
    keras.utils.set_random_seed(7)
    inp = keras.Input((6, 6, 2))
    h1 = L.Conv2D(4, 3, padding="same", activation="relu")(inp)
    h2 = L.Conv2D(4, 3, padding="same", activation="relu")(h1)
    h = L.Flatten()(L.Add()([h1, h2]))
    return keras.Model(inp, L.Dense(3)(h))


def _budget(chunks: int) -> int:
    """A budget that cuts each ReLU layer's `2 * WIDEST` rows into `chunks` chunks."""
    fit = -(-2 * WIDEST // chunks)
    assert -(-2 * WIDEST // fit) == chunks
    return fit * B * 24 * WIDEST


def _setup():
    model = _residual_cnn()
    x = np.random.default_rng(0).uniform(0, 1, (B, 6, 6, 2))
    twin = linearize(model).at_dtype("float64")
    return model, twin, structure_of(twin.program), x


def _rows():
    eye = np.eye(3)[None]
    return tf.constant(np.concatenate([eye, -eye], 1))


def _bounds(twin, structure, x, budget, p=np.inf):
    values = capture(twin.interpreter, tf.convert_to_tensor(x))
    return lower_bounds(structure, values, _rows(), tf.fill([B], EPS), p,
                        BoundMethod.RELAXATION, arithmetic_of(twin, guard=True), budget, B)


def test_map_chunks_pads_the_last_chunk_and_keeps_the_order():
    """`map_chunks` over 10 columns in chunks of 4 (the last one padded) equals the
    columns computed at once."""
    cols = tf.reshape(tf.range(30, dtype=tf.float64), [3, 10])

    def fn(start):
        idx = tf.minimum(start + tf.range(4), 9)
        return tf.gather(cols, idx, axis=1)

    np.testing.assert_array_equal(map_chunks(fn, 10, 4, tf.float64).numpy(), cols.numpy())
    np.testing.assert_array_equal(map_chunks(fn, 3, 4, tf.float64).numpy(), cols[:, :3])


# l2 slow: the chunks cut the pulled-back rows, whatever the norm (it enters only the
# concretization on the input ball); the relaxation's l2 balls are probed by default in
# tests/test_robust.py (test_probes_inside_the_lower_bound_keep_the_prediction).
@pytest.mark.parametrize("p", [np.inf, pytest.param(2, marks=pytest.mark.slow)])
def test_chunked_relaxation_equals_one_chunk_and_is_sound(p):
    """CROWN's layer bounds pulled back in 7 chunks (the last one padded), 20 chunks or
    one give the same bounds, to rounding; they contain the logit differences at 300
    points sampled in the ball (l_inf: with its two corners)."""
    _, twin, structure, x = _setup()
    one = _bounds(twin, structure, x, 2**40, p).numpy()
    for chunks in (7, 20):
        got = _bounds(twin, structure, x, _budget(chunks), p).numpy()
        np.testing.assert_allclose(got, one, rtol=1e-12, atol=1e-12)
    rng = np.random.default_rng(1)
    u = rng.uniform(-1, 1, (300, *x.shape))
    if p == 2:
        u /= np.sqrt(np.sum(u**2, axis=(2, 3, 4), keepdims=True))
    u[0], u[1] = 1.0, -1.0
    if p == 2:
        u[:2] /= np.sqrt(x[0].size)
    d = (twin.primal((x[None] + EPS * u).reshape(-1, *x.shape[1:])).logits.numpy()
         .reshape(300, B, 3) - twin.primal(x).logits.numpy()[None])
    assert np.all(d >= got[None, :, :3] - 1e-12)
    assert np.all(d <= -got[None, :, 3:] + 1e-12)


@pytest.mark.graph
def test_traced_ops_do_not_depend_on_the_number_of_chunks():
    """Compiled (the chunks in a `tf.while_loop`), a CROWN pass traces as many ops for 5
    chunks per layer (2 for the first layer) as for 20 (5), and both give the bounds of
    one chunk."""
    _, twin, structure, x = _setup()
    one = _bounds(twin, structure, x, 2**40).numpy()
    spec = tf.TensorSpec([B, 6, 6, 2], tf.float64)
    counts = {}
    for chunks in (5, 20):
        fn = tf.function(lambda t, b=_budget(chunks): _bounds(twin, structure, t, b),
                         autograph=False)  # as robust_radius compiles its passes
        concrete = fn.get_concrete_function(spec)
        counts[chunks] = len(concrete.graph.get_operations())
        np.testing.assert_allclose(concrete(tf.constant(x)).numpy(), one, rtol=1e-12,
                                   atol=1e-12)
    assert counts[5] == counts[20], counts


@pytest.mark.slow
def test_chunked_relaxation_is_differentiable_like_one_chunk():
    """In a compiled step (slow: two traced gradients), the gradient of the chunked
    bounds with respect to the weights equals the one-chunk gradient (`tf.while_loop`'s
    gradient)."""
    model, _, _, x = _setup()
    twin = linearize(model).at_dtype("float64")
    structure = structure_of(twin.program)

    def grads(budget):
        @tf.function
        def step(t):
            with tf.GradientTape() as tape:
                low = _bounds(twin, structure, t, budget)
                loss = tf.reduce_sum(low * tf.constant([1.0, -0.5, 2.0, 0.3, 1.0, -1.0],
                                                       tf.float64))
            return tape.gradient(loss, model.trainable_weights)
        return [g.numpy() for g in step(tf.constant(x))]

    ref = grads(2**40)
    got = grads(_budget(20))
    # (the output bias cancels in the differences f(x') - f(x))
    assert all(np.any(g != 0) for g, w in zip(ref, model.trainable_weights)
               if "kernel" in w.path)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-7)  # float32 weights


def _affine_add_cnn():
    """A CNN whose first ReLU's input is affine in `x` through a residual Add of two
    linear convolutions (after a Rescaling), followed by a residual ReLU block."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((6, 6, 2))
    a = L.Conv2D(4, 3, padding="same")(L.Rescaling(0.5)(inp))
    h1 = L.ReLU()(L.Add()([a, L.Conv2D(4, 3, padding="same")(a)]))
    h2 = L.Conv2D(4, 3, padding="same", activation="relu")(h1)
    h = L.Flatten()(L.Add()([h1, h2]))
    return keras.Model(inp, L.Dense(3)(h))


def _layer_boxes(twin, structure, x, p, shortcut, guard=True, budget=2**40):
    """The CROWN pass's boxes of every value (relative to `x`) and the activations' input
    keys, with or without the affine shortcut, every unit's rows pulled back (stable
    units too: `skip_stable=False`)."""
    values = capture(twin.interpreter, tf.convert_to_tensor(x))
    eps = tf.fill([x.shape[0]], tf.constant(EPS, tf.float64))
    refine = relaxation_refiner(structure, values, RelaxedOps(values), eps, p, budget,
                                x.shape[0], affine_shortcut=shortcut, skip_stable=False)
    boxes = interval_pass(structure, values, eps, arithmetic_of(twin, guard), refine=refine)
    keys = [n.inputs[0] for n in structure.nodes if isinstance(n.op, Activation)]
    return values, boxes.boxes, keys


# l2 slow: pulling back `+I` alone is the same code in every norm (l_inf runs); the l2
# pass in chunks: test_chunked_relaxation_equals_one_chunk_and_is_sound[2]; the
# shortcut's dual norm: test_affine_shortcut_is_the_exact_range_of_the_pre_activation.
@pytest.mark.parametrize("p", [np.inf, pytest.param(2, marks=pytest.mark.slow)])
def test_affine_shortcut_gives_the_bounds_of_both_signs(p):
    """The first ReLU's input (affine in `x` through a residual Add) pulls back only `+I`
    (`hi = -lo`): every box of the pass equals the pass that pulls back `+-I` everywhere,
    in one chunk and in several; the second ReLU's input is not affine."""
    twin = linearize(_affine_add_cnn()).at_dtype("float64")
    structure = structure_of(twin.program)
    x = np.random.default_rng(2).uniform(0, 1, (B, 6, 6, 2))
    values, ref, keys = _layer_boxes(twin, structure, x, p, shortcut=False)
    assert [affine_in_input(structure, values, k) for k in keys] == [(True, True),
                                                                     (False, False)]
    for budget in (2**40, _budget(20)):  # one chunk; 5 and 20 chunks, the last ones padded
        _, got, _ = _layer_boxes(twin, structure, x, p, shortcut=True, budget=budget)
        for key, box in ref.items():
            np.testing.assert_allclose(got[key].lo, box.lo, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(got[key].hi, box.hi, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("p", [np.inf, 1])
def test_affine_shortcut_is_the_exact_range_of_the_pre_activation(p):
    """Without rounding terms, the shortcut's box of the first ReLU's input is
    `+-eps ||J_j||_q` (q the dual norm), the exact range of an affine map over the lp
    ball, with `J` the `tf.GradientTape` Jacobian of the Keras pre-activation."""
    model = _affine_add_cnn()
    twin = linearize(model).at_dtype("float64")
    structure = structure_of(twin.program)
    x = np.random.default_rng(4).uniform(0, 1, (B, 6, 6, 2))
    _, boxes, keys = _layer_boxes(twin, structure, x, p, shortcut=True, guard=False)
    relu = next(layer for layer in model.layers if isinstance(layer, L.ReLU))
    pre = keras.Model(model.inputs, relu.input)
    t = tf.constant(x, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(t)
        z = tf.reshape(pre(t), [B, -1])
    jac = tape.batch_jacobian(z, t).numpy().reshape(B, z.shape[1], -1).astype(np.float64)
    q = {np.inf: 1, 2: 2, 1: np.inf}[p]
    exact = EPS * np.linalg.norm(jac, ord=q, axis=2)
    box = boxes[keys[0]]
    np.testing.assert_allclose(np.reshape(box.hi, (B, -1)), exact, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.reshape(box.lo, (B, -1)), -exact, rtol=1e-5, atol=1e-7)
