"""The robustness example's entry point: its flags (one per field of `configs/default.py`,
plus `--quick` and `--out`) and `main`.

    python -m examples.robustness --data_dir=<folder with mnist.npz> [--quick]
"""

from __future__ import annotations

from absl import flags

from examples.common import app
from examples.common.config_flags import MNIST_PATH, define_example_flags, example_config
from examples.robustness.configs import default, quick


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the robustness example's flags and their validators on `fv`."""
    define_example_flags(fv, default.get_config, out="runs/robustness", data_dir=MNIST_PATH)


def get_config(fv: flags.FlagValues) -> default.Config:
    """The run's config: the quick one under `--quick`, overridden by the flags."""
    return example_config(fv, default.get_config, quick.get_config)


def main(fv: flags.FlagValues):
    """Trains (or reuses) the two models and bounds their radii, with the parsed flags.

    Example:

    ```python
    result = main(parse_flags(define_flags, ["--quick", "--data_dir=data"]))
    ```
    """
    from examples.robustness import train  # TensorFlow: only once the flags are good

    return train.train_and_evaluate(
        get_config(fv), fv.out, logs=app.LogOptions(warn_last_epoch=fv["epochs"].present))
