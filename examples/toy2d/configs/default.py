"""The toy example's settings: the paper's Figure 1 (Appendix: a 4 x 100 ReLU network,
sigmoid cross entropy, Adam, C = 5, lam = 1). Each field is also a flag."""

from __future__ import annotations

import dataclasses
import enum

from examples.common.config_flags import option

MODELS = ("vanilla", "distance", "roll")


class Kind(enum.Enum):
    """The 2-D tasks of `keras_roll.data.make_toy2d`."""

    circles = "circles"
    spirals = "spirals"
    xor = "xor"


@dataclasses.dataclass(frozen=True)
class Config:
    """The toy example's settings (see the flags' help for each field)."""

    kind: Kind = option(Kind.circles, "The 2-D task (keras_roll.data.make_toy2d).")
    n: int = option(200, "Training points (as many validation points).", lower_bound=4)
    depth: int = option(4, "Hidden layers.", lower_bound=1)
    width: int = option(100, "Units per hidden layer.", lower_bound=1)
    epochs: int = option(300, "Training epochs.", lower_bound=1)
    batch_size: int = option(50, "Batch size.", lower_bound=1)
    lr: float = option(5e-3, "Adam learning rate.", lower_bound=0.0)
    lam: float = option(1.0, "Weight of both regularizers.", lower_bound=0.0)
    C: float = option(5.0, "C of both regularizers (the margin the hinge asks for).",
                      above=0.0)
    models: tuple[str, ...] = option(MODELS, f"Which of {', '.join(MODELS)} to train.")
    resolution: int = option(300, "Grid points per axis of the region plots.",
                             lower_bound=2)
    seed: int = option(0, "Random seed (data, initialisation, batch order).", lower_bound=0)


def get_config() -> Config:
    """The paper's settings."""
    return Config()
