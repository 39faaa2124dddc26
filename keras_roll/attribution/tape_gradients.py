"""Input gradients of models that are not piecewise linear, by `tf.GradientTape`.

Gradient saliency, Riemann-sum integrated gradients and SmoothGrad need only
input gradients, not linear regions: for a model with tanh, gelu or sigmoid hidden
layers (which `keras_roll.linearize` refuses) they run on the Keras model itself
through `tf.GradientTape`. No certified radius and no exact integral exist there:
results say so (`piecewise_linear=False` and a note), and the functions that need
them (`stable_radius`, `integrated_gradients(steps=None)`) keep refusing such
models, naming the layer.

The attributed logits are the model output before a final softmax / sigmoid, as
for the twin: a final `Activation` / `Softmax` layer is left out, and a final layer
with `activation="softmax"` (or sigmoid) is traced without it.

Example:

```python
engine = gradient_engine(model)           # LogitGradients or TapeGradients
grad, logits = engine.weighted_gradients(x, weights)
```
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from keras_roll.attribution.gradients import (
    LogitGradients,
    chunked_gradients,
    chunked_logits,
)
from keras_roll.compile.caches import cached
from keras_roll.compile.chunking import plan_directions
from keras_roll.compile.rules.activations import Link
from keras_roll.compile.twin import Linearized, unwrap
from keras_roll.errors import UnsupportedModelError
from keras_roll.inputs import InputSpec, check_input

__all__ = ["NOT_PIECEWISE_LINEAR", "TapeGradients", "TracedOnce", "gradient_engine"]

NOT_PIECEWISE_LINEAR = (
    "the model is not piecewise linear ({reason}); gradients come from tf.GradientTape on "
    "the Keras model, and no certified radius or exact integral exists for it")
_DEFAULT_BUDGET = 2**28  # bytes of live tensors per compiled chunk
_LINKS = tuple(link.value for link in Link)


def gradient_engine(model, need_linear: bool = False):
    """The gradient engine of a model: the twin's `LogitGradients` when the model is
    piecewise linear, else (unless `need_linear`) a `TapeGradients`.

    Raises:
        keras_roll.UnsupportedModelError: with `need_linear=True` for a model that
            is not piecewise linear (the message names the layer).
    """
    try:
        return LogitGradients.of(model)
    except UnsupportedModelError:
        if need_linear or isinstance(model, Linearized):
            raise
    model = unwrap(model)
    return cached(model, ("engine", TapeGradients), lambda: TapeGradients(model))


def _why_not_linear(model) -> str:
    try:
        LogitGradients.of(model)
    except UnsupportedModelError as e:
        return str(e).split(";")[0].split(". ")[0]
    return "no reason"


class TapeGradients:
    """Compiled, chunked input gradients of weighted logits of any Keras model.

    Args:
        model: a built single-input, single-output Keras model.

    Attributes:
        piecewise_linear: False: no radius and no exact walk for this model.
        note: why, in words.
        affine_prefix: None (the Riemann sums' shortcut needs the twin).
    """

    piecewise_linear = False
    affine_prefix = None

    def __init__(self, model: keras.Model):
        if len(model.inputs) != 1 or len(model.outputs) != 1:
            raise UnsupportedModelError(
                f"Model '{model.name}' has {len(model.inputs)} inputs and "
                f"{len(model.outputs)} outputs; attributions need one of each.")
        self.model = model
        dtype = keras.backend.standardize_dtype(model.inputs[0].dtype)
        self.dtype = dtype if dtype in ("float32", "float64") else "float32"
        self.input_shape = tuple(model.inputs[0].shape[1:])
        self.spec = InputSpec(self.input_shape, self.dtype, model.name)
        self.output_link, self._logits = _logit_function(model)
        self.note = NOT_PIECEWISE_LINEAR.format(reason=_why_not_linear(model))
        x_spec = TracedOnce.batch_spec(self.input_shape, self.dtype)
        weights_spec = tf.TensorSpec((None, None), self.dtype)
        self._grad_fn = TracedOnce(self.objective_gradient,
                                   x_spec and [x_spec, weights_spec])
        self._logits_fn = TracedOnce(self._logits, x_spec and [x_spec])
        self._sizes: dict = {}

    def check(self, x, name: str = "x") -> np.ndarray:
        """A checked, private copy of `x` in the engine's dtype."""
        return np.array(check_input(x, self.spec, name=name))

    def num_logits(self, example_shape) -> int:
        return self._size(example_shape)[0]

    def _size(self, example_shape):
        shape = tuple(int(d) for d in example_shape)
        if shape not in self._sizes:
            out = self._logits(tf.zeros((1, *shape), self.dtype))
            self._sizes[shape] = (int(np.prod(out.shape[1:])), _activation_elements(self.model))
        return self._sizes[shape]

    def chunk_size(self, example_shape, memory_budget: int | None = None,
                   total: int | None = None, scale: float = 1.0) -> int:
        """Points per compiled call: the layers' outputs, kept and differentiated, and a
        few copies of the input under the budget."""
        d = int(np.prod(example_shape))
        n_logits, acts = self._size(example_shape)
        per_point = int(max(1.0, scale * (2 * acts + 2 * n_logits + 4 * d))
                        * np.dtype(self.dtype).itemsize)
        budget = int(memory_budget or _DEFAULT_BUDGET)
        total = 2**62 if total is None else max(1, int(total))
        return int(max(1, plan_directions(total, per_point, budget)[0]))

    def objective_gradient(self, x, weights):
        """Traceable: `(grad, logits [n, L])` of `sum(logits * weights)`."""
        with tf.GradientTape() as tape:
            tape.watch(x)
            logits = tf.reshape(self._logits(x), tf.stack([tf.shape(x)[0], -1]))
            total = tf.reduce_sum(logits * tf.cast(weights, logits.dtype))
        grad = tape.gradient(total, x)
        return (tf.zeros_like(x) if grad is None else tf.cast(grad, x.dtype)), logits

    def logits(self, x, memory_budget: int | None = None) -> np.ndarray:
        """`[n, L]` flattened logits (numpy), in compiled chunks."""
        return chunked_logits(self._logits_fn, self, x, memory_budget)

    def weighted_gradients(self, x, weights, memory_budget: int | None = None):
        """`(grad [n, *input_shape], logits [n, L])` numpy, in chunks."""
        return chunked_gradients(self._grad_fn, self, x, weights, memory_budget)


class TracedOnce:
    """A `tf.function` of one input signature, traced once, before its first call.

    The compiled functions of an engine or a twin are made afresh for each model from
    the same Python code, and TensorFlow's retracing warning counts the traces of all
    the functions made from one piece of code together: after five models it would
    report the one trace each of them needs as "excessive retracing". Traced ahead
    of its first call (`get_concrete_function`) for a signature whose batch axis is
    free, a `TracedOnce` is never traced by a call, so it never counts. Without a
    signature (inputs of variable length) it is a `reduce_retracing` function.
    While functions run eagerly (`tf.config.run_functions_eagerly`) nothing is
    traced.

    Args:
        fn: the traceable function.
        signature: a `tf.TensorSpec` per positional argument, or None.

    Example:

    ```python
    logits_fn = TracedOnce(model, [tf.TensorSpec((None, 784), "float32")])
    logits_fn(tf.zeros((8, 784)))      # traced once (for any batch size), then run
    ```
    """

    def __init__(self, fn, signature):
        self._function = tf.function(fn, input_signature=signature,
                                     reduce_retracing=signature is None, autograph=False)
        self._ahead = signature is not None
        self._traced = False

    @staticmethod
    def batch_spec(example_shape, dtype) -> tf.TensorSpec | None:
        """The spec of a batch of examples of `example_shape`; None where an axis of
        the example is unknown (no signature then)."""
        if any(d is None for d in example_shape):
            return None
        return tf.TensorSpec((None, *example_shape), dtype)

    def __call__(self, *args):
        if self._ahead and not self._traced and not tf.config.functions_run_eagerly():
            self._function.get_concrete_function()
            self._traced = True
        return self._function(*args)


def _activation_elements(model) -> int:
    """Elements per example of every layer's output (an estimate of the tensors a
    backward pass keeps)."""
    total = 0
    for layer in model.layers:
        try:
            shape = layer.output.shape
        except (AttributeError, ValueError):
            continue
        total += int(np.prod([d for d in shape[1:] if d is not None]))
    return max(total, 1)


def _logit_function(model):
    """`(link, logits_fn)`: the model output before a final softmax / sigmoid (a `Link`,
    or None)."""
    last = model.layers[-1] if model.layers else None
    name = lambda fn: getattr(fn, "__name__", "")  # noqa: E731
    if last is not None and last.output is model.outputs[0]:
        if isinstance(last, keras.layers.Softmax):
            return Link.SOFTMAX, keras.Model(model.inputs, last.input)
        if isinstance(last, keras.layers.Activation) and name(last.activation) in _LINKS:
            return Link(name(last.activation)), keras.Model(model.inputs, last.input)
        if name(getattr(last, "activation", None)) in _LINKS:
            link = Link(name(last.activation))

            def logits(x):
                saved = last.activation
                last.activation = keras.activations.linear  # traced without the link
                try:
                    return model(x)
                finally:
                    last.activation = saved

            return link, logits
    return None, model

