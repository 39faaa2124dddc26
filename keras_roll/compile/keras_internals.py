"""The Keras internals keras_roll reads, in one place.

keras_roll compiles Keras graphs, so it needs a few things Keras keeps private:
the functional graph's nodes by depth (the execution order Keras itself uses),
whether a layer's `call` takes `training` / `mask`, and a causal Conv1D's
padding. Everything that depends on them goes through this module, so that a
Keras upgrade breaks here, with a clear name, and nowhere else
(`tests/test_architecture.py` checks it).

Example:

```python
from keras_roll.compile import keras_internals

out = keras_internals.call_layer(layer, [x])   # layer.call(x, training=False)
```
"""

from __future__ import annotations

import keras
import tensorflow as tf

__all__ = [
    "call_layer",
    "causal_padding",
    "first_local_batch",
    "in_multi_worker_mode",
    "functional_class",
    "node_training_argument",
    "nodes_by_depth",
    "normalization_statistics",
    "numpy_operation",
    "sequential_graph",
    "takes_mask",
    "takes_training",
]


def functional_class() -> type:
    """`keras.src.models.functional.Functional`, the class of functional graphs."""
    from keras.src.models.functional import Functional

    return Functional


def sequential_graph(model):
    """The functional graph a built `keras.Sequential` keeps, or None if unbuilt."""
    return getattr(model, "_functional", None)


def numpy_operation(name: str) -> type:
    """The class of a `keras.ops` numpy operation, e.g. "Add" for `x + y` on Keras tensors."""
    from keras.src.ops import numpy as knp

    return getattr(knp, name)


def nodes_by_depth(graph) -> dict:
    """`{depth: [nodes]}` of a functional graph (depth 0 holds the outputs)."""
    return graph._nodes_by_depth


def normalization_statistics(layer):
    """`(mean_fn, variance_fn)` of a built `keras.layers.Normalization`, graph-safe.

    An adapted layer's statistics are its `adapt_mean` / `adapt_variance`
    variables, reshaped to the layer's broadcast shape and read at call time (so
    they follow `adapt` and variable mappings such as `keras.StatelessScope`).
    Statistics given as `mean=` / `variance=` are fixed numpy constants. Keras
    itself keeps both as eager tensors (`layer.mean`), which a gradient graph
    must not capture: the backward pass of a `tf.cond` in `fit` then fails with
    "Tensor.graph is undefined when eager execution is enabled".
    """
    import numpy as np

    if getattr(layer, "input_mean", None) is None:
        shape = layer._broadcast_shape
        return (lambda: keras.ops.reshape(layer.adapt_mean, shape),
                lambda: keras.ops.reshape(layer.adapt_variance, shape))
    mean = np.asarray(keras.ops.convert_to_numpy(layer.mean), np.float64)
    variance = np.asarray(keras.ops.convert_to_numpy(layer.variance), np.float64)
    return (lambda: mean), (lambda: variance)


def node_training_argument(node):
    """The `training=` a functional node's call was made with (None if not given)."""
    kwargs = getattr(node.arguments, "kwargs", {}) or {}
    return kwargs.get("training")


def takes_training(layer) -> bool:
    """Whether `layer.call` accepts a `training` argument."""
    return bool(getattr(layer, "_call_has_training_arg", False))


def takes_mask(layer) -> bool:
    """Whether `layer.call` accepts a `mask` argument."""
    return bool(getattr(layer, "_call_has_mask_arg", False))


def causal_padding(layer) -> list:
    """The `ops.pad` widths a causal `Conv1D` applies before its convolution."""
    return layer._compute_causal_padding()


def call_layer(layer, inputs: list, mask=None):
    """Runs a layer's `call` (or a Keras operation) in inference mode.

    Layers get their inputs as one tensor (or a list for merge layers), `mask`
    if their `call` takes one and `training=False`; operations get `op(*inputs)`.
    `call` is used rather than `__call__`, so no autocasting happens: tangents
    keep the twin's dtype under mixed precision.

    Example:

    ```python
    y = call_layer(keras.layers.Dropout(0.5), [x])   # the identity: training=False
    ```
    """
    if not isinstance(layer, keras.layers.Layer):
        return layer(*inputs)
    kwargs = {}
    if takes_training(layer):
        kwargs["training"] = False
    if mask is not None and takes_mask(layer):
        kwargs["mask"] = mask
    return layer.call(inputs if len(inputs) > 1 else inputs[0], **kwargs)


# --------------------------------------------------------------------------- distributed fit
# (ROLL's RollModel; separate from the twin's internals above)


def in_multi_worker_mode(strategy) -> bool:
    """Whether `strategy` is a MultiWorkerMirroredStrategy spanning several workers."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    return bool(strategy.extended._in_multi_worker_mode())


def first_local_batch(strategy, iterator):
    """The first batch of a Keras TF epoch iterator as this worker's local values.

    `RollModel._maybe_symbolic_build` uses it under a multi-worker
    MultiWorkerMirroredStrategy, where Keras <= 3.15 reduces the distributed
    `(x, y)` batch with `strategy.reduce`, which that strategy refuses for
    nested values. Returns None (let Keras do it) in any other case.
    """
    if not in_multi_worker_mode(strategy):
        return None
    for _, _, it in iterator:
        batch = next(it)
        break
    else:
        return None

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    return tf.nest.map_structure(local, batch)
