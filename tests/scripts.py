"""Running a test's helper script (`tests/_*.py`) in a Python process of its own.

The distributed tests configure TensorFlow's logical devices, which a process can do
only once, before it runs anything; so their work runs in a child process, on the CPU,
with this repository on its path.

Example:

```python
run_script("_roll_distribute.py", tmp_path / "report.json", timeout=600)
```
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script: str, *args, timeout: float) -> subprocess.CompletedProcess:
    """Runs `tests/<script>` with `args` (as strings) from the repository's root, on the
    CPU and with TensorFlow's C++ log quieted; fails the test, with the end of the
    script's stderr, when it exits with an error."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", script),
                           *map(str, args)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc
