"""The Caltech-256 example's entry point: its flags (one per field of
`configs/default.py`, plus `--quick` and `--out`), the checks absl runs on them before
any work (the data folder, the weights, the strategy's cluster), and `main`.

Nothing here imports TensorFlow, so a bad flag ends the run with one line in about a
second; `main` then loads it and checks what needs it (the class folders of the tree,
the ROLL layer of the built network) before training, with one line as well.

    python -m examples.caltech256 --flagfile=examples/configs/caltech256_roll.flags \\
        --data_dir=~/data [--quick] [--strategy=mirrored] [--mixed_precision]
"""

from __future__ import annotations

import dataclasses
import os

from absl import flags

from examples.caltech256.configs import default, quick
from examples.caltech256.configs.default import Strategy
from examples.common import app
from examples.common.config_flags import define_example_flags, example_config

GET_IT = ("Get Caltech-256 from https://data.caltech.edu/records/nyy15-4j048 "
          "(256_ObjectCategories.tar), extract it and pass the extracted folder or its parent")


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the Caltech-256 example's flags and their validators on `fv`."""
    define_example_flags(fv, default.get_config, out="runs/caltech256")
    flags.register_validator("data_dir", _checked(_check_data_dir), flag_values=fv)
    flags.register_multi_flags_validator(
        ["data_dir", "quick"], lambda f: f["data_dir"] is not None or f["quick"],
        message=f"--data_dir is required (without --quick, which generates a tree). "
                f"{GET_IT}.", flag_values=fv)
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


def get_config(fv: flags.FlagValues) -> default.Config:
    """The run's config: the quick one under `--quick`, overridden by the flags."""
    return example_config(fv, default.get_config, quick.get_config)


def main(fv: flags.FlagValues, callbacks=()):
    """Trains (unless `--eval_only`) and evaluates with the parsed flags `fv`; returns the
    results on the chief, None on the other workers.

    Example:

    ```python
    result = main(parse_flags(define_flags, ["--quick", "--out=/tmp/caltech"]))
    ```
    """
    from examples.caltech256 import pair, train  # TensorFlow: only once the flags are good

    config = get_config(fv)
    check_with_tensorflow(config)
    if pair.wanted(config):
        return pair.train_and_compare(config, fv.out, callbacks=callbacks)
    return train.train_and_evaluate(config, fv.out, callbacks=callbacks)


def check_with_tensorflow(config: default.Config) -> None:
    """The checks that need keras_roll: the class folders of `--data_dir` and the layer
    `--roll_wrt` in the network the flags build.

    Raises:
        UsageError: the message says what is wrong and what to pass instead.
    """
    from keras_roll.data.caltech256 import check_tree

    if config.data_dir is not None:
        try:
            check_tree(os.path.expanduser(config.data_dir))
        except (ValueError, OSError) as e:
            raise app.UsageError(f"--data_dir={config.data_dir}: {e}") from None
    _check_roll_wrt(config)


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
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory. {GET_IT}.")


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


def _check_roll_wrt(config: default.Config) -> None:
    """`--roll_wrt` names a layer of the network the flags build (before any training)."""
    from examples.caltech256.models import build_model

    if config.roll and config.roll_wrt:
        small = build_model(dataclasses.replace(config, image_size=32), classes=2)
        names = [layer.name for layer in small.layers]
        if config.roll_wrt not in names:
            raise app.UsageError(
                f"--roll_wrt={config.roll_wrt}: {small.name} has no layer "
                f"{config.roll_wrt!r}; its first layers are {', '.join(names[:6])}, ... "
                f"(--roll_wrt= for the [0, 1] pixels)")
