"""The MNIST example's settings: the paper's 784-300x4-10 ReLU network and its training
(SGD, learning rate 0.01, Nesterov momentum 0.5, batch 64, 20 epochs; ROLL with lam 2,
gamma 100, C in {0.25, 1}, exact, in the normalised units). Each field is also a flag."""

from __future__ import annotations

import dataclasses
import enum

from examples.common.config_flags import option


class Init(enum.Enum):
    """Initial weights of the dense layers."""

    torch = "torch"  # U(-1/sqrt(fan_in), 1/sqrt(fan_in)) kernels and biases (PyTorch)
    keras = "keras"  # Glorot uniform kernels, zero biases


@dataclasses.dataclass(frozen=True)
class Config:
    """The MNIST example's settings (see the flags' help for each field)."""

    data_dir: str | None = option(
        None, "The data: a Keras-layout mnist.npz, or a folder holding it or the four IDX "
        "files (train-images-idx3-ubyte.gz, ...; another IDX data set of 28 x 28 images "
        "works too). Default: the Keras cache, then a prepared tensorflow-datasets copy.")
    dataset: str | None = option(
        None, "The data set's name in titles and tables; default: the name of the "
        "--data_dir folder (or file), or MNIST without --data_dir.")
    normalize: str = option(
        "train", "The model's input normalisation (x - mean) / std of the [0, 1] pixels: "
        "'mean,std' (the paper: 0.1307,0.3081), 'train' (computed from the training "
        "split) or 'none' (no Normalization layer).")
    epochs: int = option(20, "Training epochs.", lower_bound=1)
    batch_size: int = option(64, "Batch size.", lower_bound=1)
    lr: float = option(0.01, "SGD learning rate.", above=0.0)
    momentum: float = option(0.5, "Nesterov momentum.", lower_bound=0.0, upper_bound=1.0)
    init: Init = option(Init.torch, "Initial weights: 'torch' draws kernels and biases from "
                        "U(-1/sqrt(fan_in), 1/sqrt(fan_in)), PyTorch's nn.Linear default used "
                        "by the paper's released code; 'keras': Glorot uniform kernels, zero "
                        "biases.")
    depth: int = option(4, "Hidden layers.", lower_bound=1)
    width: int = option(300, "Units per hidden layer.", lower_bound=1)
    val_size: int = option(5000, "Validation images held out of the training images.",
                           lower_bound=1)
    train_size: int = option(0, "Use only the first N training images (0: all).",
                             lower_bound=0)
    test_size: int = option(0, "Use only the first N test images (0: all).", lower_bound=0)
    vanilla: bool = option(True, "Train the vanilla model (the reference row).")
    roll: bool = option(True, "Train the ROLL models of --lam x --C x --gamma.")
    lam: tuple[float, ...] = option((2.0,), "ROLL weights lambda.", lower_bound=0.0)
    C: tuple[float, ...] = option((0.25, 1.0), "ROLL hinge weights C.", lower_bound=0.0)
    gamma: tuple[float, ...] = option((100.0,), "ROLL percentages of neurons kept.",
                                      above=0.0, upper_bound=100.0)
    samples: int | None = option(None, "Sampled ROLL (Eq. 10) with this many input axes "
                                 "per example; unset: exact ROLL (Eq. 9).", lower_bound=1)
    wrt: str = option("normalize", "Take ROLL's gradients with respect to the output of this "
                      "layer of the model (its Normalization: the paper's normalised units); "
                      "empty: with respect to the [0, 1] pixels.")
    search: bool = option(
        False, "Instead of the --lam grid, find each Table 1 row's lam by bisection on "
        "validation accuracy (the largest lam at vanilla's accuracy, and at 1 % less), "
        "starting from the first --lam, at each --C and --gamma: for data sets the paper's "
        "lam does not suit.")
    search_steps: int = option(4, "Trainings per Table 1 row and (C, gamma) in --search.",
                               lower_bound=1)
    sweep: bool = option(False, "Also train the one-at-a-time grid --sweep_lam, --sweep_C, "
                         "--sweep_gamma around --sweep_base and draw Figure 2.")
    sweep_lam: tuple[float, ...] = option((0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
                                          "lambda values of the sweep.", lower_bound=0.0)
    sweep_C: tuple[float, ...] = option((0.25, 0.5, 1.0, 2.0, 4.0), "C values of the sweep.",
                                        lower_bound=0.0)
    sweep_gamma: tuple[float, ...] = option((25.0, 50.0, 75.0, 100.0),
                                            "gamma values of the sweep.", above=0.0,
                                            upper_bound=100.0)
    sweep_base: tuple[float, ...] = option((2.0, 1.0, 100.0), "lambda,C,gamma held fixed "
                                           "while the sweep varies one of them.",
                                           lower_bound=0.0)
    faithfulness: int = option(
        100, "Test images whose exact integrated gradients are scored for faithfulness "
        "(Deletion, Insertion, MuFidelity) for each model of Table 1, with a figure of the "
        "curves; 0: none.", lower_bound=0)
    timing: bool = option(False, "Only time one train step of each method (Table 2) on "
                          "random data.")
    timing_repeats: int = option(20, "Interleaved repetitions of the fast steps in --timing "
                                 "(the exact steps run a quarter as many).", lower_bound=1)
    resume: bool = option(True, "Reuse the results in --out/runs of a model trained with "
                          "the same settings.")
    reevaluate: bool = option(False, "With --resume, certify the stored models again (from "
                              "their weights) instead of reusing their numbers.")
    seed: int = option(0, "Random seed (data split, initialisation, sampling, batch order).",
                       lower_bound=0)


# The fields a trained model depends on: a stored result is reused only if they match
# (and the data's fingerprint: the data, wherever --data_dir finds it).
TRAINING_FIELDS = ("normalize", "epochs", "batch_size", "lr",
                   "momentum", "init", "depth", "width", "val_size", "train_size", "test_size",
                   "wrt", "seed")


def get_config() -> Config:
    """The paper's settings."""
    return Config()


def parse_normalize(text: str):
    """`--normalize` as `(mean, std)`, "train" or None ("none"); ValueError otherwise.

    Example:

    ```python
    parse_normalize("0.1307,0.3081"), parse_normalize("none")   # (0.1307, 0.3081), None
    ```
    """
    word = text.strip().lower()
    if word in ("train", "none"):
        return None if word == "none" else "train"
    try:
        mean, std = (float(v) for v in word.split(","))
    except ValueError:
        raise ValueError(f"--normalize takes 'mean,std' (two numbers), 'train' or 'none', "
                         f"got {text!r}") from None
    if not std > 0:
        raise ValueError(f"--normalize={text}: the std must be > 0")
    return mean, std


def layer_names(config: Config) -> list[str]:
    """The layer names of the network `config` builds, as `keras_roll.models.fc` names
    them (for checking `--wrt` before TensorFlow is loaded).

    Example:

    ```python
    layer_names(dataclasses.replace(get_config(), depth=1))
    # ['pixels', 'normalize', 'dense_1', 'relu_1', 'predictions']
    ```
    """
    names = ["pixels"] + (["normalize"] if parse_normalize(config.normalize) is not None else [])
    for i in range(1, config.depth + 1):
        names += [f"dense_{i}", f"relu_{i}"]
    return names + ["predictions"]
