"""The hyperparameters of the ROLL regularizer, validated once: `RollConfig`.

Every ROLL entry point (`wrap`, `RollRegularizer`, `roll_loss`,
`neuron_grad_sq`, `memory_plan`) turns its keyword arguments into one frozen
`RollConfig`, whose constructor checks each field with an error that names the
bad value; the internals take the config. To add a hyperparameter, add a field
with its default and a check in `__post_init__`: `RollRegularizer.get_config`
(`dataclasses.asdict`) and its attributes follow. See docs/design.md, section
"Data flow of a ROLL training step".

Example:

```python
config = RollConfig(lam=2.0, C=1.0, gamma=50.0, samples=3)
config.check_input_shape((784,))
dataclasses.asdict(config)      # what RollRegularizer.get_config stores
```
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["ESTIMATORS", "STRATA", "RollConfig", "check_hyperparameters"]

ESTIMATORS = ("axes", "gaussian", "rademacher")
STRATA = (None, "channel")


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class RollConfig:
    """The ROLL hyperparameters (Lee et al., ICLR 2019, Eq. 9 / 10), validated.

    Attributes:
        lam: regularization weight, `>= 0` (used by `RollRegularizer` / `wrap`).
        C: hinge weight, `>= 0`.
        gamma: percentage of neurons kept, in `(0, 100]`.
        samples: None (exact) or an int `>= 1`: sampled axes per example
            (per channel with `strata="channel"`), or random probes.
        strata: None or "channel".
        estimator: "axes", "gaussian" or "rademacher".
        seed: None or an int (a reproducible sequence of stateless seeds).
        on_eval: where the regularizer is computed outside training: None
            (default) in `evaluate` of the model `wrap` returns, so
            `val_loss` is the training objective, but not in `predict`;
            True in every inference-mode call (`predict` too); False never
            (evaluation then reports `roll_loss` as NaN).
        memory_budget: None (the twin's) or bytes of tangents per chunk.
        share_axes: one set of sampled axes for the whole batch (needs
            `samples` and estimator "axes").
        wrt: None (gradients with respect to the model input) or the name of
            a leading Rescaling / Normalization layer: ROLL's directions are
            then the axes of that layer's output, so `||grad z||^2` and the
            sampled axes are in its units (the paper's normalised units);
            checked against the model by `keras_roll.roll.estimators.tangent_entry`.

    Raises:
        ValueError: a bad value; the message names the field and the value.

    Example:

    ```python
    RollConfig(samples=3, strata="channel").check_input_shape((32, 32, 3))
    ```
    """

    lam: float = 2.0
    C: float = 1.0
    gamma: float = 100.0
    samples: int | None = None
    strata: str | None = None
    estimator: str = "axes"
    seed: int | None = None
    on_eval: bool | None = None
    memory_budget: int | None = None
    share_axes: bool = False
    wrt: str | None = None

    def __post_init__(self):
        lam, C, gamma = self.lam, self.C, self.gamma
        samples, strata, estimator = self.samples, self.strata, self.estimator
        share_axes = self.share_axes
        if not _is_number(lam) or not math.isfinite(lam) or lam < 0:
            raise ValueError(f"lam must be a finite number >= 0, got lam={lam!r}.")
        if not _is_number(C) or not math.isfinite(C) or C < 0:
            raise ValueError(f"C must be a finite number >= 0, got C={C!r}.")
        if not _is_number(gamma) or not (0 < gamma <= 100):
            raise ValueError(f"gamma is a percentage of neurons and must lie in (0, 100], "
                             f"got gamma={gamma!r}.")
        if estimator not in ESTIMATORS:
            raise ValueError(f"Unknown estimator={estimator!r}; expected one of {ESTIMATORS}.")
        if strata not in STRATA:
            raise ValueError(f"Unknown strata={strata!r}; expected None (uniform over all "
                             f"input axes) or 'channel' (the same number of axes in every "
                             f"channel).")
        if samples is not None and (not _is_int(samples) or samples < 1):
            raise ValueError(f"samples must be None (exact ROLL) or a positive int, got "
                             f"samples={samples!r}.")
        if estimator != "axes":
            if samples is None:
                raise ValueError(f"estimator={estimator!r} draws random probes and needs "
                                 f"samples=<number of probes>; use estimator='axes' with "
                                 f"samples=None for the exact loss.")
            if strata is not None:
                raise ValueError(f"strata={strata!r} applies to estimator='axes' only, got "
                                 f"estimator={estimator!r}.")
        if not isinstance(share_axes, (bool, np.bool_)):
            raise ValueError(f"share_axes must be True or False, got share_axes={share_axes!r}.")
        if share_axes and (samples is None or estimator != "axes"):
            raise ValueError(f"share_axes=True shares sampled input axes across the batch; it "
                             f"needs samples=<k> and estimator='axes', got samples={samples!r}, "
                             f"estimator={estimator!r}.")
        if strata is not None and samples is None:
            raise ValueError(f"strata={strata!r} stratifies sampled axes; pass samples=<axes "
                             f"per channel> (the exact loss uses every axis).")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got seed={self.seed!r}.")
        if self.on_eval is not None and not isinstance(self.on_eval, (bool, np.bool_)):
            raise ValueError(f"on_eval must be None (ROLL in evaluate, not in predict), True "
                             f"(in every inference call) or False (never outside training), "
                             f"got on_eval={self.on_eval!r}.")
        if self.wrt is not None and (not isinstance(self.wrt, str) or not self.wrt):
            raise ValueError(f"wrt must be None (gradients with respect to the model input) or "
                             f"the name of a leading Rescaling / Normalization layer, got "
                             f"wrt={self.wrt!r}.")
        budget = self.memory_budget
        if budget is not None and (not _is_number(budget) or budget <= 0):
            raise ValueError(f"memory_budget must be None or a positive number of bytes, got "
                             f"memory_budget={budget!r}.")
        normalised = {
            "lam": float(lam), "C": float(C), "gamma": float(gamma),
            "samples": None if samples is None else int(samples),
            "seed": None if self.seed is None else int(self.seed),
            "on_eval": None if self.on_eval is None else bool(self.on_eval),
            "share_axes": bool(share_axes),
            "memory_budget": None if budget is None else int(budget),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def exact(self) -> bool:
        """Whether this is the exact loss (every input axis, Eq. 9)."""
        return self.samples is None

    def directions(self, example_shape) -> int:
        """Directions per example: D (exact), `samples * channels` (stratified), or `samples`."""
        if self.samples is None:
            return int(np.prod(example_shape))
        if self.strata == "channel":
            return self.samples * int(example_shape[-1])
        return self.samples

    def check_input_shape(self, input_shape) -> None:
        """Checks `samples` against a per-example input shape (None dims unchecked).

        Raises:
            ValueError: more samples than axes (per channel with strata), or
                stratification of an input without a channel axis.
        """
        samples, strata = self.samples, self.strata
        if input_shape is None or samples is None or self.estimator != "axes":
            return
        shape = tuple(input_shape)
        if strata == "channel":
            if len(shape) < 2:
                raise ValueError(f"strata='channel' needs a channels-last input of rank >= 2, "
                                 f"got per-example input shape {shape}.")
            if any(d is None for d in shape[:-1]) or shape[-1] is None:
                return
            per_channel = int(np.prod(shape[:-1]))
            if samples > per_channel:
                raise ValueError(f"samples={samples} exceeds the {per_channel} axes of each "
                                 f"channel of an input of shape {shape}.")
            return
        if any(d is None for d in shape):
            return
        d = int(np.prod(shape))
        if samples > d:
            raise ValueError(f"samples={samples} exceeds the input dimension D={d} of an input "
                             f"of shape {shape}; use samples=None for the exact loss.")


def check_hyperparameters(lam=0.0, C=1.0, gamma=100.0, samples=None, strata=None,
                          estimator="axes", input_shape=None, share_axes=False) -> None:
    """Validates ROLL hyperparameters; raises `ValueError` naming the bad value.

    The same checks as `RollConfig(...)` followed by `check_input_shape`.

    Example:

    ```python
    check_hyperparameters(lam=2.0, gamma=50.0, samples=3, input_shape=(784,))
    ```
    """
    RollConfig(lam=lam, C=C, gamma=gamma, samples=samples, strata=strata, estimator=estimator,
               share_axes=share_axes).check_input_shape(input_shape)
