"""The entry point of every example: flags, one-line errors, and output that progress
bars do not run into.

* `define_run_flags`: `--quick` and `--out` (the work folder), which every example has;
* `run`: the `__main__` of an example: defines its flags, runs `absl.app.run`, and
  turns a `UsageError` found before the work starts into one line
  (`FATAL Usage error: ...`), as absl does for a bad flag value;
* `log`: prints a line without breaking the progress bar on the terminal
  (`tqdm.write`);
* `ExampleResult`: what `train_and_evaluate(config, workdir)` returns;
* `LogOptions`: how much an example prints (the demo: one line per model);
* `output_dir`, `start_tensorflow` (quiet, seeded), `deterministic` (op determinism).

Example:

```python
# examples/toy2d/__main__.py
from examples.common import app
from examples.toy2d import main

app.run(main.define_flags, main.main)
```
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

from absl import app, flags

__all__ = ["ExampleResult", "LogOptions", "UsageError", "define_run_flags", "deterministic",
           "log", "output_dir", "run", "start_tensorflow"]


class ExampleResult(NamedTuple):
    """What an example's `train_and_evaluate(config, workdir)` returns.

    Attributes:
        tables: `{name: Markdown}` of the tables it wrote (`<out>/<name>.md`).
        rows: the row (dict, as stored in JSON) of every model it trained or reused.
        figures: the PNG paths it wrote.
        summary: the example's summary (as in `<out>/summary.json`).
        out: the work folder.
    """

    tables: dict
    rows: list
    figures: list
    summary: dict
    out: Path


class LogOptions(NamedTuple):
    """How much an example prints.

    Attributes:
        quiet: one line per model and the caller's own summary: no per-epoch Keras
            logs, progress bars or tables (they are still written to files).
        warn_last_epoch: warn when a model's best validation loss is at its last epoch
            ("try more --epochs"); off where the user did not choose the epochs.

    Example:

    ```python
    result = train.train_and_evaluate(config, out, logs=LogOptions(quiet=True))
    ```
    """

    quiet: bool = False
    warn_last_epoch: bool = True

    def log(self, *parts) -> None:
        """`log(*parts)` unless quiet."""
        if not self.quiet:
            log(*parts)

    @property
    def fit_verbose(self):
        """Keras `fit`'s verbosity: 0 when quiet, else None (`fit_best`'s default)."""
        return 0 if self.quiet else None

    @property
    def certify_verbose(self):
        """keras_roll's `verbose=`: no progress bar when quiet, else "auto"."""
        return False if self.quiet else "auto"


class UsageError(ValueError):
    """A bad flag, input or output folder found before the work starts; the message
    says the way forward, and the entry point prints it as one line."""


def define_run_flags(fv: flags.FlagValues, out: str) -> None:
    """Defines `--quick` and `--out` (the work folder, default `out`) on `fv`.

    Example:

    ```python
    define_run_flags(fv, out="runs/mnist")
    ```
    """
    flags.DEFINE_bool("quick", False, "Start from the example's quick config "
                      "(configs/quick.py: small data, few epochs, a few minutes on 2 CPU "
                      "cores) instead of the paper's; the flags that are set still win.",
                      flag_values=fv)
    flags.DEFINE_string("out", out, "Work folder: everything the example writes (tables as "
                        "Markdown and JSON, PNG figures, weights, checkpoints).",
                        flag_values=fv)


def run(define_flags, main) -> None:
    """Defines the flags on `flags.FLAGS` and runs `main(flags.FLAGS)` under absl.

    Once the flags are parsed, TensorFlow's op determinism is turned on
    (`deterministic`), so the run repeats its numbers for the same `--seed`.

    A bad flag value stops absl's parser with `FATAL Flags parsing error: ...`; a
    `UsageError` raised by `main` before the work starts (a missing data set, a
    checkpoint of other settings) ends the run the same way, with one line and no
    traceback. Stray positional arguments are refused.

    Example:

    ```python
    if __name__ == "__main__":
        run(main.define_flags, main.main)
    ```
    """

    def entry(argv):
        if len(argv) > 1:
            raise app.UsageError(f"Unexpected arguments: {argv[1:]}; every setting is a "
                                 f"--flag (see --helpshort).")
        try:
            deterministic()  # the flags are good: TensorFlow may load now
            main(flags.FLAGS)
        except UsageError as e:
            sys.stdout.flush()
            sys.stderr.write(f"FATAL Usage error: {e}\n")
            sys.exit(1)
        sys.stdout.flush()

    before = set(flags.FLAGS)
    define_flags(flags.FLAGS)
    for name in sorted(set(flags.FLAGS) - before):  # what --helpshort lists
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
    app.run(entry)


def log(*parts) -> None:
    """Prints a line (stdout) above any active progress bar instead of into it.

    Example:

    ```python
    log(f"== {tag}: {n} training images")
    ```
    """
    from tqdm import tqdm

    tqdm.write(" ".join(str(p) for p in parts), file=sys.stdout)
    sys.stdout.flush()


def output_dir(path) -> Path:
    """Creates (if needed) and returns the folder `path` (`~` expanded)."""
    out = Path(os.path.expanduser(os.fspath(path)))
    out.mkdir(parents=True, exist_ok=True)
    return out


def deterministic() -> None:
    """Turns on TensorFlow's op determinism (`tf.config.experimental.
    enable_op_determinism()`): with the seeds `start_tensorflow` sets, the same run on
    the same machine and versions gives the same numbers. It holds for the whole
    process, and TensorFlow offers no public way back, so the command line (`run`)
    turns it on and `train_and_evaluate` in Python leaves it to the caller.

    Example:

    ```python
    app.deterministic()
    result = train.train_and_evaluate(quick.get_config(), "/tmp/mnist")
    ```
    """
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()


def start_tensorflow(seed: int | None = None) -> None:
    """Prepares TensorFlow for an example's run: TensorFlow's Python warnings are
    silenced (retracing notes when certifying arrays of several sizes, for example;
    errors still show) and, with `seed`, Python's, NumPy's and TensorFlow's generators
    are seeded (`keras.utils.set_random_seed`). Op determinism: `deterministic`.

    Example:

    ```python
    start_tensorflow(config.seed)
    ```
    """
    import keras
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    if seed is not None:
        keras.utils.set_random_seed(seed)
