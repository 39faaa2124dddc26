"""What the examples share, one module per job.

* `app`: the entry point (`run`, `define_run_flags`, `UsageError`, `log`,
  `LogOptions`, `ExampleResult`);
* `config_flags`: absl flags defined from an example's config dataclass, and the
  config of a run from the flags (`--quick` as a config);
* `training`: `fit_best` and `BestValLoss` (the best validation-loss epoch, as in the
  paper), the last-epoch warning;
* `margin_stats`: accuracy, #CLR bounds, margin percentiles, Spearman, guarded radii;
* `runs`: `ModelSpec` (what to train) and the stored result of each trained model
  (the data by fingerprint; `gather_stored` for the tables);
* `selection`: the paper's model selection and the tables built on it;
* `search`: `--search`, each table row's lam by bisection on validation accuracy;
* `tables`: Markdown / JSON tables and their cell formats.
"""
