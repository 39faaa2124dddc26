"""The side-by-side example's settings: MNIST, the paper's 784-300x4-10 ReLU network
(or a small CNN), Adam, and for each regularizer the knob tuned on validation accuracy
with the search's first value. Each field is also a flag.

The defaults are sized for about an hour on 2 CPU cores (docs/results.md, "ROLL among
its rivals"): 10,000 training images, 10 epochs, two search steps per operating point,
sampled ROLL (16 axes), MMR's term on 8 examples of each batch, and measurement sets
of 50-1,000 test images. The papers' scale is `--train_size=0 --epochs=20
--search_steps=3 --roll_samples=0 --mmr_examples=0` (and larger measurement sets).
"""

from __future__ import annotations

import dataclasses
import enum

from examples.common.config_flags import option

METHODS = ("vanilla", "roll", "mmr", "input_gradient", "ibp", "crown_ibp")


class Arch(enum.Enum):
    """The network every method trains."""

    mlp = "mlp"  # the paper's 784-width x depth-10 ReLU network
    cnn = "cnn"  # Conv(16, 4x4, stride 2) - Conv(32, 4x4, stride 2) - Dense(100) - Dense(10)


@dataclasses.dataclass(frozen=True)
class Config:
    """The side-by-side example's settings (see the flags' help for each field)."""

    data_dir: str | None = option(
        None, "The data: a Keras-layout mnist.npz, or a folder holding it or the four IDX "
        "files. Default: the Keras cache, then a prepared tensorflow-datasets copy.")
    dataset: str | None = option(None, "The data set's name in titles and tables; default: "
                                 "the name of the --data_dir folder (or file), or MNIST.")
    methods: tuple[str, ...] = option(
        METHODS, "The methods to train, from: " + ", ".join(METHODS) + " (vanilla is always "
        "trained: the others are tuned against it).")
    arch: Arch = option(Arch.mlp, "The network: 'mlp' (depth x width ReLU layers) or 'cnn'.")
    depth: int = option(4, "Hidden layers of the MLP.", lower_bound=1)
    width: int = option(300, "Units per hidden layer of the MLP.", lower_bound=1)
    epochs: int = option(10, "Training epochs (every method; the weights after the last).",
                         lower_bound=1)
    batch_size: int = option(64, "Batch size.", lower_bound=1)
    lr: float = option(1e-3, "Adam's learning rate.", above=0.0)
    val_size: int = option(5000, "Validation images held out of the training images.",
                           lower_bound=1)
    train_size: int = option(10000, "Use only the first N training images (0: all).",
                             lower_bound=0)
    test_size: int = option(0, "Test images for the accuracy (0: all 10,000).", lower_bound=0)
    eval_size: int = option(1000, "Test images certified (region margins, #CLR).",
                            lower_bound=1)
    robust_size: int = option(50, "Test images whose robustness radius is bounded "
                              "(robust_radius, certified accuracy).", lower_bound=1)
    distortion_size: int = option(100, "Test images for the expected gradient distortion.",
                                  lower_bound=1)
    worst_size: int = option(10, "Test images for the worst-case gradient distortion "
                             "(the genetic search is the dearest measurement).", lower_bound=0)
    distortion_eps: float = option(0.1, "Radius of the l_inf ball of the gradient distortion "
                                   "([0, 1] pixel units).", above=0.0)
    distortion_samples: int = option(1000, "Uniform draws per image of the expected "
                                     "distortion.", lower_bound=1)
    worst_population: int = option(1000, "Population of the worst-case distortion's genetic "
                                   "search.", lower_bound=4)
    worst_generations: int = option(10, "Generations of the genetic search.", lower_bound=0)
    certified_eps: tuple[float, ...] = option((0.1, 0.3), "l_inf radii of the certified "
                                              "accuracy ([0, 1] pixel units).", above=0.0)
    fixed: tuple[str, ...] = option(
        ("ibp:0.1", "ibp:0.3", "crown_ibp:0.1"), "Also train and measure these models "
        "outside the operating points, each as method:value (e.g. ibp:0.1, the training "
        "eps the certified-training papers use for that radius, whatever the accuracy; "
        "--fixed= for none).")
    search_steps: int = option(2, "New trainings per method and operating point in the "
                               "bisection of its knob on validation accuracy.", lower_bound=1)
    roll_lam: float = option(2.0, "ROLL: the first lambda of the search.", above=0.0)
    roll_C: float = option(1.0, "ROLL: the hinge weight C.", above=0.0)
    roll_samples: int = option(16, "ROLL: sampled (Eq. 10) with this many input axes per "
                               "example; 0: exact (Eq. 9).", lower_bound=0)
    mmr_lam: float = option(1.0, "MMR: the first lambda of the search.", above=0.0)
    mmr_p: str = option("2", "MMR: the norm of its margins: 1, 2 or inf.")
    mmr_k_B: int = option(100, "MMR: the region-boundary distances per example.",
                          lower_bound=1)
    mmr_gamma_B: float = option(0.5, "MMR: the region-boundary hinge's threshold ([0, 1] "
                                "pixel units).", above=0.0)
    mmr_gamma_D: float = option(2.0, "MMR: the decision-boundary hinge's threshold.",
                                above=0.0)
    mmr_examples: int = option(8, "MMR: the term on this many examples of each batch "
                               "(0: all).", lower_bound=0)
    input_gradient_lam: float = option(1.0, "Input gradient: the first lambda of the search.",
                                       above=0.0)
    input_gradient_p: str = option("2", "Input gradient: the norm of the perturbations: 1, "
                                   "2 or inf (the gradient in the dual norm).")
    ibp_eps: float = option(0.1, "IBP: the first training eps of the search (l_inf, [0, 1] "
                            "pixel units).", above=0.0)
    ibp_kappa: float = option(0.5, "IBP: the clean loss's final weight (ramped from 1).",
                              lower_bound=0.0, upper_bound=1.0)
    crown_ibp_eps: float = option(0.1, "CROWN-IBP: the first training eps of the search.",
                                  above=0.0)
    crown_ibp_kappa: float = option(0.0, "CROWN-IBP: the clean loss's final weight (ramped "
                                    "from 1).", lower_bound=0.0, upper_bound=1.0)
    ramp: float = option(0.5, "IBP / CROWN-IBP: the share of the training steps over which "
                         "eps rises from 0, kappa falls from 1 (and CROWN-IBP's beta from 1 "
                         "to 0), after the first epoch.", lower_bound=0.0, upper_bound=1.0)
    resume: bool = option(True, "Reuse the results in --out/runs of a model trained with "
                          "the same settings.")
    seed: int = option(0, "Random seed (data split, initialisation, batch order).",
                       lower_bound=0)


# The fields every trained model depends on (a stored model is reused only if they match,
# with its method's own fields, `Method.fields`, and the data's fingerprint).
TRAINING_FIELDS = ("arch", "depth", "width", "epochs", "batch_size", "lr", "val_size",
                   "train_size", "seed")


def get_config() -> Config:
    """The full comparison's settings."""
    return Config()


def parse_norm(text: str) -> float:
    """A norm flag as a number: 1, 2 or inf ('l1', 'l2', 'linf' too); ValueError otherwise.

    Example:

    ```python
    parse_norm("linf"), parse_norm("2")          # inf, 2.0
    ```
    """
    word = str(text).strip().lower().removeprefix("l")
    if word in ("1", "2"):
        return float(word)
    if word in ("inf", "infinity"):
        return float("inf")
    raise ValueError(f"a norm is 1, 2 or inf (also l1, l2, linf), got {text!r}")


def parse_fixed(items) -> list[tuple[str, float]]:
    """`--fixed` as `(method, value)` pairs; ValueError naming the bad item otherwise.

    Example:

    ```python
    parse_fixed(["ibp:0.1", "roll:4"])         # [("ibp", 0.1), ("roll", 4.0)]
    ```
    """
    pairs = []
    for item in items:
        name, _, value = str(item).partition(":")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if name not in METHODS or name == "vanilla" or not number > 0:
            raise ValueError(f"--fixed takes method:value items with a method of "
                             f"{', '.join(METHODS[1:])} and a value > 0; got {item!r}")
        pairs.append((name, number))
    return pairs
