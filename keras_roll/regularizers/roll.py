"""ROLL in the regularizer family: `RollRegularizer`, the layer that adds
`lam * mean(roll_loss(model, x))` in `fit`, and the registration of `RollConfig`.

The ROLL machinery (its config, estimators, exact and sampled passes) is
`keras_roll.roll`; this module makes it a regularizer `keras_roll.wrap` trains
with (the default one). `get_config` stores the hyperparameters with
`dataclasses.asdict`, so saved `.keras` files (which name the classes
`keras_roll>RollRegularizer` and `keras_roll>RollModel`) load back. See
docs/design.md, sections "Data flow of a ROLL training step" and "Validation
loss of a ROLL model".

**Validation loss.** Keras calls the model with `training=False` in both
`test_step` and `predict_step`. `RollModel.test_step` runs inside `evaluating()`,
a thread-local flag (replica threads of `tf.distribute` each set their own)
that the regularizer reads while the step is traced: `evaluate`, and so the
validation of `fit`, adds `lam * ROLL` to the loss and reports `roll_loss`
(`val_roll_loss`), while `predict` and plain calls only run the model. The
sampled loss uses a fixed seed in evaluation, so validation losses are
comparable between epochs.

Example:

```python
wrapped = keras_roll.wrap(model, lam=2.0)        # a RollModel around a RollRegularizer
wrapped.compile("sgd", "sparse_categorical_crossentropy")
wrapped.evaluate(x, y, verbose=0)                # the loss includes lam * ROLL
```
"""

from __future__ import annotations

import dataclasses
import enum

import keras
import tensorflow as tf

from keras_roll.compile.twin import Linearized, linearize
from keras_roll.regularizers.base import TermMean, TermResult, in_evaluation
from keras_roll.regularizers.registry import register_regularizer
from keras_roll.roll import RollConfig, loss_from_config, resolve_config, roll_loss, roll_plan

__all__ = ["RollRegularizer", "roll_term"]

_EVAL_STREAM = 2**31 - 2  # folded into the seed in evaluation (training steps never reach it)
_MAX_SEED = 2**31 - 1


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

    In inference mode it follows `on_eval`. With the default `None` it adds
    the loss and updates the metric inside an evaluation step (`evaluating()`,
    which `RollModel.test_step` enters), so `evaluate` and the validation of
    `fit` report `roll_loss` (`val_roll_loss`) and a `val_loss` that is the
    training objective, compiled loss + `lam * ROLL`; `predict` and plain calls
    only run the model. `on_eval=True` computes it in every inference-mode
    call (`predict` too, and `evaluate` of any model that contains the layer);
    `on_eval=False` never does: evaluation then reports `roll_loss` as NaN
    ("not computed"), never a misleading 0. In evaluation the sampled loss uses
    a fixed seed (the same axes every epoch), and the output is the twin's
    forward pass (the inference function itself), so it costs no second pass.

    Under `tf.distribute`, Keras scales the added loss by `1 / num_replicas`
    like the compiled loss, so the summed replica gradients equal the
    one-replica gradient of the global batch (checked in
    `tests/test_distribute.py`).

    The regularizer is computed on the inference-mode network (BatchNorm with
    moving statistics, no dropout): the twin linearizes the deployed function.

    Args:
        model: the functional / Sequential Keras model (or its config dict).
        config: a `RollConfig` (default `RollConfig()`), the hyperparameters;
            each field is described there. With an int `seed` the sampled
            directions are a reproducible sequence: one stateless seed per
            step (a step counter is kept as a non-trainable weight, saved with
            the model) and replica.
        **kwargs: `RollConfig` fields replacing those of `config` (`lam=2.0`,
            `samples=3`, ...), and the keyword arguments of `keras.layers.Layer`
            (`name`, `dtype`, ...).

    In training, with `gamma = 100` and tangents in several chunks, each chunk
    differentiates itself in the forward pass (the step differentiates the
    batch mean), so no chunk is recomputed in the backward pass
    (`keras_roll.roll.loss.loss_from_config(precompute_gradient=True)`).

    Example:

    ```python
    layer = RollRegularizer(model, lam=2.0)
    inp = keras.Input(model.input_shape[1:])
    wrapped = keras.Model(inp, layer(inp))
    ```
    """

    def __init__(self, model: keras.Model | dict, config: RollConfig | None = None, **kwargs):
        fields = {f.name for f in dataclasses.fields(RollConfig)}
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        config = resolve_config(config, **overrides)
        # float32 policy: no autocast inside call, so the twin reads float32 weights
        # even under mixed precision (the inner model keeps its own policies).
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        if isinstance(model, dict):  # from a config
            model = keras.saving.deserialize_keras_object(model)
        if config.memory_budget is None:
            lin = linearize(model)
        else:
            lin = linearize(model, memory_budget=config.memory_budget)
        config.check_input_shape(lin.input_shape)
        # Resolved once; a bad wrt= fails here, naming the choices.
        self.roll_plan = roll_plan(lin, config)
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
        self.roll_tracker = TermMean(name="roll_loss")
        # No XLA: chunk sizes depend on the batch (dynamic in fit), a chunked step is a
        # while loop of tapes, and XLA compiles a ResNet's ROLL step for minutes. So
        # compile(jit_compile="auto") of a wrapped model runs without it (on GPUs too).
        self.supports_jit = False
        self.built = True

    @property
    def metrics(self):
        # Only our own tracker: a compiled inner model must not add its "loss".
        return [self.roll_tracker]

    @property
    def linearized(self) -> Linearized:
        """The twin of `inner_model` the regularizer computes with."""
        return self._lin

    def step_seed(self, training: bool = True):
        """The stateless seed of the next call (None: fresh randomness), before the
        replica id is folded in (`keras_roll.roll.estimators.seed_tensor` does that).

        In training, with an int `seed`: `stateless_fold_in([seed, 0], step)`
        with the step counter, which it advances. In evaluation: a fixed seed
        (`seed`, or 0 without one, folded with a constant no training step
        reaches), so validation losses of different epochs use the same axes.

        Example:

        ```python
        layer.step_seed(training=True)    # [2] int32 tensor, or None
        ```
        """
        if self.samples is None:
            return None  # the exact loss draws nothing
        base = tf.constant([(self.seed or 0) % _MAX_SEED, 0], tf.int32)
        if not training:
            return tf.random.experimental.stateless_fold_in(base, _EVAL_STREAM)
        if self._step is None:
            return None
        step = self._step.value
        self._step.assign_add(1)
        step = tf.cast(tf.cast(step, tf.int64) % _MAX_SEED, tf.int32)
        return tf.random.experimental.stateless_fold_in(base, step)

    def computes_roll(self, training) -> bool:
        """Whether a call with this `training` flag computes the regularizer now."""
        if training:
            return True
        if self.on_eval is None:
            return in_evaluation()
        return self.on_eval

    @tf.autograph.experimental.do_not_convert
    def call(self, inputs, training=None):
        if not self.computes_roll(training):
            return self.inner_model(inputs, training=training)
        x = self._lin.check_input(inputs)
        per_example, logits = loss_from_config(self._lin, x, self.roll_plan,
                                               seed=self.step_seed(bool(training)),
                                               return_logits=True,
                                               precompute_gradient=bool(training))
        if not training or self._lin.inference_equals_training:
            # The twin's forward pass is the model's inference function (and, without
            # BatchNorm / dropout / noise, its training one): reuse it.
            dtype = keras.backend.standardize_dtype(self.inner_model.outputs[0].dtype)
            outputs = tf.cast(self._lin.apply_output_link(logits), dtype)
        else:
            outputs = self.inner_model(inputs, training=training)
        reg = tf.reduce_mean(per_example)
        self.add_loss(tf.cast(self.lam, reg.dtype) * reg)
        # Weighted by the batch size, as Keras weights its loss tracker: the epoch value
        # is the mean over examples, and val_loss = compiled loss + lam * val_roll_loss.
        self.roll_tracker.update_state(reg, sample_weight=tf.cast(tf.shape(x)[0], reg.dtype))
        return outputs

    def compute_output_spec(self, inputs, training=None):
        return self.inner_model.compute_output_spec(inputs)

    def get_config(self):
        config = super().get_config()
        config.update({k: v.value if isinstance(v, enum.Enum) else v  # plain JSON strings
                       for k, v in dataclasses.asdict(self.roll_config).items()})
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


def roll_term(config: RollConfig, model):
    """ROLL as a term `term(x, y, training) -> TermResult` (`y` is not read), for
    `keras_roll.regularizer_loss`; `wrap` trains ROLL with `RollRegularizer`.

    Example:

    ```python
    roll_term(RollConfig(C=1.0), model)(x, None, False).per_example     # [B]
    ```
    """
    def term(x, y, training):
        per_example, logits = roll_loss(model, x, config, return_logits=True)
        lin = linearize(model)
        return TermResult(per_example, lin.apply_output_link(logits))

    return term


register_regularizer(RollConfig, layer=RollRegularizer, make_term=roll_term,
                     resolve=resolve_config)
