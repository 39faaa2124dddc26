"""`wrap(model)`: train a Keras model with the ROLL regularizer through `fit`.

`RollRegularizer` is a layer that holds the model (sharing its weights) and, in
training, adds `lam * mean(roll_loss(model, x))` with `add_loss`; `wrap` builds
the functional model around it, a `RollModel`, and `unwrap` gives the plain
model back. Its hyperparameters are one `RollConfig`; `get_config` stores them
with `dataclasses.asdict`, so saved `.keras` files (which name the classes
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
wrapped = keras_roll.wrap(model, lam=2.0, C=1.0, gamma=100.0)
wrapped.compile("sgd", "sparse_categorical_crossentropy")
wrapped.fit(x, y, epochs=5)
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading

import keras
import tensorflow as tf

from keras_roll.compile.keras_internals import first_local_batch, in_multi_worker_mode
from keras_roll.compile.twin import Linearized, linearize, unwrap
from keras_roll.roll.config import RollConfig, resolve_config
from keras_roll.roll.entry import roll_plan
from keras_roll.roll.loss import loss_from_config
from keras_roll.roll.supervised import SupervisedRegularizer, TermMean, is_supervised_config
from keras_roll.roll.terms import labelled_step, resolve_term_config

__all__ = ["RollModel", "RollRegularizer", "evaluating", "unwrap", "wrap"]

_EVAL_STREAM = 2**31 - 2  # folded into the seed in evaluation (training steps never reach it)
_MAX_SEED = 2**31 - 1
_state = threading.local()


@contextlib.contextmanager
def evaluating():
    """Marks the calls made inside it (in this thread) as an evaluation step.

    `RollModel.test_step` runs in it; a `RollRegularizer` with `on_eval=None`
    computes the ROLL term when called with `training=False` inside it. It is
    thread-local, so the replica threads of a `MirroredStrategy` each see their
    own flag.

    Example:

    ```python
    with evaluating():
        outputs = wrapped(x, training=False)   # adds lam * ROLL to wrapped.losses
    ```
    """
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def _in_evaluation() -> bool:
    return getattr(_state, "depth", 0) > 0


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
            return _in_evaluation()
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


@keras.saving.register_keras_serializable(package="keras_roll")
class RollModel(keras.Model):
    """The functional model `wrap` returns: its `evaluate` computes the ROLL term.

    A plain functional model (same layers, inputs and outputs, saved and
    loaded like one as `keras_roll>RollModel`) whose steps pass their labels
    on (`keras_roll.roll.terms.labelled_step`, read by the regularizers that
    need them: MMR, the input-gradient norm) and whose `test_step` runs inside
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
        with _labels_of(data, self.loss):  # MMR / input gradient read them (roll.supervised)
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


def wrap(model: keras.Model, config: RollConfig | None = None, *, regularizer=None,
         **overrides) -> RollModel:
    """Returns a model that trains `model` with the ROLL regularizer (Eq. 9 / 10),
    or with the regularizer `regularizer` configures (MMR, input-gradient norm).

    The wrapped model (a `RollModel`) has the same inputs and outputs as
    `model` and shares its weights; `compile` / `fit` / `evaluate` / `predict`
    work as usual. During `fit`, `lam * mean(roll_loss(model, x))` is added to
    the loss and the regularizer (without `lam`) is reported as `roll_loss` in
    History. `evaluate` (so `fit`'s validation) computes it too, on the
    evaluation data with a fixed seed: `val_roll_loss`, and `val_loss` = the
    compiled loss + `lam * val_roll_loss`, the training objective, which is the
    quantity to select the best epoch by. `predict` returns `model`'s outputs
    without computing it. Save it as a `.keras` file like any model; `unwrap`
    gives the plain model back.

    Args:
        model: a functional or Sequential model of supported layers (a final
            softmax is fine: it is folded into the loss); a model made by `wrap`
            is unwrapped first (the new hyperparameters replace the old ones).
        config: a `RollConfig` (`keras_roll.roll.config`, where each field is
            described), or None for the defaults: exact ROLL with `lam=2`,
            `C=1`, `gamma=100`.
        **overrides: `RollConfig` fields replacing those of `config`: `lam`,
            `C`, `gamma`, `samples` (None: exact; k: Eq. 10), `strata`,
            `estimator`, `seed`, `on_eval`, `memory_budget`, `share_axes`,
            `wrt` (e.g. `wrt="normalize"` for `keras_roll.models.fc()`: the
            paper's normalised units) and `tangent_dtype`.

    Returns:
        A `RollModel` (a functional `keras.Model`).

    Raises:
        TypeError: `config` is not a `RollConfig`, or an unknown keyword.
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
    if regularizer is not None and not isinstance(chosen, RollConfig) and \
            not is_supervised_config(chosen):
        raise TypeError(f"regularizer must be a RollConfig, MMRConfig or InputGradientConfig "
                        f"(or IBPConfig, CrownIBPConfig; None for ROLL), got {chosen!r}.")
    if is_supervised_config(chosen):
        chosen = resolve_term_config(type(chosen), chosen, overrides)
        model = unwrap(model)
        name = chosen.log_name.removesuffix("_loss")
        layer = SupervisedRegularizer(model, chosen, name=f"{name}_regularizer")
        inp = keras.Input(shape=model.input_shape[1:], dtype=model.inputs[0].dtype)
        return RollModel(inp, layer(inp), name=f"{model.name}_{name}")
    config = chosen
    config = resolve_config(config, **overrides)
    model = unwrap(model)  # wrapping a wrapped model re-wraps its plain model
    layer = RollRegularizer(model, config, name="roll_regularizer")
    inp = keras.Input(shape=model.input_shape[1:], dtype=model.inputs[0].dtype)
    return RollModel(inp, layer(inp), name=f"{model.name}_roll")
