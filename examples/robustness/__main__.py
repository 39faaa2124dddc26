"""`python -m examples.robustness --data_dir=<folder with mnist.npz> [--quick]`"""

from examples.common import app
from examples.robustness import main

if __name__ == "__main__":
    app.run(main.define_flags, main.main)
