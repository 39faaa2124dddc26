"""`--quick`: the whole pipeline in a few minutes on 2 CPU cores: a generated image tree
(4 classes, when no --data_dir is given), 32 x 32 inputs, 2 epochs (the learning rate
decays after the first), 2 sampled axes per channel, small distortion searches."""

import dataclasses

from examples.caltech256.configs import default

# The generated tree of --quick without --data_dir.
CLASSES, IMAGES_PER_CLASS = 4, 40


def get_config() -> default.Config:
    return dataclasses.replace(
        default.get_config(), image_size=32, epochs=2, lr_decay_epochs=(1.0,), samples=2,
        val_per_class=2, test_per_class=3, num_eval=4, distortion_samples=64, population=32,
        generations=3, monitor_images=2, save_freq=2, ig_steps=16,
        with_vanilla=True)
