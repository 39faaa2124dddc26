"""The Caltech-256 example's settings: the paper's ResNet-18 ROLL run (Sec. 5 and
Appendix I): 299 x 299 images, per class 5 validation and 15 test images, SGD with
Nesterov momentum 0.5, batch 32, learning rate 0.005 then 0.0005 after epoch 10, 20
epochs; ROLL with lam 0.001, C 8, gamma 100 and 120 sampled axes per colour channel;
gradient distortion at eps = 8/256. Each field is also a flag."""

from __future__ import annotations

import dataclasses
import enum

from examples.common.config_flags import option


class Strategy(enum.Enum):
    """The `tf.distribute` strategy of the training."""

    default = "default"  # one device
    mirrored = "mirrored"  # every GPU of this host
    multiworker = "multiworker"  # several hosts, set up with TF_CONFIG


class Normalize(enum.Enum):
    """The input normalisation inside the model."""

    imagenet = "imagenet"  # ImageNet's per-channel mean and std
    paper = "paper"  # ImageNet's mean and the single std 0.225


class StemPool(enum.Enum):
    avg = "avg"  # the paper's (the network stays affine in the stem's outputs)
    max = "max"  # torchvision's


class Cache(enum.Enum):
    """Where the decoded validation and test images are cached."""

    auto = "auto"  # in memory when they fit
    memory = "memory"
    none = "none"


class Strata(enum.Enum):
    """How the sampled ROLL axes are drawn."""

    channel = "channel"  # the same number per colour channel
    none = "none"  # uniformly over all input axes


class Architecture(enum.Enum):
    """The network: the paper's ResNet-18, or a two-convolution network of the same
    interface for tests of the pipeline."""

    resnet18 = "resnet18"
    tiny = "tiny"


@dataclasses.dataclass(frozen=True)
class Config:
    """The Caltech-256 example's settings (see the flags' help for each field)."""

    # Data and model.
    data_dir: str | None = option(
        None, "The extracted 256_ObjectCategories folder or its parent "
        "(https://data.caltech.edu/records/nyy15-4j048). With --quick and no --data_dir, "
        "a generated tree is used.")
    image_size: int = option(299, "Images are resized to image_size^2.", lower_bound=8)
    val_per_class: int = option(5, "Validation images per class.", lower_bound=1)
    test_per_class: int = option(15, "Test images per class.", lower_bound=0)
    max_per_class: int | None = option(None, "Use at most this many images per class.",
                                       lower_bound=1)
    cache: Cache = option(Cache.auto, "Cache of the decoded validation and test images "
                          "(auto: in memory when they fit).")
    normalize: Normalize = option(Normalize.imagenet, "Input normalisation inside the "
                                  "model: imagenet (per-channel std) or paper (the single "
                                  "std 0.225).")
    stem_pool: StemPool = option(StemPool.avg, "Pooling after the stem (the paper: avg).")
    model: Architecture = option(Architecture.resnet18, "The network (tiny: two "
                                 "convolutions, for tests of the pipeline).")
    weights: str | None = option(
        None, "Initial weights: a torchvision resnet18 state dict saved as .npz (ImageNet; fc "
        "is skipped when its shape does not fit) or a .weights.h5 file of this model. With "
        "--eval_only: the weights to evaluate (default: <out>/best.weights.h5).")
    # Optimisation.
    epochs: int = option(20, "Training epochs.", lower_bound=1)
    batch_size: int = option(32, "Global batch size (split over the replicas).",
                             lower_bound=1)
    steps_per_epoch: int = option(0, "Steps per epoch (0: every full batch of the training "
                                  "split).", lower_bound=0)
    lr: float = option(0.005, "Initial learning rate.", above=0.0)
    lr_decay_epochs: tuple[float, ...] = option(
        (10.0,), "Whole epochs after which the learning rate is multiplied by "
        "--lr_decay_factor.", lower_bound=1.0)
    lr_decay_factor: float = option(0.1, "Learning-rate decay factor.", above=0.0)
    momentum: float = option(0.5, "SGD momentum.", lower_bound=0.0, upper_bound=1.0)
    nesterov: bool = option(True, "Nesterov momentum.")
    # ROLL.
    roll: bool = option(True, "Train with the ROLL regularizer (--noroll: vanilla).")
    lam: float = option(0.001, "ROLL weight lambda.", lower_bound=0.0)
    C: float = option(8.0, "ROLL hinge weight C.", lower_bound=0.0)
    gamma: float = option(100.0, "Percentage of neurons in the ROLL loss.", above=0.0,
                          upper_bound=100.0)
    samples: int = option(120, "Sampled input axes (per channel with --strata=channel); "
                          "0: the exact loss.", lower_bound=0)
    strata: Strata = option(Strata.channel, "Stratification of the sampled axes.")
    roll_wrt: str = option("normalize", "Layer whose output ROLL differentiates with respect "
                           "to (the normalisation layer: the paper's units); empty: the "
                           "[0, 1] pixels.")
    memory_budget: int = option(2**30, "Bytes of tangents per chunk of the twin (ROLL, "
                                "margins, distortion).", lower_bound=1)
    # Distribution, precision, checkpoints and logs.
    strategy: Strategy = option(Strategy.default, "tf.distribute strategy: default (one "
                                "device), mirrored (every GPU of this host), multiworker "
                                "(several hosts, set up with TF_CONFIG).")
    mixed_precision: bool = option(False, "Train under mixed precision (float16 on GPUs, "
                                   "bfloat16 on CPUs); evaluation runs in float32.")
    deterministic: bool = option(False, "tf.config.experimental.enable_op_determinism(): "
                                 "bit-identical reruns, slower on GPUs.")
    seed: int = option(0, "Random seed (split, initialisation, batch order, sampling).",
                       lower_bound=0)
    save_freq: int = option(200, "Save the training state every this many steps (and after "
                            "every epoch).", lower_bound=1)
    monitor_images: int = option(4, "Validation images whose l2 margins are logged (0: "
                                 "none).", lower_bound=0)
    monitor_every: int = option(1, "Log the margins every this many epochs.", lower_bound=1)
    verbose: int = option(-1, "Keras fit verbosity (0, 1: progress bar, 2: one line per "
                          "epoch, -1: 1 on a terminal, 2 otherwise).", lower_bound=-1,
                          upper_bound=2)
    # Evaluation.
    eval_only: bool = option(False, "Skip training: evaluate --weights (or "
                             "<out>/best.weights.h5).")
    num_eval: int = option(100, "Test images for the gradient distortion.", lower_bound=0)
    eps: float = option(8 / 256, "l_inf radius of the distortion ball, in [0, 1] pixel units "
                        "(the paper: 8/256 = 0.03125).", above=0.0, upper_bound=1.0)
    distortion_samples: int = option(8000, "Uniform draws per image for the expected "
                                     "distortion.", lower_bound=1)
    population: int = option(4800, "Population of the genetic algorithm.", lower_bound=1)
    generations: int = option(30, "Generations of the genetic algorithm.", lower_bound=0)
    figure_percentiles: tuple[float, ...] = option(
        (50.0, 75.0), "Rows of the figure: the test images at these percentiles of the "
        "worst-case distortion.", lower_bound=0.0, upper_bound=100.0)
    ig_steps: int = option(64, "Riemann points of the integrated gradients in the figure (0: "
                           "exact, region by region).", lower_bound=0)
    compare_with: str | None = option(None, "Another run's --out (e.g. the vanilla run): its "
                                      "best model is drawn beside this one in the figure.")
    with_vanilla: bool = option(False, "With --roll: train a vanilla model too, then ROLL "
                                "(in --out/vanilla and --out/roll), and compare them in "
                                "--out/comparison.md (on under --quick).")


# The fields that define a training run: a rerun with another value of one of them is
# refused (it would mix two runs in one checkpoint). The rest (strategy, evaluation,
# logging) may change between an interrupted run and its continuation.
RUN_FIELDS = (
    "image_size", "normalize", "stem_pool", "model", "weights", "seed", "epochs",
    "batch_size", "steps_per_epoch", "lr", "lr_decay_epochs", "lr_decay_factor", "momentum",
    "nesterov", "roll", "lam", "C", "gamma", "samples", "strata", "roll_wrt",
    "mixed_precision", "val_per_class", "test_per_class", "max_per_class",
)


def get_config() -> Config:
    """The paper's ROLL run."""
    return Config()
