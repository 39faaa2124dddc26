"""`python -m examples.caltech256 --flagfile=examples/configs/caltech256_roll.flags`"""

from examples.caltech256 import main
from examples.common import app

if __name__ == "__main__":
    app.run(main.define_flags, main.main)
