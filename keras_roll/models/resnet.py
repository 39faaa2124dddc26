"""ResNet-18 for the paper's Caltech-256 experiment (Lee, Alvarez-Melis & Jaakkola,
ICLR 2019, Appendix I), layer for layer like torchvision's ``resnet18``.

Differences from torchvision, all optional:

* ``stem_pool="avg"`` (the paper's choice): average pooling instead of max pooling
  after the stem, ``AvgPool2d(3, 2, padding=1)`` with ``count_include_pad=True``
  (zero padding counted), so that the whole network is affine in the stem's
  ReLU outputs. ``stem_pool="max"`` is torchvision's ``MaxPool2d(3, 2, padding=1)``.
* The final pooling is a global average pooling whose output is the 512 features
  at any input size (299 x 299 in the paper), followed by ``fc`` (512 -> classes).
* A ``Normalization`` layer first, so the model takes ``[0, 1]`` pixels and
  keras_roll's margins and distortions are in ``[0, 1]`` pixel units.

Padding is explicit (``ZeroPadding2D`` + ``"valid"`` convolutions and pools), exactly
torchvision's: Keras' ``"same"`` pads stride-2 layers asymmetrically and would give
different outputs with converted weights. Max pooling pads with zeros instead of
``-inf``; its inputs are ReLU outputs (``>= 0``), so the result is the same.

Layer names follow torchvision's module names with ``.`` replaced by ``_``
(``conv1``, ``bn1``, ``layer2_0_conv1``, ``layer2_0_downsample_0``, ``fc``), which
is what ``keras_roll.models.load_torchvision_resnet18`` maps.
"""

from __future__ import annotations

import numbers

import keras

from keras_roll.models.preprocessing import compute_dtype, input_normalization

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PAPER_STD = 0.225  # the paper normalises every channel by a single std
BN_EPSILON = 1e-5  # torchvision's BatchNorm2d default
BN_MOMENTUM = 0.9  # = 1 - torchvision's momentum 0.1
STAGES = ((64, 1), (128, 2), (256, 2), (512, 2))  # (filters, first stride) of layer1..4
BLOCKS_PER_STAGE = 2


def _conv_init():
    """torchvision's kaiming_normal_(mode="fan_out", relu), a new initializer per
    convolution: its seed is drawn when the layer is made, so it follows
    `keras.utils.set_random_seed`, and no two convolutions share their draws."""
    return keras.initializers.VarianceScaling(2.0, "fan_out", "untruncated_normal")


def resnet18(
    input_shape=(299, 299, 3),
    classes=256,
    stem_pool="avg",
    normalize=True,
    weights=None,
    classifier_activation="softmax",
    dtype=None,
    name="resnet18",
):
    """Builds ResNet-18 (BasicBlock, [2, 2, 2, 2]) as in the paper's Appendix I.

    Args:
        input_shape: ``(height, width, channels)``, channels last; the spatial
            sizes may be ``None``. The paper uses ``(299, 299, 3)``.
        classes: output units of ``fc``.
        stem_pool: ``"avg"`` (the paper) or ``"max"`` (torchvision).
        normalize: per-channel normalisation layer applied to ``[0, 1]`` inputs:
            ``True`` or ``"imagenet"``: mean ``(0.485, 0.456, 0.406)``, std
            ``(0.229, 0.224, 0.225)``; ``"paper"``: the same mean with the single
            std 0.225; a ``(mean, std)`` pair; ``False`` / ``None``: no layer.
        weights: ``None`` (random, torchvision's initialisation; fixed by
            ``keras.utils.set_random_seed`` before the call) or the path of a
            torchvision ``resnet18`` state dict saved as ``.npz`` (see
            ``load_torchvision_resnet18``; ``fc`` is loaded only when its shape fits
            ``classes``).
        classifier_activation: ``"softmax"`` (folded into the loss by keras_roll),
            ``"sigmoid"`` or ``None`` for logits.
        dtype: dtype (policy) of the input and every layer (``"float64"``,
            ``"mixed_float16"``, ...); ``None``: Keras' default. Under a mixed
            policy (given here or global) the classifier ``fc`` is float32, so
            the logits are float32.
        name: the model's name.

    Returns:
        A built functional ``keras.Model``. Its BatchNormalization layers use batch
        statistics in training and moving statistics in inference; keras_roll's
        twin always uses the moving statistics (docs/guide.md, "Training with ROLL").

    Raises:
        ValueError: for a bad argument (the message names it).
        FileNotFoundError: when ``weights`` is a path that does not exist.

    Example:

    ```python
    import keras_roll
    model = keras_roll.models.resnet18(classes=256, weights="resnet18_imagenet.npz")
    cert = keras_roll.certify(model, images, norms=(2,))  # images in [0, 1]
    ```
    """
    input_shape = _check_input_shape(input_shape)
    if not isinstance(classes, numbers.Integral) or isinstance(classes, bool) or classes < 1:
        raise ValueError(f"classes must be a positive integer, got {classes!r}.")
    if stem_pool not in ("avg", "max"):
        raise ValueError(
            f"stem_pool must be 'avg' (the paper) or 'max' (torchvision), got {stem_pool!r}."
        )
    if classifier_activation not in (None, "softmax", "sigmoid", "linear"):
        raise ValueError(
            f"classifier_activation must be 'softmax', 'sigmoid' or None (logits), got "
            f"{classifier_activation!r}: keras_roll folds only a final softmax / sigmoid."
        )
    norm = _normalization(normalize, input_shape[-1], dtype)
    if isinstance(weights, str) and weights.lower() == "imagenet":
        from keras_roll.models.torchvision_weights import EXPORT_HINT

        raise ValueError(
            "weights='imagenet' cannot be downloaded by keras_roll: export torchvision's "
            f"ImageNet weights once and pass the file as weights=path. {EXPORT_HINT}"
        )

    layers = _Layers(dtype)
    inputs = keras.Input(input_shape, dtype=compute_dtype(dtype), name="pixels")
    h = norm(inputs) if norm is not None else inputs
    h = layers.conv(h, 64, 7, 2, 3, "conv1")
    h = layers.bn(h, "bn1")
    h = keras.layers.ReLU(dtype=dtype, name="relu")(h)
    h = keras.layers.ZeroPadding2D(1, dtype=dtype, name="stem_pool_pad")(h)
    if stem_pool == "avg":
        h = keras.layers.AveragePooling2D(3, 2, dtype=dtype, name="stem_avgpool")(h)
    else:
        h = keras.layers.MaxPooling2D(3, 2, dtype=dtype, name="maxpool")(h)
    in_filters = 64
    for stage, (filters, stride) in enumerate(STAGES, start=1):
        for block in range(BLOCKS_PER_STAGE):
            s = stride if block == 0 else 1
            h = layers.basic_block(h, filters, s, in_filters != filters or s != 1,
                                   f"layer{stage}_{block}")
            in_filters = filters
    h = keras.layers.GlobalAveragePooling2D(dtype=dtype, name="avgpool")(h)  # 512 features
    outputs = keras.layers.Dense(
        classes, activation=classifier_activation, dtype=_head_dtype(dtype), name="fc"
    )(h)
    model = keras.Model(inputs, outputs, name=name)
    if weights is not None:
        from keras_roll.models.torchvision_weights import load_torchvision_resnet18

        load_torchvision_resnet18(model, weights)
    return model


def _head_dtype(dtype):
    """The classifier's dtype: float32 under a mixed-precision policy (given or global),
    as Keras' mixed-precision guide advises, so that logits and the softmax are float32."""
    policy = keras.dtype_policies.get(dtype) if dtype is not None \
        else keras.mixed_precision.global_policy()
    if policy.compute_dtype != policy.variable_dtype:
        return "float32"
    return dtype


class _Layers:
    """Layer factories sharing one dtype."""

    def __init__(self, dtype):
        self.dtype = dtype

    def basic_block(self, x, filters, stride, downsample, prefix):
        """torchvision's BasicBlock: conv3x3-bn-relu-conv3x3-bn, + shortcut, relu."""
        h = self.conv(x, filters, 3, stride, 1, f"{prefix}_conv1")
        h = self.bn(h, f"{prefix}_bn1")
        h = keras.layers.ReLU(dtype=self.dtype, name=f"{prefix}_relu1")(h)
        h = self.conv(h, filters, 3, 1, 1, f"{prefix}_conv2")
        h = self.bn(h, f"{prefix}_bn2")
        if downsample:
            x = self.conv(x, filters, 1, stride, 0, f"{prefix}_downsample_0")
            x = self.bn(x, f"{prefix}_downsample_1")
        h = keras.layers.Add(dtype=self.dtype, name=f"{prefix}_add")([h, x])
        return keras.layers.ReLU(dtype=self.dtype, name=f"{prefix}_relu2")(h)

    def conv(self, x, filters, kernel, stride, pad, name):
        """``ZeroPadding2D(pad)`` + a bias-free ``"valid"`` convolution (torch's padding)."""
        if pad:
            x = keras.layers.ZeroPadding2D(pad, dtype=self.dtype, name=f"{name}_pad")(x)
        return keras.layers.Conv2D(
            filters, kernel, strides=stride, padding="valid", use_bias=False,
            kernel_initializer=_conv_init(), dtype=self.dtype, name=name,
        )(x)

    def bn(self, x, name):
        return keras.layers.BatchNormalization(
            epsilon=BN_EPSILON, momentum=BN_MOMENTUM, dtype=self.dtype, name=name
        )(x)


def _check_input_shape(input_shape):
    try:
        shape = tuple(None if s is None else int(s) for s in input_shape)
        ok = len(shape) == 3 and all(s is None or s >= 1 for s in shape) and shape[2] is not None
        ok = ok and shape == tuple(input_shape)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"input_shape must be (height, width, channels) with positive sizes (channels "
            f"last; height and width may be None), got {input_shape!r}."
        )
    return shape


def _normalization(normalize, channels, dtype):
    if normalize is None or normalize is False:
        return None
    if normalize is True or normalize == "imagenet":
        mean, std = IMAGENET_MEAN, IMAGENET_STD
    elif normalize == "paper":
        mean, std = IMAGENET_MEAN, PAPER_STD
    elif isinstance(normalize, str):
        raise ValueError(
            f"normalize must be True / 'imagenet', 'paper', a (mean, std) pair or False, "
            f"got {normalize!r}."
        )
    else:
        try:
            mean, std = normalize
        except (TypeError, ValueError):
            raise ValueError(
                f"normalize must be True / 'imagenet', 'paper', a (mean, std) pair or False, "
                f"got {normalize!r}."
            ) from None
    for value in (mean, std):
        n = len(value) if isinstance(value, (list, tuple)) else None
        if n is not None and n != channels:
            raise ValueError(
                f"normalize has {n} per-channel values but the input has {channels} "
                f"channels (normalize={normalize!r}); pass a (mean, std) pair that fits, "
                "or normalize=False."
            )
    return input_normalization(mean, std, dtype=dtype)
