"""`wrap(model, ...)`: train a Keras model with any registered regularizer through
`fit`, and `RollModel`, the functional model it returns.

ROLL (`RollConfig`, the default), MMR, the input-gradient norm, IBP, CROWN-IBP
and a user's own regularizer are each one registered config class
(`keras_roll.regularizers.registry`); `wrap` looks the config up there and puts
its layer (`RollRegularizer` for ROLL, `SupervisedRegularizer` for the others)
around the model. docs/design.md, section "Regularizers beside ROLL".

Example:

```python
wrapped = keras_roll.wrap(model, lam=2.0, C=1.0, gamma=100.0)
wrapped.compile("sgd", "sparse_categorical_crossentropy")
wrapped.fit(x, y, epochs=5)
```
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_roll.compile.keras_internals import first_local_batch, in_multi_worker_mode
from keras_roll.compile.twin import unwrap
from keras_roll.regularizers.base import evaluating, labelled_step
from keras_roll.regularizers.registry import registered_regularizers, registration_of
from keras_roll.regularizers.supervised import SupervisedRegularizer
from keras_roll.roll import RollConfig

__all__ = ["RollModel", "wrap"]


@keras.saving.register_keras_serializable(package="keras_roll")
class RollModel(keras.Model):
    """The functional model `wrap` returns: its `evaluate` computes the ROLL term.

    A plain functional model (same layers, inputs and outputs, saved and
    loaded like one as `keras_roll>RollModel`) whose steps pass their labels
    on (`keras_roll.regularizers.base.labelled_step`, read by the regularizers
    that need them: MMR, the input-gradient norm, IBP, ...) and whose `test_step` runs inside
    `evaluating()`, so that a `RollRegularizer` with `on_eval=None` adds
    `lam * ROLL` in `evaluate` (and in `fit`'s validation) but not in
    `predict`. Keras passes `training=False` to both, so the step is what
    tells them apart.

    Example:

    ```python
    wrapped = keras_roll.wrap(model, lam=2.0)        # a RollModel
    wrapped.compile("sgd", "sparse_categorical_crossentropy")
    wrapped.evaluate(x, y, return_dict=True)         # {'loss': ce + 2 * roll, 'roll_loss': ...}
    ```
    """

    def train_step(self, data):
        with _labels_of(data, self.loss):  # the supervised regularizers read them
            return _multi_worker_logs(super().train_step(data), self.distribute_strategy)

    def test_step(self, data):
        with evaluating(), _labels_of(data, self.loss):
            return _multi_worker_logs(super().test_step(data), self.distribute_strategy)

    # Keras <= 3.15 `fit` fails under a multi-worker MultiWorkerMirroredStrategy
    # (keras-team/keras#20585) at two places, both worked around here so that wrapped
    # models train on several hosts: the first batch is reduced with
    # `strategy.reduce("MEAN", (x, y))`, refused for a nested batch (we build from this
    # worker's local batch), and the scalar logs with `strategy.reduce("MEAN", v,
    # axis=0)`, refused for scalars (`_multi_worker_logs` gives them a batch axis).
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if iterator is not None and data_batch is None:
            batch = first_local_batch(self.distribute_strategy, iterator)
            if batch is not None:
                return super()._maybe_symbolic_build(data_batch=batch)
        return super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)


def _labels_of(data, loss):
    """`labelled_step` with the targets of a step's data (`(x, y[, w])` or `x`)."""
    _, y, _ = keras.utils.unpack_x_y_sample_weight(data)
    return labelled_step(y, loss)


def _multi_worker_logs(logs, strategy):
    """Scalar logs as `[1]` tensors under a multi-worker strategy (see `RollModel`)."""
    if not in_multi_worker_mode(strategy):
        return logs
    return tf.nest.map_structure(
        lambda t: tf.reshape(t, [1]) if tf.is_tensor(t) and t.shape.rank == 0 else t, logs)


def wrap(model: keras.Model, config=None, *, regularizer=None, **overrides) -> RollModel:
    """Returns a model that trains `model` with the ROLL regularizer (Eq. 9 / 10),
    or with the registered regularizer whose config is `regularizer` (MMR, the
    input-gradient norm, IBP, CROWN-IBP, or one of your own).

    The wrapped model (a `RollModel`) has the same inputs and outputs as
    `model` and shares its weights; `compile` / `fit` / `evaluate` / `predict`
    work as usual. During `fit`, `lam` times the batch mean of the term is
    added to the loss and the term (without `lam`) is reported under the
    config's `log_name` (`roll_loss`, `mmr_loss`, ...) in History. `evaluate`
    (so `fit`'s validation) computes it too, on the evaluation data (ROLL with
    a fixed seed): `val_roll_loss`, and `val_loss` = the compiled loss +
    `lam * val_roll_loss`, the training objective, which is the quantity to
    select the best epoch by. `predict` returns `model`'s outputs without
    computing it. Save it as a `.keras` file like any model; `unwrap` gives the
    plain model back.

    Args:
        model: a functional or Sequential model of supported layers (a final
            softmax is fine: it is folded into the loss); a model made by `wrap`
            is unwrapped first (the new hyperparameters replace the old ones).
        config: a `RollConfig` (`keras_roll.roll.config`, where each field is
            described) or another registered config, or None for the
            defaults: exact ROLL with `lam=2`, `C=1`, `gamma=100`.
        regularizer: the same as `config`, by keyword: e.g.
            `MMRConfig(p="inf")`, `IBPConfig(eps=0.1)`.
        **overrides: fields replacing those of the config; for ROLL: `lam`,
            `C`, `gamma`, `samples` (None: exact; k: Eq. 10), `strata`,
            `estimator`, `seed`, `on_eval`, `memory_budget`, `share_axes`,
            `wrt` (e.g. `wrt="normalize"` for `keras_roll.models.fc()`: the
            paper's normalised units) and `tangent_dtype`.

    Returns:
        A `RollModel` (a functional `keras.Model`).

    Raises:
        TypeError: a config that is no registered regularizer's (the message
            lists them), both `config` and `regularizer`, or an unknown keyword.
        ValueError: bad hyperparameters, or a `wrt` that is not a leading
            elementwise affine layer (the message lists the valid names).
        keras_roll.UnsupportedModelError: a layer the twin cannot linearize.

    Example:

    ```python
    wrapped = keras_roll.wrap(model, lam=2.0, C=1.0, gamma=100.0)
    wrapped.compile("sgd", "sparse_categorical_crossentropy")
    history = wrapped.fit(x, y, epochs=5, validation_data=(xv, yv))
    history.history["val_roll_loss"]          # ROLL on the validation data
    sampled = keras_roll.wrap(model, RollConfig(lam=2.0, samples=3), seed=0)
    plain = keras_roll.unwrap(wrapped)        # the same object as `model`
    mmr = keras_roll.wrap(model, regularizer=keras_roll.MMRConfig(p="inf", gamma_B=0.1))
    ```
    """
    if regularizer is not None and config is not None:
        raise TypeError(f"Pass the regularizer's config once, as config or as regularizer; got "
                        f"config={config!r} and regularizer={regularizer!r}.")
    chosen = config if regularizer is None else regularizer
    if chosen is None:
        chosen = RollConfig()
    if type(chosen).__name__ not in registered_regularizers():
        raise TypeError(f"{'regularizer' if regularizer is not None else 'config'} must be the "
                        f"config of a registered regularizer, one of "
                        f"{sorted(registered_regularizers())}, or None for ROLL; got "
                        f"{chosen!r}; pass the hyperparameters by keyword instead, e.g. "
                        f"wrap(model, lam=2.0) for ROLL.")
    registration = registration_of(chosen)
    chosen = registration.resolve(chosen, **overrides)
    model = unwrap(model)  # wrapping a wrapped model re-wraps its plain model
    layer_class = registration.layer or SupervisedRegularizer
    layer = layer_class(model, chosen, name=f"{registration.name}_regularizer")
    inp = keras.Input(shape=model.input_shape[1:], dtype=model.inputs[0].dtype)
    return RollModel(inp, layer(inp), name=f"{model.name}_{registration.name}")
