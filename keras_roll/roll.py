"""The ROLL regularizer (RObust Local Linearity) and `wrap()` to train with it.

Lee, Alvarez-Melis & Jaakkola, "Towards Robust, Locally Linear Deep Networks",
ICLR 2019, Eq. 9: for every example

    R(x) = 1 / |I_gamma(x)| * sum_{j in I_gamma(x)} [ ||grad_x z_j||_2^2 + C * max(0, 1 - |z_j|) ]

where I_gamma(x) are the top gamma % of the neurons by the bracket (|z_j| is the
distance to the neuron's nearest breakpoint: |z_j| for ReLU). The training loss
is `L(f(x), y) + lam * mean_x R(x)`. The neuron gradients come from the
frozen-pattern twin (`keras_roll.twin`): one forward-mode pass along input axes,
with the activation pattern a constant for differentiation and the weights not.

Eq. 10 (approximate ROLL): `||g||^2 = D * E_k[(dz/dx_k)^2]`, so `samples=k` draws
k input axes per example (uniformly without replacement, or `strata="channel"`:
k axes in every channel) and scales the sum of squares by `D / k`, which is
unbiased for gamma = 100. `share_axes=True` draws one set of axes for the whole
batch (still unbiased per example, cheaper: the first layer's tangents are
shared). `estimator="gaussian"` / `"rademacher"` use random probes v instead
(E[(g . v)^2] = ||g||^2): they win when the gradients concentrate on few input
axes, axes win when the gradients are spread evenly (`tests/test_roll.py`).

Memory: the tangents of `B x K` directions are streamed in chunks of at most
`lin.memory_budget` bytes (estimated as `B * k * (tangent size + neurons + input
size) * itemsize`; `memory_plan` shows the plan). When more than one chunk is
needed, the gradient of the loss recomputes the chunks one by one in the
backward pass (a custom gradient), so training memory stays bounded too. If a
single direction of the batch does not fit, the error points to `samples=`.
On a CPU, chunks around the L3 cache size are fastest even with the
recomputation (`benchmarks/step_time.py`: 16 MiB beat one 700 MiB chunk by 25 %).
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np
import tensorflow as tf

from keras_roll.twin import ForwardPass, Linearized, linearize

ESTIMATORS = ("axes", "gaussian", "rademacher")
STRATA = (None, "channel")

# --------------------------------------------------------------------------- validation


def _get_lin(model_or_lin) -> Linearized:
    return linearize(model_or_lin)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def check_hyperparameters(lam=0.0, C=1.0, gamma=100.0, samples=None, strata=None,
                          estimator="axes", input_shape=None, share_axes=False) -> None:
    """Validates ROLL hyperparameters; raises `ValueError` naming the bad value.

    Args:
        lam: regularization weight, `>= 0`.
        C: hinge weight, `>= 0`.
        gamma: percentage of neurons kept, in `(0, 100]`.
        samples: None (exact) or an int in `[1, D]` (`[1, D / channels]` with
            `strata="channel"`; the number of probes for random estimators).
        strata: None or "channel".
        estimator: "axes", "gaussian" or "rademacher".
        input_shape: per-example input shape used to bound `samples` (None dims
            are not checked).
        share_axes: one set of sampled axes for the whole batch (needs
            `samples` and estimator "axes").

    Example:

    ```python
    check_hyperparameters(lam=2.0, gamma=50.0, samples=3, input_shape=(784,))
    ```
    """
    if not _is_number(lam) or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lam must be a finite number >= 0, got lam={lam!r}.")
    if not _is_number(C) or not math.isfinite(C) or C < 0:
        raise ValueError(f"C must be a finite number >= 0, got C={C!r}.")
    if not _is_number(gamma) or not (0 < gamma <= 100):
        raise ValueError(f"gamma is a percentage of neurons and must lie in (0, 100], got "
                         f"gamma={gamma!r}.")
    if estimator not in ESTIMATORS:
        raise ValueError(f"Unknown estimator={estimator!r}; expected one of {ESTIMATORS}.")
    if strata not in STRATA:
        raise ValueError(f"Unknown strata={strata!r}; expected None (uniform over all input "
                         f"axes) or 'channel' (the same number of axes in every channel).")
    if samples is not None and (not isinstance(samples, (int, np.integer))
                                or isinstance(samples, bool) or samples < 1):
        raise ValueError(f"samples must be None (exact ROLL) or a positive int, got "
                         f"samples={samples!r}.")
    if estimator != "axes":
        if samples is None:
            raise ValueError(f"estimator={estimator!r} draws random probes and needs "
                             f"samples=<number of probes>; use estimator='axes' with "
                             f"samples=None for the exact loss.")
        if strata is not None:
            raise ValueError(f"strata={strata!r} applies to estimator='axes' only, got "
                             f"estimator={estimator!r}.")
    if not isinstance(share_axes, (bool, np.bool_)):
        raise ValueError(f"share_axes must be True or False, got share_axes={share_axes!r}.")
    if share_axes and (samples is None or estimator != "axes"):
        raise ValueError(f"share_axes=True shares sampled input axes across the batch; it needs "
                         f"samples=<k> and estimator='axes', got samples={samples!r}, "
                         f"estimator={estimator!r}.")
    if strata is not None and samples is None:
        raise ValueError(f"strata={strata!r} stratifies sampled axes; pass samples=<axes "
                         f"per channel> (the exact loss uses every axis).")
    if input_shape is None or samples is None or estimator != "axes":
        return
    shape = tuple(input_shape)
    if strata == "channel":
        if len(shape) < 2:
            raise ValueError(f"strata='channel' needs a channels-last input of rank >= 2, "
                             f"got per-example input shape {shape}.")
        if any(d is None for d in shape[:-1]) or shape[-1] is None:
            return
        per_channel = int(np.prod(shape[:-1]))
        if samples > per_channel:
            raise ValueError(f"samples={samples} exceeds the {per_channel} axes of each "
                             f"channel of an input of shape {shape}.")
        return
    if any(d is None for d in shape):
        return
    d = int(np.prod(shape))
    if samples > d:
        raise ValueError(f"samples={samples} exceeds the input dimension D={d} of an input "
                         f"of shape {shape}; use samples=None for the exact loss.")


# --------------------------------------------------------------------------- directions


def _seed_tensor(seed):
    """A `[2]` int32 seed for stateless ops: int -> [seed, 0]; None -> random."""
    if seed is None:
        return tf.random.uniform([2], 0, 2**31 - 1, dtype=tf.int32)
    if tf.is_tensor(seed) or isinstance(seed, (list, tuple, np.ndarray)):
        s = tf.cast(tf.convert_to_tensor(seed), tf.int32)
        if s.shape.rank == 0:
            return tf.stack([s, tf.zeros([], tf.int32)])
        return tf.reshape(s, [2])
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise ValueError(f"seed must be None, an int or a [2] int tensor, got seed={seed!r}.")
    return tf.constant([int(seed) % (2**31 - 1), 0], tf.int32)


class _Directions:
    """The directions of one estimator: how many, their scale, a chunk maker.

    `make(trace, start, k, aux)` returns `[B, N]`: for every neuron, the sum over
    directions `start .. start + k - 1` (zero past the last one) of its squared
    derivative. Every tensor it
    needs besides the trace comes in `aux` (a list, given back as `self.aux`):
    the chunked path feeds them through its custom gradient, so that the
    recomputation in the backward pass captures nothing from outside.
    `shared` says whether the directions are the same for every example (then
    they take no per-example memory).
    """

    def __init__(self, total, scale, make, shared, aux):
        self.total = total
        self.scale = scale
        self.make = make
        self.shared = shared
        self.aux = list(aux)


def _directions(lin, x, example_shape, d, channels, samples, strata, estimator, seed,
                share_axes=False) -> _Directions:
    dtype = lin.dtype
    example_shape = tf.convert_to_tensor(example_shape, tf.int32)
    d = tf.convert_to_tensor(d, tf.int32) if tf.is_tensor(d) else int(d)
    if samples is None:  # exact: every input axis, shared one-hot directions

        def make(trace, start, k, aux):
            return lin.axes_tangent(trace, start, k, aux[0], reduce=_sum_squares_over_directions,
                                    per_neuron=True)

        return _Directions(d, None, make, True, [example_shape])

    batch = tf.shape(x)[0]
    seed_t = _seed_tensor(seed)
    if estimator == "axes":
        # One set of axes per example ([B, ...]) or, with share_axes, for the batch.
        lead = tf.zeros([0], tf.int32) if share_axes else tf.reshape(batch, [1])
        if strata == "channel":
            per_channel = d // channels
            u = tf.random.stateless_uniform(
                tf.concat([lead, tf.stack([channels, per_channel])], 0), seed_t)
            pos = tf.math.top_k(u, k=samples).indices  # [(B,) C, k] distinct per channel
            idx = pos * channels + tf.reshape(tf.range(channels), [channels, 1])
            total = samples * channels
            # Per channel: (D / C) / k; the same factor for every channel.
            scale = tf.cast(per_channel, dtype) / tf.cast(samples, dtype)
        else:
            u = tf.random.stateless_uniform(tf.concat([lead, tf.reshape(d, [1])], 0), seed_t)
            idx = tf.math.top_k(u, k=samples).indices  # k distinct axes
            total = samples
            scale = tf.cast(d, dtype) / tf.cast(samples, dtype)
        idx = tf.stop_gradient(tf.reshape(idx, tf.concat([lead, [-1]], 0)))
        depth = d

        def make(trace, start, k, aux):
            idx, lead, shape = aux
            if isinstance(start, int) and start == 0 and isinstance(k, int) and k == total:
                chunk = idx  # a single chunk: every sampled axis
            else:
                cols = tf.range(start, start + k)
                chunk = tf.gather(idx, tf.minimum(cols, total - 1), axis=-1)
                chunk = tf.where(cols < total, chunk, -1)  # one_hot(-1) = 0
            v = tf.one_hot(chunk, tf.reduce_prod(shape) if tf.is_tensor(depth) else depth,
                           dtype=dtype)
            v = tf.reshape(v, tf.concat([lead, [k], shape], 0))
            jvp = lin.tangent_from_trace(trace, v, share_axes, concat=False, axes=chunk)
            return _sum_squares_per_unit(jvp)

        return _Directions(total, scale, make, share_axes, [idx, lead, example_shape])

    # random probes, regenerated per chunk from the seed (stateless); for a fixed
    # seed they depend on the chunking (memory_budget), unbiased either way
    def make(trace, start, k, aux):
        seed_t, batch, shape = aux
        s = tf.random.experimental.stateless_fold_in(seed_t, start)
        dims = tf.stack([batch, k, tf.reduce_prod(shape)])
        if estimator == "gaussian":
            v = tf.random.stateless_normal(dims, s, dtype=dtype)
        else:
            bits = tf.random.stateless_uniform(dims, s, minval=0, maxval=2, dtype=tf.int32)
            v = tf.cast(2 * bits - 1, dtype)
        live = tf.cast(tf.range(start, start + k) < samples, dtype)
        v = v * live[None, :, None]
        v = tf.reshape(v, tf.concat([tf.stack([batch, k]), shape], 0))
        return _sum_squares_per_unit(lin.tangent_from_trace(trace, v, False, concat=False))

    return _Directions(samples, tf.constant(1.0 / samples, dtype), make, False,
                       [seed_t, batch, example_shape])


# --------------------------------------------------------------------------- streaming


def _static_int(t):
    if isinstance(t, (int, np.integer)):
        return int(t)
    v = tf.get_static_value(t)
    return None if v is None else int(v)


def _sum_squares_over_directions(jvp, start):
    return tf.reduce_sum(tf.square(jvp.neurons), axis=1)


def _sum_squares_per_unit(jvp):
    """`[B, N]` sums over directions, unit by unit (no `[B, k, N]` concat)."""
    return tf.concat([tf.reduce_sum(tf.square(t), axis=1) for t in jvp.neurons], axis=-1)


def _sq_chunk(dirs, trace, start, k, aux=None):
    return dirs.make(trace, start, k, dirs.aux if aux is None else aux)


def _chunked_sum_squares(lin, dirs, trace, n_shape, dtype, k, n):
    """Sum over `n` chunks of `k` directions, recomputed chunk by chunk in backprop.

    Everything a chunk reads enters the custom gradient as an explicit input:
    the trace, the model's variables as tensors (read once, mapped back with a
    `keras.StatelessScope`), the directions' tensors and the chunk counts. So the
    gradient captures nothing from outside and works inside `tf.cond`,
    `tf.function` (with the tape inside or outside) and `tf.distribute`.
    """
    flat = tf.nest.flatten(trace)
    variables = list(lin.model.variables)
    values = [tf.convert_to_tensor(v.value) for v in variables]
    aux = list(dirs.aux)
    sizes = [len(flat), len(values), len(aux)]
    counts = [tf.convert_to_tensor(t, tf.int32) for t in (k, n, n_shape)]

    def split(inputs):
        a, b, c = sizes
        return (inputs[:a], inputs[a:a + b], inputs[a + b:a + b + c], inputs[a + b + c:])

    def chunk(inputs, c):
        tr, vals, ax, (k_t, _, _) = split(inputs)
        k_c = k if isinstance(k, int) else k_t
        with keras.StatelessScope(state_mapping=list(zip(variables, vals))):
            return _sq_chunk(dirs, tf.nest.pack_sequence_as(trace, list(tr)), c * k_c, k_c,
                             list(ax))

    @tf.custom_gradient
    def run(*args):
        # Identities in the current graph (e.g. a tf.cond branch): the gradient
        # function must reference these, not the caller's tensors.
        inputs = [tf.identity(t) for t in args]
        _, _, _, (_, n_t, shape_t) = split(inputs)
        # Stopped copies: an eager tape must not record (and keep) the chunks.
        stopped = [tf.stop_gradient(t) for t in inputs]
        _, sq = tf.while_loop(lambda c, acc: c < n_t,
                              lambda c, acc: (c + 1, acc + chunk(stopped, c)),
                              (tf.constant(0), tf.zeros(shape_t, dtype)))

        def grad(dsq):
            diff = [i for i, t in enumerate(inputs) if t.dtype.is_floating]

            def body(c, acc):
                with tf.GradientTape() as tape:
                    tape.watch([inputs[i] for i in diff])
                    s = chunk(inputs, c)
                gs = tape.gradient(s, [inputs[i] for i in diff], output_gradients=dsq,
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
                return c + 1, [a + tf.convert_to_tensor(g) for a, g in zip(acc, gs)]

            zeros = [tf.zeros_like(inputs[i]) for i in diff]
            _, out = tf.while_loop(lambda c, acc: c < n_t, body, (tf.constant(0), zeros))
            grads = [None] * len(inputs)
            for i, g in zip(diff, out):
                grads[i] = g
            return grads

        return sq, grad

    return run(*flat, *values, *aux, *counts)


def _static_tangent_size(lin, x):
    """Per-example tangent size as a Python int when `x` has a fully static shape.

    Inside a graph the twin's `tangent_size` is a tensor; the twin's cached
    batch-1 eager probe lets fully static graphs plan their chunks in Python.
    """
    if not x.shape.is_fully_defined():
        return None
    try:
        with tf.init_scope():
            if not tf.executing_eagerly():
                return None
            return lin.tangent_size(x.shape[1:])
    except Exception:  # planning falls back to the dynamic path
        return None


def _bytes_per_direction(lin, fwd, x, shared):
    """Bytes one direction takes for the whole batch: every op's tangent, the
    neuron tangents and (per-example directions) the direction itself.

    A Python int when every size is static, else an int64 tensor.
    """
    itemsize = np.dtype(lin.dtype).itemsize
    size = tf.get_static_value(fwd.tangent_size)
    if size is None:
        size = _static_tangent_size(lin, x)
    batch, n_neurons = x.shape[0], fwd.neurons.z.shape[1]
    d = x.shape[1:].num_elements() if x.shape[1:].is_fully_defined() else None
    if None not in (size, batch, n_neurons, d):
        per = int(size) + int(n_neurons) + (0 if shared else int(d))
        return max(int(batch), 1) * per * itemsize
    batch = tf.cast(tf.shape(x)[0], tf.int64)
    per = tf.cast(fwd.tangent_size, tf.int64) + tf.cast(tf.shape(fwd.neurons.z)[1], tf.int64)
    if not shared:
        per += tf.cast(tf.reduce_prod(tf.shape(x)[1:]), tf.int64)
    return tf.maximum(batch, 1) * per * itemsize


def _sum_squares(lin: Linearized, fwd: ForwardPass, x, dirs: _Directions, memory_budget):
    """`[B, N]` sum over directions of the squared neuron derivatives (unscaled)."""
    trace = fwd.trace
    z = fwd.neurons.z
    dtype = z.dtype
    per_chunk_dir = _bytes_per_direction(lin, fwd, x, dirs.shared)
    budget = int(memory_budget or lin.memory_budget)
    total = dirs.total
    if isinstance(per_chunk_dir, int) and isinstance(total, int):
        k_fit = min(budget // per_chunk_dir, total)
    else:
        k_fit = tf.minimum(tf.cast(budget, tf.int64) // per_chunk_dir, tf.cast(total, tf.int64))

    k_static = _static_int(k_fit)
    if k_static is not None:  # eager, or fully static shapes: plan in Python
        if k_static < 1:
            raise MemoryError(_budget_message(lin, budget, _static_int(per_chunk_dir)))
        total_i = _static_int(total)
        n = -(-total_i // k_static)
        if n == 1:
            return _sq_chunk(dirs, trace, 0, total_i)
        k = -(-total_i // n)  # balanced chunks
        return _chunked_sum_squares(lin, dirs, trace, tf.shape(z), dtype, k, n)

    check = tf.debugging.assert_positive(
        k_fit, message=(f"keras_roll ROLL: one direction for the whole batch does not fit "
                        f"in memory_budget={budget} bytes; use samples=, a smaller batch or "
                        f"a larger Linearized.memory_budget."))
    with tf.control_dependencies([check]):
        k_fit = tf.cast(tf.maximum(k_fit, 1), tf.int32)
    total_t = tf.cast(total, tf.int32)
    n = (total_t + k_fit - 1) // k_fit
    k = (total_t + n - 1) // n
    return tf.cond(n <= 1, lambda: _sq_chunk(dirs, trace, 0, total_t),
                   lambda: _chunked_sum_squares(lin, dirs, trace, tf.shape(z), dtype, k, n))


def _budget_message(lin, budget, per):
    return (f"The ROLL tangents of model '{lin.model.name}' need {per} bytes for a single "
            f"input direction of the batch, more than memory_budget={budget} bytes. Use the "
            f"approximate loss (samples=..., e.g. samples=120, strata='channel' for images), "
            f"a smaller batch, or a larger budget (keras_roll.linearize(model, "
            f"memory_budget=...)).")


@dataclasses.dataclass(frozen=True)
class RollPlan:
    """How the ROLL tangents of a batch are streamed (see `memory_plan`).

    Attributes:
        directions: input directions per example (D for the exact loss).
        per_chunk: directions per chunk.
        chunks: number of chunks (tangent passes); more than one also costs a
            recomputation in the backward pass.
        bytes_per_direction: estimated tangent bytes of one direction for the
            whole batch.
        memory_budget: the budget the chunks respect.
    """

    directions: int
    per_chunk: int
    chunks: int
    bytes_per_direction: int
    memory_budget: int

    @property
    def fits(self) -> bool:
        """Whether one direction of the batch fits into the budget."""
        return self.per_chunk >= 1


def memory_plan(model_or_lin, x, samples=None, strata=None, estimator="axes",
                share_axes=False) -> RollPlan:
    """The chunking `roll_loss` uses on `x` within `lin.memory_budget` (eager).

    Example:

    ```python
    plan = keras_roll.roll.memory_plan(model, x_batch)   # exact loss
    print(plan.chunks, plan.per_chunk)                     # tangent passes, axes each
    ```
    """
    lin = _get_lin(model_or_lin)
    x = lin.check_input(x)
    check_hyperparameters(samples=samples, strata=strata, estimator=estimator,
                          input_shape=tuple(x.shape[1:]), share_axes=share_axes)
    fwd = lin.compiled.primal(x)
    d = int(np.prod(x.shape[1:]))
    if samples is None:
        total = d
    elif strata == "channel":
        total = samples * int(x.shape[-1])
    else:
        total = samples
    per = int(_bytes_per_direction(lin, fwd, x, samples is None or share_axes))
    k = min(lin.memory_budget // per, total)
    n = -(-total // k) if k >= 1 else 0
    if n:
        k = -(-total // n)
    return RollPlan(total, int(k), int(n), per, lin.memory_budget)


# --------------------------------------------------------------------------- public API


@tf.autograph.experimental.do_not_convert
def neuron_grad_sq(model_or_lin, x, samples=None, strata=None, seed=None,
                   estimator="axes", share_axes=False, forward: ForwardPass | None = None):
    """Squared l2 norms of every neuron's input gradient, `[B, N]`.

    Exact (`samples=None`, Eq. 9) or the unbiased estimate of Eq. 10. The
    activation pattern of `x` is frozen; the result is differentiable w.r.t.
    the model weights.

    Args:
        model_or_lin: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs.
        samples, strata, seed, estimator, share_axes: see `roll_loss`.
        forward: a `ForwardPass` of `x` to reuse (from `lin.primal(x)`).

    Returns:
        A `[B, N]` tensor in the twin's dtype (float32 or float64).

    Example:

    ```python
    sq = keras_roll.roll.neuron_grad_sq(model, x)   # ||grad_x z_j||^2 per neuron
    ```
    """
    lin = _get_lin(model_or_lin)
    x = lin.check_input(x)
    check_hyperparameters(samples=samples, strata=strata, estimator=estimator,
                          input_shape=tuple(x.shape[1:]), share_axes=share_axes)
    fwd = forward if forward is not None else lin.primal(x)
    return _grad_sq(lin, fwd, x, samples, strata, seed, estimator, share_axes)


def _grad_sq(lin, fwd, x, samples, strata, seed, estimator, share_axes=False):
    static = x.shape[1:]
    if static.is_fully_defined():
        dims = static.as_list()
        example_shape = tf.constant(dims, tf.int32)
        d, channels = int(np.prod(dims)), dims[-1]
    else:
        example_shape = tf.shape(x)[1:]
        d, channels = tf.reduce_prod(example_shape), example_shape[-1]
    dirs = _directions(lin, x, example_shape, d, channels, samples, strata, estimator, seed,
                       share_axes)
    sq = _sum_squares(lin, fwd, x, dirs, lin.memory_budget)
    if dirs.scale is not None:
        sq = sq * tf.cast(dirs.scale, sq.dtype)
    return sq


@tf.autograph.experimental.do_not_convert
def roll_loss(model_or_lin, x, C=1.0, gamma=100.0, samples=None, strata=None, seed=None,
              estimator="axes", share_axes=False, return_logits=False):
    """The per-example ROLL regularizer of Eq. 9 (without `lam`), `[B]`.

    For every example, the mean over the top `gamma` % of its valid neurons
    (ranked by the bracket) of `||grad_x z_j||_2^2 + C * max(0, 1 - |z_j - b_j|)`,
    with `b_j` the neuron's nearest breakpoint (0 for ReLU, so `|z_j|` as in the
    paper; ReLU6 also has 6; max-pooling neurons are the differences
    `v_winner - v_k`). Neurons that do not exist for an example (padded RNN time
    steps, the winner of a max window) are left out. The activation pattern is a
    constant for differentiation; the weights are not.

    Args:
        model_or_lin: a Keras model (linearized and cached) or a `Linearized`.
        x: `[B, *input_shape]` inputs (array or tensor).
        C: weight of the hinge term, `>= 0`.
        gamma: percentage of neurons kept, in `(0, 100]`. 100 keeps all (no sort);
            otherwise `ceil(gamma / 100 * n_valid)` per example.
        samples: None for the exact loss (every input axis, streamed in chunks
            within `lin.memory_budget`); k for Eq. 10: k axes per example, drawn
            uniformly without replacement, sum of squares scaled by `D / k`
            (unbiased for gamma = 100); the number of probes for random estimators.
        strata: None, or "channel": k axes in every channel of a channels-last
            input (the paper's "120 samples on each channel"), scaled per channel.
        seed: None (fresh randomness per call), an int, or a `[2]` int tensor for
            stateless, reproducible sampling (also inside `fit`).
        estimator: "axes" (one-hot input axes), "gaussian" or "rademacher"
            (random probes v, `E[(g . v)^2] = ||g||^2`, scaled by `1 / k`).
        share_axes: draw one set of axes for the whole batch instead of one per
            example. Each example's estimate stays unbiased (its axes are still
            uniform without replacement) but the examples' estimates are
            correlated; the first layer's tangents are then shared by the batch,
            which makes the step markedly cheaper (benchmarks/step_time.py).
        return_logits: also return the twin's logits `[B, ...]` (the model output
            before a folded softmax) from the same forward pass.

    Returns:
        A `[B]` tensor (float32 even under mixed precision), or `(loss, logits)`.

    Raises:
        ValueError: bad hyperparameters (the message names the value).
        MemoryError: a single direction of the batch exceeds the memory budget
            (with the exact loss on large inputs: use `samples=`).

    Example:

    ```python
    reg = keras_roll.roll.roll_loss(model, x, C=1.0, gamma=100.0)   # [B]
    loss = keras.losses.sparse_categorical_crossentropy(y, model(x)) + 2.0 * reg
    ```
    """
    lin = _get_lin(model_or_lin)
    x = lin.check_input(x)
    check_hyperparameters(C=C, gamma=gamma, samples=samples, strata=strata,
                          estimator=estimator, input_shape=tuple(x.shape[1:]),
                          share_axes=share_axes)
    fwd = lin.primal(x)
    if x.shape[0] == 0:  # an empty batch has an empty loss
        loss = tf.zeros([0], lin.dtype)
        return (loss, fwd.logits) if return_logits else loss
    sq = _grad_sq(lin, fwd, x, samples, strata, seed, estimator, share_axes)
    loss = _select_and_average(fwd, sq, C, gamma)
    if return_logits:
        return loss, fwd.logits
    return loss


def _select_and_average(fwd: ForwardPass, sq, C, gamma):
    """Eq. 9's average over I_gamma(x), the top gamma % valid neurons by the bracket."""
    neurons = fwd.neurons
    dtype = sq.dtype
    dist = tf.minimum(neurons.below, neurons.above)  # |z_j - b_j|, nearest breakpoint
    hinge = tf.nn.relu(1.0 - dist)
    bracket = sq + tf.cast(C, dtype) * hinge if C else sq
    valid = neurons.valid
    n_valid = tf.reduce_sum(tf.cast(valid, tf.int32), axis=1)
    if gamma >= 100:
        total = tf.reduce_sum(tf.where(valid, bracket, tf.zeros_like(bracket)), axis=1)
        return total / tf.cast(tf.maximum(n_valid, 1), dtype)
    n = tf.shape(bracket)[1]
    frac = float(gamma) / 100.0
    # ceil(gamma / 100 * n), guarded against float round-up (e.g. 0.07 * 100).
    k_max = tf.cast(tf.math.ceil(tf.cast(n, tf.float64) * frac - 1e-9), tf.int32)
    k_max = tf.clip_by_value(k_max, 1, tf.maximum(n, 1))
    n_keep = tf.cast(tf.math.ceil(tf.cast(n_valid, tf.float64) * frac - 1e-9), tf.int32)
    vals = tf.where(valid, bracket, tf.fill(tf.shape(bracket), tf.constant(-np.inf, dtype)))
    top = tf.math.top_k(vals, k=tf.minimum(k_max, n)).values  # [B, k_max], descending
    keep = tf.range(tf.shape(top)[1])[None, :] < n_keep[:, None]
    total = tf.reduce_sum(tf.where(keep, top, tf.zeros_like(top)), axis=1)
    return total / tf.cast(tf.maximum(n_keep, 1), dtype)


# --------------------------------------------------------------------------- wrap


class _RollMean(keras.metrics.Mean):
    """A Mean that reads NaN ("not computed") instead of 0 before any update."""

    def result(self):
        count = tf.convert_to_tensor(self.count)
        total = tf.convert_to_tensor(self.total)
        nan = tf.constant(float("nan"), count.dtype)
        return tf.where(count > 0, total / tf.maximum(count, 1e-12), nan)


@keras.saving.register_keras_serializable(package="keras_roll")
class RollRegularizer(keras.layers.Layer):
    """Adds `lam * mean(roll_loss(model, x))` to the training loss of `model(x)`.

    The layer holds the original model (it *shares* its weights: training the
    wrapped model trains `model`) and returns `model(x)` unchanged. When called
    with `training=True` (inside `fit`) it computes the ROLL regularizer of
    Eq. 9 / 10 on the inputs, adds `lam` times its batch mean through
    `self.add_loss`, and tracks the batch mean (without `lam`) as the metric
    `roll_loss` (History and progress bar). When no layer behaves differently
    in training (no BatchNorm, dropout or noise layer), the training output is
    computed from the twin's forward pass, which is the same function, instead
    of a second forward pass of `model`.

    In inference mode (`evaluate`, `predict`, plain calls) it only runs the
    model unless `on_eval=True`: then it also adds the loss and updates the
    metric, so `evaluate` reports `roll_loss` and a `val_loss` that includes it
    (as Keras does for weight regularizers), at the price of computing it in
    `predict` too. Without `on_eval`, evaluation reports `roll_loss` as NaN
    ("not computed"), never a misleading 0.

    Under `tf.distribute`, Keras scales the added loss by `1 / num_replicas`
    like the compiled loss, so the summed replica gradients equal the
    one-replica gradient of the global batch (checked in
    `tests/test_distribute.py`).

    The regularizer is computed on the inference-mode network (BatchNorm with
    moving statistics, no dropout): the twin linearizes the deployed function.

    Args:
        model: the functional / Sequential Keras model (or its config dict).
        lam, C, gamma, samples, strata, estimator, share_axes: see `wrap` and
            `roll_loss`.
        seed: None (fresh axes every step) or an int: a reproducible sequence,
            one stateless seed per step (a step counter is kept as a
            non-trainable weight, saved with the model) and replica.
        on_eval: also compute the regularizer in inference mode.
        memory_budget: bytes of tangents per chunk (default: the twin's,
            `keras_roll.twin.DEFAULT_MEMORY_BUDGET`).

    Example:

    ```python
    layer = RollRegularizer(model, lam=2.0)
    inp = keras.Input(model.input_shape[1:])
    wrapped = keras.Model(inp, layer(inp))
    ```
    """

    def __init__(self, model, lam=2.0, C=1.0, gamma=100.0, samples=None, strata=None,
                 estimator="axes", seed=None, on_eval=False, memory_budget=None,
                 share_axes=False, **kwargs):
        # float32 policy: no autocast inside call, so the twin reads float32 weights
        # even under mixed precision (the inner model keeps its own policies).
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        if isinstance(model, dict):  # from a config
            model = keras.saving.deserialize_keras_object(model)
        if memory_budget is None:
            lin = _get_lin(model)
        else:
            lin = linearize(model, memory_budget=int(memory_budget))
        check_hyperparameters(lam=lam, C=C, gamma=gamma, samples=samples, strata=strata,
                              estimator=estimator, input_shape=lin.input_shape,
                              share_axes=share_axes)
        if seed is not None and (not isinstance(seed, (int, np.integer))
                                 or isinstance(seed, bool)):
            raise ValueError(f"seed must be None or an int, got seed={seed!r}.")
        self.inner_model = model
        self.lam = float(lam)
        self.C = float(C)
        self.gamma = float(gamma)
        self.samples = None if samples is None else int(samples)
        self.strata = strata
        self.estimator = estimator
        self.seed = None if seed is None else int(seed)
        self.on_eval = bool(on_eval)
        self.share_axes = bool(share_axes)
        self.memory_budget = None if memory_budget is None else int(memory_budget)
        self._lin = lin
        self._step = None
        if self.samples is not None and self.seed is not None:
            # ON_READ: every replica counts locally. A synchronized update would be a
            # merge_call inside `call`, which lets the other replica thread run its
            # `call` in between and mix up the layer's (shared) add_loss list.
            self._step = keras.Variable(0, shape=(), dtype="int64", trainable=False,
                                        aggregation="only_first_replica",
                                        synchronization="on_read", name="roll_seed_step")
        self.roll_tracker = _RollMean(name="roll_loss")
        self.built = True

    @property
    def metrics(self):
        # Only our own tracker: a compiled inner model must not add its "loss".
        return [self.roll_tracker]

    @property
    def linearized(self) -> Linearized:
        """The twin of `inner_model` the regularizer computes with."""
        return self._lin

    def _seed(self):
        """A fresh `[2]` stateless seed per step (and replica) from the int seed."""
        if self._step is None:
            return None
        step = self._step.value
        self._step.assign_add(1)
        replica = tf.distribute.get_replica_context()
        rid = replica.replica_id_in_sync_group if replica is not None else 0
        mixed = tf.cast(step, tf.int64) * 1009 + tf.cast(rid, tf.int64)
        return tf.stack([tf.constant(self.seed % (2**31 - 1), tf.int32),
                         tf.cast(mixed % (2**31 - 1), tf.int32)])

    @tf.autograph.experimental.do_not_convert
    def call(self, inputs, training=None):
        if not (training or self.on_eval):
            return self.inner_model(inputs, training=training)
        per_example, logits = roll_loss(self._lin, inputs, C=self.C, gamma=self.gamma,
                                        samples=self.samples, strata=self.strata,
                                        seed=self._seed(), estimator=self.estimator,
                                        share_axes=self.share_axes, return_logits=True)
        if self._lin.inference_equals_training:
            # The twin's forward pass is the model's: reuse it instead of a second one.
            dtype = keras.backend.standardize_dtype(self.inner_model.outputs[0].dtype)
            outputs = tf.cast(self._lin.apply_output_link(logits), dtype)
        else:
            outputs = self.inner_model(inputs, training=training)
        reg = tf.reduce_mean(per_example)
        self.add_loss(tf.cast(self.lam, reg.dtype) * reg)
        self.roll_tracker.update_state(reg)
        return outputs

    def compute_output_spec(self, inputs, training=None):
        return self.inner_model.compute_output_spec(inputs)

    def get_config(self):
        config = super().get_config()
        config.update({
            "model": keras.saving.serialize_keras_object(self.inner_model),
            "lam": self.lam, "C": self.C, "gamma": self.gamma, "samples": self.samples,
            "strata": self.strata, "estimator": self.estimator, "seed": self.seed,
            "on_eval": self.on_eval, "memory_budget": self.memory_budget,
            "share_axes": self.share_axes,
        })
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(config["model"])
        return cls(**config)


def wrap(model, lam=2.0, C=1.0, gamma=100.0, samples=None, strata=None, estimator="axes",
         seed=None, on_eval=False, memory_budget=None, share_axes=False):
    """Returns a model that trains `model` with the ROLL regularizer (Eq. 9 / 10).

    The wrapped model has the same inputs and outputs as `model` and shares its
    weights; `compile` / `fit` / `evaluate` / `predict` work as usual. During
    `fit`, `lam * mean(roll_loss(model, x))` is added to the loss and the
    regularizer (without `lam`) is reported as `roll_loss` in History.
    `predict` returns `model`'s outputs. Save it as a `.keras` file like any
    model; `unwrap` gives the plain model back.

    Args:
        model: a functional or Sequential model of supported layers (a final
            softmax is fine: it is folded into the loss).
        lam: regularizer weight (>= 0).
        C: hinge weight in the bracket (>= 0).
        gamma: percentage of neurons kept (0, 100].
        samples: None for the exact loss, or k for the sampled Eq. 10.
        strata: None or "channel".
        estimator: "axes", "gaussian" or "rademacher".
        seed: None or an int for reproducible sampling.
        on_eval: also compute it in `evaluate` (reported as `val_roll_loss` and
            included in `val_loss`); then `predict` computes it too. Off by
            default: evaluation reports `roll_loss` as NaN.
        memory_budget: bytes of live tangents per chunk of the exact loss
            (default 64 MiB); more chunks cost one extra tangent pass in the
            backward (they are recomputed rather than stored).
        share_axes: with `samples`, one set of axes for the whole batch (see
            `roll_loss`): cheaper, still unbiased per example.

    Returns:
        A `keras.Model`.

    Raises:
        ValueError: bad hyperparameters.
        keras_roll.UnsupportedModelError: a layer the twin cannot linearize.

    Example:

    ```python
    wrapped = keras_roll.roll.wrap(model, lam=2.0, C=1.0, gamma=100.0)
    wrapped.compile("sgd", "sparse_categorical_crossentropy")
    history = wrapped.fit(x, y, epochs=5)      # history.history["roll_loss"]
    plain = keras_roll.roll.unwrap(wrapped)    # the same object as `model`
    ```
    """
    layer = RollRegularizer(model, lam=lam, C=C, gamma=gamma, samples=samples, strata=strata,
                            estimator=estimator, seed=seed, on_eval=on_eval,
                            memory_budget=memory_budget, share_axes=share_axes,
                            name="roll_regularizer")
    inp = keras.Input(shape=model.input_shape[1:], dtype=model.inputs[0].dtype)
    return keras.Model(inp, layer(inp), name=f"{model.name}_roll")


def unwrap(wrapped):
    """The plain model inside a model returned by `wrap` (itself otherwise).

    Example:

    ```python
    plain = keras_roll.roll.unwrap(keras_roll.roll.wrap(model))   # plain is model
    ```
    """
    if isinstance(wrapped, RollRegularizer):
        return wrapped.inner_model
    for layer in getattr(wrapped, "layers", []):
        if isinstance(layer, RollRegularizer):
            return layer.inner_model
    return wrapped
