"""`python -m examples.japanese_vowel --flagfile=examples/configs/japanese_vowel_roll.flags`"""

from examples.common import app
from examples.japanese_vowel import main

if __name__ == "__main__":
    app.run(main.define_flags, main.main)
