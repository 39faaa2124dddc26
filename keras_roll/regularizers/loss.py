"""`regularizer_loss`: the per-example term of any registered regularizer, for a
custom training loop (what `wrap` adds to the loss in `fit`, without `lam`).

Example:

```python
with tf.GradientTape() as tape:
    reg = tf.reduce_mean(regularizer_loss(model, x, y, MMRConfig(p="inf", gamma_B=0.1)))
grads = tape.gradient(reg, model.trainable_variables)
```
"""

from __future__ import annotations

import tensorflow as tf

from keras_roll.regularizers.registry import registration_of

__all__ = ["regularizer_loss"]


def regularizer_loss(model, x, y, config, **overrides) -> tf.Tensor:
    """The regularizer `config` configures, per example (`[B]`, without `lam`).

    Computed in inference mode and differentiable with respect to the model's
    weights, so `lam * mean(...)` can be added to a custom training loss;
    `keras_roll.wrap(model, regularizer=config)` does so in `fit`.

    Args:
        model: a Keras model (MMR, IBP, CROWN-IBP and ROLL also take its
            `Linearized`).
        x: `[B, *input_shape]` inputs.
        y: the labels as the term reads them (`[B]` ints or `[B, L]` one-hot
            for MMR, IBP, CROWN-IBP; the loss's targets for the input gradient,
            whose config must then name its `loss`); None for a term that reads
            none (ROLL).
        config: the config of a registered regularizer (`RollConfig`,
            `MMRConfig`, `InputGradientConfig`, `IBPConfig`, `CrownIBPConfig`, ...).
        **overrides: fields replacing those of `config`.

    Returns:
        `[B]` float tensor.

    Raises:
        TypeError: `config` is no registered regularizer's (the message lists
            them), or an override names no field.

    Example:

    ```python
    regularizer_loss(model, x, y, MMRConfig(), p="inf", k_B=50, gamma_B=0.1)
    regularizer_loss(model, x, y, InputGradientConfig(loss="sparse_categorical_crossentropy"))
    regularizer_loss(model, x, None, RollConfig(C=1.0))
    ```
    """
    registration = registration_of(config, "config")
    config = registration.resolve(config, **overrides)
    term = registration.make_term(config, model)
    return term(x, y, False).per_example
