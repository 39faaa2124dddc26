"""The Caltech-256 example's entry point: its flags (one per field of
`configs/default.py`, plus `--quick` and `--out`), the checks absl runs on them before
any work (the data tree, the weights, the strategy's cluster, the ROLL layer), and
`main`.

    python -m examples.caltech256 --flagfile=examples/configs/caltech256_roll.flags \\
        --data_dir=~/data [--quick] [--strategy=mirrored] [--mixed_precision]
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from examples.caltech256 import train
from examples.caltech256.configs import default, quick
from examples.caltech256.configs.default import Strategy
from examples.caltech256.models import build_model
from examples.common import app
from examples.common.config_flags import config_from_flags, define_config_flags
from keras_roll.data.caltech256 import WHERE_TO_GET, check_tree


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the Caltech-256 example's flags and their validators on `fv`."""
    app.define_run_flags(fv, out="runs/caltech256")
    define_config_flags(fv, default.get_config())
    flags.register_validator("data_dir", _checked(_check_data_dir), flag_values=fv)
    flags.register_multi_flags_validator(
        ["data_dir", "quick"], lambda f: f["data_dir"] is not None or f["quick"],
        message=f"--data_dir is required (without --quick, which generates a tree). "
                f"{WHERE_TO_GET}", flag_values=fv)
    flags.register_validator(
        "strategy", lambda s: s != Strategy.multiworker or bool(os.environ.get("TF_CONFIG")),
        message="--strategy=multiworker needs TF_CONFIG on every host, e.g. TF_CONFIG='"
                '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": {"type": '
                '"worker", "index": 0}}\' on host1 and index 1 on host2; for the GPUs of one '
                "host use --strategy=mirrored", flag_values=fv)
    flags.register_multi_flags_validator(
        ["eval_only", "strategy"],
        lambda f: not (f["eval_only"] and f["strategy"] == Strategy.multiworker),
        message="--eval_only evaluates in one process; drop --strategy=multiworker",
        flag_values=fv)
    flags.register_validator(
        "lr_decay_epochs", lambda epochs: all(float(e).is_integer() for e in epochs),
        message="--lr_decay_epochs takes whole epochs >= 1", flag_values=fv)
    flags.register_validator("weights", _checked(_check_weights), flag_values=fv)
    flags.register_validator("compare_with", _checked(_check_compare_with), flag_values=fv)
    # Checked against the network the flags build; absl runs validators once every flag
    # is parsed, so the other flags' values are final.
    flags.register_validator("roll_wrt", lambda _: _check_roll_wrt(get_config(fv)),
                             flag_values=fv)


def get_config(fv: flags.FlagValues) -> default.Config:
    """The run's config: the quick one under `--quick`, overridden by the flags."""
    return config_from_flags(fv, default.get_config(), quick.get_config() if fv.quick else None)


def main(fv: flags.FlagValues, callbacks=()):
    """Trains (unless `--eval_only`) and evaluates with the parsed flags `fv`; returns the
    results on the chief, None on the other workers.

    Example:

    ```python
    result = main(parse_flags(define_flags, ["--quick", "--out=/tmp/caltech"]))
    ```
    """
    return train.train_and_evaluate(get_config(fv), fv.out, callbacks=callbacks)


def _checked(check):
    """A validator for an optional path flag: `check(path)` raises ValueError or
    FileNotFoundError with the message."""
    def validator(value):
        if value is None:
            return True
        try:
            check(os.path.expanduser(value))
        except (ValueError, OSError) as e:
            raise flags.ValidationError(str(e)) from None
        return True
    return validator


def _check_data_dir(path):
    check_tree(path)


def _check_weights(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--weights={path}: no such file")
    if not path.endswith((".npz", ".weights.h5")):
        raise ValueError(f"--weights={path}: expected a torchvision state dict saved as .npz "
                         f"or a Keras .weights.h5 file")


def _check_compare_with(path):
    for name in ("run_config.json", "best.weights.h5"):
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(f"--compare_with={path} has no {name}; pass the --out of "
                                    f"a finished run")


def _check_roll_wrt(config: default.Config) -> bool:
    """`--roll_wrt` names a layer of the network the flags build (before any training)."""
    if config.roll and config.roll_wrt:
        small = build_model(dataclasses.replace(config, image_size=32), classes=2)
        names = [layer.name for layer in small.layers]
        if config.roll_wrt not in names:
            raise flags.ValidationError(
                f"{small.name} has no layer {config.roll_wrt!r}; its first layers are "
                f"{', '.join(names[:6])}, ... (--roll_wrt= for the [0, 1] pixels)")
    return True
