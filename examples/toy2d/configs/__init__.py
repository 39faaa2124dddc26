"""The toy example's configs: `default` (the paper's settings) and `quick`."""
