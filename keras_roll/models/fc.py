"""The paper's fully connected MNIST network (Lee, Alvarez-Melis & Jaakkola, ICLR 2019)."""

from __future__ import annotations

import numbers

import keras

from keras_roll.models.preprocessing import compute_dtype, input_normalization, is_number

MNIST_MEAN = 0.1307
MNIST_STD = 0.3081


def fc(
    input_shape=(784,),
    depth=4,
    width=300,
    classes=10,
    normalize=(MNIST_MEAN, MNIST_STD),
    activation="relu",
    classifier_activation="softmax",
    dtype=None,
    name="fc",
):
    """Builds a fully connected ReLU classifier: the paper's 784-300x4-10 MNIST model.

    Layers: ``Input(input_shape)``, ``Flatten`` (when the input is not a vector),
    ``Normalization`` (``(x - mean) / std``, when ``normalize`` is given), ``depth``
    ``Dense(width)`` + activation layers named ``dense_1``/``relu_1`` ...
    ``dense_{depth}``/``relu_{depth}``, and ``Dense(classes)`` named ``predictions``.

    The normalisation is a layer *inside* the model, so the model takes pixels in
    ``[0, 1]`` (``keras_roll.data.mnist_splits`` or ``load_mnist(normalize=True)``)
    and keras_roll's margins come out in ``[0, 1]`` pixel units: the paper's
    ``sigma * margin`` for a model trained on normalised inputs.

    Args:
        input_shape: per-example input shape, e.g. ``(784,)`` or ``(28, 28)``.
        depth: number of hidden layers, ``>= 0``.
        width: units per hidden layer, ``>= 1``.
        classes: number of output units, ``>= 1``.
        normalize: ``(mean, std)`` of the inputs (numbers, or per-feature sequences
            for a vector input), or ``None`` for no normalisation layer.
        activation: hidden activation layer: ``"relu"`` or ``"leaky_relu"`` (slope
            0.2), or a ``keras.layers.Layer`` *class* taking ``name=`` and ``dtype=``.
        classifier_activation: ``"softmax"`` (folded into the loss by keras_roll),
            ``"sigmoid"`` or ``None`` for logits.
        dtype: dtype (policy) of the input and every layer, e.g. ``"float64"`` for
            certificates without float32 round-off; ``None``: Keras' default.
        name: the model's name.

    Returns:
        A built functional ``keras.Model``.

    Raises:
        ValueError: for bad sizes, activations or normalisation statistics.

    Example:

    ```python
    import keras_roll
    model = keras_roll.models.fc()            # 784-300-300-300-300-10, inputs in [0, 1]
    model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    cert = keras_roll.certify(model, x_test)  # margins in [0, 1] pixel units
    ```
    """
    input_shape = _check_shape(input_shape)
    for arg, value, low in (("depth", depth, 0), ("width", width, 1), ("classes", classes, 1)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
            raise ValueError(f"{arg} must be an integer >= {low}, got {value!r}.")
    if classifier_activation not in (None, "softmax", "sigmoid", "linear"):
        raise ValueError(
            f"classifier_activation must be 'softmax', 'sigmoid' or None (logits), got "
            f"{classifier_activation!r}: keras_roll folds only a final softmax / sigmoid."
        )
    make_activation = _activation(activation)

    inputs = keras.Input(input_shape, dtype=compute_dtype(dtype), name="pixels")
    h = inputs
    if len(input_shape) > 1:
        h = keras.layers.Flatten(dtype=dtype, name="flatten")(h)
    if normalize is not None:
        try:
            mean, std = normalize
        except (TypeError, ValueError):
            raise ValueError(
                f"normalize must be a (mean, std) pair or None, got {normalize!r}."
            ) from None
        h = input_normalization(mean, std, dtype=dtype)(h)
    for i in range(1, depth + 1):
        h = keras.layers.Dense(width, dtype=dtype, name=f"dense_{i}")(h)
        h = make_activation(name=f"{_act_name(activation)}_{i}", dtype=dtype)(h)
    outputs = keras.layers.Dense(
        classes, activation=classifier_activation, dtype=dtype, name="predictions"
    )(h)
    return keras.Model(inputs, outputs, name=name)


def _check_shape(input_shape):
    if is_number(input_shape):
        input_shape = (input_shape,)
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise ValueError(
            f"input_shape must be a tuple of positive ints, e.g. (784,), got {input_shape!r}."
        ) from None
    if not shape or any(s < 1 for s in shape) or shape != tuple(input_shape):
        raise ValueError(
            f"input_shape must be a tuple of positive ints, e.g. (784,), got {input_shape!r}."
        )
    return shape


def _activation(activation):
    if activation == "relu":
        return keras.layers.ReLU
    if activation == "leaky_relu":
        return lambda name, dtype: keras.layers.LeakyReLU(0.2, name=name, dtype=dtype)
    if isinstance(activation, type) and issubclass(activation, keras.layers.Layer):
        return activation
    raise ValueError(
        f"activation must be 'relu', 'leaky_relu' or a keras Layer class, got {activation!r}."
    )


def _act_name(activation):
    if isinstance(activation, str):
        return activation
    return activation.__name__.lower()

