"""Runnable keras_roll examples, one package each, in the manner of flax's examples:
`main.py` (the absl flags and entry point), `train.py` (`train_and_evaluate(config,
workdir)`), `configs/` (`default.py`: the paper's settings, one flag per field;
`quick.py`: the `--quick` config). `examples/configs/*.flags` hold the paper's runs:

    python -m examples.<name> --flagfile=examples/configs/<name>_roll.flags [--quick]

`common/` holds what they share.
"""

import os

# TensorFlow's C++ logs (type inference notes, CPU features) stay quiet in the examples.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
