"""The ROLL regularizer (RObust Local Linearity): `roll_loss`, `neuron_grad_sq`, `memory_plan`.

Lee, Alvarez-Melis & Jaakkola, "Towards Robust, Locally Linear Deep Networks",
ICLR 2019, Eq. 9: for every example

    R(x) = 1 / |I_gamma(x)| * sum_{j in I_gamma(x)} [ ||grad_x z_j||_2^2 + C * max(0, 1 - |z_j|) ]

where I_gamma(x) are the top gamma % of the neurons by the bracket (|z_j| is the
distance to the neuron's nearest breakpoint: |z_j| for ReLU). The training loss
is `L(f(x), y) + lam * mean_x R(x)`. The neuron gradients come from the
frozen-pattern twin (`keras_roll.compile.twin`): one forward-mode pass along input axes,
with the activation pattern a constant for differentiation and the weights not.
The data flow of a training step is in docs/design.md, section "Data flow of a
ROLL training step".

Eq. 10 (approximate ROLL): `||g||^2 = D * E_k[(dz/dx_k)^2]`, so `samples=k` draws
k input axes per example (uniformly without replacement, or `strata="channel"`:
k axes in every channel) and scales the sum of squares by `D / k`, which is
unbiased for gamma = 100. `share_axes=True` draws one set of axes for the whole
batch (still unbiased per example, cheaper: the first layer's tangents are
shared). `estimator="gaussian"` / `"rademacher"` use random probes v instead
(E[(g . v)^2] = ||g||^2): they win when the gradients concentrate on few input
axes, axes win when the gradients are spread evenly (`tests/test_roll.py`).
The three estimators are in `keras_roll.roll.estimators`; the hyperparameters are
one validated `RollConfig` (`keras_roll.roll.config`).

`wrt="<layer>"` takes the gradients (axes, probes) with respect to the output of a
leading Rescaling / Normalization layer instead of the raw input: the paper's
normalised units (docs/design.md, "The maths", Units). Behind a leading Masking
layer the sampled axes of each example are drawn among its valid steps only,
scaled by `D_valid / k` (still unbiased).

Memory: the tangents of `B x K` directions are streamed in chunks of at most
`lin.memory_budget` bytes (estimated as `B * k * (tangent size + neurons + input
size) * itemsize`; `memory_plan` shows the `keras_roll.compile.chunking.ChunkPlan` that
`roll_loss` runs). When more than one chunk is
needed, the gradient of the loss recomputes the chunks one by one in the
backward pass (a custom gradient), so training memory stays bounded too. If a
single direction of the batch does not fit, the error points to `samples=`.
On a CPU, chunks around the L3 cache size are fastest even with the
recomputation (`benchmarks/step_time.py`).

`RollRegularizer` and `wrap`, which train with this loss through
`fit`, live in `keras_roll.regularizers` (`roll`, `wrap`).
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from keras_roll.compile.chunking import ChunkPlan
from keras_roll.compile.interpreter import ForwardPass
from keras_roll.compile.twin import Linearized, linearize
from keras_roll.inputs import Array, ModelOrTwin
from keras_roll.options import Seed
from keras_roll.roll.autotune import tuned_config
from keras_roll.roll.buckets import bucketed, buckets_apply
from keras_roll.roll.chunks import plan_directions_for, roll_budget, sum_squares
from keras_roll.roll.config import RollConfig, RollPlan, resolve_config
from keras_roll.roll.entry import padding_mask, roll_plan
from keras_roll.roll.estimators import estimator_for

__all__ = ["LOSS_UNUSED", "checked_plan", "grad_sq", "loss_from_config", "memory_plan",
           "neuron_grad_sq", "roll_loss"]

LOSS_UNUSED = ("lam", "on_eval")
"""`RollConfig` fields `roll_loss`, `neuron_grad_sq` and `memory_plan` do not read (`wrap` does)."""


# --------------------------------------------------------------------------- public API


def checked_plan(lin: Linearized, x: tf.Tensor, config: RollConfig | None, overrides: dict,
                 caller: str = "roll_loss") -> RollPlan:
    """The `RollPlan` of a call (`config` with `overrides`, resolved against the twin),
    checked against the batch `x`: `samples` against the input shape, `wrt`
    against the model (a bad `wrt=` fails here, eagerly, naming the valid layers).

    Raises:
        TypeError: an override `caller` does not read (`lam`, `on_eval`: `wrap`'s),
            or one that names no field.

    Example:

    ```python
    plan = checked_plan(lin, lin.check_input(x), None, {"samples": 3})
    ```
    """
    unused = [k for k in LOSS_UNUSED if k in overrides]
    if unused:
        raise TypeError(f"{caller}() does not use {unused}: it returns the regularizer "
                        f"without lam and computes it whenever called; pass them to "
                        f"keras_roll.wrap (or multiply the loss by lam yourself).")
    config = resolve_config(config, **overrides)
    config.check_input_shape(tuple(x.shape[1:]))
    return roll_plan(lin, config)


@tf.autograph.experimental.do_not_convert
def neuron_grad_sq(model_or_lin: ModelOrTwin, x: Array, config: RollConfig | None = None, *,
                   seed: Seed = None, forward: ForwardPass | None = None,
                   **overrides) -> tf.Tensor:
    """Squared l2 norms of every neuron's input gradient, `[B, N]`.

    Exact (`samples=None`, Eq. 9) or the unbiased estimate of Eq. 10. The
    activation pattern of `x` is frozen; the result is differentiable w.r.t.
    the model weights.

    Args:
        model_or_lin: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs.
        config: a `RollConfig` (default `RollConfig()`); `samples`, `strata`,
            `estimator`, `share_axes`, `wrt`, `tangent_dtype` and
            `memory_budget` apply.
        seed: None (`config.seed`), an int or a `[2]` int tensor (see `roll_loss`).
        forward: a `ForwardPass` of `x` to reuse (from `lin.primal(x)`).
        **overrides: `RollConfig` fields replacing those of `config`.

    Returns:
        A `[B, N]` tensor in the twin's dtype (float32 or float64).

    Example:

    ```python
    sq = keras_roll.roll.loss.neuron_grad_sq(model, x)   # ||grad_x z_j||^2 per neuron
    sq3 = keras_roll.roll.loss.neuron_grad_sq(model, x, samples=3, seed=0)   # Eq. 10
    ```
    """
    lin, x, plan = _tuned_plan(model_or_lin, x, config, overrides, "neuron_grad_sq")
    fwd = forward if forward is not None else lin.primal(x)
    return grad_sq(lin, fwd, x, plan, plan.config.seed if seed is None else seed)


def grad_sq(lin: Linearized, fwd: ForwardPass, x: tf.Tensor, config: RollConfig | RollPlan,
            seed: Seed = None) -> tf.Tensor:
    """`[B, N]` squared gradient norms (scaled estimate) for a checked batch `x`.

    The internal entry point of `neuron_grad_sq` and `roll_loss`: `config` (or its
    `RollPlan`) is already validated and `fwd` is the forward pass of `x`.
    """
    plan = roll_plan(lin, config)
    est = estimator_for(lin, x, plan, seed, trace=fwd.trace)
    sq = sum_squares(lin, fwd, x, est, roll_budget(lin, plan.config))
    scale = est.scale(lin.dtype)
    if scale is not None:
        sq = sq * tf.cast(scale, sq.dtype)
    return sq


@tf.autograph.experimental.do_not_convert
def roll_loss(model_or_lin: ModelOrTwin, x: Array, config: RollConfig | None = None, *,
              seed: Seed = None, return_logits: bool = False, **overrides):
    """The per-example ROLL regularizer of Eq. 9 (without `lam`), `[B]`.

    For every example, the mean over the top `gamma` % of its valid neurons
    (ranked by the bracket) of `||grad_x z_j||_2^2 + C * max(0, 1 - |z_j - b_j|)`,
    with `b_j` the neuron's nearest breakpoint (0 for ReLU, so `|z_j|` as in the
    paper; ReLU6 also has 6; max-pooling neurons are the differences
    `v_winner - v_k`). Neurons that do not exist for an example (padded RNN time
    steps, the winner of a max window) are left out. The activation pattern is a
    constant for differentiation; the weights are not.

    The hyperparameters are one `RollConfig` (`keras_roll.roll.config`, where
    each field is described): pass one as `config`, its fields by keyword, or
    both (the keywords replace the config's fields). `lam` and `on_eval` are
    read by `wrap` only: passing them here is a `TypeError` (a `config` that
    holds them is fine).

    Args:
        model_or_lin: a Keras model (linearized and cached) or a `Linearized`.
        x: `[B, *input_shape]` inputs (array or tensor).
        config: a `RollConfig`, or None for the defaults (exact ROLL, `C=1`,
            `gamma=100`).
        seed: None (`config.seed`; fresh randomness without one), an int, or a
            `[2]` int tensor for stateless, reproducible sampling (also inside
            `fit`).
        return_logits: also return the twin's logits `[B, ...]` (the model output
            before a folded softmax) from the same forward pass.
        **overrides: `RollConfig` fields, e.g. `C=0.25`, `gamma=50.0`,
            `samples=3`, `strata="channel"`, `estimator="gaussian"`,
            `share_axes=True`, `wrt="normalize"`, `tangent_dtype="bfloat16"`,
            `memory_budget=2**24`.

    Returns:
        A `[B]` tensor (float32 even under mixed precision), or `(loss, logits)`.

    Raises:
        TypeError: `config` is not a `RollConfig`, an unknown keyword, or `lam` /
            `on_eval` (read by `wrap` only).
        ValueError: bad hyperparameters (the message names the value).
        MemoryError: a single direction of the batch exceeds the memory budget
            (with the exact loss on large inputs: use `samples=`).

    Example:

    ```python
    reg = keras_roll.roll_loss(model, x, C=1.0, gamma=100.0)   # [B]
    loss = keras.losses.sparse_categorical_crossentropy(y, model(x)) + 2.0 * reg
    sampled = keras_roll.roll_loss(model, x, RollConfig(samples=3), seed=0)
    ```
    """
    lin = linearize(model_or_lin)
    x = lin.check_input(x)
    plan = checked_plan(lin, x, config, overrides)
    return loss_from_config(lin, x, plan, plan.config.seed if seed is None else seed,
                            return_logits)


def loss_from_config(lin: Linearized, x: tf.Tensor, config: RollConfig | RollPlan,
                     seed: Seed = None, return_logits: bool = False,
                     precompute_gradient: bool = False):
    """`roll_loss` for a checked batch `x` and a validated `config` (or its `RollPlan`,
    which the callers resolve once: `RollRegularizer`, `roll_loss`).

    Args:
        lin, x, seed, return_logits: see `roll_loss`.
        config: a `RollConfig` or its `RollPlan` (`keras_roll.roll.entry.roll_plan`).
        precompute_gradient: True when the caller differentiates a uniform
            weighting of the per-example losses (the batch mean of a training
            step, as `RollRegularizer` does). With `gamma = 100` and tangents in
            several chunks, each chunk then computes its weight gradient in the
            forward pass, instead of being recomputed in the backward pass (one
            tangent pass less); a backward pass with non-uniform weights still
            recomputes, so the gradient is right either way. Costly if nothing
            is differentiated.

    Example:

    ```python
    loss, logits = loss_from_config(lin, lin.check_input(x), RollConfig(gamma=50.0),
                                    return_logits=True)
    ```
    """
    plan = roll_plan(lin, config)
    plan = tuned_config(lin, x, plan, precompute_gradient, lambda cfg, xb: loss_from_config(
        lin, xb, plan.with_config(cfg), 0, precompute_gradient=precompute_gradient))
    fwd = lin.primal(x)
    if x.shape[0] == 0:  # an empty batch has an empty loss
        loss = tf.zeros([0], lin.dtype)
        return (loss, fwd.logits) if return_logits else loss
    if buckets_apply(lin.program, plan.config, plan.entry):  # exact, masked: crop by length
        keep = padding_mask(lin.program, fwd.trace, plan.entry)
        loss = bucketed(x, keep, lambda xb: _per_example(
            lin, fwd if xb is x else lin.primal(xb), xb, plan, seed, precompute_gradient))
    else:
        loss = _per_example(lin, fwd, x, plan, seed, precompute_gradient)
    loss = _nan_where_nonfinite(fwd, loss)
    if return_logits:
        return loss, fwd.logits
    return loss


def _tuned_plan(model_or_lin, x, config, overrides: dict, caller: str):
    """`(lin, x, plan)`: the twin, the checked inputs and the checked plan with the
    memory settings tuned on `x`."""
    lin = linearize(model_or_lin)
    x = lin.check_input(x)
    plan = checked_plan(lin, x, config, overrides, caller=caller)
    plan = tuned_config(lin, x, plan, False, lambda cfg, xb: (
        loss_from_config(lin, xb, plan.with_config(cfg), 0)))
    return lin, x, plan


def _per_example(lin, fwd, x, plan: RollPlan, seed, precompute_gradient):
    """Eq. 9 per example from the forward pass `fwd` of `x` (before the NaN check)."""
    if precompute_gradient and plan.config.gamma >= 100:
        return _full_gamma_loss(lin, fwd, x, plan, seed)
    sq = grad_sq(lin, fwd, x, plan, seed)
    return _select_and_average(fwd, sq, plan.config.C, plan.config.gamma)


def _full_gamma_loss(lin: Linearized, fwd: ForwardPass, x, plan: RollPlan, seed):
    """Eq. 9 with gamma = 100 as `sum_j w_j sq_j + C * mean hinge` with constant weights
    `w_j = valid_j * scale / n_valid`, so that chunked tangents can differentiate their
    weighted sum in the forward pass (`chunked_weighted_sum`): the loss is the same
    function as `_select_and_average(fwd, sq, C, 100)`."""
    config = plan.config
    est = estimator_for(lin, x, plan, seed, trace=fwd.trace)
    neurons = fwd.neurons
    dtype = neurons.z.dtype
    valid = neurons.valid
    n_valid = tf.cast(tf.maximum(tf.reduce_sum(tf.cast(valid, tf.int32), axis=1), 1), dtype)
    scale = est.scale(lin.dtype)
    per_example = 1.0 / n_valid if scale is None else \
        tf.reshape(tf.cast(scale, dtype), [-1]) / n_valid
    weights = tf.where(valid, per_example[:, None], tf.zeros([], dtype))
    budget = roll_budget(lin, config)
    loss = sum_squares(lin, fwd, x, est, budget, weights=tf.stop_gradient(weights))
    if config.C:
        hinge = tf.nn.relu(1.0 - tf.minimum(neurons.below, neurons.above))
        hinge = tf.where(valid, hinge, tf.zeros_like(hinge))
        loss += tf.cast(config.C, dtype) * tf.reduce_sum(hinge, axis=1) / n_valid
    return loss


def _nan_where_nonfinite(fwd: ForwardPass, loss):
    """NaN for the examples with a non-finite neuron or logit (overflow, NaN rows).

    A NaN pre-activation is on no piece: without this its neuron would look like
    a dead one at infinite distance and the loss would be finite and wrong. In a
    graph (`fit`) the NaN reaches the reported loss, which
    `keras.callbacks.TerminateOnNaN` stops on; eagerly it also warns.
    """
    n = fwd.neurons
    logits = tf.reshape(fwd.logits, tf.stack([tf.shape(fwd.logits)[0], -1]))
    ok = tf.reduce_all(tf.math.is_finite(n.z) | tf.logical_not(n.valid), axis=1)
    ok = tf.logical_and(ok, tf.reduce_all(tf.math.is_finite(logits), axis=1))
    if tf.executing_eagerly() and not bool(tf.reduce_all(ok)):
        bad = int(tf.reduce_sum(tf.cast(tf.logical_not(ok), tf.int32)))
        warnings.warn(f"{bad} example(s) have non-finite neurons or logits (NaN / inf, e.g. "
                      f"an input so large that the network overflows): their ROLL loss is "
                      f"NaN.", stacklevel=3)
    return tf.where(ok, loss, tf.constant(np.nan, loss.dtype))


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
    n_keep = tf.maximum(n_keep, tf.minimum(n_valid, 1))  # at least one neuron (tiny gamma)
    vals = tf.where(valid, bracket, tf.fill(tf.shape(bracket), tf.constant(-np.inf, dtype)))
    top = tf.math.top_k(vals, k=tf.minimum(k_max, n)).values  # [B, k_max], descending
    keep = tf.range(tf.shape(top)[1])[None, :] < n_keep[:, None]
    total = tf.reduce_sum(tf.where(keep, top, tf.zeros_like(top)), axis=1)
    return total / tf.cast(tf.maximum(n_keep, 1), dtype)


def memory_plan(model_or_lin: ModelOrTwin, x: Array, config: RollConfig | None = None,
                **overrides) -> ChunkPlan:
    """The chunking `roll_loss` uses on `x` with `config` (eager).

    Returns the `keras_roll.compile.chunking.ChunkPlan` that `roll_loss` executes:
    `directions` per example, `per_chunk` directions per tangent pass,
    `chunks` passes (more than one also costs a recomputation in the backward
    pass), `bytes_per_direction` for the whole batch, and `fits` (False: one
    direction of the batch exceeds the budget, and `roll_loss` raises).
    Exact ROLL behind a leading Masking layer packs one row per example and
    valid axis (`keras_roll.roll.exact.PackedAxes`): its plan then has
    `examples=1` and `directions` = the rows of the whole batch.
    With a ReLU after a first Dense layer of `H1 < D` units, `directions` is
    the batch's largest number of active units of that layer
    (`keras_roll.roll.exact.ActiveFactorAxes`), so it depends on `x`.

    Args:
        model_or_lin: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs.
        config, **overrides: the hyperparameters, as in `roll_loss`.

    Example:

    ```python
    plan = keras_roll.roll.loss.memory_plan(model, x_batch)   # exact loss
    print(plan.chunks, plan.per_chunk)                     # tangent passes, axes each
    ```
    """
    lin, x, plan = _tuned_plan(model_or_lin, x, config, overrides, "memory_plan")
    fwd = lin.primal(x)
    estimator = estimator_for(lin, x, plan, 0, trace=fwd.trace)
    return plan_directions_for(lin, fwd, x, estimator, roll_budget(lin, plan.config))
