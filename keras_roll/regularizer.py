"""`wrap(model)`: train a Keras model with the ROLL regularizer through `fit`.

`RollRegularizer` is a layer that holds the model (sharing its weights) and, in
training, adds `lam * mean(roll_loss(model, x))` with `add_loss`; `wrap` builds
the functional model around it and `unwrap` gives the plain model back. Its
hyperparameters are one `RollConfig`; `get_config` stores them with
`dataclasses.asdict`, so saved `.keras` files (which name the class
`keras_roll>RollRegularizer`) load back. See docs/design.md, section "Data flow
of a ROLL training step".

Example:

```python
wrapped = keras_roll.wrap(model, lam=2.0, C=1.0, gamma=100.0)
wrapped.compile("sgd", "sparse_categorical_crossentropy")
wrapped.fit(x, y, epochs=5)
```
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from keras_roll.roll import loss_from_config
from keras_roll.roll_config import RollConfig
from keras_roll.twin import Linearized, linearize

__all__ = ["RollRegularizer", "unwrap", "wrap"]


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

    def __init__(self, model: keras.Model | dict, lam: float = 2.0, C: float = 1.0,
                 gamma: float = 100.0, samples: int | None = None, strata: str | None = None,
                 estimator: str = "axes", seed: int | None = None, on_eval: bool = False,
                 memory_budget: int | None = None, share_axes: bool = False, **kwargs):
        # float32 policy: no autocast inside call, so the twin reads float32 weights
        # even under mixed precision (the inner model keeps its own policies).
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        if isinstance(model, dict):  # from a config
            model = keras.saving.deserialize_keras_object(model)
        config = RollConfig(lam=lam, C=C, gamma=gamma, samples=samples, strata=strata,
                            estimator=estimator, seed=seed, on_eval=on_eval,
                            memory_budget=memory_budget, share_axes=share_axes)
        if config.memory_budget is None:
            lin = linearize(model)
        else:
            lin = linearize(model, memory_budget=config.memory_budget)
        config.check_input_shape(lin.input_shape)
        self.inner_model = model
        self.roll_config = config
        self._lin = lin
        self._step = None
        if config.samples is not None and config.seed is not None:
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
        x = self._lin.check_input(inputs)
        per_example, logits = loss_from_config(self._lin, x, self.roll_config, seed=self._seed(),
                                               return_logits=True)
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
        config.update(dataclasses.asdict(self.roll_config))
        config["model"] = keras.saving.serialize_keras_object(self.inner_model)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(config["model"])
        return cls(**config)


# The hyperparameters read as attributes (`layer.lam`, `layer.samples`, ...), one
# read-only property per `RollConfig` field, so a new field needs no code here.
for _field in dataclasses.fields(RollConfig):
    setattr(RollRegularizer, _field.name,
            property(lambda self, _name=_field.name: getattr(self.roll_config, _name),
                     doc=f"`RollConfig.{_field.name}` of this regularizer."))


def wrap(model: keras.Model, lam: float = 2.0, C: float = 1.0, gamma: float = 100.0,
         samples: int | None = None, strata: str | None = None, estimator: str = "axes",
         seed: int | None = None, on_eval: bool = False, memory_budget: int | None = None,
         share_axes: bool = False) -> keras.Model:
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


def unwrap(wrapped: keras.Model | RollRegularizer) -> keras.Model:
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
