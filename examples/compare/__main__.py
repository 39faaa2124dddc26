"""`python -m examples.compare --flagfile=examples/configs/compare_mnist.flags [--quick]`"""

from examples.common import app
from examples.compare import main

if __name__ == "__main__":
    app.run(main.define_flags, main.main)
