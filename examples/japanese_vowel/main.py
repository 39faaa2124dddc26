"""The Japanese Vowels example's entry point: its flags (one per field of
`configs/default.py`, plus `--quick` and `--out`), their checks, and `main`.

    python -m examples.japanese_vowel --flagfile=examples/configs/japanese_vowel_roll.flags
"""

from __future__ import annotations

from absl import flags

from examples.common import app
from examples.common.config_flags import define_example_flags, example_config
from examples.japanese_vowel.configs import default, quick


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the Japanese Vowels example's flags and their validators on `fv`."""
    define_example_flags(
        fv, default.get_config, out="runs/japanese_vowel",
        data_dir="a folder with JapaneseVowels_TRAIN.ts / _TEST.ts or ae.train / ae.test, "
                 "or leave it unset")
    flags.register_multi_flags_validator(
        ["vanilla", "roll"], lambda f: any(f.values()),
        message="Nothing to train: pass --vanilla and/or --roll", flag_values=fv)


def get_config(fv: flags.FlagValues) -> default.Config:
    """The run's config: the quick one under `--quick`, overridden by the flags."""
    return example_config(fv, default.get_config, quick.get_config)


def main(fv: flags.FlagValues) -> app.ExampleResult:
    """Runs the example with the parsed flags `fv`.

    Example:

    ```python
    result = main(parse_flags(define_flags, ["--quick", "--out=/tmp/jv"]))
    ```
    """
    from examples.japanese_vowel import train  # TensorFlow: only once the flags are good

    return train.train_and_evaluate(
        get_config(fv), fv.out, logs=app.LogOptions(warn_last_epoch=fv["epochs"].present))
