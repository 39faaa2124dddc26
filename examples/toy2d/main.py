"""The toy example's entry point: its flags (one per field of `configs/default.py`,
plus `--quick` and `--out`) and `main`, which runs `train.train_and_evaluate`.

    python -m examples.toy2d --flagfile=examples/configs/toy2d.flags [--quick]
"""

from __future__ import annotations

from absl import flags

from examples.common import app
from examples.common.config_flags import define_example_flags, example_config
from examples.toy2d.configs import default, quick


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the toy example's flags on `fv`."""
    define_example_flags(fv, default.get_config, out="runs/toy2d")
    flags.register_validator(
        "models", lambda names: bool(names) and set(names) <= set(default.MODELS),
        message=f"--models takes a comma-separated subset of {','.join(default.MODELS)}",
        flag_values=fv)


def get_config(fv: flags.FlagValues) -> default.Config:
    """The run's config: the quick one under `--quick`, overridden by the flags."""
    return example_config(fv, default.get_config, quick.get_config)


def main(fv: flags.FlagValues) -> app.ExampleResult:
    """Runs the example with the parsed flags `fv`.

    Example:

    ```python
    fv = parse_flags(define_flags, ["--quick", "--out=/tmp/toy"])
    result = main(fv)     # tables, rows, figures, summary, out
    ```
    """
    from examples.toy2d import train  # TensorFlow: only once the flags are good

    return train.train_and_evaluate(
        get_config(fv), fv.out, logs=app.LogOptions(warn_last_epoch=fv["epochs"].present))
