"""Caltech-256: train the paper's ResNet-18 with the sampled ROLL loss, then evaluate it.

The experiment of Lee, Alvarez-Melis & Jaakkola (ICLR 2019, Sec. 5 and Appendix I):
ResNet-18 with average pooling after the stem (`keras_roll.models.resnet18`) on
299 x 299 Caltech-256 images, per class 5 validation and 15 test images, SGD with
Nesterov momentum 0.5, batch 32, learning rate 0.005 and 0.0005 after epoch 10, 20
epochs, the best validation-loss epoch kept; ROLL with lam = 0.001, C = 8,
gamma = 100 and 120 sampled axes per colour channel (360 directions per image).

    python -m examples.caltech256 --flagfile=examples/configs/caltech256_roll.flags \\
        --data_dir=~/data --out=runs/caltech_roll [--strategy=mirrored] [--mixed_precision]
    python -m examples.caltech256 --flagfile=examples/configs/caltech256_roll.flags --quick

It writes under `--out`:

* `run_config.json`: the flags that define the training run (a rerun must match);
* `checkpoint/`: the training state (weights, optimizer, ROLL sampling counter, epoch,
  step, best validation loss, history) every `--save_freq` steps and every epoch: kill
  the run and rerun the same command, it continues from there, exactly;
* `best.weights.h5`: the plain model at the epoch of lowest validation loss;
* `tensorboard/`: per epoch, loss, roll_loss, accuracy, top-5 accuracy, l2 margin
  percentiles (`keras_roll.MarginMonitor` on `--monitor_images` validation images), step
  time and learning rate (`keras.callbacks.TensorBoard`; `tensorboard --logdir
  <out>/tensorboard`);
* `results.md`, `results.json`: P@1 and P@5 on the test split, the expected and
  worst-case l1 gradient distortion at eps = 8/256 (P25 / P50 / P75 / P100) on
  `--num_eval` test images, how many worst-case points change the prediction;
* `figure4.png`: the Figure 4-style grid (image, gradient, worst-case gradient and
  integrated gradients at the examples of P50 and P75 worst-case distortion; with
  `--compare_with=<another run's --out>` both models side by side).

`--quick` runs the whole pipeline in minutes on 2 CPU cores: a generated image tree
(`keras_roll.data.make_synthetic_caltech256`, 4 classes) when no `--data_dir` is given,
32 x 32 inputs, 2 epochs, 2 axes per channel and small distortion searches, for a
vanilla and a ROLL model (`--with_vanilla`: `<out>/vanilla`, `<out>/roll` and
`comparison.md`, their test accuracy and gradient distortion side by side).

Modules: `main` (flags, checks, entry point), `train` (`train_and_evaluate(config,
workdir)`, strategies), `pair` (`--with_vanilla`), `input_pipeline` (split, epoch
batches), `models` (ResNet-18, a tiny test network), `callbacks`, `checkpoint`
(resumable training), `evaluate` (P@k, distortion, Figure 4), `report` (results.md),
`configs/` (`default`, `quick`).
"""
