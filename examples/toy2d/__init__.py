"""Toy 2-D task: Figure 1 of Lee, Alvarez-Melis & Jaakkola (ICLR 2019).

Trains the paper's toy network (Appendix: a 4 x 100 fully connected ReLU network with
one sigmoid output, sigmoid cross entropy, Adam) on a 2-D binary task three ways:

* vanilla: cross entropy only;
* the distance regularizer (the paper's hinge on the l2 margin itself,
  `distance.DistanceRegularizer`);
* relaxed ROLL (Eq. 9, exact, gamma = 100) through `keras_roll.wrap`;

with C = 5 and lam = 1, and draws the Figure 1 panels with
`keras_roll.plots.plot_linear_regions`: the linear regions, the prediction heat map
and the certified l2 margin around every training point.

Writes to `--out`: `table.md` / `.json` (accuracy, #CLR bounds and l2 margin
percentiles on the training points, ratios to vanilla), `figure1_<model>.png`.

    python -m examples.toy2d --flagfile=examples/configs/toy2d.flags
    python -m examples.toy2d --flagfile=examples/configs/toy2d.flags --quick

Modules: `main` (flags, entry point), `train` (`train_and_evaluate(config, workdir)`),
`distance` (the distance regularizer), `configs/` (`default`, `quick`).
"""
