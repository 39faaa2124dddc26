"""Toy 2-D task: Figure 1 of Lee, Alvarez-Melis & Jaakkola (ICLR 2019).

Trains the paper's toy network (Appendix: a 4 x 100 fully connected ReLU network with
one sigmoid output, sigmoid cross entropy, Adam) on a 2-D binary task three ways:

* vanilla: cross entropy only;
* the distance regularizer (the paper's hinge on the l2 margin itself):
  `lam * mean_x max(0, 1 - eps_2(x) / C)`, with `eps_2(x) = min_j |z_j| /
  ||grad_x z_j||_2` the certified l2 margin (Prop. 6), differentiated with the
  activation pattern held fixed (only the binding neuron gets a gradient);
* relaxed ROLL (Eq. 9, exact, gamma = 100) through `keras_roll.wrap`;

with C = 5 and lam = 1, and draws the Figure 1 panels with
`keras_roll.plots.plot_linear_regions`: the linear regions, the prediction heat map
and the certified l2 margin around every training point.

Writes to `--out`: `table.md` / `.json` (accuracy, #CLR bounds and l2 margin
percentiles on the training points, ratios to vanilla), `figure1_<model>.png`.

    python -m examples.toy2d --flagfile=examples/configs/toy2d.flags
    python -m examples.toy2d --flagfile=examples/configs/toy2d.flags --quick
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import flags  # noqa: E402

import keras_roll  # noqa: E402
from examples import common  # noqa: E402
from keras_roll.certification.region_map import region_map  # noqa: E402
from keras_roll.data import make_toy2d  # noqa: E402

QUICK = {"n": 100, "epochs": 300}  # ~1 minute per model on 2 CPU cores
MODELS = ("vanilla", "distance", "roll")
TITLES = {"vanilla": "Vanilla loss", "distance": "Distance regularizer (hinge on the l2 margin)",
          "roll": "Relaxed regularizer (ROLL)"}
SHORT = {"vanilla": "Vanilla", "distance": "Distance regularizer", "roll": "Relaxed ROLL"}


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the toy example's flags on `fv`."""
    common.define_common_flags(fv, out="runs/toy2d",
                               data_help="Unused: the toy data are generated.")
    flags.DEFINE_enum("kind", "circles", ["circles", "spirals", "xor"], "The 2-D task "
                      "(keras_roll.data.make_toy2d).", flag_values=fv)
    flags.DEFINE_integer("n", 200, "Training points.", flag_values=fv)
    flags.DEFINE_integer("depth", 4, "Hidden layers.", flag_values=fv)
    flags.DEFINE_integer("width", 100, "Units per hidden layer.", flag_values=fv)
    flags.DEFINE_integer("epochs", 300, "Training epochs.", flag_values=fv)
    flags.DEFINE_integer("batch_size", 50, "Batch size.", flag_values=fv)
    flags.DEFINE_float("lr", 5e-3, "Adam learning rate.", flag_values=fv)
    flags.DEFINE_float("lam", 1.0, "Weight of both regularizers.", flag_values=fv)
    flags.DEFINE_float("C", 5.0, "C of both regularizers.", flag_values=fv)
    flags.DEFINE_list("models", list(MODELS), f"Which of {MODELS} to train.", flag_values=fv)
    flags.DEFINE_integer("resolution", 300, "Grid points per axis of the region plots.",
                         flag_values=fv)


# ----------------------------------------------------------------------------- the
# distance regularizer


def l2_margin(lin: keras_roll.Linearized, x) -> tf.Tensor:
    """The certified l2 margin `min_j |z_j - b_j| / ||grad_x z_j||_2`, `[B]`, differentiable
    with respect to the weights (the activation pattern of `x` held fixed).

    Neurons with a zero gradient never bind (their ratio is inf).

    Example:

    ```python
    eps = l2_margin(keras_roll.linearize(model), x)   # equals certify(model, x).margins[2]
    ```
    """
    x = lin.check_input(x)
    fwd = lin.primal(x)
    sq = keras_roll.roll.loss.neuron_grad_sq(lin, x, forward=fwd)  # exact, [B, N]
    n = fwd.neurons
    dist = tf.minimum(n.below, n.above)
    usable = n.valid & (sq > 0)
    safe_sq = tf.where(usable, sq, tf.ones_like(sq))  # no 0 / 0 in the gradient
    inf = tf.fill(tf.shape(sq), tf.constant(np.inf, sq.dtype))
    ratio = tf.where(usable, dist / tf.sqrt(safe_sq), inf)
    return tf.reduce_min(ratio, axis=1)


def distance_loss(lin: keras_roll.Linearized, x, C: float) -> tf.Tensor:
    """The distance regularizer `max(0, 1 - eps_2(x) / C)` of every example, `[B]`.

    Example:

    ```python
    reg = distance_loss(keras_roll.linearize(model), x, C=5.0)
    ```
    """
    if not C > 0:
        raise ValueError(f"C must be > 0 (the margin the hinge asks for), got C={C!r}.")
    eps = l2_margin(lin, x)
    return tf.nn.relu(1.0 - eps / tf.cast(C, eps.dtype))


class DistanceRegularizer(keras.layers.Layer):
    """Adds `lam * mean(distance_loss(model, x, C))` to the loss of `model(x)` in training
    and in evaluation (so `val_loss` is the training objective, as for ROLL).

    It holds `model` (sharing its weights) and returns `model(x)` unchanged.

    Example:

    ```python
    inp = keras.Input((2,))
    wrapped = keras.Model(inp, DistanceRegularizer(model, lam=1.0, C=5.0)(inp))
    ```
    """

    def __init__(self, model: keras.Model, lam: float = 1.0, C: float = 5.0, **kwargs):
        super().__init__(**kwargs)
        if not lam >= 0:
            raise ValueError(f"lam must be >= 0, got lam={lam!r}.")
        self.inner_model = model
        self.lam, self.C = float(lam), float(C)
        self.lin = keras_roll.linearize(model)
        self.tracker = keras.metrics.Mean(name="distance_loss")

    @property
    def metrics(self):
        return [self.tracker]

    @tf.autograph.experimental.do_not_convert
    def call(self, inputs, training=None):
        reg = tf.reduce_mean(distance_loss(self.lin, inputs, self.C))
        self.add_loss(self.lam * reg)
        self.tracker.update_state(reg)
        return self.inner_model(inputs, training=training)

    def compute_output_spec(self, inputs, training=None):
        return self.inner_model.compute_output_spec(inputs)


# ----------------------------------------------------------------------------- run


def build_model(fv) -> keras.Model:
    """The paper's toy network: 2 -> 100 x 4 ReLU -> 1 sigmoid."""
    return keras_roll.models.fc(input_shape=(2,), depth=fv.depth, width=fv.width, classes=1,
                                normalize=None, classifier_activation="sigmoid", name="toy")


def train_one(name: str, data, fv, out: Path):
    """Trains one of vanilla / distance / roll; returns (model, row)."""
    (x, y), (xv, yv) = data
    keras.utils.set_random_seed(fv.seed)
    model = build_model(fv)
    if name == "vanilla":
        fit_model = model
    elif name == "distance":
        inp = keras.Input((2,))
        fit_model = keras.Model(
            inp, DistanceRegularizer(model, lam=fv.lam, C=fv.C, name="distance")(inp))
    else:
        fit_model = keras_roll.wrap(model, lam=fv.lam, C=fv.C, gamma=100.0)
    fit_model.compile(optimizer=keras.optimizers.Adam(fv.lr), loss="binary_crossentropy",
                      metrics=["accuracy"])
    best, history, seconds = common.fit_best(
        model, fit_model, (x, y.astype("float32")), (xv, yv.astype("float32")), fv.epochs,
        fv.batch_size, verbose=0, progress=name)
    row, _ = common.margin_stats(model, x, y)
    val, _ = common.margin_stats(model, xv, yv, prefix="val_", regions=False)
    row.update(val)
    row.update({"tag": name, "model": TITLES[name], "best_epoch": best.epoch,
                "val_loss": best.best, "train_time_s": seconds})
    model.save_weights(out / f"{name}.weights.h5")
    return model, row


def run(fv) -> dict:
    """Runs the example with the parsed flags `fv`; returns what it wrote.

    Example:

    ```python
    fv = common.parse_flags(define_flags, ["--quick", "--out=/tmp/toy"])
    result = run(fv)     # {"table": markdown, "rows": [...], "figures": [...], "out": ...}
    ```
    """
    common.quiet_tensorflow()
    out = common.output_dir(fv.out)
    common.apply_quick(fv, QUICK)
    names = list(fv.models)
    bad = [m for m in names if m not in MODELS]
    if bad or not names:
        raise ValueError(f"--models takes names from {MODELS}, got {fv.models!r}.")
    data = (make_toy2d(n=fv.n, seed=fv.seed, kind=fv.kind),
            make_toy2d(n=fv.n, seed=fv.seed + 1, kind=fv.kind))
    x, y = data[0]
    rows, figures = [], []
    for name in names:
        print(f"== {name}: {fv.depth} x {fv.width} ReLU, {fv.n} points, {fv.epochs} epochs",
              flush=True)
        model, row = train_one(name, data, fv, out)
        rows.append(row)
        path = out / f"figure1_{name}.png"
        grid = region_map(model, bounds=((-1.2, 1.2), (-1.2, 1.2)), resolution=fv.resolution)
        cert = keras_roll.certify(common.exact_twin(model), x, norms=(2,), rigor="float32")
        keras_roll.plots.plot_linear_regions(
            grid, x, y, cert, path=path,
            title=f"{SHORT[name]}: accuracy {100 * row['acc']:.0f} %, median l2 margin "
                  f"{row['l2_p50']:.2g}")
        figures.append(path)
    vanilla = next((r for r in rows if r["tag"] == "vanilla"), None)
    for r in rows:
        r["ratio"] = common.ratio(r["l2_p50"], vanilla["l2_p50"]) if vanilla else None
    columns = [("model", "Model", common.fmt), ("best_epoch", "epoch", common.fmt),
               ("acc", "train ACC", common.percent), ("val_acc", "val ACC", common.percent),
               ("clr", "#CLR", common.fmt)]
    columns += [(f"l2_p{q}", f"l2 P{q}", common.fmt) for q in common.PERCENTILES]
    columns += [("ratio", "P50 l2 / vanilla", common.fmt)]
    md = common.write_table(
        out, "table", f"Toy 2-D task ({fv.kind}): {fv.depth} x {fv.width} ReLU network",
        columns, rows,
        notes=[f"#CLR and l2 margins over the {fv.n} training points (the circles of "
               f"Figure 1); lam={fv.lam:g}, C={fv.C:g}; each model at its best "
               f"validation-loss epoch ({fv.n} validation points)."])
    print("\n" + md)
    for path in figures:
        print(f"Figure 1: {path}")
    return {"table": md, "rows": rows, "figures": figures, "out": out}


if __name__ == "__main__":
    common.run_app(define_flags, run)
