"""The paper's recurrent model for Japanese Vowels: Masking + scoRNN + Dense.

Lee, Alvarez-Melis & Jaakkola (ICLR 2019) train a scoRNN (Helfrich et al., ICML
2018) with LeakyReLU and 512 hidden units on the UCI Japanese Vowels data
(12 LPC cepstrum coefficients per frame, 7 to 29 frames, 9 speakers), with
AMSGrad, learning rate 0.001 and batch size 32.
"""

from __future__ import annotations

import numbers

import keras

from keras_roll.layers.scornn import ScoRNN


def _check_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (
            high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}.")
    return int(value)


def scornn_classifier(input_shape=(None, 12), units=512, classes=9, num_negative_ones=None,
                      mask_value=0.0, activation=keras.activations.leaky_relu,
                      classifier_activation="softmax", seed=None, name="scornn"):
    """Builds the Japanese Vowels classifier: `Masking -> ScoRNN -> Dense`.

    Variable-length sequences are zero-padded at the end (as
    `keras_roll.data.japanese_vowels` returns them); the `Masking` layer makes the
    padded frames carry the state, and keras_roll creates no neurons for them.

    Layers: `Input(input_shape)` named `frames`, `Masking(mask_value)` named
    `masking`, `ScoRNN(units)` named `scornn` (last state), `Dense(classes)` named
    `predictions`.

    Args:
        input_shape: `(time, features)`; `time` may be None (any length).
        units: scoRNN state size (the paper: 512).
        classes: number of output classes (9 speakers).
        num_negative_ones: number of -1 entries of the scoRNN's diagonal `D`
            (Helfrich et al.'s `rho`). None gives `units // 10`, the scoRNN
            reference code's MNIST setting (the ROLL paper does not state it).
        mask_value: the padding value; frames whose features all equal it are
            skipped. None builds no Masking layer (fixed-length inputs).
        activation: the scoRNN activation (default LeakyReLU, slope 0.2).
        classifier_activation: "softmax" (folded into the loss by keras_roll),
            "sigmoid" or None (logits).
        seed: seed of the scoRNN's initialisers (None: Keras's global seed).
        name: the model's name.

    Returns:
        A built functional `keras.Model`.

    Raises:
        ValueError: for bad sizes or arguments.

    Example:

    ```python
    model = keras_roll.models.scornn_classifier()          # 12 -> 512 -> 9
    model.compile(keras.optimizers.Adam(1e-3, amsgrad=True),
                  "sparse_categorical_crossentropy", metrics=["accuracy"])
    wrapped = keras_roll.wrap(model, lam=2.0)              # exact ROLL
    ```
    """
    try:
        steps, features = input_shape
    except (TypeError, ValueError):
        raise ValueError(
            f"input_shape must be (time, features), e.g. (None, 12), got {input_shape!r}."
        ) from None
    if steps is not None:
        steps = _check_int("input_shape[0] (time steps)", steps, 1)
    features = _check_int("input_shape[1] (features)", features, 1)
    units = _check_int("units", units, 1)
    classes = _check_int("classes", classes, 1)
    if num_negative_ones is None:
        num_negative_ones = units // 10
    num_negative_ones = _check_int("num_negative_ones", num_negative_ones, 0, units)
    if classifier_activation not in (None, "softmax", "sigmoid", "linear"):
        raise ValueError(
            f"classifier_activation must be 'softmax', 'sigmoid' or None (logits), got "
            f"{classifier_activation!r}: keras_roll folds only a final softmax / sigmoid."
        )
    if mask_value is not None and not isinstance(mask_value, numbers.Real):
        raise ValueError(f"mask_value must be a number or None, got {mask_value!r}.")

    inputs = keras.Input((steps, features), name="frames")
    h = inputs
    if mask_value is not None:
        h = keras.layers.Masking(float(mask_value), name="masking")(h)
    h = ScoRNN(units, activation=activation, num_negative_ones=num_negative_ones, seed=seed,
               name="scornn")(h)
    outputs = keras.layers.Dense(classes, activation=classifier_activation,
                                 name="predictions")(h)
    return keras.Model(inputs, outputs, name=name)
