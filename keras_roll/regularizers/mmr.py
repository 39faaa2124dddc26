"""MMR, the Maximum Margin Regularizer: `MMRConfig`, `mmr_distances`.

Croce, Andriushchenko & Hein, "Provable robustness of ReLU networks via
maximization of linear regions", AISTATS 2019. For every example, the hinge on
the `k_B` smallest lp distances to the boundaries of its linear region and on
the `k_D` smallest lp distances to the decision boundaries, both computed
exactly on the frozen-pattern twin: the same quantities `certify` computes, and
differentiable with respect to the weights with the pattern frozen.
docs/design.md, section "Regularizers beside ROLL".

Example:

```python
config = MMRConfig(lam=0.5, p="inf", k_B=100, gamma_B=0.2, gamma_D=0.2)
wrapped = keras_roll.wrap(model, regularizer=config)
per_example = keras_roll.regularizer_loss(model, x, y, config)      # [B], without lam
```
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.records import Record
from keras_roll.compile.twin import Linearized, linearize
from keras_roll.geometry import dual_norm
from keras_roll.options import INF
from keras_roll.regularizers.base import (
    RegularizerConfig,
    TermResult,
    check_positive,
    class_indices,
)
from keras_roll.regularizers.registry import register_regularizer
from keras_roll.roll import factored_entry, gram_factor, sum_squares

__all__ = ["MMRConfig", "MMRDistances", "MMRTerm", "mmr_distances", "mmr_per_example"]


@register_regularizer
@dataclasses.dataclass(frozen=True)
class MMRConfig(RegularizerConfig):
    """The MMR hyperparameters (Croce et al., AISTATS 2019), validated.

    For an example `x` with label `y`, with the activation pattern of `x` frozen,

        d_B^j(x) = dist_j / ||grad_x z_j||_q                   (every neuron j)
        d_D^c(x) = (f_y - f_c) / ||grad_x (f_y - f_c)||_q      (every class c != y)
        MMR(x) = 1/k_B sum_{k_B smallest d_B} max(0, 1 - d_B / gamma_B)
               + 1/k_D sum_{k_D smallest d_D} max(0, 1 - d_D / gamma_D)

    with `1/p + 1/q = 1` and `dist_j` the neuron's distance to its nearest
    breakpoint (`|z_j|` for a ReLU), and the training loss is
    `L(f(x), y) + lam * mean_x MMR(x)`. A misclassified example has
    `d_D < 0`, so its hinge exceeds 1. docs/design.md, "Regularizers beside
    ROLL".

    This follows the authors' TensorFlow code
    (github.com/max-andr/provable-robustness-max-linear-regions,
    `regularizers.py`): one `lam` for both terms, the decision term over `k_D`
    of the `L` classes with the true class at distance infinity (its hinge is
    0; the code's `n_db` is the number of classes, the default `k_D=None`
    here). Differences: a neuron or class whose gradient is exactly zero is at
    distance infinity (it cannot bind: the convention of `certify`) where the
    code adds 1e-5 to small gradient entries; ties among the smallest
    distances are broken by index where the code adds a random 1e-5 jitter;
    neurons of any supported unit (max pooling, LeakyReLU, ...) count, with
    their distance to the nearest breakpoint. The code's schedules (the
    regularizer's weight ramped from 0 to `lam` over 10 epochs, `k_B` from
    10 % to 2 % of the hidden units) are left to the training loop.

    Attributes:
        lam: weight of the regularizer in the training loss, `>= 0`.
        p: the lp norm of the margins: 1, 2 or inf ("l1", "l2", "linf" also
            accepted); the gradients are measured in the dual norm q.
        k_B: number of smallest region-boundary distances per example, `>= 1`
            (at most the number of neurons is used).
        k_D: number of smallest decision-boundary distances per example, `>= 1`,
            or None for every class (the authors' code); at most the number of
            classes is used.
        gamma_B: threshold of the region-boundary hinge, `> 0` (in the units of
            the input, like the lp radius sought).
        gamma_D: threshold of the decision-boundary hinge, `> 0`.
        on_eval: None (default): the term is computed in `evaluate` (so
            `val_loss` is the training objective) but not in `predict`; False:
            only in training.
        examples: None (default): the term of every example of the batch;
            an int `m >= 1`: only the first `m` examples of each batch (of each
            replica's part under `tf.distribute`), whose mean is an unbiased
            estimate of the batch's when the batches are shuffled. The cost of
            the exact distances grows with the examples (every neuron's input
            gradient, about 100-700 x a plain step on a 784-300x4-10 MLP), so a
            subset buys speed with variance.
        fewest_directions: l2 only: True (default) pushes, when the model
            starts with a Dense layer of `H1 < D` units, the `H1` rows of a
            factor of its Gram matrix from its output instead of the `D` input
            axes (the same l2 norms: docs/design.md, "The factored exact
            path"); False always pushes the `D` axes. The l1 and l_inf dual
            norms always need the `D` axes.

    Raises:
        ValueError: a bad value; the message names the field and the value.

    Example:

    ```python
    MMRConfig(lam=1.0, p=2, k_B=100, k_D=None, gamma_B=1.0, gamma_D=1.0)
    ```
    """

    lam: float = 1.0
    p: float | str = 2
    k_B: int = 100
    k_D: int | None = None
    gamma_B: float = 1.0
    gamma_D: float = 1.0
    on_eval: bool | None = None
    examples: int | None = None
    fewest_directions: bool = True

    log_name = "mmr_loss"

    def __post_init__(self):
        self.check_shared("the margins MMR enlarges")
        for name, what in (("k_B", "distances per example"), ("k_D", "distances per example"),
                           ("examples", "examples per batch")):
            k = getattr(self, name)
            if k is None and name != "k_B":
                continue
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
                allowed = "a positive int" + {"k_B": "", "k_D": " or None (every class)",
                                              "examples": " or None (all)"}[name]
                raise ValueError(f"{name} is a number of {what} and must be "
                                 f"{allowed}; got {name}={k!r}.")
        normalised = {
            "k_B": int(self.k_B),
            "k_D": None if self.k_D is None else int(self.k_D),
            "examples": None if self.examples is None else int(self.examples),
            "gamma_B": check_positive("gamma_B", self.gamma_B),
            "gamma_D": check_positive("gamma_D", self.gamma_D),
            "fewest_directions": _check_bool("fewest_directions", self.fewest_directions),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    def term(self, model: keras.Model) -> MMRTerm:
        """The per-example term of `model` (checks that the twin can linearize it)."""
        return MMRTerm(linearize(model), self)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {name}={value!r}.")
    return bool(value)


def _distances(numerator, norm, ok):
    """`numerator / norm` where `ok` and the norm is positive, else +inf; NaN-free
    gradients (the masked entries see only finite values)."""
    positive = ok & (norm > 0)
    safe = tf.where(positive, norm, tf.ones_like(norm))
    num = tf.where(positive, numerator, tf.zeros_like(numerator))
    return tf.where(positive, num / safe, tf.fill(tf.shape(num), tf.constant(INF, num.dtype)))


class MMRDistances(NamedTuple):
    """The exact lp distances MMR penalizes, differentiable in the weights.

    Attributes:
        boundary: `[B, N]` distance of `x` to each neuron's hyperplane (+inf for
            a neuron that is not valid or has a zero gradient).
        decision: `[B, L]` signed distance to the decision boundary between the
            label and each class (+inf for the label itself; negative when the
            class scores above the label).
        logits: `[B, L]` the twin's logits (before any folded softmax).
    """

    boundary: tf.Tensor
    decision: tf.Tensor
    logits: tf.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class _AxesNorms(Record):
    """The input axes, streamed in chunks (`keras_roll.roll.sum_squares`): per chunk,
    `[B, N + L]` partial dual-norm reductions of every neuron's derivatives and of the
    label's logit minus each logit's (sums of squares for l2, of absolute values for
    l_inf, maxima of absolute values for l1); `finish` makes them norms."""

    labels: tf.Tensor
    example_shape: tf.Tensor
    total: int
    p: float
    shared: bool = True

    def sum_squares(self, lin, trace, start, k):
        jvp = lin.axes_tangent(trace, start, k, self.example_shape, per_neuron=True)
        own = tf.gather(jvp.logits, self.labels, axis=2, batch_dims=1)     # [B, k]
        blocks = [*jvp.neurons, own[:, :, None] - jvp.logits]
        return tf.concat([dual_norm(b, self.p, axis=1, squared=self.p == 2) for b in blocks],
                         axis=-1)

    @property
    def combine(self) -> str:
        return "max" if self.p == 1 else "sum"

    def finish(self, partial):
        if self.p != 2:
            return partial
        pos = partial > 0
        return tf.where(pos, tf.sqrt(tf.where(pos, partial, tf.ones_like(partial))),
                        tf.zeros_like(partial))


def _norms(lin: Linearized, fwd, x, labels, p: float, fewest_directions: bool):
    """`([B, N], [B, L])`: the dual norms of every neuron's input gradient and of the
    label's logit's minus each logit's: along the `D` input axes in chunks within the
    twin's `memory_budget` (recomputed chunk by chunk in backprop), or (l2) along the
    rows of a Gram factor of a first Dense layer with fewer units, pushed from its
    output in one pass."""
    entry = factored_entry(lin.program, 0) if p == 2 and fewest_directions else None
    if entry is None or entry.units >= entry.depth:
        shape = tuple(x.shape[1:])
        est = _AxesNorms(labels, tf.constant(shape, tf.int32), int(np.prod(shape)), p)
        n_neurons = int(fwd.neurons.z.shape[1])
        width = n_neurons + int(np.prod(fwd.logits.shape[1:]))
        try:
            partial = sum_squares(lin, fwd, x, est, lin.memory_budget, columns=width,
                                  combine=est.combine)
        except MemoryError:
            raise MemoryError(
                f"MMR's tangents of model '{lin.model.name}' along one input axis of the "
                f"batch of {x.shape[0]} need more than memory_budget={lin.memory_budget} "
                f"bytes; use MMRConfig(examples=m) or a smaller batch, or a larger budget "
                f"(keras_roll.linearize(model, memory_budget=...)).") from None
        norms = est.finish(partial)
        return norms[:, :n_neurons], norms[:, n_neurons:]
    factor = gram_factor(entry.kernel(lin.dtype))  # R^T R = W^T W: sum (R_i . g)^2 = ||W g||^2
    jvp = lin.interpreter.tangent(fwd.trace, factor, True, concat=False, start=entry.index,
                                  start_op=1)
    blocks = [dual_norm(block, p, axis=1) for block in jvp.neurons]
    norms = tf.concat(blocks, axis=-1) if blocks else tf.zeros_like(fwd.neurons.z)
    own = tf.gather(jvp.logits, labels, axis=2, batch_dims=1)           # [B, H1]
    return norms, dual_norm(own[:, :, None] - jvp.logits, p, axis=1)


@tf.autograph.experimental.do_not_convert
def mmr_distances(lin: Linearized, x: tf.Tensor, labels: tf.Tensor, p: float,
                  fewest_directions: bool = True) -> MMRDistances:
    """The distances `d_B` and `d_D` of `MMRConfig` for a batch, in the caller's graph.

    One forward pass of the twin and one tangent pass along the `D` input axes
    (every neuron's and logit's full input gradient, reduced to its dual norm),
    or, in l2 with `fewest_directions`, along the `H1 < D` rows of a Gram factor
    of a first Dense layer (the same norms, `MMRConfig.fewest_directions`). The
    axes run in chunks that fit the twin's `memory_budget`
    (`keras_roll.linearize(model, memory_budget=...)`), each recomputed in the
    backward pass, so a large CNN's step needs one chunk's tangents at a time.

    Args:
        lin: the twin of the model.
        x: `[B, *input_shape]` checked inputs (`lin.check_input`), static shape.
        labels: `[B]` int class indices.
        p: 1.0, 2.0 or inf.
        fewest_directions: see `MMRConfig.fewest_directions`.

    Returns:
        `MMRDistances`.

    Example:

    ```python
    dist = mmr_distances(keras_roll.linearize(model), x, tf.constant(y), 2.0)
    dist.boundary.shape, dist.decision.shape        # [B, N], [B, L]
    ```
    """
    shape = tuple(x.shape[1:])
    if any(d is None for d in shape):
        raise ValueError(f"MMR pushes every input axis and needs a fixed per-example input "
                         f"shape; got {shape}.")
    fwd = lin.primal(x)
    logits = tf.reshape(fwd.logits, [-1, int(np.prod(fwd.logits.shape[1:]))])
    labels = tf.cast(labels, tf.int32)
    norms, diff = _norms(lin, fwd, x, labels, p, fewest_directions)
    neurons = fwd.neurons
    dist = tf.minimum(neurons.below, neurons.above)
    boundary = _distances(dist, norms, neurons.valid & tf.math.is_finite(dist))

    margin = tf.gather(logits, labels, axis=1, batch_dims=1)[:, None] - logits
    others = tf.not_equal(tf.range(tf.shape(logits)[1])[None, :], labels[:, None])
    decision = _distances(margin, diff, others)
    return MMRDistances(boundary, decision, fwd.logits)


def _smallest_hinge(dist, k: int, gamma: float):
    """Mean over the `k` smallest distances of `max(0, 1 - d / gamma)` per row."""
    k = min(k, int(dist.shape[-1]))
    if k == 0:
        return tf.zeros(tf.shape(dist)[:1], dist.dtype)
    smallest = -tf.math.top_k(-dist, k=k, sorted=False).values
    return tf.reduce_mean(tf.nn.relu(1.0 - smallest / gamma), axis=-1)


def mmr_per_example(dist: MMRDistances, config: MMRConfig):
    """`MMR(x)` per example from its distances (`[B]`, without `lam`)."""
    k_d = config.k_D if config.k_D is not None else int(dist.decision.shape[-1])
    return (_smallest_hinge(dist.boundary, config.k_B, config.gamma_B)
            + _smallest_hinge(dist.decision, k_d, config.gamma_D))


class MMRTerm:
    """MMR of one model as a regularizer term: `term(x, y, training) -> TermResult`.

    Example:

    ```python
    term = MMRConfig().term(model)
    result = term(x, y, training=True)     # result.per_example [B], result.outputs
    ```
    """

    def __init__(self, lin: Linearized, config: MMRConfig):
        num_classes = int(np.prod(lin.model.outputs[0].shape[1:]))
        if num_classes < 2:
            raise ValueError(f"MMR measures distances to the decision boundaries between "
                             f"classes and needs a model with at least 2 output logits; "
                             f"'{lin.model.name}' has {num_classes}.")
        self.lin = lin
        self.config = config
        self.num_classes = num_classes

    def __call__(self, x, y, training: bool) -> TermResult:
        lin = self.lin
        x = lin.check_input(x)
        labels = class_indices(y, self.num_classes, "MMR")
        m = self.config.examples
        if m is not None and (x.shape[0] is None or m < x.shape[0]):
            # the first m examples (fewer in a short last batch); outputs of all
            dist = mmr_distances(lin, x[:m], labels[:m], self.config.p,
                                 self.config.fewest_directions)
            outputs = lin.model(x, training=training)
            return TermResult(mmr_per_example(dist, self.config), outputs)
        dist = mmr_distances(lin, x, labels, self.config.p, self.config.fewest_directions)
        per_example = mmr_per_example(dist, self.config)
        if not training or lin.inference_equals_training:
            dtype = keras.backend.standardize_dtype(lin.model.outputs[0].dtype)
            outputs = tf.cast(lin.apply_output_link(dist.logits), dtype)
        else:
            outputs = lin.model(x, training=training)
        return TermResult(per_example, outputs)

