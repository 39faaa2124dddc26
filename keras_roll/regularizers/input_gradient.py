"""Input-gradient regularization (double back-propagation): `InputGradientConfig`.

Drucker & LeCun, "Improving generalization performance using double
backpropagation", IEEE TNN 1992; Ross & Doshi-Velez, "Improving the adversarial
robustness and interpretability of deep neural networks by regularizing their
input gradients", AAAI 2018. The penalty `||grad_x L(f(x), y)||_q^2` is
computed by a `tf.GradientTape` inside the training step's tape, so it works for
any differentiable model (not only piecewise-linear ones). docs/design.md,
section "Regularizers beside ROLL".

Example:

```python
wrapped = keras_roll.wrap(model, regularizer=InputGradientConfig(lam=0.1, p=2))
config = InputGradientConfig(loss="sparse_categorical_crossentropy")
per_example = keras_roll.regularizer_loss(model, x, y, config)
```
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from keras_roll.geometry import dual_norm
from keras_roll.regularizers.base import (
    RegularizerConfig,
    TermResult,
    current_labels,
)
from keras_roll.regularizers.registry import register_regularizer

__all__ = ["InputGradientConfig", "InputGradientTerm", "input_gradient_penalty",
           "per_example_loss"]


@register_regularizer
@dataclasses.dataclass(frozen=True)
class InputGradientConfig(RegularizerConfig):
    """The hyperparameters of input-gradient regularization, validated.

    For an example `x` with label `y`,

        R(x) = ||grad_x L(f(x), y)||_q^2,    1/p + 1/q = 1,

    and the training loss is `L(f(x), y) + lam * mean_x R(x)` (Drucker &
    LeCun 1992; Ross & Doshi-Velez 2018 use `p = 2`). `q` is the dual norm of
    the lp ball: to first order, the loss rises by at most
    `eps * ||grad_x L||_q` over `||delta||_p <= eps`. docs/design.md,
    "Regularizers beside ROLL".

    `L` is the per-example loss the wrapped model is compiled with (or the
    named Keras loss `loss`), computed with the model in the step's mode
    (training mode in `fit`: dropout is on, as in the loss it regularizes).
    Sample weights are not applied to the penalty.

    Attributes:
        lam: weight of the penalty in the training loss, `>= 0`.
        p: the lp norm of the perturbations: 1, 2 or inf ("l1", "l2", "linf"
            also accepted); the gradient is measured in the dual norm q.
        loss: None (the loss the wrapped model is compiled with) or the name
            of a Keras loss, e.g. "sparse_categorical_crossentropy".
        on_eval: None (default): the term is computed in `evaluate` (so
            `val_loss` is the training objective) but not in `predict`; False:
            only in training.

    Raises:
        ValueError: a bad value; the message names the field and the value.

    Example:

    ```python
    InputGradientConfig(lam=0.1, p=2)
    ```
    """

    lam: float = 1.0
    p: float | str = 2
    loss: str | None = None
    on_eval: bool | None = None

    log_name = "input_gradient_loss"

    def __post_init__(self):
        self.check_shared("the perturbations")
        if self.loss is not None:
            if not isinstance(self.loss, str):
                raise ValueError(f"loss must be None (the compiled loss) or the name of a Keras "
                                 f"loss; got loss={self.loss!r}.")
            try:
                keras.losses.get(self.loss)
            except ValueError:
                raise ValueError(f"loss={self.loss!r} is not a Keras loss name; use e.g. "
                                 f"'sparse_categorical_crossentropy', or None for the "
                                 f"compiled loss.") from None

    def term(self, model: keras.Model) -> InputGradientTerm:
        """The per-example term of `model`."""
        return InputGradientTerm(model, self)


def per_example_loss(loss):
    """A function `(y_true, y_pred) -> [B]` (no reduction) from a compiled loss.

    Raises:
        ValueError: no loss, or several (a dict or list of losses).
    """
    if isinstance(loss, keras.losses.Loss):
        return loss.call
    if isinstance(loss, str) or callable(loss):
        return keras.losses.get(loss)
    raise ValueError(f"The input-gradient penalty differentiates the model's loss and needs "
                     f"one loss for its one output: compile the wrapped model with a loss, or "
                     f"pass InputGradientConfig(loss=<Keras loss name>); got loss={loss!r}.")


@tf.autograph.experimental.do_not_convert
def input_gradient_penalty(model, x, y, loss_fn, p: float, training: bool) -> TermResult:
    """`||grad_x loss_fn(y, model(x))||_q^2` per example, differentiable in the weights.

    The inner tape's gradient is recorded by any tape around the call (double
    back-propagation); the outputs come from the same forward pass.

    Example:

    ```python
    result = input_gradient_penalty(model, x, y, keras.losses.get("mse"), 2.0, True)
    ```
    """
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_floating:
        raise ValueError(f"The input-gradient penalty differentiates with respect to the "
                         f"input, which must be floating point; got dtype {x.dtype.name}.")
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = model(x, training=training)
        total = tf.reduce_sum(loss_fn(y, outputs))
    grad = tape.gradient(total, x)
    grad = tf.reshape(grad, [tf.shape(x)[0], -1])
    return TermResult(dual_norm(grad, p, squared=True), outputs)


class InputGradientTerm:
    """The input-gradient penalty of one model: `term(x, y, training) -> TermResult`.

    The loss is the config's `loss`, else the loss of the step being traced
    (`keras_roll.regularizers.base.current_labels`).

    Example:

    ```python
    term = InputGradientConfig(loss="sparse_categorical_crossentropy").term(model)
    result = term(x, y, training=True)
    ```
    """

    def __init__(self, model: keras.Model, config: InputGradientConfig):
        self.model = model
        self.config = config

    def __call__(self, x, y, training: bool) -> TermResult:
        loss = self.config.loss
        if loss is None:
            step = current_labels()
            loss = None if step is None else step.loss
        return input_gradient_penalty(self.model, x, y, per_example_loss(loss), self.config.p,
                                      bool(training))

