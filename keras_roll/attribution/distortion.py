"""Gradient distortion across linear regions (Lee et al., ICLR 2019, Table 4, App. J).

Certificates say how far the gradient is stable *inside* one linear region. Gradient
distortion measures how much it moves in a whole neighbourhood, across regions: for
the label logit `f_y` (a final softmax / sigmoid folded),

    Delta(x, x') = || grad f_y(x') - grad f_y(x) ||_1,

for `x'` in the l_inf ball of radius `eps` around `x` intersected with the input
box `domain`. `mode="expected"` averages it over uniform draws from that set;
`mode="max"` searches for its worst case with the paper's genetic algorithm.

Gradients are computed by reverse mode on batches of candidates, in compiled chunks
under the model's memory budget, batched across examples; the distances are reduced
inside the compiled call (`keras_roll.attribution.gradients.LogitGradients`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from collections.abc import Sequence

import numpy as np

from keras_roll.attribution.genetic import genetic_search, survivors
from keras_roll.attribution.gradients import LogitGradients, check_count, select_logits
from keras_roll.attribution.result import join_examples
from keras_roll.attribution.targets import read_examples
from keras_roll.compile.chunking import plan_directions
from keras_roll.compile.units import INPUT_UNITS, Units, resolve_units
from keras_roll.distribute import Replicas
from keras_roll.options import GRADIENT_FIELDS, Choice, RunOptions, check_seed, fixed_budget
from keras_roll.summary import Summary

__all__ = ["Distortion", "DistortionMode", "gradient_distortion", "sampling_box"]


class DistortionMode(Choice):
    """How `gradient_distortion` searches the ball: `EXPECTED` ("expected", the
    default: the mean over uniform draws) or `MAX` ("max": the paper's genetic
    algorithm, the worst case found).

    Example:

    ```python
    worst = keras_roll.gradient_distortion(model, x, mode=DistortionMode.MAX)  # or "max"
    ```
    """

    EXPECTED = "expected"
    MAX = "max"

_BUDGETS = 4  # a chunk's live tensors, a group's populations: 4 x the twin's budget


@dataclasses.dataclass(repr=False)
class Distortion:
    """Gradient distortion of a batch (the paper's Table 4).

    Attributes:
        distortion: `[B]` float64, the l1 distortion of the label logit's input
            gradient: the mean over `samples` uniform draws (`mode="expected"`)
            or the worst case found (`mode="max"`).
        points: `[B, *input_shape]` the maximiser of each example (`mode="max"`),
            None for `mode="expected"`.
        changed: `[B]` bool, whether the prediction at `points` differs from the
            prediction at `x` (`mode="max"`), None for `mode="expected"`.
        changed_fraction: `[B]` float64, the fraction of evaluated candidates whose
            prediction differs from the prediction at `x`.
        evaluations: input gradients evaluated per example.
        mode: the `DistortionMode` (equal to "expected" or "max").
        eps, domain: the arguments of the run (`eps` and `domain` in `units`).
        seed: the seed that reproduces the run (the drawn entropy when `seed=None`;
            None for a `concat` of runs with different seeds).
        units: the `keras_roll.compile.units.Units` of `eps`, `domain` and the
            gradients (input units, or a leading layer's output: `wrt=`).
    """

    distortion: np.ndarray
    points: np.ndarray | None
    changed: np.ndarray | None
    changed_fraction: np.ndarray
    evaluations: int
    mode: DistortionMode
    eps: float
    domain: tuple | None
    seed: int | None
    units: Units = INPUT_UNITS

    @property
    def n(self) -> int:
        return int(self.distortion.shape[0])

    @classmethod
    def concat(cls, parts: Sequence[Distortion]) -> Distortion:
        """The distortions of the examples of `parts`, in order.

        Each example's draws come from its own random stream, so the join equals
        one call over the concatenated inputs where the streams match (the
        replicas of one call). Parts drawn with different seeds (workers given
        `seed + worker`, say) join with `seed=None`: no one seed reproduces them.

        Raises:
            ValueError: no parts, or parts of runs with different `mode`, `eps`,
                `domain`, `evaluations` or units.

        Example:

        ```python
        d = Distortion.concat([gradient_distortion(model, x[w::2], seed=w) for w in (0, 1)])
        ```
        """
        return join_examples(cls, parts, ("distortion", "points", "changed",
                                          "changed_fraction"), differ={"seed": None})

    def __repr__(self) -> str:
        med = float(np.median(self.distortion)) if self.n else float("nan")
        extra = f", changed={int(self.changed.sum())}" if self.changed is not None else ""
        return (f"Distortion(n={self.n}, mode={str(self.mode)!r}, eps={self.eps:g}, "
                f"median={med:.4g}{extra})")

    def summary(self, print_fn=None, percentiles=(25, 50, 75, 100)) -> Summary:
        """The paper-style table, percentiles of the distortion: a `Summary` (its
        `str` is the table; a notebook shows it); `print_fn` also receives the text.

        Example:

        ```python
        keras_roll.gradient_distortion(model, x, y, mode="max").summary()
        ```
        """
        cols = [f"P{q:g}" for q in percentiles]
        width = 22 + 12 * (len(cols) + 1)
        label = {DistortionMode.EXPECTED: "expected l1",
                 DistortionMode.MAX: "max l1 (GA)"}[DistortionMode.parse(self.mode, "mode")]
        vals = (np.percentile(self.distortion, percentiles) if self.n
                else [float("nan")] * len(cols))
        mean = float(np.mean(self.distortion)) if self.n else float("nan")
        lines = [f"Gradient distortion ({self.units.describe()}): {self.n} examples, "
                 f"eps={self.eps:g} (l_inf), domain={_fmt_domain(self.domain)}, "
                 f"{self.evaluations} gradients per example",
                 "_" * width,
                 f"{'Distortion':<22}" + "".join(f"{c:>12}" for c in cols) + f"{'mean':>12}",
                 "=" * width,
                 f"{label:<22}" + "".join(f"{v:>12.4g}" for v in vals) + f"{mean:>12.4g}",
                 "_" * width]
        if self.changed is not None:
            lines.append(f"Prediction changed at the maximiser: {int(self.changed.sum())} "
                         f"of {self.n}")
        return Summary.emit(lines, print_fn)


def gradient_distortion(model, x, y=None, eps: float = 8 / 256, domain=(0.0, 1.0),
                        mode: DistortionMode | str | None = "expected", samples: int = 8000,
                        population: int = 4800,
                        generations: int = 30, seed: int | None = None, callback=None,
                        options: RunOptions | None = None, *, wrt: str | None = None,
                        **overrides) -> Distortion:
    """Expected or worst-case l1 distortion of the label logit's input gradient.

    For each example, `Delta(x') = ||grad f_y(x') - grad f_y(x)||_1` over the set
    `S = {x' : ||x' - x||_inf <= eps} ∩ domain` (Lee, Alvarez-Melis & Jaakkola,
    ICLR 2019, Table 4). A final softmax / sigmoid is folded: `f_y` is the logit.
    Distances are in the model's raw input space (normalisation layers inside the
    model are part of the function). The distortion is exactly 0 at a candidate
    with the activation pattern of `x` (same region, same gradient).

    * `mode="expected"`: the mean of `Delta` over `samples` uniform draws in `S`.
    * `mode="max"`: the paper's genetic algorithm (Appendix J): a uniform initial
      population of `population` points in `S`; each of `generations` generations
      keeps the best 25 % and refills the rest by crossover `a c + (1 - a) c'`
      (`a ~ U[-0.25, 1.25]`, one `a` per child, `c, c'` two survivors drawn
      uniformly with replacement), each child projected back onto `S` (clipped to
      the box). The result is the worst distortion found; survivors are not
      evaluated again, so a run evaluates
      `population + generations * (population - keep)` gradients per example.

    Every example draws from its own stream of `np.random.SeedSequence(seed)`, so
    a fixed `seed` reproduces a run bit for bit and an example's result does not
    depend on the other examples of the batch.

    Args:
        model: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs, or a stream (`tf.data.Dataset`, generator,
            `PyDataset`) of `x` or `(x, y)` elements, read whole.
        y: `[B]` integer labels, or one integer for every example (the logit to
            differentiate; a stream's labels if it has them); None: the predicted
            class. A single sigmoid output takes 0 / 1 (class 0 is the negated logit).
        eps: radius of the l_inf ball, > 0.
        domain: `(low, high)` box of valid inputs (scalars or arrays broadcastable
            to an example), or None for no box. `x` must lie inside it.
        mode: "expected" or "max".
        samples: uniform draws per example for `mode="expected"`.
        population: population size for `mode="max"`.
        generations: generations of the genetic algorithm.
        seed: None or a non-negative integer.
        callback: optional `callback(example_index [n], candidates [n, *input_shape],
            distortion [n])`, called on every evaluated chunk of candidates.
        options: a `keras_roll.RunOptions`, or None.
        wrt: None (input units), or the name of a leading Rescaling / Normalization
            layer with a scalar scale: `eps`, `domain` and the gradients in the
            units of its output.
        **overrides: its fields: `memory_budget` (bytes of live tensors per
            compiled chunk, default 4 x the twin's memory budget; the
            populations of a group of examples take up to 4 x the twin's
            budget, or 4 x `memory_budget`, beside it), `verbose` ("auto": a
            progress bar for runs longer than a second, True or False) and
            `strategy` (a `tf.distribute.Strategy` whose replicas share the
            examples, each drawing from its own stream: the one-device result;
            default the strategy in scope); `batch_size` and `rigor` do not
            apply to gradients.

    Returns:
        A `Distortion`.

    Raises:
        ValueError: naming the argument, for wrong label shapes, labels out of
            range, `eps <= 0`, `x` outside `domain`, NaN (naming the rows), an input
            without examples and other bad input.

    Example:

    ```python
    res = keras_roll.gradient_distortion(model, x_test[:100], y_test[:100],
                                         eps=8 / 256, mode="max", seed=0)
    res.summary()
    res.points        # [100, 28, 28, 1] the worst-case inputs
    res.changed.sum() # how many of them change the prediction
    ```
    """
    mode = DistortionMode.parse(mode, "mode", default=DistortionMode.EXPECTED)
    opts = RunOptions.of(options, uses=(*GRADIENT_FIELDS, "strategy"),
                         caller="gradient_distortion", **overrides)
    budget = fixed_budget(opts.memory_budget)
    samples = check_count(samples, "samples")
    population = check_count(population, "population")
    generations = check_count(generations, "generations", minimum=0)
    check_seed(seed)
    if callback is not None and not callable(callback):
        raise ValueError(f"callback must be callable, got {callback!r}.")
    engine = LogitGradients.of(model)
    lin = engine.lin
    units = resolve_units(lin.program, wrt)
    x, y = read_examples(x, y, engine.spec)
    eps = _check_eps(eps)
    if units.is_input:
        lo, hi, domain_used = sampling_box(x, eps, domain)
    else:
        box = _box_from_units(domain, units)
        try:
            lo, hi, _ = sampling_box(x, float(units.from_units(eps)), box)
        except ValueError as e:  # say which box in which units
            raise ValueError(f"{e} (domain={domain!r} in {units.describe()} is that box in "
                             f"the model's input units, where x is read.)") from None
        domain_used = domain if domain is None else tuple(domain)
    b_total = x.shape[0]
    index, sign = select_logits(y, b_total, engine.num_logits(x.shape[1:]), lin.output_link,
                                lin.model.name,
                                default_logits=_logits(engine, x) if y is None else None)

    seq = np.random.SeedSequence(seed)
    streams = [np.random.default_rng(s) for s in seq.spawn(b_total)]
    total = b_total * (samples if mode is DistortionMode.EXPECTED else population)
    chunk = engine.chunk_size(x.shape[1:], budget or _BUDGETS * lin.memory_budget, total=total)
    replicas = Replicas.of(opts.strategy)
    run = _Run(engine, chunk, None if callback is None else replicas.serial(callback), units)

    def shared(search, bar):  # each replica searches its examples, with its own streams
        run.bar = replicas.serial(bar)
        parts = replicas.map(lambda sl: search(run.on(sl), *(
            a[sl] for a in (x, index, sign, lo, hi)), streams[sl]), b_total)
        return tuple(None if p[0] is None else np.concatenate(p) for p in zip(*parts))

    if mode is DistortionMode.EXPECTED:
        with opts.progress(total, "gradient distortion", unit="grad") as bar:
            dist, frac = shared(lambda r, *a: _expected(r, *a[:5], samples, a[5]), bar)
        points = changed = None
        evaluations = samples
    else:
        keep = survivors(population)
        evaluations = population + generations * (population - keep)
        with opts.progress(b_total * evaluations, "gradient distortion (GA)",
                           unit="grad") as bar:
            dist, frac, points, changed = shared(lambda r, *a: _genetic(
                r, *a[:5], population, generations, keep, a[5], budget), bar)
    return Distortion(distortion=units.gradient_norm_to_units(dist), points=points,
                      changed=changed, changed_fraction=frac, evaluations=int(evaluations),
                      mode=mode, eps=eps, domain=domain_used, seed=int(seq.entropy),
                      units=units)


def sampling_box(x: np.ndarray, eps: float, domain):
    """The box `[lo, hi] = [x - eps, x + eps] ∩ domain` in the dtype of `x`.

    Bounds are rounded inwards when they are not representable in that dtype, so
    every point of the returned box lies in the exact set.

    Returns:
        `(lo, hi, domain)` with `lo, hi` shaped like `x` and `domain` the checked
        `(low, high)` pair (floats, or arrays shaped like an example; or None).

    Raises:
        ValueError: for a malformed `domain` or `x` outside it.

    Example:

    ```python
    lo, hi, _ = sampling_box(x, 8 / 256, (0.0, 1.0))   # every candidate lies in [lo, hi]
    ```
    """
    x64 = x.astype(np.float64)
    lo, hi = x64 - eps, x64 + eps
    checked = None
    if domain is not None:
        low, high = _check_domain(domain, x.shape[1:])
        outside = (x64 < low) | (x64 > high)
        if outside.any():
            ex = np.flatnonzero(outside.reshape(x.shape[0], int(np.prod(x.shape[1:]))).any(axis=1))
            raise ValueError(
                f"x lies outside domain=({_fmt(low)}, {_fmt(high)}) for examples "
                f"{ex[:5].tolist()} (values from {x64.min():.4g} to {x64.max():.4g}); "
                f"rescale x, pass the model's input range as domain, or domain=None."
            )
        lo, hi = np.maximum(lo, low), np.minimum(hi, high)
        checked = tuple(float(b.flat[0]) if b.size and np.all(b == b.flat[0]) else b
                        for b in (low, high))
    lo_t, hi_t = lo.astype(x.dtype), hi.astype(x.dtype)
    lo_t = np.where(lo_t.astype(np.float64) < lo, np.nextafter(lo_t, np.inf, dtype=x.dtype), lo_t)
    hi_t = np.where(hi_t.astype(np.float64) > hi, np.nextafter(hi_t, -np.inf, dtype=x.dtype), hi_t)
    # a box thinner than one ulp around x: x itself is in it
    lo_t, hi_t = np.minimum(lo_t, x), np.maximum(hi_t, x)
    return lo_t, hi_t, checked


# ---------------------------------------------------------------------- internals


class _Run:
    """Evaluates candidates in chunks, feeds the progress bar and the callback."""

    def __init__(self, engine: LogitGradients, chunk: int, callback, units: Units = INPUT_UNITS):
        self.engine = engine
        self.chunk = chunk
        self.callback = callback
        self.units = units
        self.bar = None

    def on(self, examples: slice) -> _Run:
        """This run for the examples `examples` of the call (a replica's share): the
        callback gets the call's example indices."""
        if not examples.start or self.callback is None:
            return self
        mine = copy.copy(self)
        mine.callback = lambda ex, *rest: self.callback(ex + examples.start, *rest)
        return mine

    def evaluate(self, cands: np.ndarray, owner: np.ndarray, ref, examples: np.ndarray):
        """`(l1 [n], changed [n])` of flat candidates; `owner` indexes `ref` rows,
        `examples` maps them to the caller's example indices (for the callback)."""
        n = cands.shape[0]
        l1 = np.empty(n, np.float64)
        changed = np.empty(n, bool)
        for i in range(0, n, self.chunk):
            sl = slice(i, min(n, i + self.chunk))
            l1[sl], changed[sl] = self.engine.distortion(cands[sl], owner[sl], ref)
            if self.callback is not None:
                self.callback(examples[owner[sl]], cands[sl].copy(),
                              self.units.gradient_norm_to_units(l1[sl].copy()))
            self.bar.update(sl.stop - sl.start)
        return l1, changed


def _expected(run: _Run, x, index, sign, lo, hi, samples, streams):
    b_total = x.shape[0]
    dist = np.zeros(b_total)
    frac = np.zeros(b_total)
    chunk = run.chunk
    # Examples whose draws fill about one chunk share a reference; every example draws
    # from its own stream in order, so the numbers do not depend on the chunking.
    group = max(1, min(b_total, -(-chunk // samples)))
    for g0 in range(0, b_total, group):
        ex = np.arange(g0, min(b_total, g0 + group))
        ref = run.engine.reference(x[ex], index[ex], sign[ex])
        draws = _uniform_draws(ex, lo, hi, samples, chunk, streams)
        for owner, cands in _rechunk(draws, chunk):
            l1, changed = run.evaluate(cands, owner, ref, ex)
            np.add.at(dist, ex[owner], l1)
            np.add.at(frac, ex[owner], changed)
    return dist / samples, frac / samples


def _uniform_draws(ex, lo, hi, samples, block, streams):
    """Yields `(owner [m], points [m, ...])`: `samples` uniform draws in the box of
    every example of `ex` (`owner` indexes `ex`), in blocks of at most `block`."""
    for e, i in enumerate(ex):
        low = lo[i].astype(np.float64)
        width = hi[i].astype(np.float64) - low
        for j in range(0, samples, block):
            m = min(block, samples - j)
            u = streams[i].random((m, *lo.shape[1:]))
            pts = np.clip((low + u * width).astype(lo.dtype), lo[i], hi[i])
            yield np.full(m, e, np.int64), pts


def _rechunk(blocks, size):
    """Regroups `(owner, points)` blocks into chunks of exactly `size` rows (the last
    one smaller)."""
    owners, points, count = [], [], 0
    for owner, pts in blocks:
        owners.append(owner)
        points.append(pts)
        count += owner.size
        while count >= size:
            o, p = np.concatenate(owners), np.concatenate(points)
            yield o[:size], p[:size]
            owners, points, count = [o[size:]], [p[size:]], count - size
    if count:
        yield np.concatenate(owners), np.concatenate(points)


def _genetic(run: _Run, x, index, sign, lo, hi, population, generations, keep, streams,
             budget):
    """Groups examples as their populations fit the population budget; the two
    populations of a group (current and next) stay in memory when one fits it, and go
    to a temporary file when a single example's population is larger."""
    d = int(np.prod(x.shape[1:]))
    budget = _BUDGETS * (budget or run.engine.lin.memory_budget)
    one = population * d * np.dtype(x.dtype).itemsize
    group = max(1, plan_directions(x.shape[0], one, budget)[0])  # examples per group
    in_memory = group * one <= budget
    return genetic_search(run, x, index, sign, lo, hi, population, generations, keep,
                          streams, group, in_memory)


def _logits(engine: LogitGradients, x) -> np.ndarray:
    zeros = np.zeros(x.shape[0], np.int32)
    return engine.gradients(x, zeros, np.ones(x.shape[0]))[1]


BOX_SLACK = 8 * float(np.finfo(np.float32).eps)  # relative; see _box_from_units


def _box_from_units(domain, units: Units):
    """A `(low, high)` box given in `units`, in input units (None stays None)."""
    if domain is None:
        return None
    try:
        low, high = domain
    except (TypeError, ValueError):
        raise ValueError(f"domain must be a (low, high) pair or None, got {domain!r}.") from None
    low, high = units.point_from_units(low), units.point_from_units(high)
    low, high = (low, high) if units.scale > 0 else (high, low)
    # The layer's scale is a float32 (1 / 255 is not one): (1 - b) / a lands a few float32
    # ulps off the input's own bound (254.99998 for 255); a bound that close to an
    # integer is that integer.
    slack = BOX_SLACK * max(abs(float(low)), abs(float(high)), 1.0)
    return tuple(float(np.round(v)) if abs(v - np.round(v)) <= slack else float(v)
                 for v in (low, high))


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise ValueError(f"eps must be a positive number (an l_inf radius), got {eps!r}.")
    eps = float(eps)
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a positive, finite l_inf radius, got {eps!r}.")
    return eps


def _check_domain(domain, ex_shape):
    try:
        low, high = domain
    except (TypeError, ValueError):
        raise ValueError(f"domain must be a (low, high) pair or None, got {domain!r}.") from None
    try:
        low = np.broadcast_to(np.asarray(low, np.float64), ex_shape)
        high = np.broadcast_to(np.asarray(high, np.float64), ex_shape)
    except (TypeError, ValueError) as e:
        raise ValueError(f"domain bounds must be numbers or arrays broadcastable to an "
                         f"example of shape {tuple(ex_shape)}: {e}") from None
    if np.isnan(low).any() or np.isnan(high).any() or not np.all(low < high):
        raise ValueError(f"domain must satisfy low < high everywhere, got "
                         f"({_fmt(low)}, {_fmt(high)}).")
    return low, high


def _fmt_domain(domain) -> str:
    return "None" if domain is None else f"({_fmt(domain[0])}, {_fmt(domain[1])})"


def _fmt(a) -> str:
    a = np.asarray(a)
    if a.size and np.all(a == a.flat[0]):
        return f"{a.flat[0]:g}"
    return f"array of shape {a.shape}"
