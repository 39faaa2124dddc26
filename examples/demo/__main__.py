"""`python -m examples.demo` (or `make demo`)"""

from examples.common import app
from examples.demo import main

if __name__ == "__main__":
    app.run(main.define_flags, main.main)
