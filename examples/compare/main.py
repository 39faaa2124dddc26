"""The side-by-side example's entry point: its flags (one per field of
`configs/default.py`, plus `--quick` and `--out`), the checks absl runs on them before
any work, and `main`.

Nothing here imports TensorFlow: a bad flag ends the run with one line in about a second.

    python -m examples.compare --flagfile=examples/configs/compare_mnist.flags \\
        --data_dir=<folder with mnist.npz or the IDX files> [--quick]
"""

from __future__ import annotations

from absl import flags

from examples.common import app
from examples.common.config_flags import (
    config_from_flags,
    define_config_flags,
    parsed_by,
    require_existing_path,
)
from examples.compare.configs import default, quick


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the example's flags and their validators on `fv`."""
    app.define_run_flags(fv, out="runs/compare")
    define_config_flags(fv, default.get_config())
    require_existing_path(fv, "data_dir", "a Keras-layout mnist.npz or a folder holding it "
                                          "or the four IDX files")
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
    return config_from_flags(fv, default.get_config(), quick.get_config() if fv.quick else None)


def main(fv: flags.FlagValues):
    """Runs the comparison with the parsed flags `fv`.

    Example:

    ```python
    result = main(parse_flags(define_flags, ["--quick", "--data_dir=data"]))
    ```
    """
    from examples.compare import experiment  # TensorFlow: only once the flags are good

    return experiment.run(get_config(fv), fv.out)
