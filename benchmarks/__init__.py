"""Benchmarks of keras_roll, each run as `python -m benchmarks.<name>` (benchmarks/README.md).

Importing the package quiets TensorFlow's C++ log (`TF_CPP_MIN_LOG_LEVEL=2`, unless
set) before any benchmark imports TensorFlow, so that a benchmark's output is its table.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
