"""The hyperparameters of the ROLL regularizer, validated once: `RollConfig`.

Every ROLL entry point (`wrap`, `RollRegularizer`, `roll_loss`,
`neuron_grad_sq`, `memory_plan`) takes `config=None, **overrides` and turns
them into one frozen `RollConfig` with `resolve_config`; the constructor checks
each field with an error that names the bad value (None stands for a field's
default), and the entry point resolves it once against the model into a
`RollPlan` (`keras_roll.roll.entry.roll_plan`: the config and where the
tangents enter), which the loss, the estimators and the regularizer read. To add
a hyperparameter, add a field with its default and a check in `__post_init__`:
every entry point accepts it as a keyword, and `RollRegularizer.get_config`
(`dataclasses.asdict`) and its attributes follow. See docs/design.md, section
"Data flow of a ROLL training step".

Example:

```python
config = RollConfig(lam=2.0, C=1.0, gamma=50.0, samples=3)
config.check_input_shape((784,))
resolve_config(config, lam=1.0)  # a validated copy with lam=1.0
dataclasses.asdict(config)      # what RollRegularizer.get_config stores
```
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np

from keras_roll.options import Choice, check_memory_budget

__all__ = ["ESTIMATORS", "STRATA", "TANGENT_DTYPES", "EstimatorKind", "RollConfig", "RollPlan",
           "Strata", "resolve_config"]


class EstimatorKind(Choice):
    """The directions of ROLL's gradient norms (`RollConfig.estimator`).

    * `AXES` ("axes", the default): one-hot input axes (every axis for the exact
      loss, `samples` drawn ones for Eq. 10).
    * `GAUSSIAN` ("gaussian"), `RADEMACHER` ("rademacher"): random probes `v`
      with `E[(g . v)^2] = ||g||^2`.

    Example:

    ```python
    RollConfig(samples=16, estimator="gaussian").estimator   # EstimatorKind.GAUSSIAN
    ```
    """

    AXES = "axes"
    GAUSSIAN = "gaussian"
    RADEMACHER = "rademacher"


class Strata(Choice):
    """How sampled axes are stratified (`RollConfig.strata`; None: uniformly over
    all axes): `CHANNEL` ("channel"), `samples` axes in every channel.

    Example:

    ```python
    RollConfig(samples=3, strata=Strata.CHANNEL).check_input_shape((32, 32, 3))
    ```
    """

    CHANNEL = "channel"


ESTIMATORS = tuple(e.value for e in EstimatorKind)
STRATA = (None, *(s.value for s in Strata))
TANGENT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class RollConfig:
    """The ROLL hyperparameters (Lee et al., ICLR 2019, Eq. 9 / 10), validated.

    One frozen record for every ROLL entry point: `wrap(model, config,
    **overrides)`, `RollRegularizer`, `roll_loss(model, x, config,
    **overrides)`, `neuron_grad_sq` and `memory_plan` take it, and accept its
    fields as keywords (`resolve_config`).

    Attributes:
        lam: regularization weight, `>= 0` (read by `wrap` / `RollRegularizer`;
            `roll_loss` returns the regularizer without it).
        C: weight of the hinge term `max(0, 1 - |z_j - b_j|)`, `>= 0`.
        gamma: percentage of neurons kept, in `(0, 100]`: 100 keeps all (no
            sort); otherwise `max(1, ceil(gamma / 100 * n_valid))` per example.
        samples: None for the exact loss (every input axis, Eq. 9), or k for
            Eq. 10: k axes per example drawn uniformly without replacement, the
            sum of squares scaled by `D / k` (unbiased for gamma = 100); the
            number of probes for random estimators. Behind a leading Masking
            layer the axes of each example are drawn among its valid
            (unpadded) steps only, scaled by `D_valid / k`.
        strata: None, or "channel" (`Strata.CHANNEL`): k axes in every channel
            of a channels-last input (the paper's "120 samples on each
            channel"), scaled per channel.
        estimator: "axes" (one-hot input axes), "gaussian" or "rademacher"
            (random probes v, `E[(g . v)^2] = ||g||^2`, scaled by `1 / k`); an
            `EstimatorKind`, strings accepted.
        seed: None (fresh randomness every step) or an int: a reproducible
            sequence of stateless seeds (one per step and replica under `wrap`).
            Under `tf.distribute` the global replica id is folded in, so
            replicas never draw the same directions.
        on_eval: where `wrap`'s regularizer is computed outside training: None
            (default) in `evaluate` of the model `wrap` returns, so `val_loss`
            is the training objective, but not in `predict`; True in every
            inference-mode call (`predict` too); False never (evaluation then
            reports `roll_loss` as NaN).
        memory_budget: None (the twin's), "auto" or bytes of tangents per
            chunk of directions; more chunks cost a recomputation in the
            backward pass unless a training step differentiates each chunk in
            its forward.
        share_axes: one set of sampled axes for the whole batch (needs
            `samples` and estimator "axes"): each example's estimate stays
            unbiased, the examples' estimates are correlated, and the first
            layer's tangents are shared (a markedly cheaper step).
        wrt: None (gradients with respect to the model input) or the name of
            a leading Rescaling / Normalization layer: ROLL's directions are
            then the axes of that layer's output, so `||grad z||^2` and the
            sampled axes are in its units (the paper's normalised units;
            docs/guide.md, "Units and wrt="); checked against the model by
            `keras_roll.roll.entry.tangent_entry`.
        tangent_dtype: None (the twin's dtype, float32 even under mixed
            precision) or "float16" / "bfloat16" (also "float32", "float64"):
            the dtype of ROLL's tangent pass, e.g. the compute dtype of a
            mixed-precision model (half the tangent memory, 16-bit convolutions;
            gradient norms to about 1e-3 (float16) or 1e-2 (bfloat16) relative);
            the squares are summed in the twin's dtype.
        fewest_directions: exact ROLL only: True (default) pushes the fewest
            directions that give the same loss: from the output of a first
            Dense layer with `H1 < D` units, the `H1` rows of a factor of its
            Gram matrix (`keras_roll.roll.factored`), or, with a ReLU after
            that layer, per example a factor of the Gram matrix of its active
            units, from the ReLU's output (`keras_roll.roll.active_factor`);
            False pushes every input axis (the reference path).
            docs/design.md, "Exact ROLL in fewer directions".
        skip_padded_steps: exact ROLL only: True pushes, behind a leading
            Masking layer, one direction per example and valid (unpadded) input
            axis (`keras_roll.roll.exact.PackedAxes`): the same loss. False
            (default) pushes every input axis: on the paper's Japanese Vowels
            scoRNN it was measured faster (benchmarks/README.md, "Training
            steps"). Either way a padded batch of a last-state recurrent layer
            runs in length buckets (`keras_roll.roll.buckets`).

    None stands for a field's default (`RollConfig(lam=None).lam == 2.0`).

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
    strata: Strata | None = None
    estimator: EstimatorKind = EstimatorKind.AXES
    seed: int | None = None
    on_eval: bool | None = None
    memory_budget: int | str | None = None
    share_axes: bool = False
    wrt: str | None = None
    tangent_dtype: str | None = None
    fewest_directions: bool = True
    skip_padded_steps: bool = False

    log_name = "roll_loss"  # the metric of the term (keras_roll.regularizers.registry)

    def __post_init__(self):
        for field in dataclasses.fields(self):  # None means the default
            if getattr(self, field.name) is None and field.default is not None:
                object.__setattr__(self, field.name, field.default)
        object.__setattr__(self, "estimator", EstimatorKind.parse(self.estimator, "estimator"))
        if self.strata is not None:
            try:
                object.__setattr__(self, "strata", Strata.parse(self.strata, "strata"))
            except ValueError:
                raise ValueError(f"Unknown strata={self.strata!r}; expected None (uniform over "
                                 f"all input axes) or 'channel' (the same number of axes in "
                                 f"every channel).") from None
        _check_weights(self.lam, self.C, self.gamma)
        _check_sampling(self.samples, None if self.strata is None else self.strata.value,
                        self.estimator.value, self.share_axes)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got seed={self.seed!r}.")
        if self.on_eval is not None and not isinstance(self.on_eval, (bool, np.bool_)):
            raise ValueError(f"on_eval must be None (ROLL in evaluate, not in predict), True "
                             f"(in every inference call) or False (never outside training), "
                             f"got on_eval={self.on_eval!r}.")
        if not isinstance(self.fewest_directions, (bool, np.bool_)):
            raise ValueError(f"fewest_directions must be True or False, got "
                             f"fewest_directions={self.fewest_directions!r}.")
        if not isinstance(self.skip_padded_steps, (bool, np.bool_)):
            raise ValueError(f"skip_padded_steps must be True or False, got "
                             f"skip_padded_steps={self.skip_padded_steps!r}.")
        if self.wrt is not None and (not isinstance(self.wrt, str) or not self.wrt):
            raise ValueError(f"wrt must be None (gradients with respect to the model input) or "
                             f"the name of a leading Rescaling / Normalization layer, got "
                             f"wrt={self.wrt!r}.")
        normalised = {
            "tangent_dtype": _check_tangent_dtype(self.tangent_dtype),
            "lam": float(self.lam), "C": float(self.C), "gamma": float(self.gamma),
            "samples": None if self.samples is None else int(self.samples),
            "seed": None if self.seed is None else int(self.seed),
            "on_eval": None if self.on_eval is None else bool(self.on_eval),
            "share_axes": bool(self.share_axes),
            "fewest_directions": bool(self.fewest_directions),
            "skip_padded_steps": bool(self.skip_padded_steps),
            "memory_budget": check_memory_budget(self.memory_budget),
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
        if self.strata is Strata.CHANNEL:
            return self.samples * int(example_shape[-1])
        return self.samples

    def check_input_shape(self, input_shape) -> None:
        """Checks `samples` against a per-example input shape (None dims unchecked).

        Raises:
            ValueError: more samples than axes (per channel with strata), or
                stratification of an input without a channel axis.
        """
        samples, strata = self.samples, self.strata
        if input_shape is None or samples is None or self.estimator is not EstimatorKind.AXES:
            return
        shape = tuple(input_shape)
        if strata is Strata.CHANNEL:
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


def _check_weights(lam, C, gamma) -> None:
    if not _is_number(lam) or not math.isfinite(lam) or lam < 0:
        raise ValueError(f"lam must be a finite number >= 0, got lam={lam!r}.")
    if not _is_number(C) or not math.isfinite(C) or C < 0:
        raise ValueError(f"C must be a finite number >= 0, got C={C!r}.")
    if not _is_number(gamma) or not (0 < gamma <= 100):
        raise ValueError(f"gamma is a percentage of neurons and must lie in (0, 100], "
                         f"got gamma={gamma!r}.")


def _check_sampling(samples, strata, estimator, share_axes) -> None:
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


def _check_tangent_dtype(tangent_dtype) -> str | None:
    """`tangent_dtype` as a standard dtype name (None stays None)."""
    if tangent_dtype is None:
        return None
    try:
        name = keras.backend.standardize_dtype(tangent_dtype)
    except (TypeError, ValueError):
        name = None
    if name not in TANGENT_DTYPES:
        raise ValueError(f"tangent_dtype must be None (the twin's dtype), 'float16' or "
                         f"'bfloat16' (16-bit ROLL tangents, e.g. under mixed precision), "
                         f"'float32' or 'float64'; got tangent_dtype={tangent_dtype!r}.")
    return name


def resolve_config(config: RollConfig | None = None, **overrides) -> RollConfig:
    """`config` (default `RollConfig()`) with the fields in `overrides` replaced, validated.

    The one way every ROLL entry point reads its hyperparameters: `wrap(model,
    config, **overrides)`, `roll_loss(model, x, config, **overrides)`, ...

    Raises:
        TypeError: `config` is not a `RollConfig`, or an override names no field
            (the message lists the fields).
        ValueError: a bad value (see `RollConfig`).

    Example:

    ```python
    base = RollConfig(lam=2.0, samples=3)
    resolve_config(base, seed=0)        # RollConfig(lam=2.0, samples=3, seed=0, ...)
    resolve_config(None, C=0.25)        # the defaults with C=0.25
    ```
    """
    if config is None:
        config = RollConfig()
    elif not isinstance(config, RollConfig):
        raise TypeError(f"config must be a keras_roll.roll.config.RollConfig or None, got "
                        f"{config!r}; pass the hyperparameters by keyword instead, e.g. "
                        f"wrap(model, lam=2.0) or roll_loss(model, x, C=1.0).")
    fields = [f.name for f in dataclasses.fields(RollConfig)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise TypeError(f"Unknown ROLL hyperparameter(s) {unknown}; the fields of RollConfig "
                        f"are {fields}.")
    return dataclasses.replace(config, **overrides) if overrides else config


@dataclasses.dataclass(frozen=True)
class RollPlan:
    """A `RollConfig` resolved once against a model: what the loss, the estimators
    and the regularizer read (`keras_roll.roll.entry.roll_plan` makes it).

    Attributes:
        config: the validated hyperparameters.
        entry: the program step the tangents enter at (0: the model input; after a
            leading Rescaling / Normalization layer with `wrt=`).

    Example:

    ```python
    plan = roll_plan(lin, RollConfig(wrt="normalize"))
    plan.entry, plan.config.samples     # (1, None)
    ```
    """

    config: RollConfig
    entry: int

    def with_config(self, config: RollConfig) -> RollPlan:
        """The same plan with `config` (e.g. a tuned memory budget); `config.wrt`
        must be the plan's (the entry depends on it).

        Example:

        ```python
        plan.with_config(dataclasses.replace(plan.config, memory_budget=2**24))
        ```
        """
        if config.wrt != self.config.wrt:
            raise ValueError(f"RollPlan.with_config keeps the entry of wrt="
                             f"{self.config.wrt!r}; got a config with wrt={config.wrt!r}: "
                             f"make a new plan with roll_plan(lin, config).")
        return RollPlan(config, self.entry)
