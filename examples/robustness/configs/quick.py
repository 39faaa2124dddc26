"""`--quick`: a few minutes on 2 CPU cores: 5,000 training and 1,000 validation images,
a 100-wide network for 6 epochs at a larger learning rate, sampled ROLL (16 axes,
lam 0.5), and the bounds of 20 test images."""

import dataclasses

from examples.robustness.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(default.get_config(), train_size=5000, val_size=1000,
                               width=100, epochs=6, lr=0.05, momentum=0.9, samples=16,
                               lam=0.5, test_size=20)
