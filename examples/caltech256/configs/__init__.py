"""The Caltech-256 example's configs: `default` (the paper's ROLL run) and `quick`."""
