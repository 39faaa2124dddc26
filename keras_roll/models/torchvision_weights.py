"""Loads a torchvision ``resnet18`` state dict, exported to ``.npz``, into
``keras_roll.models.resnet18``.

Pretrained ImageNet weights cannot be downloaded by keras_roll. Export them once on
a machine with PyTorch and torchvision (the keys are torchvision's own; the
user guide, docs/guide.md "Models", has the same as a one-line ``python -c``
command)::

    import numpy as np, torchvision
    sd = torchvision.models.resnet18(weights="IMAGENET1K_V1").state_dict()
    np.savez("resnet18_imagenet.npz", **{k: v.numpy() for k, v in sd.items()})

This module imports only numpy and Keras; PyTorch is never needed here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import keras
import numpy as np

EXPORT_HINT = (
    "Export a torchvision state dict with: python -c \"import numpy as np, torchvision; "
    "sd = torchvision.models.resnet18(weights='IMAGENET1K_V1').state_dict(); "
    "np.savez('resnet18_imagenet.npz', **{k: v.numpy() for k, v in sd.items()})\""
)
_BN_PARAMS = (
    ("weight", "gamma"),
    ("bias", "beta"),
    ("running_mean", "moving_mean"),
    ("running_var", "moving_variance"),
)
_IGNORED_SUFFIX = ".num_batches_tracked"


class TorchvisionWeights(NamedTuple):
    """What `load_torchvision_resnet18` did.

    Attributes:
        loaded: the state-dict keys copied into the model.
        skipped: keys left out (``fc.weight`` / ``fc.bias`` when ``fc`` was not
            loaded; ``*.num_batches_tracked`` counters, which Keras has no use for).
    """

    loaded: list
    skipped: list


def torchvision_key(layer_name: str) -> str:
    """The torchvision module name of a keras_roll ResNet layer.

    Example:
        >>> torchvision_key("layer2_0_downsample_1")
        'layer2.0.downsample.1'
    """
    return layer_name.replace("_", ".")


def load_torchvision_resnet18(model, path, load_fc="auto") -> TorchvisionWeights:
    """Copies a torchvision ``resnet18`` state dict (``.npz``) into ``model``.

    ``model`` is a `keras_roll.models.resnet18` (either ``stem_pool``; the pools
    have no weights). Every ``Conv2D``, ``BatchNormalization`` and ``Dense`` layer
    of the model must find its keys, and every key of the file must find its layer,
    with the right shapes; nothing is assigned unless everything fits. Conversions:
    convolution kernels ``[out, in, kh, kw] -> [kh, kw, in, out]``, ``fc.weight``
    ``[classes, 512] -> [512, classes]``, BatchNorm ``weight, bias, running_mean,
    running_var -> gamma, beta, moving_mean, moving_variance`` (both use
    ``eps = 1e-5``). Keys saved from ``nn.DataParallel`` (``module.`` prefix) work.

    Args:
        model: the Keras ResNet-18.
        path: the ``.npz`` file, see the module docstring for the one-line export.
        load_fc: ``"auto"``: load ``fc`` when its shape fits the model's classes
            and skip it otherwise (fine-tuning ImageNet weights on Caltech-256's
            256 classes); ``True``: always (a shape mismatch is an error);
            ``False``: never.

    Returns:
        A `TorchvisionWeights` with the loaded and skipped keys.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not an ``.npz`` state dict, keys are missing or
            unexpected, or shapes do not match (the message lists them).

    Example:

    ```python
    model = keras_roll.models.resnet18(classes=256)
    report = keras_roll.models.load_torchvision_resnet18(model, "resnet18_imagenet.npz")
    report.skipped            # ['fc.weight', 'fc.bias', ...]: 1000 ImageNet classes != 256
    ```
    """
    if load_fc not in ("auto", True, False):
        raise ValueError(f"load_fc must be 'auto', True or False, got {load_fc!r}.")
    state = _read_state_dict(path)
    targets = _targets(model)  # key -> (variable, torch shape, converter)
    skipped = sorted(k for k in state if k.endswith(_IGNORED_SUFFIX))
    unexpected = sorted(k for k in state if k not in targets and not k.endswith(_IGNORED_SUFFIX))
    missing = sorted(k for k in targets if k not in state)
    fc_keys = [k for k in targets if k.startswith("fc.")]
    fc_fits = all(k in state and state[k].shape == targets[k][1] for k in fc_keys)
    skip_fc = load_fc is False or (load_fc == "auto" and not fc_fits)
    if skip_fc:
        missing = [k for k in missing if k not in fc_keys]
        skipped += [k for k in fc_keys if k in state]
    if missing or unexpected:
        raise ValueError(
            f"{path}: the state dict does not match the model {model.name!r}: "
            f"missing keys {_few(missing)}, unexpected keys {_few(unexpected)}. Expected "
            "torchvision resnet18 keys (conv1.weight, bn1.weight, layer1.0.conv1.weight, "
            f"..., fc.weight) and a keras_roll.models.resnet18 model. {EXPORT_HINT}"
        )
    assignments = []
    bad = []
    for key, (variable, torch_shape, convert) in targets.items():
        if skip_fc and key in fc_keys:
            continue
        value = state[key]
        if value.shape != torch_shape:
            bad.append(f"{key}: file {tuple(value.shape)}, model expects {torch_shape}")
            continue
        assignments.append((key, variable, convert(value)))
    if bad:
        raise ValueError(
            f"{path}: shapes do not match the model {model.name!r} (torch layout): "
            + "; ".join(bad[:8]) + (f"; ... ({len(bad)} in all)" if len(bad) > 8 else "")
            + ". Build the model with the classes of the file, or pass load_fc=False."
        )
    for _, variable, value in assignments:
        variable.assign(value.astype(keras.backend.standardize_dtype(variable.dtype)))
    return TorchvisionWeights([k for k, _, _ in assignments], skipped)


def _read_state_dict(path):
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_file():
        raise FileNotFoundError(
            f"Torchvision weights file {str(p)!r} does not exist. {EXPORT_HINT}"
        )
    try:
        data = np.load(p, allow_pickle=False)
    except (OSError, EOFError, ValueError) as e:
        raise ValueError(
            f"{str(p)!r} cannot be read as an .npz state dict ({e}). {EXPORT_HINT}"
        ) from e
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{str(p)!r} holds a single array, not an .npz state dict. {EXPORT_HINT}")
    with data:
        state = {k: np.asarray(data[k]) for k in data.files}
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def _targets(model):
    """{torchvision key: (Keras variable, torch-layout shape, torch -> Keras function)}."""
    targets = {}
    for layer in model.layers:
        module = torchvision_key(layer.name)
        if isinstance(layer, keras.layers.Conv2D):
            if layer.use_bias:
                raise ValueError(
                    f"Conv2D {layer.name!r} has a bias; torchvision's resnet18 convolutions "
                    "have none. Use keras_roll.models.resnet18."
                )
            kh, kw, cin, cout = layer.kernel.shape
            targets[f"{module}.weight"] = (
                layer.kernel, (cout, cin, kh, kw), lambda w: np.transpose(w, (2, 3, 1, 0))
            )
        elif isinstance(layer, keras.layers.BatchNormalization):
            for torch_name, keras_name in _BN_PARAMS:
                variable = getattr(layer, keras_name)
                if variable is None:
                    raise ValueError(
                        f"BatchNormalization {layer.name!r} has no {keras_name} (center / "
                        "scale off); torchvision's has. Use keras_roll.models.resnet18."
                    )
                targets[f"{module}.{torch_name}"] = (variable, tuple(variable.shape), _same)
        elif isinstance(layer, keras.layers.Dense):
            n_in, n_out = layer.kernel.shape
            targets[f"{module}.weight"] = (layer.kernel, (n_out, n_in), np.transpose)
            if layer.use_bias:
                targets[f"{module}.bias"] = (layer.bias, (n_out,), _same)
        elif layer.weights:
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}) has weights that no "
                "torchvision resnet18 key maps to. Use keras_roll.models.resnet18."
            )
    if not targets:
        raise ValueError(f"Model {model.name!r} has no Conv2D / BatchNormalization / Dense layers.")
    return targets


def _same(value):
    return value


def _few(keys, n=6):
    if not keys:
        return "[]"
    more = f", ... ({len(keys)} in all)" if len(keys) > n else ""
    return "[" + ", ".join(keys[:n]) + more + "]"
