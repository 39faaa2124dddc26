"""Certified robustness radii of the paper's MNIST networks, vanilla and ROLL
(`keras_roll.robust_radius`): `python -m examples.robustness [--quick]`."""
