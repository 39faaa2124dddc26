"""`--quick`: minutes on 2 CPU cores that show ROLL at work: 5,000 training images,
1,000 validation and 500 test images, a 100-wide network (Glorot initialisation) for
20 epochs of SGD at learning rate 0.02 with Nesterov momentum 0.9, and sampled ROLL (16
axes, Eq. 10) with lam 1 at C 1.

Measured over seeds 0, 1, 2 (`--seed`; op determinism on, so a seed gives the same
table run after run on one machine): ROLL's median l2 margin on the test images is
5.4-6.8 x vanilla's (5.43, 6.76, 5.99). It keeps vanilla's validation accuracy (whole
percent) for seeds 1 and 2 (92 % against 91 %, 93 % against 93 %); for seed 0 it is one
point below (94 % against 95 %), so Table 1's "same accuracy" row is empty there and
the 5.43 x is its "1 % less accuracy" row. Test accuracy: ROLL 90.8-93.6 %, vanilla
92.2-94.8 %. With 1,000 validation images a point is 10 images: which row a seed fills
is noise at this size."""

import dataclasses

from examples.mnist.configs import default


def get_config() -> default.Config:
    return dataclasses.replace(
        default.get_config(), train_size=5000, val_size=1000, test_size=500, width=100,
        epochs=20, lr=0.02, momentum=0.9, init=default.Init.keras, samples=16,
        lam=(1.0,), C=(1.0,), timing_repeats=3, faithfulness=50)
