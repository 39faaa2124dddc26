"""The MNIST example's entry point: its flags (one per field of `configs/default.py`,
plus `--quick` and `--out`), the checks absl runs on them before any work, and `main`.

Nothing here imports TensorFlow: the flags and the data path are checked first, so a
bad flag ends the run with one line in about a second; `main` loads the rest.

    python -m examples.mnist --flagfile=examples/configs/mnist_roll.flags \\
        --data_dir=<folder with mnist.npz or the IDX files> [--quick] [--sweep]
    python -m examples.mnist --timing
"""

from __future__ import annotations

from absl import flags

from examples.common import app
from examples.common.config_flags import (
    MNIST_PATH,
    define_example_flags,
    example_config,
    parsed_by,
)
from examples.mnist.configs import default, quick


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the MNIST example's flags and their validators on `fv`."""
    define_example_flags(fv, default.get_config, out="runs/mnist", data_dir=MNIST_PATH)
    flags.register_validator("normalize", parsed_by(default.parse_normalize),
                             flag_values=fv)
    flags.register_validator("sweep_base", lambda v: len(v) == 3,
                             message="--sweep_base takes three numbers: lambda,C,gamma",
                             flag_values=fv)
    flags.register_multi_flags_validator(
        ["vanilla", "roll", "sweep", "timing"], lambda f: any(f.values()),
        message="Nothing to train: pass --vanilla and/or --roll (or --sweep, --timing)",
        flag_values=fv)
    # Checked against the model the flags build; absl runs validators once every flag is
    # parsed, so the other flags' values are final.
    flags.register_validator("wrt", lambda _: _check_wrt(get_config(fv)), flag_values=fv)


def get_config(fv: flags.FlagValues) -> default.Config:
    """The run's config: the quick one under `--quick`, overridden by the flags."""
    return example_config(fv, default.get_config, quick.get_config)


def main(fv: flags.FlagValues):
    """Runs the example (or, with `--timing`, Table 2) with the parsed flags `fv`.

    Example:

    ```python
    result = main(parse_flags(define_flags, ["--quick", "--data_dir=data"]))
    ```
    """
    from examples.mnist import timing, train  # TensorFlow: only once the flags are good

    config = get_config(fv)
    if config.timing:
        md = timing.timing(config, app.output_dir(fv.out))
        app.log(md)
        return md
    return train.train_and_evaluate(
        config, fv.out, logs=app.LogOptions(warn_last_epoch=fv["epochs"].present))


def _check_wrt(config: default.Config) -> bool:
    """`--wrt` names a layer of the model the flags build (checked before training)."""
    if config.wrt:
        try:
            names = default.layer_names(config)
        except ValueError:  # another flag is bad (--normalize): its own validator says so
            return True
        if config.wrt not in names:
            raise flags.ValidationError(
                f"the model has no layer {config.wrt!r}; its layers are {', '.join(names)} "
                f"(--wrt= for the [0, 1] pixels)")
    return True
