"""The robustness example's configs: `default` (the paper's network) and `quick`."""
