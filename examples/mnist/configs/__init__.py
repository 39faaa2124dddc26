"""The MNIST example's configs: `default` (the paper's settings) and `quick`."""
