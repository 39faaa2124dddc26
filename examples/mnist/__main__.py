"""`python -m examples.mnist --flagfile=examples/configs/mnist_roll.flags [--quick]`"""

from examples.common import app
from examples.mnist import main

if __name__ == "__main__":
    app.run(main.define_flags, main.main)
