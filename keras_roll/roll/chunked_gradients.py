"""Chunked sums of squared neuron derivatives with bounded-memory custom gradients.

ROLL's loss sums squared tangents over many directions (docs/design.md, "Memory"
and "Data flow of a ROLL training step"). When the directions do not fit the memory
budget in one pass, `roll.py` runs them in chunks through these custom gradients:

* `chunked_sum_squares`: `[B, N]` sums; the backward pass recomputes each chunk
  under a tape, so no chunk's tangents are kept.
* `chunked_weighted_sum`: `[B]` weighted sums for a training step with
  `gamma = 100`; each chunk differentiates itself in the forward pass, and a
  uniform upstream gradient (the batch mean) reuses those gradients.
* `gradient_may_flow`: which inputs of a chunk a gradient can reach (frozen ReLU
  slopes, one-hot choices and masks cannot), so that no backward pass computes
  gradients nobody reads.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_roll.roll.estimators import Estimator


def _chunk_inputs(lin, estimator: Estimator, trace, extra=()):
    """The explicit inputs of a chunked custom gradient and how to read them back.

    Everything a chunk reads enters the custom gradient as an explicit input:
    the trace, the model's variables as tensors (read once, mapped back with a
    `keras.StatelessScope`), the estimator's tensors and `extra` tensors. So the
    gradient captures nothing from outside and works inside `tf.cond`,
    `tf.function` (with the tape inside or outside) and `tf.distribute`.

    Returns `(inputs, differentiable, chunk, split)`: `differentiable[i]` says
    whether a gradient may flow into `inputs[i]` (`gradient_may_flow`: the frozen
    slopes of a ReLU, one-hot choices and masks need none, which spares the
    backward pass of every chunk a product and a reduction per unit);
    `chunk(inputs, start, k)` is the estimator's `[B, N]` sum of squares of
    directions `start .. start + k - 1`; `split(inputs)` gives back the groups.
    """
    flat = tf.nest.flatten(trace)
    variables = list(lin.model.variables)
    values = [tf.convert_to_tensor(v.value) for v in variables]
    aux = tf.nest.flatten(estimator)
    extra = [tf.convert_to_tensor(t) for t in extra]
    sizes = [len(flat), len(values), len(aux), len(extra)]
    inputs = [*flat, *values, *aux, *extra]
    may_flow = gradient_may_flow(inputs)
    differentiable = [ok and i < sizes[0] + sizes[1] + sizes[2]
                      for i, ok in enumerate(may_flow)]

    def split(ins):
        a, b, c, _ = sizes
        return ins[:a], ins[a:a + b], ins[a + b:a + b + c], ins[a + b + c:]

    def chunk(ins, start, k):
        tr, vals, ax, _ = split(ins)
        with keras.StatelessScope(state_mapping=list(zip(variables, vals))):
            est = tf.nest.pack_sequence_as(estimator, list(ax))
            return est.sum_squares(lin, tf.nest.pack_sequence_as(trace, list(tr)), start, k)

    return inputs, differentiable, chunk, split


def chunked_sum_squares(lin, estimator: Estimator, trace, n_shape, dtype, k, n,
                        combine: str = "sum"):
    """Sum (or, `combine="max"`, maximum) over `n` chunks of `k` directions,
    recomputed chunk by chunk in backprop.

    The maximum's gradient flows into the first chunk that attains it (a
    subgradient, as `tf.reduce_max` gives within a chunk). See `_chunk_inputs` for
    what enters the custom gradient.
    """
    if combine not in ("sum", "max"):
        raise ValueError(f"combine must be 'sum' or 'max', got combine={combine!r}.")
    counts = [tf.convert_to_tensor(t, tf.int32) for t in (k, n, n_shape)]
    flat_inputs, differentiable, chunk, split = _chunk_inputs(lin, estimator, trace, counts)

    def chunk_at(inputs, c):
        k_t, _, _ = split(inputs)[3]
        k_c = k if isinstance(k, int) else k_t
        return chunk(inputs, c * k_c, k_c)

    @tf.custom_gradient
    def run(*args):
        # Identities in the current graph (e.g. a tf.cond branch): the gradient
        # function must reference these, not the caller's tensors.
        inputs = [tf.identity(t) for t in args]
        _, n_t, shape_t = split(inputs)[3]
        # Stopped copies: an eager tape must not record (and keep) the chunks.
        stopped = [tf.stop_gradient(t) for t in inputs]
        if combine == "sum":
            _, sq = tf.while_loop(lambda c, acc: c < n_t,
                                  lambda c, acc: (c + 1, _add(acc, chunk_at(stopped, c))),
                                  (tf.constant(0), tf.zeros(shape_t, dtype)))
            first = None
        else:
            sq, first = _loop_max(lambda c: chunk_at(stopped, c), n_t, shape_t, dtype)

        def grad(dsq):
            def upstream(c):
                return dsq if first is None else tf.where(tf.equal(first, c), dsq, 0)

            return _recompute_gradients(inputs, differentiable, n_t,
                                        lambda ins, c: (chunk_at(ins, c), upstream(c)))

        return sq, grad

    return run(*flat_inputs)


def chunked_weighted_sum(lin, estimator: Estimator, trace, weights, k, n):
    """`[B]` `sum_j weights_bj * sq_bj` over `n` chunks of `k` directions, each chunk
    differentiated in the forward pass.

    The forward loop runs every chunk under a tape and accumulates the gradient
    `G` of `sum_b q_b` with respect to the differentiable inputs. A backward pass
    whose upstream gradient is the same `c` for every example (the batch mean of
    a training step) returns `c G`: one tangent pass and its backward per chunk,
    where `chunked_sum_squares` needs two passes. Any other upstream gradient
    recomputes the chunks with it (`_recompute_gradients`), so the gradient is
    exact either way.
    """
    dtype = weights.dtype
    counts = [tf.convert_to_tensor(t, tf.int32) for t in (k, n)]
    flat_inputs, differentiable, chunk, split = _chunk_inputs(
        lin, estimator, trace, [weights, *counts])

    def weighted_at(inputs, c):
        w, k_t, _ = split(inputs)[3]
        k_c = k if isinstance(k, int) else k_t
        return tf.reduce_sum(chunk(inputs, c * k_c, k_c) * w, axis=1)

    @tf.custom_gradient
    def run(*args):
        inputs = [tf.identity(t) for t in args]
        w, _, n_t = split(inputs)[3]
        stopped = [tf.stop_gradient(t) for t in inputs]
        diff = [i for i, d in enumerate(differentiable) if d]

        def body(c, acc, grads):
            with tf.GradientTape() as tape:
                tape.watch([stopped[i] for i in diff])
                q = weighted_at(stopped, c)
                total = tf.reduce_sum(q)
            gs = tape.gradient(total, [stopped[i] for i in diff],
                               unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return c + 1, _add(acc, q), [_add(a, g) for a, g in zip(grads, gs)]

        zeros = [tf.zeros_like(inputs[i]) for i in diff]
        batch = tf.shape(w)[0]
        _, q, summed = tf.while_loop(lambda c, acc, grads: c < n_t, body,
                                     (tf.constant(0), tf.zeros([batch], dtype), zeros))

        def grad(dq):
            c = tf.reduce_max(dq)
            uniform = tf.reduce_min(dq) == c  # False for an empty batch

            def scaled():
                return [c * g for g in summed]

            def recomputed():
                out = _recompute_gradients(
                    inputs, differentiable, n_t,
                    lambda ins, cc: (chunk(ins, cc * _k(ins), _k(ins)), dq[:, None] * w))
                return [out[i] for i in diff]

            def _k(ins):
                k_t = split(ins)[3][1]
                return k if isinstance(k, int) else k_t

            picked = tf.cond(uniform, scaled, recomputed)
            grads = [None] * len(inputs)
            for i, g in zip(diff, picked):
                grads[i] = g
            return grads

        return q, grad

    return run(*flat_inputs)


def _loop_max(chunk_at, n_t, shape_t, dtype):
    """`(max over the chunks, [the first chunk attaining it])` of `n_t` chunks."""

    def body(c, best, first):
        value = chunk_at(c)
        better = value > best
        kept = tf.ensure_shape(tf.where(better, value, best), best.shape)
        return c + 1, kept, tf.where(better, c, first)

    lowest = tf.fill(shape_t, tf.constant(-float("inf"), dtype))
    _, best, first = tf.while_loop(lambda c, best, first: c < n_t, body,
                                   (tf.constant(0), lowest, tf.zeros(shape_t, tf.int32)))
    return best, first


def _recompute_gradients(inputs, differentiable, n_t, chunk_and_upstream):
    """Gradients of `sum_c <chunk_c, upstream_c>` with respect to the differentiable
    `inputs`, chunk by chunk under a tape (`chunk_and_upstream(inputs, c)` gives the
    chunk's output and its upstream gradient); None for the other inputs."""
    diff = [i for i, d in enumerate(differentiable) if d]

    def body(c, acc):
        with tf.GradientTape() as tape:
            tape.watch([inputs[i] for i in diff])
            s, upstream = chunk_and_upstream(inputs, c)
        gs = tape.gradient(s, [inputs[i] for i in diff], output_gradients=upstream,
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return c + 1, [_add(a, g) for a, g in zip(acc, gs)]

    zeros = [tf.zeros_like(inputs[i]) for i in diff]
    _, out = tf.while_loop(lambda c, acc: c < n_t, body, (tf.constant(0), zeros))
    grads = [None] * len(inputs)
    for i, g in zip(diff, out):
        grads[i] = g
    return grads


def _add(acc, value):
    """`acc + value` with the static shape of `acc`: a loop variable must keep its
    shape, and a gradient's static shape may be less specific than its variable's."""
    return tf.ensure_shape(acc + tf.convert_to_tensor(value), acc.shape)


def gradient_may_flow(tensors) -> list[bool]:
    """Whether a gradient may flow into each of `tensors` (conservative).

    Eagerly, exactly when a tape watches it (`should_record_backprop`: without a
    tape nothing will be differentiated). In a graph, unless every path back
    from it ends in a constant or a non-differentiable op (a `Cast` of the
    booleans `z > 0`, `OneHot`, `StopGradient`, ...): a gradient of the graph
    may also be taken from outside (a tf.function under an eager tape), where
    no tape inside the graph would tell.
    """
    floating = [t.dtype.is_floating for t in tensors]
    if tf.executing_eagerly():
        from tensorflow.python.eager import record  # noqa: PLC0415  (TF internal)

        return [f and bool(record.should_record_backprop([t]))
                for f, t in zip(floating, tensors)]
    memo: dict = {}
    return [f and _graph_connected(t, memo) for f, t in zip(floating, tensors)]


_SOURCE_OPS = frozenset({"Placeholder", "ReadVariableOp", "VarHandleOp"})
_CONSTANT_OPS = frozenset({"Const", "StopGradient", "PreventGradient", "ZerosLike",
                           "OnesLike", "Shape", "Size", "Rank"})


def _graph_connected(tensor, memo: dict) -> bool:
    """False when no gradient can reach `tensor` from a graph input or variable."""
    from tensorflow.python.framework import ops as tf_ops  # noqa: PLC0415  (TF internal)

    def floating_or_resource(t):
        return t.dtype.is_floating or t.dtype.is_complex or t.dtype == tf.resource

    stack = [tensor]
    while stack:
        t = stack[-1]
        key = t.ref()
        if key in memo:
            stack.pop()
            continue
        if not hasattr(t, "graph"):  # an eager tensor captured by the graph: assume it may
            memo[key] = floating_or_resource(t)
            stack.pop()
            continue
        op = t.op
        if not floating_or_resource(t) or op.type in _CONSTANT_OPS:
            memo[key] = False
            stack.pop()
            continue
        inputs = [i for i in op.inputs if floating_or_resource(i)]
        try:
            no_gradient = tf_ops.get_gradient_function(op) is None
        except LookupError:
            no_gradient = False  # unregistered: assume it passes gradients on
        if no_gradient and op.type not in _SOURCE_OPS:
            memo[key] = False
            stack.pop()
            continue
        if not inputs:  # a graph input or variable; else a cast of booleans, a draw
            memo[key] = op.type in _SOURCE_OPS
            stack.pop()
            continue
        pending = [i for i in inputs if i.ref() not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[key] = any(memo[i.ref()] for i in inputs)
        stack.pop()
    return memo[tensor.ref()]
