"""`RobustRadius`: lower and upper bounds on each input's minimal adversarial perturbation.

Numpy arrays throughout (docs/design.md, section "Return types"), dicts by norm that
accept 1, 2, np.inf, 'l1', 'l2', 'linf' (`NormDict`, as `Certificate`'s), and a
`summary()` in the style of the certificate tables.

Example:

```python
rr = keras_roll.robust_radius(model, x_test[:100], y_test[:100])
rr.summary()
rr.certified_accuracy(0.03, np.inf)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from keras_roll.compile.bounds import IntermediateChoice
from keras_roll.compile.units import INPUT_UNITS, Units
from keras_roll.geometry import NORM_LABELS, NormDict
from keras_roll.options import Choice, Rigor, parse_norm
from keras_roll.summary import Summary, format_table, percentiles_of

__all__ = ["BoundSource", "RobustMethod", "RobustRadius"]

PER_NORM = ("lower", "upper", "adversarial", "exact", "exact_value", "runner_up",
            "lower_method", "upper_method", "bound_passes", "attack_steps", "seconds")


class RobustMethod(Choice):
    """How `robust_radius` bounds the minimal adversarial perturbation
    (docs/design.md, "Robustness radius").

    * `BEST` ("best", the default): every method that applies, the larger lower
      and the smaller upper bound.
    * `REGION` ("region"): the linear region of `x` (exact inside it).
    * `WALK` ("walk"): an upper bound by walking region by region.
    * `RELAXATION` ("relaxation"): a sound lower bound by linear relaxation.
    * `INTERVAL` ("interval"): the same search with interval bounds alone.
    * `ALPHA_CROWN` ("alpha_crown"): the same search with the relaxation's lower
      slopes optimized per margin (alpha-CROWN), never looser than "relaxation".
    * `ATTACK` ("attack"): an upper bound by a minimal-norm gradient attack
      (`keras_roll.robust.attacks`).

    Example:

    ```python
    upper_only = keras_roll.robust_radius(model, x, y, method="walk")
    ```
    """

    BEST = "best"
    REGION = "region"
    WALK = "walk"
    RELAXATION = "relaxation"
    INTERVAL = "interval"
    ATTACK = "attack"
    ALPHA_CROWN = "alpha_crown"

    @property
    def finds_points(self) -> bool:
        """Whether the method looks for adversarial points (upper bounds)."""
        return self not in (RobustMethod.RELAXATION, RobustMethod.INTERVAL,
                            RobustMethod.ALPHA_CROWN)


class BoundSource(Choice):
    """Which method gave a bound of `RobustRadius` (`lower_method`, `upper_method`).

    `NONE` (""): none did; `LABEL`: a misclassified input (0); `REGION`,
    `DECISION`: method 1 (the region margin, the nearest decision hyperplane);
    `INTERVAL`, `CROWN_IBP`, `RELAXATION`, `ALPHA_CROWN`: a bound pass's certified
    radius; `BRANCH`: branch and bound; `WALK`: the region walk's point; `ATTACK`:
    the minimal-norm attack's point; `SEARCH`: a point of the radius search's probes
    at fixed radii between the certified radius and the upper bound
    (`keras_roll.robust.upper_search.shrink_upper`).

    Example:

    ```python
    rr.upper_method[np.inf] == BoundSource.ATTACK      # [B] bool
    ```
    """

    NONE = ""
    LABEL = "label"
    REGION = "region"
    DECISION = "decision"
    INTERVAL = "interval"
    CROWN_IBP = "crown_ibp"
    RELAXATION = "relaxation"
    ALPHA_CROWN = "alpha_crown"
    BRANCH = "branch"
    WALK = "walk"
    ATTACK = "attack"
    SEARCH = "search"

    @classmethod
    def array(cls, values, name: str) -> np.ndarray:
        """`values` as an object array of members (strings are parsed)."""
        out = np.empty(np.shape(values), object)
        out[...] = [cls.parse(v, name) for v in np.asarray(values, object).ravel()]
        return out


def _fill_defaults(rr) -> None:
    """The fields a `RobustRadius` was built without: zero budgets, `exact_value`."""
    for name, dtype in zip(PER_NORM[-3:], (np.int64, np.int64, np.float64)):
        if getattr(rr, name) is None:
            setattr(rr, name, {p: np.zeros(len(v), dtype) for p, v in rr.lower.items()})
    if rr.exact_value is None:
        rr.exact_value = {p: np.where(np.asarray(rr.exact[p], bool), rr.upper[p], np.nan)
                          for p in rr.upper}


@dataclasses.dataclass(repr=False)
class RobustRadius:
    """Bounds on the minimal adversarial perturbation of every input, per norm.

    The minimal adversarial perturbation of `x` in the lp norm is the distance from
    `x` to the nearest point the model (as Keras evaluates it) assigns another class
    (with `labels`: a class other than the label; 0 for misclassified inputs).

    Attributes:
        lower: `{p: [B]}` float64: no point closer than this changes the prediction
            (under `rigor`, as `keras_roll.certify`); NaN for `nonfinite` inputs.
            In `units`, as all distances here.
        upper: `{p: [B]}` float64: the distance of `adversarial`, NaN where none was
            found within the search budget.
        adversarial: `{p: [B, *input_shape]}`: points whose prediction differs, in
            the model's input dtype (as float64) and input units (points the model
            takes), NaN rows where none.
        exact: `{p: [B]}` bool: the minimal perturbation is known, with its point:
            either `upper - lower <= exact_rtol * upper`, or method 1 found the
            nearest decision hyperplane inside the certified region (its distance
            in exact arithmetic on the weights is `exact_value`, and `[lower,
            upper]` is how far the model's own rounding may move it: the guard
            below, the push that makes the point's flip robust above).
        exact_value: `{p: [B]}` float64: where `exact`, the minimal perturbation
            (method 1's distance in exact arithmetic, else `upper`); NaN elsewhere.
        runner_up: `{p: [B]}` int64: the class of the adversarial point, else of
            the nearest decision hyperplane of the region (-1 if none).
        lower_method, upper_method: `{p: [B]}` `BoundSource` members (object arrays).
        bound_passes, attack_steps, seconds: `{p: [B]}` per input, the relaxation's bound
            passes, the attack's gradient steps, the methods' wall time (shared evenly).
        predicted: `[B]` int64, the class the model predicts (-1 for `nonfinite`).
        labels: `[B]` int64 or None, the labels given.
        method: the `RobustMethod` of the call; rigor: the rounding guard (a
            `Rigor`: 'float64', 'strict' or 'float32'); exact_rtol: see `exact`.
        nonfinite: `[B]` bool, inputs with NaN / inf values (or non-finite neurons):
            their bounds are NaN.
        units: the `keras_roll.compile.units.Units` of the distances (input units,
            or those of a leading Rescaling / Normalization's output: `wrt=`).
        intermediate: a tuple of the relaxation's `IntermediateChoice`s (CROWN or
            intervals, and why), one per distinct choice (empty where it did not run).

    Example:

    ```python
    rr = keras_roll.robust_radius(model, x, norms=(2, np.inf))
    rr.lower["l2"], rr.upper["l2"]           # [B] each
    rr.adversarial[np.inf][0]                # a point of another class
    ```
    """

    lower: dict
    upper: dict
    adversarial: dict
    exact: dict
    runner_up: dict
    lower_method: dict
    upper_method: dict
    predicted: np.ndarray
    labels: np.ndarray | None = None
    method: RobustMethod = RobustMethod.BEST
    rigor: Rigor = Rigor.FLOAT64
    exact_rtol: float = 1e-3
    nonfinite: np.ndarray | None = None
    exact_value: dict | None = None
    units: Units = INPUT_UNITS
    bound_passes: dict | None = None
    attack_steps: dict | None = None
    seconds: dict | None = None
    intermediate: tuple[IntermediateChoice, ...] = ()

    def __post_init__(self):
        _fill_defaults(self)
        for name in PER_NORM:
            value = getattr(self, name)
            if not isinstance(value, NormDict):
                value = NormDict({parse_norm(k): v for k, v in value.items()})
                setattr(self, name, value)
            if name.endswith("_method"):
                value.update({p: BoundSource.array(v, name) for p, v in value.items()})
        self.method = RobustMethod.parse(self.method, "method")
        self.rigor = Rigor.parse(self.rigor)
        if self.nonfinite is None:
            self.nonfinite = np.zeros(self.n, bool)

    @classmethod
    def concat(cls, parts: Sequence[RobustRadius]) -> RobustRadius:
        """The bounds of the inputs of `parts`, in order: the result of one call over
        the concatenated inputs (each input's bounds depend on it alone).

        Raises:
            ValueError: no parts, or parts of different methods, rigors,
                `exact_rtol`, norms, or with labels in some parts only.

        Example:

        ```python
        rr = RobustRadius.concat([robust_radius(model, xa, ya), robust_radius(model, xb, yb)])
        ```
        """
        parts = list(parts)
        if not parts:
            raise ValueError("RobustRadius.concat needs at least one RobustRadius.")
        first = parts[0]
        key = (first.method, first.rigor, first.exact_rtol, first.norms, first.units)
        for i, q in enumerate(parts):
            if (q.method, q.rigor, q.exact_rtol, q.norms, q.units) != key:
                raise ValueError(
                    f"RobustRadius of different runs cannot be concatenated: part {i} has "
                    f"method={str(q.method)!r}, rigor={str(q.rigor)!r}, exact_rtol="
                    f"{q.exact_rtol!r}, norms={q.norms}, units {q.units.describe()}; part 0 "
                    f"has {str(key[0])!r}, {str(key[1])!r}, {key[2]!r}, {key[3]}, "
                    f"{key[4].describe()}.")
        labelled = [q.labels is not None for q in parts]
        if any(labelled) and not all(labelled):
            raise ValueError(f"RobustRadius.concat: parts {labelled.index(False)} and "
                             f"{labelled.index(True)} differ in having labels; bound all "
                             f"parts with labels or all without.")
        fields = {name: {p: np.concatenate([getattr(q, name)[p] for q in parts])
                         for p in first.norms} for name in PER_NORM}
        labels = np.concatenate([q.labels for q in parts]) if all(labelled) else None
        return cls(**fields, predicted=np.concatenate([q.predicted for q in parts]),
                   labels=labels, method=first.method, rigor=first.rigor,
                   exact_rtol=first.exact_rtol, units=first.units,
                   nonfinite=np.concatenate([q.nonfinite for q in parts]),
                   intermediate=_distinct_choices(parts))

    @property
    def n(self) -> int:
        """Number of inputs."""
        return int(np.shape(self.predicted)[0])

    @property
    def norms(self) -> tuple:
        return tuple(self.lower)

    @property
    def correct(self) -> np.ndarray:
        """`[B]` bool: predicted == label (all True without labels, False if nonfinite)."""
        ok = ~np.asarray(self.nonfinite, bool)
        if self.labels is None:
            return ok
        return ok & (np.asarray(self.predicted) == np.asarray(self.labels))

    def certified_accuracy(self, eps: float, p=np.inf) -> float:
        """The share of inputs classified correctly with a certified radius above `eps`.

        `eps = 0` gives the accuracy. Without labels, the share with `lower > eps`.
        `eps` is read in `units` (those of `robust_radius(wrt=...)`).

        Example:

        ```python
        rr.certified_accuracy(0.03, "linf")       # 0.62
        ```
        """
        if not np.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be a finite radius >= 0, got {eps!r}.")
        ok = self.correct if eps == 0 else self.correct & (self.lower[p] > eps)
        return float(np.mean(ok)) if self.n else float("nan")

    def gap(self, p) -> np.ndarray:
        """`[B]` `upper / lower` (inf where the lower bound is 0, NaN without upper)."""
        lo, up = self.lower[p], self.upper[p]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(lo > 0, up / lo, np.where(np.isfinite(up), np.inf, np.nan))

    def __repr__(self) -> str:
        parts = [f"n={self.n}", f"method={str(self.method)!r}", f"rigor={str(self.rigor)!r}"]
        for p in self.norms:
            lab = NORM_LABELS[p]
            median = percentiles_of(self.lower[p][self.correct], (50,))[0]
            parts.append(f"median_lower_{lab}={median:.4g}")
            parts.append(f"exact_{lab}={float(np.mean(self.exact[p])) if self.n else 0:.0%}")
        return f"RobustRadius({', '.join(parts)})"

    def summary(self, print_fn=None, percentiles=(10, 50, 90)) -> Summary:
        """Percentiles of the bounds and of their ratio over the correctly classified
        inputs, the share solved exactly and which methods gave the bounds: a `Summary`
        (its `str` is the table; a notebook shows it); `print_fn` also receives the text.

        Nothing undefined is shown as a number: misclassified inputs (radius 0 by
        definition) and non-finite ones are counted apart, not folded into the
        percentiles; an upper bound that is NaN (no adversarial point found, or a
        method that finds none) and a ratio over a lower bound of 0 are left out of
        their rows and counted, with the reason, below the table; a row with no value
        left prints `n/a`.

        Example:

        ```python
        keras_roll.robust_radius(model, x_test[:100], y_test[:100]).summary()
        ```
        """
        solved = self.correct
        rows = []
        no_upper, zero_lower = {}, {}  # count -> the norms with that many
        for p in self.norms:
            lab = NORM_LABELS[p]
            lower, upper = self.lower[p][solved], self.upper[p][solved]
            found = np.isfinite(upper)
            ratio = found & (lower > 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                rows += [(f"{lab} lower", lower), (f"{lab} upper", upper[found]),
                         (f"{lab} upper / lower", upper[ratio] / lower[ratio])]
            no_upper.setdefault(int(np.sum(~found)), []).append(lab)
            zero_lower.setdefault(int(np.sum(found & (lower <= 0))), []).append(lab)
        inputs = "correctly classified inputs" if self.labels is not None else "inputs"
        head = (f"Minimal adversarial perturbation ({self.units.describe()}) of the "
                f"{int(solved.sum())} {inputs} of {self.n}: method '{self.method}', rigor "
                f"'{self.rigor}'")
        out = [format_table(head, rows, percentiles, count=True, column="Bound")]
        out += _undefined_lines(self.method, no_upper, zero_lower, int(solved.sum()))
        out += [self._methods_line(p) for p in self.norms]
        out += [_choice_line(c) for c in self.intermediate]
        if self.labels is not None:
            wrong = int(np.sum(~solved & ~self.nonfinite))
            line = f"Accuracy {self.certified_accuracy(0.0):.1%}"
            out.append(line + "." if not wrong else
                       f"{line}: {wrong} misclassified input(s), radius 0 by definition "
                       f"(lower = upper = 0), counted apart from the table.")
        if self.nonfinite.any():
            out.append(f"{int(self.nonfinite.sum())} input(s) with non-finite values: bounds "
                       f"NaN, counted apart from the table.")
        return Summary.emit(out, print_fn)

    def _methods_line(self, p) -> str:
        lab = NORM_LABELS[p]
        solved = self.correct
        if not solved.any():
            return f"{lab}: no correctly classified finite input to bound."
        exact = float(np.mean(self.exact[p][solved]))
        found = float(np.mean(np.isfinite(self.upper[p][solved])))

        def counts(arr):
            names, num = np.unique(np.asarray(arr)[solved], return_counts=True)
            return ", ".join(f"{n or 'none'} {c}" for n, c in zip(names, num))

        of = " of the correctly classified" if self.labels is not None else ""
        spent = ", ".join(f"{np.mean(getattr(self, f)[p][solved]):.4g} {f.replace('_', ' ')}"
                          for f in PER_NORM[-3:])
        return (f"{lab}: exact {exact:.0%}{of}, adversarial found {found:.0%}; lower from "
                f"[{counts(self.lower_method[p])}], upper from [{counts(self.upper_method[p])}]"
                f"; mean per input {spent}")


def _distinct_choices(parts) -> tuple:
    """The distinct `IntermediateChoice`s of `parts` (the first of each kind)."""
    choices = {c.bounds: c for q in reversed(parts) for c in q.intermediate}
    return tuple(sorted(choices.values(), key=lambda c: c.bounds.value))


def _choice_line(choice: IntermediateChoice) -> str:
    given_up = " Pass intermediate='crown' for CROWN's." if choice.gave_up else ""
    return f"Intermediate bounds of the relaxation: {choice.reason}{given_up}"


def _undefined_lines(method: RobustMethod, no_upper: dict, zero_lower: dict, n: int) -> list:
    """Why rows of the table leave values out, one line per reason and count (its
    norms named): NaN upper bounds, ratios over a lower bound of 0."""
    why = ("no adversarial point found within the search budget (max_regions)"
           if method.finds_points else
           f"method '{method}' bounds from below only; 'walk', 'region' or 'best' "
           f"also find adversarial points")
    lines = [f"upper ({', '.join(labs)}): NaN (undefined) for {k} of {n}: {why}."
             for k, labs in no_upper.items() if k]
    lines += [f"upper / lower ({', '.join(labs)}): undefined for {k} of {n} whose lower "
              f"bound is 0." for k, labs in zero_lower.items() if k]
    return lines
