"""`robust_radius`: lower and upper bounds on the minimal adversarial perturbation.

Four methods, each usable alone and combined by `method="best"` (the larger lower
bound and the smaller upper bound of those that apply; docs/design.md, section
"Robustness radius"):

* `"region"` (`keras_roll.robust.region`): inside the linear region of `x`, the
  nearest decision hyperplane of the affine map; exact where it lies inside the
  certified region, else the region margin is the lower bound. About one `certify`.
* `"walk"` (`keras_roll.robust.walk`): an upper bound, a real adversarial point
  found by walking region by region toward the decision boundary.
* `"attack"` (`keras_roll.robust.attacks`): an upper bound, a minimal-norm gradient
  attack (FMN style) started from the region's and the walk's points.
* `"relaxation"` (`keras_roll.robust.bounds`): a sound lower bound beyond the
  region by a CROWN-style linear relaxation, the largest certified radius by a
  search steered by each pass's own bound (`keras_roll.robust.search`);
  `"interval"` is the same search with interval bounds alone
  (`keras_roll.compile.bounds.ibp`), the usual baseline.
  `"alpha_crown"` is the same search with the relaxation's lower slopes optimized
  per margin (`keras_roll.compile.bounds.alpha`), never looser than `"relaxation"`.

Example:

```python
rr = keras_roll.robust_radius(model, x_test[:100], y_test[:100], norms=(2, np.inf))
rr.summary()
```
"""

from __future__ import annotations

import copy
import time
import warnings

import numpy as np

from keras_roll.certification import certify
from keras_roll.compile.bounds import (
    BoundMethod,
    IntermediateBounds,
    SlopeOptions,
)
from keras_roll.compile.bounds.intermediate import DEFAULT_MAX_SECONDS
from keras_roll.compile.bounds.priors import PriorStore
from keras_roll.compile.twin import linearize
from keras_roll.compile.units import Units, resolve_units
from keras_roll.distribute import Replicas
from keras_roll.geometry import dual_norm, to_numpy
from keras_roll.inputs import LabelSpec, ModelOrTwin, read_batches
from keras_roll.options import FIELDS as RUN_FIELDS
from keras_roll.options import Norms, RunOptions, parse_norms
from keras_roll.robust.adversarial import predict_classes
from keras_roll.robust.arguments import (
    SearchOptions,
    bound_method_of,
    check_arguments,
    check_classifier,
    checked_options,
    warn_saturating_link,
)
from keras_roll.robust.attacks import AttackOptions, probe_attack, run_attack
from keras_roll.robust.bounds import intermediate_choice, relaxed_margins
from keras_roll.robust.branch import BranchOptions, branch_radius
from keras_roll.robust.region import decision_terms, link_gap, region_bounds
from keras_roll.robust.result import BoundSource, RobustMethod, RobustRadius
from keras_roll.robust.search import search_certified
from keras_roll.robust.walk import walk_bounds
from keras_roll.rounding.precision import unit_roundoff

__all__ = ["METHODS", "SearchOptions", "robust_radius"]

METHODS = tuple(m.value for m in RobustMethod)


class _Run:
    """One call's settings; `batch` bounds a batch into a `RobustRadius`."""

    def __init__(self, lin, norms, method: RobustMethod, run: RunOptions,
                 search: SearchOptions, units: Units):
        self.lin = lin
        self.twin = lin.at_dtype("float64")
        self.model = lin.model
        self.norms = norms
        self.method = method
        self.rigor = run.rigor
        self.run = run
        self.budget = run.budget(lin.memory_budget)
        self.search = search
        self.units = units
        self.bound = bound_method_of(self.twin, method)
        self.bar, self.shown, self.walked = None, 0, None

    def empty(self, x: np.ndarray, y) -> RobustRadius:
        """The bounds of a batch before any method ran: lower 0, no upper bound."""
        b = x.shape[0]

        def per_norm(make) -> dict:
            return {p: make() for p in self.norms}

        return RobustRadius(
            lower=per_norm(lambda: np.zeros(b)), upper=per_norm(lambda: np.full(b, np.nan)),
            adversarial=per_norm(lambda: np.full(x.shape, np.nan)),
            exact=per_norm(lambda: np.zeros(b, bool)),
            exact_value=per_norm(lambda: np.full(b, np.nan)),
            runner_up=per_norm(lambda: np.full(b, -1, np.int64)),
            lower_method=per_norm(lambda: np.full(b, BoundSource.NONE, object)),
            upper_method=per_norm(lambda: np.full(b, BoundSource.NONE, object)),
            bound_passes=per_norm(lambda: np.zeros(b, np.int64)),
            attack_steps=per_norm(lambda: np.zeros(b, np.int64)),
            seconds=per_norm(lambda: np.zeros(b)),
            predicted=np.full(b, -1, np.int64), labels=None if y is None else np.asarray(y),
            method=self.method, rigor=self.rigor, exact_rtol=self.search.exact_rtol,
            nonfinite=~np.all(np.isfinite(x.reshape(b, -1)), axis=1), units=self.units)

    def batch(self, x: np.ndarray, y, bar) -> RobustRadius:
        """The bounds of one batch, in the call's units."""
        b = x.shape[0]
        self.bar, self.shown = bar, 0  # the relaxation reports the examples it finishes
        rr = self.empty(x, y)
        bad, pred = rr.nonfinite, rr.predicted
        idx = np.flatnonzero(~bad)
        if idx.size:
            pred[idx] = predict_classes(self.model, x[idx])
        if y is not None:
            wrong = idx[pred[idx] != y[idx]]
            for p in self.norms:
                rr.upper[p][wrong], rr.adversarial[p][wrong] = 0.0, x[wrong]
                rr.exact_value[p][wrong] = 0.0
                rr.lower_method[p][wrong] = rr.upper_method[p][wrong] = BoundSource.LABEL
                rr.runner_up[p][wrong] = pred[wrong]
            idx = idx[pred[idx] == y[idx]]
        if idx.size:
            bad[idx] |= self._solve(x[idx], pred[idx], idx, rr)
        for p in self.norms:
            met = _bounds_meet(rr.lower[p], rr.upper[p], self.search.exact_rtol)
            rr.exact_value[p] = np.where(np.isnan(rr.exact_value[p]) & met, rr.upper[p],
                                         rr.exact_value[p])
            rr.exact[p] = np.isfinite(rr.exact_value[p]) & ~bad
            for field in (rr.lower, rr.upper, rr.exact_value, rr.adversarial):
                field[p][bad] = np.nan
            for field in (rr.lower, rr.upper, rr.exact_value):  # distances in the call's units
                field[p] = self.units.to_units(field[p])
        bar.update(b * len(self.norms) - self.shown)
        return rr

    def _finished(self, k: int) -> None:
        """Moves the progress bar by `k` examples finished within the batch."""
        self.bar.update(k)
        self.shown += k

    def _solve(self, x, pred, idx, rr: RobustRadius) -> np.ndarray:
        """Runs the methods on correctly classified finite inputs; returns `nonfinite`."""
        bad = np.zeros(x.shape[0], bool)
        x64 = x.astype(np.float64)
        terms = None
        if self.method in (RobustMethod.BEST, RobustMethod.REGION):
            bad, terms = self._region(x, x64, pred, idx, rr)
        for p in self.norms:
            todo = ~bad & ~_bounds_meet(rr.lower[p][idx], rr.upper[p][idx],
                                        self.search.exact_rtol) \
                & ~np.isfinite(rr.exact_value[p][idx])
            if self.method in (RobustMethod.BEST, RobustMethod.WALK):
                _timed(self._walk, x64, pred, idx, todo, p, rr)
            if self.method in (RobustMethod.BEST, RobustMethod.ATTACK):
                _timed(self._attack, x64, pred, idx, todo, p, rr)
            if self.bound is not None:
                if terms is None:
                    terms = decision_terms(self.twin, x64, pred, guard=False,
                                           memory_budget=self.budget)
                _timed(self._relaxation, x64, pred, idx, todo, p, rr, terms)
            if self.search.branch is not None and self.bound is not None:
                _timed(self._branch, x64, pred, idx, todo, p, rr, terms)
            if self.method is RobustMethod.BEST:
                _timed(self._search, x64, pred, idx, todo, p, rr)
        return bad

    def _region(self, x, x64, pred, idx, rr: RobustRadius):
        """Method 1; returns `(nonfinite, DecisionTerms)`."""
        cert = certify(self.lin, x, norms=self.norms, rigor=self.rigor,
                       batch_size=self.run.batch_size, memory_budget=self.run.memory_budget,
                       verbose=False)  # None / "auto": certify times its chunks
        terms = decision_terms(self.twin, x64, pred, guard=self.rigor,
                               memory_budget=self.budget)
        slack = 4.0 * (int(np.prod(x.shape[1:])) + 16) * unit_roundoff("float64")
        gap = self._gap(terms)
        for p in self.norms:
            margin = np.nan_to_num(cert.margins[p], nan=0.0)
            nb = region_bounds(self.model, x64, pred, terms, margin, p, slack, gap)
            rr.lower[p][idx] = nb.lower
            rr.lower_method[p][idx] = np.where(nb.lower < margin, BoundSource.DECISION,
                                               BoundSource.REGION)
            rr.exact_value[p][idx] = nb.exact_value
            _take_upper(rr, p, idx, nb, BoundSource.REGION)
        return np.asarray(cert.nonfinite, bool), terms

    def _gap(self, terms) -> float:
        """The logit margin the model's rounded output needs (`region.link_gap`)."""
        return link_gap(self.model, self.lin.output_link, terms.margins.shape[1] + 1,
                        self.rigor.guarded)

    def _walk(self, x64, pred, idx, todo, p, rr: RobustRadius):
        sub = np.flatnonzero(todo)
        self.walked = np.full(x64.shape, np.nan)  # the walk's points: starts of the attack
        if not sub.size:
            return
        nb = walk_bounds(self.model, self.twin, x64[sub], pred[sub], p,
                         self.search.max_regions, self.budget)
        self.walked[sub] = nb.adversarial
        _take_upper(rr, p, idx[sub], nb, BoundSource.WALK)

    def _attack(self, x64, pred, idx, todo, p, rr: RobustRadius):
        sub = np.flatnonzero(todo)
        if not sub.size:
            return
        starts = [rr.adversarial[p][idx[sub]]]  # the best so far, and the walk's
        if self.method is RobustMethod.BEST:
            starts.append(self.walked[sub])
        nb, steps = run_attack(self.model, x64[sub], p, pred=pred[sub],
                               lower=rr.lower[p][idx[sub]], start=starts,
                               options=self.search.attack, tol=self.search.exact_rtol,
                               probes=self.method is not RobustMethod.BEST)  # "best": later
        rr.attack_steps[p][idx[sub]] += steps
        _take_upper(rr, p, idx[sub], nb, BoundSource.ATTACK)

    def _search(self, x64, pred, idx, todo, p, rr: RobustRadius):
        """The attack's probes at fixed radii between the certified radius and the
        upper bound (`keras_roll.robust.search.shrink_upper`)."""
        open_ = ~_bounds_meet(rr.lower[p][idx], rr.upper[p][idx], self.search.exact_rtol)
        sub = np.flatnonzero(todo & open_ & np.isfinite(rr.upper[p][idx]))
        if not sub.size or not self.search.attack.probe_steps:
            return
        nb, steps = probe_attack(self.model, x64[sub], p, pred[sub], rr.adversarial[p][idx[sub]],
                                 rr.lower[p][idx[sub]], self.search.attack)
        rr.attack_steps[p][idx[sub]] += steps
        _take_upper(rr, p, idx[sub], nb, BoundSource.SEARCH)

    def _relaxation(self, x64, pred, idx, todo, p, rr: RobustRadius, terms):
        sub = np.flatnonzero(todo)
        if not sub.size:
            return
        xs, ps = x64[sub], pred[sub]
        bound = self.bound
        if bound is BoundMethod.RELAXATION:  # CROWN or CROWN-IBP: the call's choice
            choice = intermediate_choice(self.twin, xs, self.search.intermediate, self.budget,
                                         self.search.pass_seconds)
            bound, rr.intermediate = choice.method, (choice,)

        gap = self._gap(terms)  # certified where every margin exceeds it
        store = PriorStore(len(sub))  # each probe's layer bounds: priors of smaller ones

        def values(i, eps):
            bounds = relaxed_margins(self.twin, xs[i], ps[i], eps, p, method=bound,
                                     guard=self.rigor, memory_budget=self.budget,
                                     slopes=self.search.slopes, prior=store.get(i, eps))
            store.add(i, eps, bounds.boxes)
            return np.min(bounds.lower, axis=1) - gap, bounds.root(gap)

        known = rr.lower[p][idx[sub]]
        # The affine map at x steers the search: its margins at `known` and its
        # nearest decision hyperplane (the first radius tried).
        m, gq = terms.margins[sub], to_numpy(dual_norm(terms.gradients[sub], p))
        at_known = np.min(m - gq * known[:, None], axis=1) - gap
        with np.errstate(divide="ignore", invalid="ignore"):
            guess = np.min(np.where(gq > 0, m / gq, np.inf), axis=1)
            root0 = np.min(np.where(gq > 0, (m - gap) / gq, np.inf), axis=1)
        found = search_certified(values, known, rr.upper[p][idx[sub]], guess,
                                 self.search.bisect_tol, progress=self._finished,
                                 values_at_lower=at_known,
                                 value_at_zero=np.min(m, axis=1) - gap,
                                 root_at_zero=np.where(np.isfinite(root0), root0, np.nan))
        lo = found.lower
        rr.bound_passes[p][idx[sub]] += found.passes
        better = lo > known
        target = idx[sub[better]]
        rr.lower[p][target] = lo[better]
        rr.lower_method[p][target] = BoundSource.parse(bound.value)


    def _branch(self, x64, pred, idx, todo, p, rr: RobustRadius, terms):
        """Branch and bound where the bracket is still open (`keras_roll.robust.branch`)."""
        sub = np.flatnonzero(todo & ~_bounds_meet(rr.lower[p][idx], rr.upper[p][idx],
                                                  self.search.exact_rtol))
        if not sub.size:
            return
        at = idx[sub]
        res = branch_radius(self.model, self.twin, x64[sub], pred[sub], p, rr.lower[p][at],
                            rr.upper[p][at], rr.adversarial[p][at], gap=self._gap(terms),
                            rtol=self.search.exact_rtol, guard=self.rigor,
                            memory_budget=self.budget, options=self.search.branch)
        res.write(rr, p, at)


def _timed(method, x64, pred, idx, todo, p, rr: RobustRadius, *rest) -> None:
    """Runs `method` and shares its wall time among the inputs it ran on (`todo`)."""
    began = time.perf_counter()
    method(x64, pred, idx, todo, p, rr, *rest)
    rows = idx[todo]
    rr.seconds[p][rows] += (time.perf_counter() - began) / max(1, rows.size)


def _bounds_meet(lower, upper, rtol) -> np.ndarray:
    """Where `upper - lower <= rtol * upper` (a finite upper bound)."""
    with np.errstate(invalid="ignore"):
        return np.isfinite(upper) & (upper - lower <= rtol * upper)


def _take_upper(rr: RobustRadius, p, idx, nb, name):
    """Keeps the upper bounds of `nb` (a method's `NormBounds`) where they are smaller."""
    better = np.isfinite(nb.upper) & ~(nb.upper >= rr.upper[p][idx])
    target = idx[better]
    rr.upper[p][target] = nb.upper[better]
    rr.adversarial[p][target] = nb.adversarial[better]
    rr.runner_up[p][target] = nb.runner_up[better]
    rr.upper_method[p][target] = name
    unset = rr.runner_up[p][idx] < 0
    rr.runner_up[p][idx[unset]] = nb.runner_up[unset]


def robust_radius(model: ModelOrTwin, x, y=None, norms: Norms = (2, np.inf),
                  method: RobustMethod | str | None = "best", *, max_regions: int = 100,
                  bisect_tol: float = 1e-3, exact_rtol: float = 1e-3,
                  options: RunOptions | None = None, wrt: str | None = None,
                  attack: AttackOptions | None = None,
                  intermediate: IntermediateBounds | str = "auto",
                  pass_seconds: float | None = DEFAULT_MAX_SECONDS,
                  branch: BranchOptions | None = None, slopes: SlopeOptions | None = None,
                  **overrides) -> RobustRadius:
    """Lower and upper bounds on every input's minimal adversarial perturbation.

    The minimal adversarial perturbation of `x` in the lp norm is the distance to the
    nearest point that the model, as Keras evaluates it, assigns another class than
    it assigns `x` (with labels `y`: another class than `y`; 0 where the model
    misclassifies `x`). No input domain is imposed (no clipping to `[0, 1]`), so the
    lower bounds also hold on any domain.

    Methods (docs/guide.md, section "Robustness radius"; the maths and the soundness
    argument in docs/design.md, section "Robustness radius"):

    * `"region"`: inside the linear region of `x` the logits are affine; where the
      nearest decision hyperplane is closer than the certified region margin, the
      minimal perturbation is known exactly (lower = upper, with the point), else
      the region margin is the lower bound.
    * `"walk"`: an upper bound by walking region by region to the decision
      boundary; every point is checked in the Keras model.
    * `"attack"`: an upper bound by a minimal-norm gradient attack (after FMN,
      `keras_roll.robust.attacks`): from the walk's point (under `"best"`) or `x`,
      it shrinks the perturbation while the point stays adversarial; every point is
      checked in the Keras model.
    * `"relaxation"`: a sound lower bound beyond the region by linear relaxation
      (CROWN / DeepPoly), the largest certified radius by a bracketing search; its
      intermediate bounds (on every activation's input) by CROWN at every layer or
      by intervals (CROWN-IBP), as `intermediate=` says; `"interval"` uses interval
      bounds alone; `"alpha_crown"` optimizes the relaxation's lower slopes per margin
      (alpha-CROWN, budget `slopes=`), never looser than `"relaxation"`. Dense, convolutions,
      BatchNormalization, average pooling, reshapes, Add / Concatenate and
      ReLU-family activations; other layers raise `UnsupportedModelError` (and
      `"best"` falls back to `"region"`).
    * `"best"` (default): all that apply; the larger lower and smaller upper bound.

    **Rounding** (`rigor`, as `certify`; default "float64"): under "float64" and
    "strict" the lower bounds hold for the model as Keras evaluates it (float32;
    float16 / bfloat16 under mixed precision). Under "float64" with `certify`'s
    semantics: the region margin has its probabilistic guard, and method 1's logit
    margins `LAMBDA = 8` standard deviations of their rounding in the same model of
    rounding (each margin of each point fails with probability below 2.5e-14), or
    the worst-case bound where that allows more; the relaxation's passes bound the
    rounding of the margins and of every intermediate bound the same way (each bound
    of each point fails with probability below 2.5e-14).
    Under "strict" every term is worst case (sound whatever the
    rounding errors). "float32" bounds exact arithmetic on the weights (no guard).

    **Exact** (`RobustRadius.exact`): where `upper - lower <= exact_rtol * upper`, or
    where method 1's nearest decision hyperplane lies inside the certified region and
    its projection is confirmed with `lower > 0`: the minimal perturbation in exact
    arithmetic on the weights is then that distance (`exact_value`), and `[lower,
    upper]` only says how far the model's own rounding may move it.

    **Units** (`wrt=`): as `certify`'s; with `wrt="<layer>"` (a leading Rescaling /
    Normalization with a scalar scale) `lower`, `upper`, `exact_value` and the
    thresholds of `certified_accuracy` are in the units of its output; the
    adversarial points stay model inputs.

    Args:
        model: a Keras classifier (a model made by `keras_roll.wrap` is unwrapped) or
            its `Linearized`; its output `[B, L]`, `L >= 2` (logits or a softmax).
        x: `[B, *input_shape]` inputs, or a stream of batches (`tf.data.Dataset`,
            generator, `keras.utils.PyDataset` of `x` or `(x, y)`); rows with NaN /
            inf get NaN bounds and a warning.
        y: optional labels: `[B]` integer classes in `[0, L)`, or one integer for
            every input (checked as by every function: `keras_roll.inputs.check_labels`);
            for streams, taken from `(x, y)` elements unless given here.
        norms: any of 1, 2, np.inf (or 'l1', 'l2', 'linf').
        method: "best" (the default, also for None), "region", "walk", "attack",
            "relaxation", "alpha_crown" or "interval" (a
            `keras_roll.robust.RobustMethod`).
        max_regions: regions the walk may cross per input (and per refining line).
        bisect_tol: relative width of the relaxation search's final bracket: the lower
            bound is within `1 + bisect_tol` of the largest radius the pass certifies
            (default 1e-3, no wider than `exact_rtol`, so a search that meets the
            walk's point can claim `exact`).
        exact_rtol: `exact` where `upper - lower <= exact_rtol * upper` (and where
            method 1 located the minimum inside the region; see above).
        options: a `keras_roll.RunOptions` (batch_size, memory_budget, verbose,
            rigor, strategy), or None.
        wrt: None (input units), or the name of a leading Rescaling /
            Normalization layer with a scalar scale: distances in its output's units.
        attack: the budgets of the `"attack"` method, a
            `keras_roll.robust.AttackOptions` (steps, restarts, max_seconds, seed);
            None: its defaults.
        intermediate: where the relaxation's bounds on every activation's input come
            from: "crown" (CROWN at every layer, the tightest), "intervals" (CROWN-IBP:
            one pass, looser) or "auto" (the default: CROWN where its chunks fit the
            memory budget and its estimated time per pass and input fits
            `pass_seconds`, else intervals, with a warning that says what was given
            up); a `keras_roll.compile.bounds.IntermediateBounds`. The choice and its
            reason are recorded (`RobustRadius.intermediate`) and summarized.
        pass_seconds: the time budget of "auto": CROWN's estimated seconds per bound
            pass and input (a timed chunk of its pull-backs, extrapolated; the search
            runs about 4-6 passes per input and norm); None: no time budget.
        branch: None (the default), or a `keras_roll.robust.BranchOptions`: after
            the relaxation and the attack, branch and bound on ReLU splits
            (beta-CROWN, `keras_roll.robust.branch`) narrows every open bracket
            within its budget (`max_seconds` per input and norm); where it closes
            within `exact_rtol` the result is `exact`. Needs the relaxation
            (`method` "best" or "relaxation").
        slopes: the budget of the `"alpha_crown"` method per bound pass, a
            `keras_roll.robust.SlopeOptions` (steps, lr, decay, max_seconds);
            None: its defaults (20 Adam steps).
        **overrides: its fields, replacing those of `options`: `rigor`
            ("float64", the default, "strict" or "float32"), `batch_size`
            (examples per batch; streams of single examples are grouped),
            `memory_budget` (bytes of tangents / functionals per chunk, default
            the twin's), `verbose` ("auto", the default, True or False: a
            progress bar) and `strategy` (a `tf.distribute.Strategy` whose
            replicas share each batch; default the strategy in scope). None
            means the default.

    Returns:
        A `RobustRadius` (numpy arrays).

    Raises:
        ValueError: bad arguments or labels, an input without examples, a model that
            is not a classifier, or a `wrt` that names no leading Rescaling /
            Normalization with a scalar scale.
        keras_roll.UnsupportedModelError: layers the chosen method cannot bound.

    Example:

    ```python
    rr = keras_roll.robust_radius(model, x_test[:100], y_test[:100])
    rr.summary()                          # percentiles of lower / upper, share exact
    rr.certified_accuracy(0.1, np.inf)    # certified accuracy at l_inf radius 0.1
    rr = keras_roll.robust_radius(model, x_test[:100], y_test[:100], wrt="rescaling")
    rr.certified_accuracy(8 / 255, np.inf)    # in [0, 1] pixels for 0-255 inputs
    ```
    """
    run_options = RunOptions.of(options, uses=RUN_FIELDS, caller="robust_radius", **overrides)
    method = RobustMethod.parse(method, "method", default=RobustMethod.BEST)
    norms = parse_norms(norms)
    if not norms:
        raise ValueError("norms=() leaves nothing to bound; pass e.g. norms=(2, np.inf).")
    check_arguments(max_regions, bisect_tol, exact_rtol, pass_seconds)
    lin = linearize(model)
    units = resolve_units(lin.program, wrt)
    classes = check_classifier(lin)
    warn_saturating_link(lin, run_options.rigor)
    search = SearchOptions(int(max_regions), float(bisect_tol), float(exact_rtol),
                           checked_options(attack, AttackOptions, "attack",
                                    "AttackOptions(steps=200, restarts=5)"),
                           IntermediateBounds.parse(intermediate, "intermediate"),
                           None if pass_seconds is None else float(pass_seconds),
                           BranchOptions.of(branch),
                           checked_options(slopes, SlopeOptions, "slopes",
                                    "SlopeOptions(steps=50, lr=0.1)"))
    run = _Run(lin, norms, method, run_options, search, units)
    labels = LabelSpec(classes, model=lin.model.name)
    batches = read_batches(x, lin.input_spec, y=y, labels=labels,
                           batch_size=run_options.batch_size, split=True, finite=False)
    replicas = Replicas.of(run_options.strategy)
    parts = []
    with run_options.progress(None if batches.total is None else batches.total * len(norms),
                              "robust radius") as bar:
        bar = replicas.serial(bar)
        for batch in batches:  # a copy of `run` per replica: it tracks its batch's progress
            parts += replicas.map_batch(
                lambda part: copy.copy(run).batch(part.x.numpy(), part.y, bar), batch)
    rr = RobustRadius.concat(parts)
    if rr.nonfinite.any():
        warnings.warn(f"{int(rr.nonfinite.sum())} of {rr.n} inputs have non-finite values "
                      f"(NaN / inf), or non-finite neurons or logits: their bounds are NaN "
                      f"(see .nonfinite).", stacklevel=2)
    for choice in rr.intermediate:
        if choice.gave_up:
            warnings.warn(f"robust_radius took {choice.reason} Pass intermediate='crown' for "
                          f"CROWN's bounds, or a larger pass_seconds / memory_budget.",
                          stacklevel=2)
    return rr
