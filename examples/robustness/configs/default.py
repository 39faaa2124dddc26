"""The robustness example's settings: the paper's 784-300x4-10 ReLU network, vanilla and
ROLL (lam 2, C 1, exact), trained by the MNIST example's code (`examples.mnist.train`:
SGD 0.01, Nesterov momentum 0.5, batch 64, the best validation-loss epoch), and the
bounds of `keras_roll.robust_radius` on the first `test_size` test images. Each field is
also a flag."""

from __future__ import annotations

import dataclasses
import enum

from examples.common.config_flags import option


class Method(enum.Enum):
    """`robust_radius`'s `method`."""

    best = "best"
    region = "region"
    walk = "walk"
    relaxation = "relaxation"
    interval = "interval"


class Rigor(enum.Enum):
    """`robust_radius`'s rounding guard."""

    float64 = "float64"
    strict = "strict"
    float32 = "float32"


@dataclasses.dataclass(frozen=True)
class Config:
    """The robustness example's settings (see the flags' help for each field)."""

    data_dir: str | None = option(
        None, "The data: a Keras-layout mnist.npz, or a folder holding it or the four IDX "
        "files. Default: the Keras cache, then a prepared tensorflow-datasets copy.")
    dataset: str = option(
        "MNIST", "The data set's name in the table's title and the figure (another data "
        "set in MNIST's layout: pass its name).")
    train_size: int = option(0, "Train on the first N training images (0: all 55,000).",
                             lower_bound=0)
    val_size: int = option(5000, "Validation images (the best epoch is kept).",
                           lower_bound=1)
    epochs: int = option(20, "Training epochs.", lower_bound=1)
    lr: float = option(0.01, "SGD learning rate.", above=0.0)
    momentum: float = option(0.5, "Nesterov momentum.", lower_bound=0.0, upper_bound=1.0)
    width: int = option(300, "Units per hidden layer.", lower_bound=1)
    depth: int = option(4, "Hidden layers.", lower_bound=1)
    lam: float = option(2.0, "ROLL weight lambda.", lower_bound=0.0)
    C: float = option(1.0, "ROLL hinge weight C.", lower_bound=0.0)
    samples: int | None = option(None, "Sampled ROLL (Eq. 10) with this many input axes "
                                 "per example; unset: exact ROLL.", lower_bound=1)
    seed: int = option(0, "Random seed (data split, initialisation, sampling, batch order).",
                       lower_bound=0)
    test_size: int = option(100, "Test images whose radii are bounded.", lower_bound=1)
    method: Method = option(Method.best, "robust_radius's method.")
    rigor: Rigor = option(Rigor.float64, "Rounding guard of the lower bounds.")
    max_regions: int = option(100, "Regions the walk may cross per input.", lower_bound=1)
    bisect_tol: float = option(0.01, "Relative width of the relaxation search's last "
                               "bracket.", above=0.0, upper_bound=0.5)
    radii: tuple[float, ...] = option((0.01, 0.03, 0.1), "l_inf radii ([0, 1] pixel "
                                      "units) of the certified accuracy columns.",
                                      above=0.0)
    resume: bool = option(True, "Reuse models trained with the same settings in --out/runs "
                          "(also those of `python -m examples.mnist` with --out here).")


def get_config() -> Config:
    return Config()
