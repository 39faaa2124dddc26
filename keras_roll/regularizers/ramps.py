"""The schedules of certified training as Keras callbacks: `EpsilonRamp`, `KappaRamp`,
`BetaRamp` (linear ramps over training steps or epochs, as Gowal et al. 2018 and
Zhang et al., ICLR 2020 use them).

Each sets a variable that the IBP / CROWN-IBP term of the wrapped model reads
(`keras_roll.regularizers.certified.CertifiedTerm`) before every training batch:

    value(t) = start + (end - start) * clip((t - begin) / length, 0, 1)

with `t` the number of training batches (or epochs, `per="epoch"`) run so far in
this callback's `fit` calls. docs/design.md, section "Certified training by bound
passes".

Example:

```python
ramps = [EpsilonRamp(0.3, length=2000, begin=200), KappaRamp(1.0, 0.5, length=2000, begin=200)]
wrapped.fit(x, y, epochs=20, callbacks=ramps)
```
"""

from __future__ import annotations

import keras

from keras_roll.regularizers.certified import (
    CertifiedTerm,
    certified_terms,
    check_fraction,
    check_radius,
)

__all__ = ["BetaRamp", "EpsilonRamp", "KappaRamp", "LinearRamp"]


class LinearRamp(keras.callbacks.Callback):
    """A linear ramp of one variable of the model's certified-training terms.

    Args:
        start: the value before `begin`.
        end: the value from `begin + length` on.
        length: the number of steps (or epochs) of the ramp, `>= 0`.
        begin: the step (or epoch) the ramp starts at, `>= 0` (a warm-up).
        per: "step" (each training batch) or "epoch".

    Raises:
        ValueError: bad values (named), or a model without an IBP / CROWN-IBP
            term at the start of `fit`.

    Example:

    ```python
    EpsilonRamp(0.1, length=10, per="epoch")
    ```
    """

    variable = ""

    def __init__(self, start: float, end: float, length: int, begin: int = 0,
                 per: str = "step"):
        super().__init__()
        self.start = self.check(f"{type(self).__name__} start", start)
        self.end = self.check(f"{type(self).__name__} end", end)
        for name, value in (("length", length), ("begin", begin)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{type(self).__name__} {name} must be an int >= 0 (steps or "
                                 f"epochs), got {name}={value!r}.")
        if per not in ("step", "epoch"):
            raise ValueError(f"per must be 'step' or 'epoch', got per={per!r}.")
        self.length, self.begin, self.per = int(length), int(begin), per
        self.t = 0
        self.terms: list[CertifiedTerm] = []

    def check(self, name: str, value) -> float:
        """A value of the ramp, checked (a radius by default)."""
        return check_radius(name, value)

    def value(self, t: int) -> float:
        """The ramp's value at step (or epoch) `t`."""
        if self.length == 0:
            return self.end if t >= self.begin else self.start
        frac = min(max((t - self.begin) / self.length, 0.0), 1.0)
        return self.start + (self.end - self.start) * frac

    def variables_of(self, terms: list[CertifiedTerm]) -> list:
        """The variables this ramp sets."""
        return [getattr(term, self.variable) for term in terms]

    def on_train_begin(self, logs=None):
        self.terms = certified_terms(self.model)
        if not self.terms:
            raise ValueError(f"{type(self).__name__} ramps the {self.variable} of certified "
                             f"training: use it with a model from keras_roll.wrap(model, "
                             f"regularizer=IBPConfig(...) or CrownIBPConfig(...)); model "
                             f"{self.model.name!r} has no such term.")

    def set(self):
        """Assigns the value at the current step to every term's variable."""
        for var in self.variables_of(self.terms):
            var.assign(self.value(self.t))

    def on_train_batch_begin(self, batch, logs=None):
        if self.per == "step":
            self.set()
            self.t += 1

    def on_epoch_begin(self, epoch, logs=None):
        if self.per == "epoch":
            self.set()
            self.t += 1


class EpsilonRamp(LinearRamp):
    """Ramps `eps` linearly from `start` (default 0) to `end`.

    Example:

    ```python
    EpsilonRamp(0.3, length=2000, begin=200)        # 0 -> 0.3 over steps 200..2200
    ```
    """

    variable = "eps"

    def __init__(self, end: float, length: int, begin: int = 0, start: float = 0.0,
                 per: str = "step"):
        super().__init__(start, end, length, begin, per)


class KappaRamp(LinearRamp):
    """Ramps `kappa` (the clean loss's weight) linearly from `start` to `end`.

    Example:

    ```python
    KappaRamp(1.0, 0.5, length=2000, begin=200)      # Gowal et al.
    ```
    """

    variable = "kappa"

    def check(self, name: str, value) -> float:
        return check_fraction(name, value)


class BetaRamp(KappaRamp):
    """Ramps CROWN-IBP's `beta` (the CROWN-IBP bound's weight) from `start` to `end`.

    Example:

    ```python
    BetaRamp(1.0, 0.0, length=2000)                  # Zhang et al.
    ```
    """

    variable = "beta"

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self.terms = [t for t in self.terms if t.config.method.value == "crown_ibp"]
        if not self.terms:
            raise ValueError(f"BetaRamp ramps CROWN-IBP's beta: use it with "
                             f"keras_roll.wrap(model, regularizer=CrownIBPConfig(...)); model "
                             f"{self.model.name!r} has no CROWN-IBP term.")
