"""`python -m examples.toy2d --flagfile=examples/configs/toy2d.flags [--quick]`"""

from examples.common import app
from examples.toy2d import main

if __name__ == "__main__":
    app.run(main.define_flags, main.main)
