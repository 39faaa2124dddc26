"""The Japanese Vowels example's settings: the paper's scoRNN (LeakyReLU, 512 hidden
units) + Dense(9), AMSGrad (learning rate 0.001), batch 32, exact ROLL with gamma 100.
Each field is also a flag."""

from __future__ import annotations

import dataclasses

from examples.common.config_flags import option


@dataclasses.dataclass(frozen=True)
class Config:
    """The Japanese Vowels example's settings (see the flags' help for each field)."""

    data_dir: str | None = option(
        None, "Folder with JapaneseVowels_TRAIN.ts / _TEST.ts or the UCI ae.train / ae.test "
        "files; default: the copy embedded in keras_roll.")
    units: int = option(512, "scoRNN hidden units.", lower_bound=1)
    num_negative_ones: int | None = option(None, "-1 entries of the scoRNN's diagonal D "
                                           "(rho); unset: units // 10.", lower_bound=0)
    epochs: int = option(80, "Training epochs.", lower_bound=1)
    batch_size: int = option(32, "Batch size.", lower_bound=1)
    lr: float = option(1e-3, "AMSGrad learning rate.", above=0.0)
    val_fraction: float = option(0.2, "Fraction of each speaker's training sequences held "
                                 "out for validation, in (0, 1).", above=0.0,
                                 upper_bound=0.9)
    test_size: int = option(0, "Use only the first N test sequences (0: all 370).",
                            lower_bound=0)
    vanilla: bool = option(True, "Train the vanilla model.")
    roll: bool = option(True, "Train the ROLL models of --lam x --C x --gamma.")
    lam: tuple[float, ...] = option((1.0,), "ROLL weights lambda.", lower_bound=0.0)
    C: tuple[float, ...] = option((1.0,), "ROLL hinge weights C.", lower_bound=0.0)
    gamma: tuple[float, ...] = option((100.0,), "ROLL percentages of neurons kept.",
                                      above=0.0, upper_bound=100.0)
    samples: int | None = option(None, "Sampled ROLL with this many axes per example; "
                                 "unset: exact ROLL (the paper's setting here).",
                                 lower_bound=1)
    figure_example: int = option(0, "Test sequence drawn in Figure 3.", lower_bound=0)
    figure_channel: int = option(0, "Channel (LPC coefficient, 0-11) drawn in Figure 3.",
                                 lower_bound=0, upper_bound=11)
    resume: bool = option(True, "Reuse the results in --out/runs of a model trained with "
                          "the same settings.")
    reevaluate: bool = option(False, "With --resume, certify the stored models again (from "
                              "their weights) instead of reusing their numbers.")
    seed: int = option(0, "Random seed (validation split, initialisation, sampling).",
                       lower_bound=0)


# The fields a trained model depends on: a stored result is reused only if they match
# (and the data's fingerprint: the data, wherever --data_dir finds it).
TRAINING_FIELDS = ("units", "num_negative_ones", "epochs", "batch_size", "lr",
                   "val_fraction", "test_size", "seed")


def get_config() -> Config:
    """The paper's settings."""
    return Config()
