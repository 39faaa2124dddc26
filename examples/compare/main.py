"""The side-by-side example's entry point: its flags (one per field of
`configs/default.py`, plus `--quick` and `--out`), the checks absl runs on them before
any work, and `main`.

Nothing here imports TensorFlow: a bad flag ends the run with one line in about a second.

    python -m examples.compare --flagfile=examples/configs/compare_mnist.flags \\
        --data_dir=<folder with mnist.npz or the IDX files> [--quick]
"""

from __future__ import annotations

from absl import flags

from examples.common.config_flags import (
    MNIST_PATH,
    define_example_flags,
    example_config,
    parsed_by,
)
from examples.compare.configs import default, quick


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the example's flags and their validators on `fv`."""
    define_example_flags(fv, default.get_config, out="runs/compare", data_dir=MNIST_PATH)
    flags.register_validator(
        "methods", lambda v: set(v) <= set(default.METHODS) and len(v) > 0,
        message="--methods takes a comma-separated subset of " + ", ".join(default.METHODS),
        flag_values=fv)
    flags.register_validator("fixed", parsed_by(default.parse_fixed), flag_values=fv)
    for name in ("mmr_p", "input_gradient_p"):
        flags.register_validator(name, _is_norm, message=f"--{name} is 1, 2 or inf",
                                 flag_values=fv)


def _is_norm(text: str) -> bool:
    try:
        default.parse_norm(text)
    except ValueError:
        return False
    return True


def get_config(fv: flags.FlagValues) -> default.Config:
    """The run's config: the quick one under `--quick`, overridden by the flags."""
    return example_config(fv, default.get_config, quick.get_config)


def main(fv: flags.FlagValues):
    """Runs the comparison with the parsed flags `fv`.

    Example:

    ```python
    result = main(parse_flags(define_flags, ["--quick", "--data_dir=data"]))
    ```
    """
    from examples.compare import experiment  # TensorFlow: only once the flags are good

    return experiment.run(get_config(fv), fv.out, quick=fv.quick)
