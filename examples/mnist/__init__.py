"""MNIST: Table 1, Figure 2 and Table 2 of Lee, Alvarez-Melis & Jaakkola (ICLR 2019).

Trains the paper's 784-300x4-10 ReLU network (`keras_roll.models.fc`, normalisation
inside the model) on the paper's split (55,000 / 5,000 / 10,000, seeded), vanilla
and with ROLL, with the paper's settings: SGD, learning rate 0.01, Nesterov momentum
0.5, batch 64, 20 epochs, the weights of the best validation-loss epoch; ROLL with
lam 2, gamma 100, C in {0.25, 1}, exact by default (`--samples=k` for Eq. 10).
ROLL's gradients are taken with respect to the normalised input (`--wrt=normalize`),
the units of the paper's hyperparameters; margins are in [0, 1] pixel units (the
paper's sigma x margin).

Any data set in the same files works (`--data_dir` at a folder of the four IDX files
of 28 x 28 images, Fashion-MNIST for example): its name comes from `--dataset` (or
the folder's name), its normalisation from `--normalize` (or its training split), its
number of classes from its labels.

Writes to `--out`: `table1.md` / `.json` (ACC, #CLR bounds, P25 / P50 / P75 / P100
of the l1 and l2 margins over the test points, for vanilla and for ROLL selected as
the paper does: the largest validation P50 l2 margin at the same and at 1 % lower
validation accuracy, in whole percent; a row says so when no ROLL model qualifies),
`runs.md` / `.json` (every trained model's full row), `summary.json`, `runs/<tag>.*`
(per-model results, margins and weights; reused by a rerun with the same settings
unless `--noresume`; the data is named by a fingerprint of its arrays, not its path);
with `--sweep`, Figure 2 as `figure2_<hyperparameter>.png`; with `--timing`, Table 2
as `table2.md` / `.json`. The tables gather every model stored in `--out/runs` with
the same settings, so models trained by separate commands share one table.

`--search` replaces the `--lam` grid: it finds each Table 1 row's lam by bisection on
validation accuracy (the largest lam at vanilla's accuracy, and at 1 % less; starting
from the first `--lam`, `--search_steps` trainings per row), for data sets the paper's
lam does not suit.

    python -m examples.mnist --flagfile=examples/configs/mnist_roll.flags \\
        --data_dir=<folder with mnist.npz or the IDX files>
    python -m examples.mnist --flagfile=examples/configs/mnist_roll.flags --sweep
    python -m examples.mnist --flagfile=examples/configs/mnist_roll.flags --quick
    python -m examples.mnist --flagfile=examples/configs/mnist_roll.flags --search --C=1
    python -m examples.mnist --timing

Modules: `main` (flags, checks, entry point), `train` (`train_and_evaluate(config,
workdir)`), `input_pipeline` (data, name, normalisation), `timing` (Table 2),
`configs/` (`default`, `quick`).
"""
