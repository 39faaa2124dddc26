"""`--quick`: a scoRNN of 64 units for 30 epochs and ROLL with lam 0.5 (a few minutes on
2 CPU cores; ROLL's regions are already visibly larger)."""

import dataclasses

from examples.japanese_vowel.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(default.get_config(), units=64, epochs=30, lam=(0.5,))
