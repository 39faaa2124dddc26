"""`SupervisedRegularizer`: the layer of every registered regularizer but ROLL
(MMR, the input-gradient norm, IBP, CROWN-IBP, a user's own), in the model
`keras_roll.wrap` returns.

ROLL reads only `x`; the others may also need `y` (and the loss), which Keras
gives to `train_step` and `test_step` but not to a layer. The wrapped model
(`RollModel`) enters `keras_roll.regularizers.base.labelled_step` in both
steps, and this layer reads the labels from it while the step is traced. The
layer runs whatever term the config's registration makes (`config.term(model)`),
so a new regularizer is one registered config class and no code here.
docs/design.md, section "Regularizers beside ROLL".

Example:

```python
layer = SupervisedRegularizer(model, MMRConfig(p="inf", gamma_B=0.1))
inp = keras.Input(model.input_shape[1:])
wrapped = keras_roll.RollModel(inp, layer(inp))
```
"""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_roll.regularizers.base import TermMean, current_labels
from keras_roll.regularizers.registry import registration_of

__all__ = ["SupervisedRegularizer"]


@keras.saving.register_keras_serializable(package="keras_roll")
class SupervisedRegularizer(keras.layers.Layer):
    """Adds `lam * mean(term(x, y))` to the loss of `model(x)`: MMR, input gradient, ...

    The layer holds the model (sharing its weights) and returns its outputs.
    In a training step (`fit`) it computes the config's term on the step's
    inputs and labels, adds `lam` times its batch mean with `add_loss`, and
    tracks the batch mean without `lam` as the metric `config.log_name`
    (`mmr_loss`, `input_gradient_loss`). With `on_eval=None` it does the same
    in `evaluate` (so `val_loss` is the training objective, as for ROLL:
    docs/design.md, "Validation loss of a ROLL model"); `predict` and plain
    calls only run the model. Under `tf.distribute`, Keras scales the added
    loss by `1 / num_replicas` like the compiled loss. Sample weights weigh
    the compiled loss only, not the term.

    Args:
        model: the Keras model (or its config dict).
        config: the config of a registered regularizer (`MMRConfig`,
            `InputGradientConfig`, `IBPConfig`, `CrownIBPConfig`, ...).
        **kwargs: the keyword arguments of `keras.layers.Layer` (`name`, ...).

    Raises:
        TypeError: `config` is not a registered regularizer's (the message
            lists them).

    Example:

    ```python
    layer = SupervisedRegularizer(model, InputGradientConfig(lam=0.1))
    ```
    """

    def __init__(self, model: keras.Model | dict, config, **kwargs):
        registration = registration_of(config, "config")
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        if isinstance(model, dict):  # from a config
            model = keras.saving.deserialize_keras_object(model)
        self.term = registration.make_term(config, model)
        self.inner_model = model
        # Named as RollRegularizer's, so that `unwrap` and `linearize` recognise the layer.
        self.roll_config = config
        self.tracker = TermMean(name=config.log_name)
        self.supports_jit = False
        self.built = True

    @property
    def config(self):
        """The regularizer's config (`MMRConfig`, `InputGradientConfig`, ...)."""
        return self.roll_config

    @property
    def metrics(self):
        return [self.tracker, *getattr(self.term, "metrics", ())]

    def computes_term(self, training) -> bool:
        """Whether a call with this `training` flag computes the term now."""
        if training:
            return True
        return self.roll_config.on_eval is None and current_labels() is not None

    @tf.autograph.experimental.do_not_convert
    def call(self, inputs, training=None):
        if not self.computes_term(training):
            return self.inner_model(inputs, training=training)
        step = current_labels()
        if step is None or step.y is None:
            raise ValueError(f"{type(self.roll_config).__name__} needs the labels of the batch: "
                             f"train the model keras_roll.wrap returns with fit(x, y) (or "
                             f"train_on_batch / evaluate with labels); in a custom loop, add "
                             f"lam * mean of keras_roll.regularizer_loss(model, x, y, "
                             f"config) to the loss instead.")
        result = self.term(inputs, step.y, bool(training))
        per_example = tf.cast(result.per_example, "float32")
        reg = tf.reduce_mean(per_example)
        self.add_loss(tf.cast(self.roll_config.lam, reg.dtype) * reg)
        self.tracker.update_state(reg, sample_weight=tf.cast(tf.shape(per_example)[0],
                                                             reg.dtype))
        return result.outputs

    def compute_output_spec(self, inputs, training=None):
        return self.inner_model.compute_output_spec(inputs)

    def get_config(self):
        config = super().get_config()
        config["regularizer"] = type(self.roll_config).__name__
        config["config"] = self.roll_config.to_config()
        config["model"] = keras.saving.serialize_keras_object(self.inner_model)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        name = config.pop("regularizer")
        try:
            registration = registration_of(name)
        except TypeError:
            raise ValueError(f"Unknown regularizer {name!r} in a saved SupervisedRegularizer: "
                             f"register its config class (keras_roll.regularizers."
                             f"register_regularizer) before loading the model.") from None
        fields = registration.config_class(**config.pop("config"))
        model = keras.saving.deserialize_keras_object(config.pop("model"))
        return cls(model, fields, **config)
