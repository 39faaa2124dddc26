"""The bound passes of `keras_roll.compile.bounds`, each walk on its own, against
independent references: brute-force sampling of the box, `tf.GradientTape` Jacobians,
the activations themselves on a grid, finite differences in the weights; the program
structure on hand-built graphs; the bracketing search on a hand-built margin."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile.bounds import (
    METHOD_PASSES,
    AffineBounds,
    BoundMethod,
    BoundPass,
    Box,
    IntervalPasses,
    SlopeOptions,
    capture,
    check_bounds,
    lower_bounds,
    pull_back,
    register_bound_rule,
    relaxation_lines,
    supported_passes,
    unregister_bound_rule,
)
from keras_roll.compile.bounds.ibp import interval_pass
from keras_roll.compile.rules import Activation, Op, Tangent, unregister_rule
from keras_roll.compile.rules.base import NO_RECORD
from keras_roll.compile.structure import structure_of
from keras_roll.robust.bounds import arithmetic_of
from keras_roll.robust.search import largest_certified
from tests.model_zoo import randomize_batch_norm

L = keras.layers
EPS = 0.15


def _dense_net():
    keras.utils.set_random_seed(3)
    inp = keras.Input((4,))
    h = L.Dense(6, activation="relu")(inp)
    a = L.Dense(5)(h)
    b = L.Dense(5)(h)
    h = L.LeakyReLU(0.1)(L.Add()([a, b]))
    return keras.Model(inp, L.Dense(3)(h))


def _conv_net():
    keras.utils.set_random_seed(4)
    inp = keras.Input((6, 6, 2))
    h = L.Conv2D(3, 3, padding="same")(inp)
    h = L.BatchNormalization()(h)
    h = L.ReLU(max_value=2.0)(h)
    h = L.AveragePooling2D(2)(h)
    h = L.Flatten()(h)
    model = keras.Model(inp, L.Dense(3)(h))
    randomize_batch_norm(model)
    return model


def _affine_net():
    keras.utils.set_random_seed(5)
    inp = keras.Input((5, 5, 1))
    h = L.Conv2D(2, 2)(inp)
    h = L.BatchNormalization()(h)
    h = L.AveragePooling2D(2)(h)
    h = L.Flatten()(h)
    a = L.Dense(4)(h)
    h = L.Add()([a, L.Dense(4)(h)])
    model = keras.Model(inp, L.Dense(3)(h))
    randomize_batch_norm(model)
    return model


NETS = {"dense": _dense_net, "conv": _conv_net, "affine": _affine_net}


def _setup(model, x):
    twin = keras_roll.linearize(model).at_dtype("float64")
    structure = structure_of(twin.program)
    values = capture(twin.interpreter, tf.constant(x, tf.float64))
    return twin, structure, values


def _inputs(model, b, seed=0):
    shape = tuple(model.inputs[0].shape[1:])
    return np.random.default_rng(seed).normal(size=(b, *shape))


# --------------------------------------------------------------------------- intervals


@pytest.mark.parametrize("name", sorted(NETS))
def test_intervals_contain_every_sampled_point(name):
    """Brute force: 400 points of the box (and its corners) around each of 2 inputs; every
    value of every op stays inside its interval."""
    model = NETS[name]()
    x = _inputs(model, 2)
    twin, structure, values = _setup(model, x)
    boxes = interval_pass(structure, values, tf.constant([EPS, EPS]),
                          arithmetic_of(twin, guard=False)).boxes
    rng = np.random.default_rng(1)
    u = rng.uniform(-1, 1, (400, *x.shape))
    u[0], u[1] = 1.0, -1.0
    pts = capture(twin.interpreter, tf.constant((x[None] + EPS * u).reshape(-1, *x.shape[1:])))
    for node in structure.nodes:
        d = (pts.value(structure, node.output).numpy().reshape(400, 2, -1)
             - values.value(structure, node.output).numpy().reshape(1, 2, -1))
        lo, hi = (t.numpy().reshape(1, 2, -1) for t in boxes[node.output])
        # The corners reach the ends of affine ops' intervals; the twin's forward pass
        # uses Keras' float32 constants (a BatchNormalization's epsilon, a LeakyReLU's
        # slope) where its tangent has them in float64: 1e-7 of the width covers that.
        tol = 1e-7 * (hi - lo) + 1e-12
        assert np.all(d >= lo - tol), node.name
        assert np.all(d <= hi + tol), node.name


class GenericAffine(AffineBounds):
    """`AffineBounds` with its own `interval` (so the pass never takes the shortcut of the
    first op on the input box): the reference for the shortcut."""

    def interval(self, op, boxes, at, arithmetic):
        return super().interval(op, boxes, at, arithmetic)


def _flatten_net():
    keras.utils.set_random_seed(7)
    inp = keras.Input((3, 3, 2))
    h = L.Dense(4, activation="relu")(L.Flatten()(inp))
    return keras.Model(inp, L.Dense(3)(h))


@pytest.mark.parametrize("guard", [False, True])
@pytest.mark.parametrize("name", [*sorted(NETS), "flatten"])
def test_first_affine_op_on_the_box_equals_the_generic_rule(name, guard):
    """The first affine op on the input box takes its radius from `eps |A| 1` once for
    the batch (centre 0): every value's interval equals the one the generic rule's two
    products per example give, for one eps and per-example eps, with and without the
    rounding of the model's evaluation (a first op that changes the rank too)."""
    model = _flatten_net() if name == "flatten" else NETS[name]()
    x = _inputs(model, 3)
    twin, structure, values = _setup(model, x)
    first = type(structure.nodes[0].op)
    assert type(keras_roll.compile.bounds.bound_rule(structure.nodes[0].op)) is AffineBounds
    for eps in (tf.constant(EPS, tf.float64), tf.constant([EPS, 0.0, 2 * EPS], tf.float64)):
        fast = interval_pass(structure, values, eps, arithmetic_of(twin, guard=guard)).boxes
        register_bound_rule(first, GenericAffine())
        try:
            ref = interval_pass(structure, values, eps, arithmetic_of(twin, guard=guard)).boxes
        finally:
            unregister_bound_rule(first)
        for key, box in ref.items():
            assert fast[key].lo.shape == box.lo.shape, key
            for a, b in zip(fast[key], box):
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12,
                                           atol=1e-12 * np.abs(b.numpy()).max())


def _one_affine_layer(layer, shape):
    keras.utils.set_random_seed(6)
    inp = keras.Input(shape)
    model = keras.Model(inp, L.Flatten()(layer(inp)))
    randomize_batch_norm(model)
    return model


AFFINE_LAYERS = {
    "dense": lambda: _one_affine_layer(L.Dense(3), (4,)),
    "conv": lambda: _one_affine_layer(L.Conv2D(2, 2), (3, 3, 2)),
    "batch_norm": lambda: _one_affine_layer(L.BatchNormalization(), (2, 3)),
    "average_pooling": lambda: _one_affine_layer(L.AveragePooling2D(2), (4, 4, 1)),
}


@pytest.mark.parametrize("name", sorted(AFFINE_LAYERS))
def test_intervals_of_an_affine_layer_are_exact(name):
    """Dense, Conv2D, BatchNormalization, average pooling (then Flatten, which moves
    values): the output interval is `+-|J| eps` with `J` the tape's Jacobian of the Keras
    model, and its ends are reached at the corners `x + eps sign(J_k)`."""
    model = AFFINE_LAYERS[name]()
    x = _inputs(model, 1)
    twin, structure, values = _setup(model, x)
    boxes = interval_pass(structure, values, tf.constant([EPS]),
                          arithmetic_of(twin, guard=False)).boxes
    xt = tf.constant(x, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        y = tf.reshape(model(xt, training=False), [-1])
    jac = tape.jacobian(y, xt).numpy().reshape(y.shape[0], -1).astype(np.float64)
    out = boxes[structure.output_key]
    radius = EPS * np.abs(jac).sum(1)
    np.testing.assert_allclose(out.hi.numpy()[0], radius, rtol=1e-5)
    np.testing.assert_allclose(out.lo.numpy()[0], -radius, rtol=1e-5)
    corners = x + EPS * np.sign(jac).reshape(-1, *x.shape[1:])
    f0 = twin.primal(x).logits.numpy()[0]
    reached = np.diag(twin.primal(corners).logits.numpy()) - f0
    np.testing.assert_allclose(reached, radius, rtol=1e-5)


def test_intervals_of_an_affine_net_are_exact_op_by_op():
    """Composed, intervals are loose (`|W2| |W1|` against `|W2 W1|`), but each affine op's
    interval is exact given its inputs' (`keras_roll.testing.check_bounds`, against the
    tape's Jacobian of every op)."""
    model = _affine_net()
    errors = keras_roll.testing.check_bounds(model, _inputs(model, 2), eps=EPS)
    assert errors["intervals of affine ops (exact)"] <= 1e-7
    assert errors["intervals at sampled points"] <= 1e-7


# --------------------------------------------------------------------------- pull-back


@pytest.mark.parametrize("name", sorted(NETS))
def test_pull_back_is_the_tapes_jacobian_in_the_frozen_pattern(name):
    """The frozen-pattern pull-back of every output row equals the Jacobian of the
    float64 forward pass by `tf.GradientTape` (per example, both functionals shared by
    the batch and per example)."""
    model = NETS[name]()
    x = _inputs(model, 3)
    twin, structure, values = _setup(model, x)
    xt = tf.constant(x, tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        logits = twin.primal(xt).logits
    jac = tape.batch_jacobian(logits, xt).numpy().reshape(3, 3, -1)
    # float64 throughout, but the forward pass uses Keras' float32 constants (a
    # LeakyReLU's slope, a BatchNormalization's epsilon) where the tangents do not
    tol = 1e-6 * np.abs(jac).max()
    shared = tf.eye(3, dtype=tf.float64)[None]
    res = pull_back(structure, values, structure.output_key, shared)
    got = res.lam_input.numpy()  # [1, 3, ...] while no activation makes it per example
    np.testing.assert_allclose(np.broadcast_to(got.reshape(got.shape[0], 3, -1), jac.shape),
                               jac, atol=tol, rtol=0)
    rows = tf.constant(np.random.default_rng(2).normal(size=(3, 2, 3)))
    res = pull_back(structure, values, structure.output_key, rows)
    np.testing.assert_allclose(res.lam_input.numpy().reshape(3, 2, -1),
                               np.einsum("bcl,bld->bcd", rows.numpy(), jac), atol=3 * tol,
                               rtol=0)
    assert np.all(res.const.numpy() == 0.0)


# --------------------------------------------------------------------------- lines


def _activations():
    keras.utils.set_random_seed(0)
    layers = {"relu": L.ReLU(), "relu6": L.ReLU(max_value=6.0),
              "threshold": L.ReLU(threshold=0.5, negative_slope=0.2),
              "leaky": L.LeakyReLU(0.3),
              "prelu_negative": L.PReLU(alpha_initializer=keras.initializers.Constant(-0.4))}
    ops = {}
    for name, layer in layers.items():
        layer.build((None, 200))
        ops[name] = keras_roll.compile.rules.compile_layer(layer)[0]
    return ops


@pytest.mark.parametrize("name", ["relu", "relu6", "threshold", "leaky", "prelu_negative"])
def test_relaxation_lines_lie_below_and_above_the_activation(name):
    """On 200 random intervals (some inside one piece, some across breakpoints), each
    line lies below / above the activation at 1001 points of its interval and its
    breakpoints, touching it within the float64 safety margin somewhere (a ReLU with a
    threshold jumps at it: the lines hold on both sides)."""
    op = _activations()[name]
    rng = np.random.default_rng(7)
    a, b = rng.normal(0, 4, (2, 1, 200))
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    a_l, b_l, a_u, b_u = (t.numpy() for t in relaxation_lines(op, tf.constant(lo),
                                                              tf.constant(hi)))
    z = lo + np.linspace(0.0, 1.0, 1001)[:, None, None] * (hi - lo)
    # where the lines may touch: the breakpoints and just above them (a threshold jumps)
    kinks = [np.clip(k, lo, hi)[None] for b in op.breakpoints
             for k in (b, np.nextafter(b, np.inf))]
    z = np.concatenate([z, *kinks])
    f = op.fn(tf.constant(z.reshape(-1, 200))).numpy().reshape(z.shape)
    assert np.all(a_l * z + b_l <= f)
    assert np.all(f <= a_u * z + b_u)
    slack = 1e-12 * (1.0 + np.abs(z).max(0))
    assert np.all(np.min(f - (a_l * z + b_l), 0) <= slack)
    assert np.all(np.min(a_u * z + b_u - f, 0) <= slack)


@pytest.mark.parametrize("name", ["relu", "relu6", "threshold", "leaky", "prelu_negative"])
def test_activation_intervals_are_the_range_on_a_grid(name):
    """The interval of an activation over `[lo, hi]` against its minimum and maximum over
    1001 points and its breakpoints (and just above them); nondecreasing activations (the
    ends alone) are told from the others (a negative slope)."""
    op = _activations()[name]
    assert keras_roll.compile.bounds.rules.nondecreasing(op) == (name != "prelu_negative")
    rng = np.random.default_rng(8)
    a, b = rng.normal(0, 4, (2, 1, 200))
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    z0 = (lo + hi) / 2
    h0 = op.fn(tf.constant(z0)).numpy()
    at = keras_roll.compile.bounds.rules.OpValues([tf.constant(z0)], tf.constant(h0))
    box = keras_roll.compile.bounds.rules.ActivationBounds().interval(
        op, [Box(tf.constant(lo - z0), tf.constant(hi - z0))], at, None)
    z = lo + np.linspace(0.0, 1.0, 1001)[:, None, None] * (hi - lo)
    kinks = [np.clip(k, lo, hi)[None] for b in op.breakpoints
             for k in (b, np.nextafter(b, np.inf))]
    z = np.concatenate([z, *kinks])
    f = op.fn(tf.constant(z.reshape(-1, 200))).numpy().reshape(z.shape) - h0
    np.testing.assert_allclose(box.lo.numpy(), f.min(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(box.hi.numpy(), f.max(0), rtol=0, atol=1e-12)


def test_relu_lines_equal_the_vertex_search(monkeypatch):
    """A plain ReLU's lines come from its ends and clip(0) alone: the same lines as the
    search over every vertex of any activation, on random intervals and on the edge cases
    (an end at 0, zero width, tiny widths), and the same gradients in `lo`, `hi` but at
    `lo = 0` exactly; but a line that is one of the ReLU's pieces (every stable unit's)
    has no float64 safety, its offset is exactly 0."""
    op = _activations()["relu"]
    assert keras_roll.compile.bounds.rules.plain_relu(op)
    assert not keras_roll.compile.bounds.rules.plain_relu(_activations()["leaky"])
    rng = np.random.default_rng(9)
    a, b = rng.normal(0, 2, (2, 1, 300))
    edges = np.array([[0.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [2.0, 2.0], [-3.0, -3.0],
                      [-1e-14, 1e-14], [0.0, 1e-13], [-1.0, 1e-9], [-1e-9, 1.0]]).T
    lo = np.concatenate([np.minimum(a, b), edges[0][None]], 1)
    hi = np.concatenate([np.maximum(a, b), edges[1][None]], 1)

    def lines_and_grads():
        t_lo, t_hi = tf.constant(lo), tf.constant(hi)
        with tf.GradientTape() as tape:
            tape.watch([t_lo, t_hi])
            lines = relaxation_lines(op, t_lo, t_hi)
            total = sum(tf.reduce_sum(t * w) for t, w in zip(lines, (1.0, 2.0, 3.0, 4.0)))
        return [t.numpy() for t in lines], [g.numpy() for g in tape.gradient(total,
                                                                             [t_lo, t_hi])]

    fast, fast_grads = lines_and_grads()
    monkeypatch.setattr(keras_roll.compile.bounds.rules, "plain_relu", lambda op: False)
    ref, ref_grads = lines_and_grads()
    np.testing.assert_array_equal(fast[0], ref[0])  # the slopes
    np.testing.assert_array_equal(fast[2], ref[2])
    # a piece of the ReLU (slope 0 or 1, offset 0 but for the safety) keeps no safety:
    # the stable units', the lower line 0 of the open ones
    scale = 16 * 2.0**-53 * np.maximum(np.abs(lo), np.abs(hi))
    tiny = np.finfo(np.float64).tiny  # slope 1 holds on positive normal numbers only
    shapes = ((fast[0] == 0) | ((fast[0] == 1) & ((lo >= tiny) | (hi <= 0))),
              ((fast[2] == 0) & (hi <= 0)) | ((fast[2] == 1) & (lo >= tiny)))
    pieces = []
    for shape, got, want in zip(shapes, fast[1::2], ref[1::2]):
        piece = shape & (np.abs(want) <= scale)
        np.testing.assert_array_equal(got[~piece], want[~piece])
        assert np.all(got[piece] == 0.0)
        pieces.append(piece)
    assert np.all(pieces[0][(hi <= 0) | (lo > 1e-300)])  # stable: both lines are pieces
    assert np.all(pieces[1][(hi <= 0) | (lo > 1e-300)])
    assert not np.all(pieces[1])
    # at lo = 0 exactly (a kink of the offsets in lo) each takes another subgradient;
    # a piece's offset does not move with the bounds
    smooth = (lo != 0.0) & ~pieces[0] & ~pieces[1]
    for got, want in zip(fast_grads, ref_grads):
        np.testing.assert_allclose(got[smooth], want[smooth], rtol=1e-9, atol=1e-9)


def test_relu_lines_are_crowns_adaptive_choice():
    """ReLU across 0: the chord above, slope 1 below if `u >= -l` else 0."""
    op = _activations()["relu"]
    lo, hi = np.array([[-1.0, -3.0, 2.0]]), np.array([[3.0, 1.0, 5.0]])
    a_l, b_l, a_u, b_u = (t.numpy()[0] for t in relaxation_lines(op, tf.constant(lo),
                                                               tf.constant(hi)))
    np.testing.assert_allclose(a_u[:2], [3.0 / 4.0, 1.0 / 4.0])
    np.testing.assert_allclose(b_u[:2], [0.75, 0.75], rtol=1e-12)
    np.testing.assert_array_equal(a_l, [1.0, 0.0, 1.0])
    np.testing.assert_allclose([a_u[2], b_u[2], b_l[2]], [1.0, 0.0, 0.0], atol=1e-13)


# --------------------------------------------------------------------------- relaxation


@pytest.mark.parametrize("method", list(BoundMethod))
@pytest.mark.parametrize("name", ["dense", "conv"])
def test_every_method_bounds_the_sampled_outputs(name, method):
    """Lower and upper bounds of every logit difference over the l_inf ball contain the
    values at 400 sampled points; CROWN is at least as tight as the intervals. Five
    steps of alpha-CROWN's slopes (sound after any number; tests/test_alpha_crown.py
    checks what the optimization gains)."""
    model = NETS[name]()
    x = _inputs(model, 2)
    twin, structure, values = _setup(model, x)
    eye = np.eye(3)[None]
    rows = tf.constant(np.concatenate([eye, -eye], 1))
    arithmetic = arithmetic_of(twin, guard=False)
    low = lower_bounds(structure, values, rows, tf.constant([EPS, EPS]), np.inf, method,
                       arithmetic, slopes=SlopeOptions(steps=5)).numpy()
    rng = np.random.default_rng(5)
    u = rng.uniform(-1, 1, (400, *x.shape))
    d = (twin.primal((x[None] + EPS * u).reshape(-1, *x.shape[1:])).logits.numpy()
         .reshape(400, 2, 3) - twin.primal(x).logits.numpy()[None])
    assert np.all(d >= low[None, :, :3] - 1e-12)
    assert np.all(d <= -low[None, :, 3:] + 1e-12)
    ibp = lower_bounds(structure, values, rows, tf.constant([EPS, EPS]), np.inf,
                       BoundMethod.INTERVAL, arithmetic).numpy()
    assert np.all(low >= ibp - 1e-12)


def test_every_bound_method_has_one_pass_in_the_table():
    """`lower_bounds` dispatches through `METHOD_PASSES`: one pass per `BoundMethod`, and
    the table is read-only (a method is added with its pass, not patched in)."""
    assert set(METHOD_PASSES) == set(BoundMethod)
    assert len({id(fn) for fn in METHOD_PASSES.values()}) == len(BoundMethod)
    with pytest.raises(TypeError):
        METHOD_PASSES[BoundMethod.INTERVAL] = None


@pytest.mark.parametrize("guard", [False, True])
def test_one_interval_pass_serves_both_bounds_and_any_rows(guard):
    """`IntervalPasses`: functionals shared by the batch (`[1, C, L]`, one product with
    the last layer's box) give the bounds of the same rows per example (`[B, C, L]`,
    summed per example); CROWN-IBP on the shared pass, given the intervals, equals
    `lower_bounds` with its own passes (with and without rounding)."""
    model = NETS["dense"]()
    x = _inputs(model, 3)
    twin, structure, values = _setup(model, x)
    arithmetic = arithmetic_of(twin, guard=guard)
    eps = tf.constant([EPS, 0.5 * EPS, 2 * EPS], tf.float64)
    shared = np.random.default_rng(3).normal(size=(1, 4, 3))
    per_example = tf.constant(np.repeat(shared, 3, 0))
    passes = IntervalPasses(structure, values, eps, np.inf, arithmetic)
    ibp = passes.interval(tf.constant(shared)).numpy()
    np.testing.assert_allclose(ibp, passes.interval(per_example).numpy(), rtol=1e-12,
                               atol=1e-12)
    crown = passes.crown_ibp(per_example, interval=tf.constant(ibp)).numpy()
    ref = lower_bounds(structure, values, per_example, eps, np.inf, BoundMethod.CROWN_IBP,
                       arithmetic).numpy()
    np.testing.assert_allclose(crown, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ibp, lower_bounds(structure, values, per_example, eps, np.inf,
                                                 BoundMethod.INTERVAL, arithmetic).numpy(),
                               rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- weights


def _tiny():
    keras.utils.set_random_seed(11)
    inp = keras.Input((3,))
    h = L.Dense(5, activation="relu")(inp)
    return keras.Model(inp, L.Dense(3)(h))


@pytest.mark.parametrize("method", ["interval", "crown_ibp", "relaxation"])
def test_margin_bounds_are_differentiable_in_the_weights(method):
    """`tape.gradient` of the margins' lower bounds reaches every weight, is finite and
    matches central finite differences along two random weight directions."""
    model = _tiny()
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    y = np.array([0, 1, 2, 1])

    def objective():
        b = keras_roll.robust.interval_bounds(model, x, 0.1, y, method=method,
                                              dtype="float64")
        return tf.reduce_sum(b.lower) - 0.5 * tf.reduce_sum(b.upper)

    with tf.GradientTape() as tape:
        value = objective()
    grads = tape.gradient(value, model.trainable_weights)
    assert all(g is not None and np.all(np.isfinite(g.numpy())) for g in grads)
    assert all(np.any(g.numpy() != 0) for g in grads)
    rng = np.random.default_rng(1)
    saved = [w.numpy() for w in model.trainable_weights]
    h = 1e-3
    for _ in range(2):
        dirs = [rng.normal(size=w.shape).astype("float32") for w in saved]
        ends = []
        for sign in (1.0, -1.0):
            for w, s, v in zip(model.trainable_weights, saved, dirs):
                w.assign(s + sign * h * v)
            ends.append(float(objective()))
        for w, s in zip(model.trainable_weights, saved):
            w.assign(s)
        fd = (ends[0] - ends[1]) / (2 * h)
        analytic = sum(float(np.sum(g.numpy() * v)) for g, v in zip(grads, dirs))
        assert abs(fd - analytic) <= 2e-3 * (1.0 + abs(analytic)), (fd, analytic)


def test_interval_bounds_certify_what_robust_radius_certifies():
    """The margins' lower bound of `interval_bounds` (float64, with the guard) is positive
    at the radius robust_radius(method='interval') certifies, and not far beyond."""
    model = _tiny()
    x = np.random.default_rng(0).normal(size=(4, 3)).astype("float32")
    y = np.argmax(model.predict(x, verbose=0), -1)
    rr = keras_roll.robust_radius(model, x, y, norms=(np.inf,), method="interval",
                                  verbose=False)
    r = rr.lower[np.inf]
    low = keras_roll.robust.interval_bounds(model, x, r, y, guard=True,
                                            dtype="float64").lower.numpy()
    low[np.arange(4), y] = np.inf
    assert np.all(low.min(1) > 0)
    low = keras_roll.robust.interval_bounds(model, x, 1.05 * r, y, guard=True,
                                            dtype="float64").lower.numpy()
    low[np.arange(4), y] = np.inf
    assert np.all(low.min(1) <= 0)


# --------------------------------------------------------------------------- rules


class Negate(L.Layer):
    def call(self, x):
        return -x


class NegateOp(Op):
    """`-x`, written as an op of its own (not `affine`: the passes know nothing of it)."""

    def forward(self, inputs, mask):
        return -inputs[0], NO_RECORD

    def tangent(self, tangents, record, mask):
        t = tangents[0]
        return Tangent(-t.value, shared=t.shared), None


@pytest.fixture
def negate_model():
    keras_roll.register_rule(Negate, NegateOp, override=True)
    keras.utils.set_random_seed(2)
    inp = keras.Input((3,))
    h = L.Dense(4, activation="relu", name="hidden")(Negate(name="negate")(inp))
    yield keras.Model(inp, L.Dense(2)(h))
    unregister_rule(Negate)
    unregister_bound_rule(NegateOp)


def test_a_custom_op_needs_a_bound_rule_and_then_gets_bounds(negate_model):
    """Without a bound rule the error names the layer and the pass; with one (registered),
    the intervals hold on sampled points and check_rule reports it."""
    x = _inputs(negate_model, 2)
    lin = keras_roll.linearize(negate_model)
    structure = structure_of(lin.program)
    assert supported_passes(structure.nodes[0].op) == frozenset()
    with pytest.raises(keras_roll.UnsupportedModelError,
                       match=r"'negate' \(Negate, op NegateOp\).*interval bounds"):
        check_bounds(structure, BoundPass.INTERVAL)
    with pytest.raises(keras_roll.UnsupportedModelError, match="'negate'"):
        keras_roll.robust_radius(negate_model, x, method="relaxation", verbose=False)
    result = keras_roll.testing.check_rule(negate_model, input_data=x, rounding=False)
    assert not result.passes["negate"].intervals and result.passes["hidden"].relaxation
    register_bound_rule(NegateOp, AffineBounds())
    assert supported_passes(structure.nodes[0].op) == frozenset(BoundPass)
    result = keras_roll.testing.check_rule(negate_model, input_data=x, rounding=False)
    assert result.passes["negate"] == (True, False, True, True)
    assert result.errors["intervals at sampled points"] == 0.0
    assert result.errors["intervals of affine ops (exact)"] <= 1e-12
    with pytest.raises(ValueError, match="already registered"):
        register_bound_rule(NegateOp, AffineBounds())
    with pytest.raises(TypeError, match="Op subclass"):
        register_bound_rule(Negate, AffineBounds())


def test_check_rule_catches_an_unsound_bound_rule(negate_model):
    """A rule whose interval is half the true one fails the sampled points and the
    exactness check."""

    class Wrong(AffineBounds):
        def interval(self, op, boxes, at, arithmetic):
            return Box(0.5 * boxes[0].lo, 0.5 * boxes[0].hi)

    register_bound_rule(NegateOp, Wrong())
    x = _inputs(negate_model, 2)
    with pytest.raises(AssertionError, match="(?s)intervals at sampled points: off by.*"
                       "intervals of affine ops \\(exact\\): off by"):
        keras_roll.testing.check_rule(negate_model, input_data=x, rounding=False)


def test_activation_subclasses_inherit_the_activation_rule():
    class MyActivation(Activation):
        pass

    op = MyActivation(None, tf.nn.relu, [0.0], [0.0, 1.0], name="a")
    assert supported_passes(op) == frozenset(BoundPass)


# --------------------------------------------------------------------------- structure


def test_structure_answers_readers_entries_and_the_chain():
    """x -> Rescaling -> Dense(relu) -> {Dense a, Dense b} -> Add -> softmax: hand-checked."""
    inp = keras.Input((3,))
    h = L.Rescaling(2.0, name="scale")(inp)
    h = L.Dense(4, activation="relu", name="d")(h)
    a, b = L.Dense(2, name="a")(h), L.Dense(2, name="b")(h)
    out = L.Activation("softmax", name="soft")(L.Add(name="add")([a, b]))
    program = keras_roll.linearize(keras.Model(inp, out)).program
    s = structure_of(program)
    names = [st.name for st in program.steps]
    assert names == ["scale", "d", "a", "b", "add", "soft"]
    assert s.readers(s.input_key) == (0,)
    assert s.entry_readers(2) == [2, 3]  # the Dense 'd' output feeds 'a' and 'b'
    assert s.readers(program.steps[2].output) == (4,)
    assert s.leading_chain() == [0, 1]
    assert [n.name for n in s.nodes] == ["scale", "d", "d", "a", "b", "add"]
    assert s.nodes[2].inputs == (s.nodes[1].output,) and s.nodes[1].output < 0
    assert s.output_key == program.steps[4].output  # the folded softmax is an alias
    assert structure_of(program) is s
    prefix = keras_roll.linearize(keras.Model(inp, out)).affine_prefix
    assert (prefix.start, prefix.start_op, len(prefix.ops)) == (1, 1, 2)


# --------------------------------------------------------------------------- search


def test_bracketing_search_on_a_hand_built_margin():
    """`v(eps) = c - eps^2` per example (certified below `sqrt(c)`), and a non-monotone
    one: the answer is a radius the values certified, within `1 + tol` of the boundary
    where the values are monotone, and the known lower bound where nothing more holds."""
    c = np.array([0.04, 1.0, 9.0, 0.25])
    calls = []

    def values(idx, eps):
        calls.append(len(idx))
        return c[idx] - eps**2

    lo = largest_certified(values, np.zeros(4), np.array([np.inf, 2.0, np.nan, 1.0]),
                           np.ones(4), tol=1e-3)
    root = np.sqrt(c)
    assert np.all(lo < root) and np.all(lo >= root / (1 + 1e-3) ** 2)
    assert sum(calls) <= 64 * 4

    def bumpy(idx, eps):  # certified on [0, 1) and on (2, 3): the search keeps a certified one
        return np.where((eps < 1.0) | ((eps > 2.0) & (eps < 3.0)), 1.0, -1.0)

    lo = largest_certified(bumpy, np.array([0.5]), np.array([10.0]), np.array([1.0]), 1e-3)
    assert bumpy(None, lo)[0] > 0
    lo = largest_certified(lambda i, e: -np.ones(len(i)), np.array([0.3]), np.array([1.0]),
                           np.array([1.0]), 1e-3)
    assert lo[0] == 0.3
