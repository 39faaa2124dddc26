"""Certified training by bound propagation: `IBPConfig` (Gowal et al. 2018) and
`CrownIBPConfig` (Zhang et al., ICLR 2020), with `worst_case_logits`.

The term bounds the logit margins `f_y(x') - f_j(x')` over the lp ball of radius
`eps` around each training input with the compiler's bound passes
(`keras_roll.compile.bounds`, the passes `robust_radius` runs), in the training
step's graph and differentiable in the weights. `-lower` are the worst-case logits
`z_worst` (column `y` is 0) and the objective is

    kappa * CE(f(x), y) + (1 - kappa) * CE(z_worst(eps), y).

This module calls the compiler's passes itself (on the twin's `capture` of the
batch, with every pair of classes' margins folded into the last layer), with the
unguarded arithmetic `keras_roll.robust.interval_bounds` uses for training.
docs/design.md, section "Certified training by bound passes".

Example:

```python
wrapped = keras_roll.wrap(model, regularizer=IBPConfig(eps=0.1, kappa=0.5))
wrapped.compile("adam", "sparse_categorical_crossentropy")
wrapped.fit(x, y, callbacks=[keras_roll.callbacks.EpsilonRamp(0.1, length=2000)])
```
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds import (
    Arithmetic,
    BoundMethod,
    IntervalPasses,
    logit_margins,
    margin_rows,
)
from keras_roll.compile.twin import linearize
from keras_roll.compile.units import resolve_units
from keras_roll.regularizers.base import RegularizerConfig, TermMean, TermResult, class_indices
from keras_roll.regularizers.registry import register_regularizer
from keras_roll.rounding import rules

__all__ = ["CertifiedTerm", "CrownIBPConfig", "IBPConfig", "WorstCase",
           "certified_terms", "check_fraction", "check_radius", "worst_case_logits"]


def check_radius(name: str, value) -> float:
    """`value` as a float, checked finite and `>= 0` (a radius `eps`)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite radius >= 0 in the model's input units, "
                         f"got {name}={value!r}.")
    return float(value)


def check_fraction(name: str, value) -> float:
    """`value` as a float, checked in `[0, 1]` (the mixing weights `kappa`, `beta`)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1] (a mixing weight), got "
                         f"{name}={value!r}.")
    return float(value)


@register_regularizer
@dataclasses.dataclass(frozen=True)
class IBPConfig(RegularizerConfig):
    """Interval bound propagation training (Gowal et al. 2018), validated.

    With `z_worst(eps) = -lower`, the negated lower bounds of the margins
    `f_y - f_j` over the lp ball of radius `eps` (interval bounds, exact boxes
    for l_inf, the bounding box of the ball otherwise), the term added to the
    compiled loss is, per example,

        (1 - kappa) * (CE(z_worst(eps), y) - CE(z(x), y))

    with `z(x)` the logits (before a final softmax). When the model is compiled
    with the clean cross entropy (`"sparse_categorical_crossentropy"` on a
    softmax output, or `from_logits=True` on logits) and `lam = 1`, the total
    loss is the paper's `kappa * CE(z(x), y) + (1 - kappa) * CE(z_worst, y)`.
    docs/design.md, "Certified training by bound passes".

    `eps` and `kappa` are the values the term reads when no ramp sets them
    (`keras_roll.callbacks.EpsilonRamp`, `KappaRamp` ramp them in `fit`, as the
    papers do). The logs hold the term's batch mean (`ibp_loss`, without `lam`)
    and `certified_accuracy`: the fraction of the batch whose every margin's
    lower bound at the current `eps` is > 0.

    Attributes:
        eps: the radius, `>= 0`, in the model's input units (a leading
            `Rescaling` / `Normalization` counts as part of the model).
        kappa: the weight of the clean loss, in `[0, 1]` (Gowal et al. ramp it
            from 1 to 0.5).
        p: the norm of the ball: inf (default), 2 or 1 ("linf", "l2", "l1").
        lam: the weight of the term, `>= 0`; 1 gives the paper's objective.
        on_eval: None (default): the term in `evaluate` too (`val_loss` is the
            training objective); False: only in training.
        wrt: None (default): `eps` in the model's input units; or the name of a
            leading `Rescaling` / `Normalization` layer with a scalar scale: `eps`
            (and the ramps' values) in the units of its output, e.g. [0, 1]
            pixels for a model that takes 0-255 pixels and starts with
            `Rescaling(1 / 255)` (as `robust_radius(wrt=...)`).

    Raises:
        ValueError: a bad value; the message names the field and the value.

    Example:

    ```python
    wrapped = keras_roll.wrap(model, regularizer=IBPConfig(eps=0.1, kappa=0.5))
    ```
    """

    eps: float = 0.1
    kappa: float = 0.5
    p: float | str = np.inf
    lam: float = 1.0
    on_eval: bool | None = None
    wrt: str | None = None

    log_name = "ibp_loss"
    method = BoundMethod.INTERVAL

    def __post_init__(self):
        self.check_shared("the ball")
        object.__setattr__(self, "eps", check_radius("eps", self.eps))
        object.__setattr__(self, "kappa", check_fraction("kappa", self.kappa))
        if self.wrt is not None and not isinstance(self.wrt, str):
            raise ValueError(f"wrt must be None (eps in input units) or the name of a leading "
                             f"Rescaling / Normalization layer; got wrt={self.wrt!r}.")

    @property
    def beta_value(self) -> float:
        """The weight of the CROWN-IBP bound in the mixture (0: intervals only)."""
        return 0.0

    def term(self, model: keras.Model) -> CertifiedTerm:
        """The per-example term of `model`, with its `eps`, `kappa`, `beta` variables."""
        return CertifiedTerm(model, self)


@register_regularizer
@dataclasses.dataclass(frozen=True)
class CrownIBPConfig(IBPConfig):
    """CROWN-IBP training (Zhang et al., ICLR 2020), validated.

    As `IBPConfig`, with the lower bounds mixed as in the paper,

        lower = beta * lower_CROWN-IBP + (1 - beta) * lower_IBP,

    where `lower_CROWN-IBP` bounds the margins by one backward linear relaxation
    over the intervals' pre-activation bounds. The compiler's CROWN-IBP pass keeps
    the larger of the two bounds per margin, so the mixture here is never looser
    than the paper's (both are sound). Zhang et al. ramp `beta` from 1 to 0 with
    `eps` (`keras_roll.callbacks.BetaRamp`) and `kappa` from 1 (or 0) to 0.
    docs/design.md, "Certified training by bound passes".

    Attributes:
        beta: the weight of the CROWN-IBP bound, in `[0, 1]`.
        (the others as `IBPConfig`; `kappa` defaults to 0 here.)

    Example:

    ```python
    CrownIBPConfig(eps=0.1, kappa=0.0, beta=1.0)
    ```
    """

    kappa: float = 0.0
    beta: float = 1.0

    log_name = "crown_ibp_loss"
    method = BoundMethod.CROWN_IBP

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "beta", check_fraction("beta", self.beta))

    @property
    def beta_value(self) -> float:
        """The weight of the CROWN-IBP bound in the mixture."""
        return self.beta


class WorstCase(NamedTuple):
    """The bounds of one batch.

    Attributes:
        logits: `[B, L]` the logits `z(x)` (before a final softmax).
        lower: `[B, L]` lower bounds of `z_y - z_j` over the ball (column y is 0);
            `-lower` are the worst-case logits.
        certified: `[B]` bool, every margin but y's bounded above 0.
    """

    logits: tf.Tensor
    lower: tf.Tensor
    certified: tf.Tensor


def _linear_magnitude(op, bounds, record, mask, values):
    return rules.magnitude(op, bounds, record, False, mask, values)


def worst_case_logits(model, x, y, eps, *, p=np.inf, beta=0.0) -> WorstCase:
    """Lower bounds of the logit margins over the ball, mixed as in CROWN-IBP.

    `lower = beta * lower_CROWN-IBP + (1 - beta) * lower_IBP` (`beta = 0`:
    IBP alone: the CROWN pass is not run when `beta` is 0, as a number or, at run
    time, as a tensor or variable, as Zhang et al. do after the ramp). The margins of
    the `L - 1` classes other than `y` are bounded (no functional for `y` itself).
    Differentiable in the weights; pure TensorFlow (runs in a training step).

    Args:
        model: a Keras model keras_roll can linearize, or its `Linearized`.
        x: `[B, *input_shape]` inputs.
        y: `[B]` / `[B, 1]` int or `[B, L]` one-hot labels.
        eps: the radius (a number, tensor or variable).
        p: the norm of the ball.
        beta: the weight of the CROWN-IBP bound, in `[0, 1]` (a tensor too).

    Returns:
        `WorstCase` of tensors in the twin's dtype.

    Example:

    ```python
    worst = worst_case_logits(model, x, y, 0.1)
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(y, -worst.lower)
    ```
    """
    lin = linearize(model)
    x = lin.check_input(x)
    classes = int(np.prod(lin.model.outputs[0].shape[1:]))
    labels = class_indices(y, classes, "Certified training")
    lm = logit_margins(lin.interpreter, x, labels)
    structure, values, logits, rows = lm.structure, lm.values, lm.logits, lm.rows
    others = tf.one_hot(lm.others, classes, dtype=logits.dtype)         # [B, L-1, L]
    m0 = lm.margins                                                     # z_y - z_j
    passes = IntervalPasses(structure, values, tf.cast(eps, logits.dtype), p,
                            Arithmetic(_linear_magnitude))
    if _pairs_fit(structure, values, classes, lin.memory_budget):
        # The intervals of the margins of every pair of classes (rows shared by the
        # batch: two small products with the last layer's box), then each example's.
        pairs = passes.interval(tf.reshape(margin_rows(tf.range(classes), classes,
                                                       logits.dtype)[0], [1, -1, classes]))
        ibp = tf.gather(tf.reshape(pairs, [-1, classes, classes - 1]), labels, batch_dims=1)
    else:  # many classes: the L - 1 rows of each example
        ibp = passes.interval(rows)
    lower = m0 + ibp
    if not (isinstance(beta, (int, float)) and beta == 0):
        beta = tf.cast(beta, logits.dtype)
        mixed = lower

        def crown_ibp():
            crown = m0 + passes.crown_ibp(rows, interval=ibp)
            return beta * crown + (1 - beta) * mixed

        lower = tf.cond(beta > 0, crown_ibp, lambda: mixed)  # as Zhang et al.: none at 0
    lower = tf.einsum("bk,bkl->bl", lower, others)                 # [B, L], 0 at y
    certified = tf.reduce_all((lower > 0) | _own(labels, classes), axis=-1)
    return WorstCase(logits, lower, certified)


def _pairs_fit(structure, values, classes: int, budget: int) -> bool:
    """Whether the functionals of every pair of classes at the last op's input (`L (L-1)`
    rows shared by the batch) fit the twin's memory budget."""
    index = structure.producer[structure.output_key]
    width = max(int(np.prod(v.shape[1:])) for v in values.inputs[index])
    return classes * (classes - 1) * width * values.x.dtype.size <= budget


def _own(labels, classes):
    """`[B, L]` True at the label's column."""
    return tf.one_hot(labels, classes, on_value=True, off_value=False, dtype=tf.bool)


class CertifiedTerm:
    """The IBP / CROWN-IBP term of one model: `term(x, y, training) -> TermResult`.

    Holds the variables `eps`, `kappa`, `beta` the term reads (set by the
    ramps of `keras_roll.callbacks`) and the metric `certified_accuracy`.

    Example:

    ```python
    term = IBPConfig(eps=0.1).term(model)
    term.eps.assign(0.05)
    result = term(x, y, training=True)
    ```
    """

    def __init__(self, model: keras.Model, config: IBPConfig):
        self.model = model
        self.config = config
        self.lin = linearize(model)
        classes = int(np.prod(model.outputs[0].shape[1:]))
        if classes < 2 or self.lin.output_link == "sigmoid":
            raise ValueError(f"{type(config).__name__} trains a classifier with one logit per "
                             f"class (>= 2, softmax or none at the end); model "
                             f"{model.name!r} has {classes} output(s) with output link "
                             f"'{self.lin.output_link}'.")
        # eps is stated in `wrt`'s units; the passes take it in input units
        self.units = resolve_units(self.lin.program, config.wrt)
        self.eps = _variable(config.eps, "eps")
        self.kappa = _variable(config.kappa, "kappa")
        self.beta = _variable(config.beta_value, "beta")
        self.certified = TermMean(name="certified_accuracy")

    @property
    def metrics(self) -> list:
        """The term's own metrics: `certified_accuracy`."""
        return [self.certified]

    def __call__(self, x, y, training: bool) -> TermResult:
        beta = 0.0 if self.config.method is BoundMethod.INTERVAL else self.beta
        eps = self.eps if self.units.is_input else self.eps / abs(self.units.scale)
        worst = worst_case_logits(self.lin, x, y, eps, p=self.config.p, beta=beta)
        labels = class_indices(y, int(worst.logits.shape[-1]), "Certified training")
        clean = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, worst.logits)
        robust = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, -worst.lower)
        kappa = tf.cast(self.kappa, clean.dtype)
        per_example = (1 - kappa) * (robust - clean)
        self.certified.update_state(tf.cast(worst.certified, "float32"))
        if not training or self.lin.inference_equals_training:
            dtype = keras.backend.standardize_dtype(self.model.outputs[0].dtype)
            outputs = tf.cast(self.lin.apply_output_link(worst.logits), dtype)
            outputs = tf.reshape(outputs, tf.concat([tf.shape(outputs)[:1],
                                                     self.model.outputs[0].shape[1:]], 0))
        else:
            outputs = self.model(x, training=training)
        return TermResult(per_example, outputs)


def _variable(value: float, name: str) -> tf.Variable:
    return tf.Variable(float(value), trainable=False, dtype=tf.float32, name=name,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


def certified_terms(model) -> list[CertifiedTerm]:
    """The `CertifiedTerm`s of the layers of `model` (nested models searched).

    Example:

    ```python
    certified_terms(keras_roll.wrap(model, regularizer=IBPConfig()))[0].eps
    ```
    """
    found = []
    for layer in getattr(model, "layers", []):
        term = getattr(layer, "term", None)
        if isinstance(term, CertifiedTerm):
            found.append(term)
        elif isinstance(layer, keras.Model):
            found += certified_terms(layer)
    return found

