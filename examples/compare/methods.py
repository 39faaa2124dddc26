"""The methods side by side: how each one wraps the model, which knob the search tunes,
which config fields its models depend on, and the ramps it trains with.

Every method trains the same network from the same initial weights; a method is one
`Method` value, and `METHODS` maps the names of `--methods` to them. The knob is the
hyperparameter the search moves (stronger regularization as it grows): `lam` for the
penalties (ROLL, MMR, input gradient), the training radius `eps` for certified
training (IBP, CROWN-IBP). Adding a method is one more `Method` in `METHODS` (and its
flags in `configs/default.py`).

Example:

```python
method = METHODS["ibp"]
fit_model = method.wrap(model, config, 0.1)
callbacks = method.ramps(config, 0.1, steps_per_epoch=157)
method.fields                                   # ('ibp_kappa', 'ramp')
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras

import keras_roll
from examples.compare.configs.default import Config, parse_norm

__all__ = ["METHODS", "Method", "Ramps"]


@dataclasses.dataclass(frozen=True)
class Ramps:
    """The certified-training schedule (Gowal et al.; Zhang et al.): eps rises from 0 to
    the knob while kappa, the clean loss's weight, falls from 1 to `kappa(config)` (and,
    with `beta`, CROWN-IBP's beta from 1 to 0).

    Attributes:
        kappa: `config -> ` kappa's final value.
        beta: whether beta ramps too (CROWN-IBP).
    """

    kappa: Callable[[Config], float]
    beta: bool = False

    def callbacks(self, config: Config, value: float, steps_per_epoch: int) -> list:
        """The ramps as Keras callbacks: after one epoch at `eps = 0` (none when training
        for one epoch), over `config.ramp` of the training steps, ending by the last step
        (which then trains at `eps = value`): `--ramp=1` ramps over every step after the
        first epoch."""
        total = config.epochs * steps_per_epoch
        begin = steps_per_epoch if config.epochs > 1 else 0
        length = max(0, min(round(config.ramp * total), total - begin - 1))
        ramps = [keras_roll.callbacks.EpsilonRamp(value, length=length, begin=begin),
                 keras_roll.callbacks.KappaRamp(1.0, self.kappa(config), length=length,
                                                begin=begin)]
        if self.beta:
            ramps.append(keras_roll.callbacks.BetaRamp(1.0, 0.0, length=length, begin=begin))
        return ramps


@dataclasses.dataclass(frozen=True)
class Method:
    """One method of the comparison.

    Attributes:
        name: its name in `--methods`, tags and tables' keys.
        label: its name in tables and figures.
        knob: the hyperparameter the search tunes ("" for vanilla).
        start: `config -> ` the search's first value of the knob.
        regularizer: `(config, value) -> ` the keras_roll regularizer config (None:
            the plain model).
        fields: the config fields its models depend on beside the shared training
            fields and the knob (a stored model is reused only if they match).
        schedule: its certified-training ramps (None: it trains with a fixed
            objective).
    """

    name: str
    label: str
    knob: str = ""
    start: Callable[[Config], float] = lambda config: 0.0
    regularizer: Callable[[Config, float], object] = lambda config, value: None
    fields: tuple[str, ...] = ()
    schedule: Ramps | None = None

    @property
    def tuned(self) -> bool:
        """Whether the search tunes a knob (every method but vanilla)."""
        return bool(self.knob)

    def wrap(self, model: keras.Model, config: Config, value: float) -> keras.Model:
        """The model `fit` trains: `model` itself for vanilla, else its keras_roll wrapper."""
        regularizer = self.regularizer(config, value)
        return model if regularizer is None else keras_roll.wrap(model,
                                                                 regularizer=regularizer)

    def ramps(self, config: Config, value: float, steps_per_epoch: int) -> list:
        """The callbacks of its schedule (`Ramps.callbacks`); none without one."""
        if self.schedule is None:
            return []
        return self.schedule.callbacks(config, value, steps_per_epoch)


def _roll(config: Config, value: float):
    samples = config.roll_samples or None  # 0: exact
    return keras_roll.RollConfig(lam=value, C=config.roll_C, gamma=100.0, samples=samples,
                                 seed=None if samples is None else config.seed)


def _mmr(config: Config, value: float):
    return keras_roll.MMRConfig(lam=value, p=parse_norm(config.mmr_p), k_B=config.mmr_k_B,
                                gamma_B=config.mmr_gamma_B, gamma_D=config.mmr_gamma_D,
                                examples=config.mmr_examples or None)  # 0: all


def _input_gradient(config: Config, value: float):
    return keras_roll.InputGradientConfig(lam=value, p=parse_norm(config.input_gradient_p))


def _ibp(config: Config, value: float):
    return keras_roll.IBPConfig(eps=0.0, kappa=1.0)  # the ramps set eps and kappa


def _crown_ibp(config: Config, value: float):
    return keras_roll.CrownIBPConfig(eps=0.0, kappa=1.0, beta=1.0)  # and beta


METHODS = {m.name: m for m in (
    Method("vanilla", "vanilla"),
    Method("roll", "ROLL", "lam", lambda c: c.roll_lam, _roll,
           fields=("roll_C", "roll_samples")),
    Method("mmr", "MMR", "lam", lambda c: c.mmr_lam, _mmr,
           fields=("mmr_p", "mmr_k_B", "mmr_gamma_B", "mmr_gamma_D", "mmr_examples")),
    Method("input_gradient", "input gradient", "lam", lambda c: c.input_gradient_lam,
           _input_gradient, fields=("input_gradient_p",)),
    Method("ibp", "IBP", "eps", lambda c: c.ibp_eps, _ibp, fields=("ibp_kappa", "ramp"),
           schedule=Ramps(lambda c: c.ibp_kappa)),
    Method("crown_ibp", "CROWN-IBP", "eps", lambda c: c.crown_ibp_eps, _crown_ibp,
           fields=("crown_ibp_kappa", "ramp"),
           schedule=Ramps(lambda c: c.crown_ibp_kappa, beta=True)),
)}
