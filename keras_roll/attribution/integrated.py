"""Integrated gradients, exact for piecewise-linear networks.

Integrated gradients (Sundararajan, Taly & Yan, ICML 2017) attribute
`f(x) - f(x0)` to the input coordinates:

    IG(x) = (x - x0) * integral_0^1 grad f(x0 + t (x - x0)) dt.

For a piecewise-linear network the gradient is constant inside each linear
region, so the integral is a finite sum over the regions the straight path from
the baseline `x0` to `x` crosses (`keras_roll.attribution.path_walk`): exact up to
round-off, complete (the attributions sum to `f(x) - f(x0)`), and with the
number of regions crossed. A Riemann sum (`steps=k`, with a `rule`) works for any
differentiable model. See docs/design.md, section "Exact integrated gradients".
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

import numpy as np
import tensorflow as tf

from keras_roll.attribution.gradients import check_count
from keras_roll.attribution.path_walk import exact_walk
from keras_roll.attribution.result import Attribution, deprecated_alias
from keras_roll.attribution.tape_gradients import TracedOnce, gradient_engine
from keras_roll.attribution.targets import check_baseline, read_examples, resolve_targets
from keras_roll.compile.caches import cached
from keras_roll.distribute import Replicas
from keras_roll.errors import UnsupportedModelError
from keras_roll.options import (
    GRADIENT_FIELDS,
    Choice,
    RunOptions,
    fixed_budget,
    progress_bar,
)

__all__ = ["RULES", "IntegratedGradients", "PathMethod", "RiemannRule", "integrated_gradients",
           "riemann_points"]

DEFAULT_MAX_REGIONS = 100_000


class RiemannRule(Choice):
    """The points of a Riemann sum of `k` gradients (`integrated_gradients(steps=k)`).

    * `RIGHT` ("right", the default): `t = i / k`, `i = 1..k`.
    * `LEFT` ("left"): `i = 0..k-1`.
    * `MIDPOINT` ("midpoint"): `t = (i + 1/2) / k`.
    * `TRAPEZOID` ("trapezoid"): `t = i / (k - 1)`, the end points weighted 1/2.

    Example:

    ```python
    ig = keras_roll.integrated_gradients(model, x, steps=32, rule=RiemannRule.TRAPEZOID)
    ```
    """

    RIGHT = "right"
    LEFT = "left"
    MIDPOINT = "midpoint"
    TRAPEZOID = "trapezoid"


class PathMethod(Choice):
    """How an `IntegratedGradients` was integrated: `EXACT` ("exact", region by
    region) or `RIEMANN` ("riemann", a Riemann sum).

    Example:

    ```python
    keras_roll.integrated_gradients(model, x).method is PathMethod.EXACT   # True
    ```
    """

    EXACT = "exact"
    RIEMANN = "riemann"


RULES = tuple(r.value for r in RiemannRule)


@dataclasses.dataclass(kw_only=True, repr=False)
class IntegratedGradients(Attribution):
    """Integrated-gradient attributions of a batch.

    Attributes:
        maps: `[B, *input_shape]` float64 attributions (`attributions` is their
            deprecated name).
        regions: `[B]` int, linear regions crossed by the path (exact method; for a
            path over `max_regions`, the estimated count), None for a Riemann sum.
        delta: `[B]` completeness gap `sum(attributions) - (f(x) - f(baseline))`.
        f_x: `[B]` the attributed function at `x` (the target's logit, or the sum of
            the targets' logits).
        f_baseline: `[B]` the same at the baseline.
        labels: `[B]` the class whose logit was attributed (-1 for a target of
            several classes).
        method: `PathMethod.EXACT` or `PathMethod.RIEMANN` (equal to "exact",
            "riemann").
        steps: the number of Riemann points, or None.
        rule: the `RiemannRule`, or None.
        targets: `[B, L]` the weights of the attributed logits.
        exact: `[B]` bool, whether each example's integral is exact (the exact
            method; False where a path over `max_regions` fell back to a Riemann
            sum of `fallback_steps` points), None for a Riemann sum.
        error: `[B]` the estimated error of each fallback's attributions: the
            largest absolute difference between its sums of `fallback_steps` and of
            half as many points; 0 where exact. None for a Riemann sum.
        piecewise_linear: False for a model that is not piecewise linear (Riemann
            sums through `tf.GradientTape`: no exact integral, no regions).
        note: why, in words, for such a model.

    Example:

    ```python
    ig = keras_roll.integrated_gradients(model, x)
    ig.maps.reshape(len(x), -1).sum(1) - (ig.f_x - ig.f_baseline)    # ~0
    ```
    """

    regions: np.ndarray | None
    delta: np.ndarray
    f_x: np.ndarray
    f_baseline: np.ndarray
    method: PathMethod
    steps: int | None = None
    rule: RiemannRule | None = None
    exact: np.ndarray | None = None
    error: np.ndarray | None = None

    EXAMPLE_FIELDS: ClassVar[tuple] = (*Attribution.EXAMPLE_FIELDS, "regions", "delta", "f_x",
                                       "f_baseline", "exact", "error")

    attributions = deprecated_alias("maps", "attributions")

    def __repr__(self) -> str:
        n = self.maps.shape[0]
        extra = (f", median_regions={float(np.median(self.regions)):g}"
                 if self.regions is not None and n else "")
        gap = float(np.max(np.abs(self.delta))) if n else 0.0
        return (f"IntegratedGradients(n={n}, method={str(self.method)!r}{extra}, "
                f"max_abs_delta={gap:.3g})")


def integrated_gradients(model, x, y=None, baseline=None, steps: int | None = None,
                         rule: RiemannRule | str | None = "right",
                         max_regions: int = DEFAULT_MAX_REGIONS,
                         fallback_steps: int | None = None,
                         options: RunOptions | None = None,
                         **overrides) -> IntegratedGradients:
    """Integrated gradients of the target logit, exact by default.

    * `steps=None`: the **exact** integral over the linear regions the straight
      path from the baseline to `x` crosses (batched rounds of probes; each finds
      one region's interval along the path, its gradient and its pattern). Regions
      thinner than 64 machine epsilons of the path are merged into a neighbour.
      Float64 models are complete to ~1e-12 (relative); float32 models to about
      1e-6, and their region counts merge such slivers. Needs a piecewise-linear
      model.
    * `steps=k`: a Riemann sum over `k` gradient evaluations with `rule`:
      "right" (`t = i / k`, `i = 1..k`), "left" (`i = 0..k-1`), "midpoint"
      (`t = (i + 1/2) / k`) or "trapezoid" (`t = i / (k - 1)`, `i = 0..k-1`, the
      end points weighted 1/2). Gradients are summed in float64. Works for any
      differentiable model (through `tf.GradientTape` when it is not piecewise
      linear).

    The logit is the model output before a final softmax / sigmoid.

    Args:
        model: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs, or a stream (`tf.data.Dataset`, generator,
            `PyDataset`) of `x` or `(x, y)` elements, batched or not.
        y: the targets: None (the predicted class; a stream's labels if it has
            them), an int, `[B]` integer labels, or `[B, L]` one-hot / multi-hot
            targets (the sum of the hot logits is attributed).
        baseline: a number, one example `[*input_shape]`, or `[B, *input_shape]`;
            None for zeros.
        steps: None (exact) or a positive number of Riemann points.
        rule: the Riemann rule for `steps=k` (see above).
        max_regions: the most regions one path may cross (each costs about one
            batched probe: a forward, tangent and backward pass). A path stops as
            soon as it reaches them, or as soon as its estimated count (regions
            found per length of path covered) passes twice them, which bounds the
            work of every call; the path then raises an error, or falls back.
        fallback_steps: None (an error for a path over `max_regions`) or `k`: such
            a path is integrated by a Riemann sum of `k` points with `rule`
            instead, with a `RuntimeWarning`; `result.exact` is False for it and
            `result.error` estimates its error (the other paths stay exact).
        options: a `keras_roll.RunOptions`, or None.
        **overrides: its fields: `memory_budget` (bytes of live tensors per
            compiled chunk), `verbose` ("auto": a progress bar for runs
            longer than a second, True or False) and `strategy` (a
            `tf.distribute.Strategy` whose replicas share the examples; default
            the strategy in scope); `batch_size` and `rigor` do not apply to
            gradients.

    Returns:
        An `IntegratedGradients`.

    Raises:
        ValueError: naming the argument, for bad inputs, targets, baselines or rules.
        keras_roll.UnsupportedModelError: for `steps=None` on a model that is not
            piecewise linear (naming the layer).
        RuntimeError: when a path crosses more than `max_regions` regions and
            `fallback_steps` is None.

    Example:

    ```python
    ig = keras_roll.integrated_gradients(model, x, y)           # exact
    ig.attributions.sum(axis=(1, 2, 3)) - (ig.f_x - ig.f_baseline)   # ~0
    ig.regions                                                  # regions crossed
    approx = keras_roll.integrated_gradients(model, x, y, steps=64, rule="trapezoid")
    capped = keras_roll.integrated_gradients(model, x, y, max_regions=2000,
                                             fallback_steps=256)
    capped.exact, capped.error          # which paths are exact; the others' error
    ```
    """
    opts = RunOptions.of(options, uses=(*GRADIENT_FIELDS, "strategy"),
                         caller="integrated_gradients",
                         **overrides)
    budget = fixed_budget(opts.memory_budget)
    rule = RiemannRule.parse(rule, "rule", default=RiemannRule.RIGHT)
    if steps is not None:
        steps = check_count(steps, "steps")
        riemann_points(steps, rule)  # checks the rule against the steps
    max_regions = check_count(max_regions, "max_regions")
    if fallback_steps is not None:
        fallback_steps = check_count(fallback_steps, "fallback_steps")
        riemann_points(fallback_steps, rule)
    engine = _engine(model, exact=steps is None)
    x, y = read_examples(x, y, engine.spec)
    n = x.shape[0]
    base = check_baseline(baseline, x, engine.check)
    logits = engine.logits(np.concatenate([x, base]), budget).astype(np.float64)
    logits_x, logits_b = logits[:n], logits[n:]
    targets = resolve_targets(y, n, logits.shape[1], engine.output_link, logits_x,
                              engine.spec.name)
    f_x = np.sum(targets.weights * logits_x, axis=1)
    f_b = np.sum(targets.weights * logits_b, axis=1)
    replicas = Replicas.of(opts.strategy)
    with opts.progress(n, "integrated gradients") as bar:
        bar = replicas.serial(bar)
        if steps is None:
            cap = _Cap(max_regions, fallback_steps, rule)
            parts = replicas.map(lambda sl: _exact(
                engine, x[sl], base[sl], targets.weights[sl], cap, budget, bar, sl.start or 0), n)
            attr, regions, exact, error = (np.concatenate(v) for v in zip(*parts))
            cap.warn(exact, regions)
        else:
            attr = np.concatenate(replicas.map(lambda sl: _riemann(
                engine, x[sl], base[sl], targets.weights[sl], steps, rule, budget, bar), n))
            regions = exact = error = None
    delta = attr.reshape(n, -1).sum(axis=1) - (f_x - f_b)
    return IntegratedGradients(
        maps=attr, regions=regions, delta=delta, f_x=f_x, f_baseline=f_b,
        labels=targets.labels, method=PathMethod.EXACT if steps is None else PathMethod.RIEMANN,
        steps=steps,
        rule=None if steps is None else rule, targets=targets.weights, exact=exact,
        error=error, piecewise_linear=engine.piecewise_linear, note=engine.note)


@dataclasses.dataclass(frozen=True)
class _Cap:
    """`max_regions` and what a path over it gets: an error, or a Riemann sum."""

    max_regions: int
    fallback_steps: int | None
    rule: RiemannRule

    def check(self, over: np.ndarray, regions: np.ndarray, first: int):
        if over.any() and self.fallback_steps is None:
            e = int(np.flatnonzero(over)[0])
            raise RuntimeError(
                f"The path from the baseline to example {first + e} crosses about "
                f"{int(regions[e])} linear regions (estimated from those found), more than "
                f"max_regions={self.max_regions}: its exact integral would take about one "
                f"probe per region; raise max_regions, pass fallback_steps=k for a Riemann "
                f"sum of k points on such paths, or use steps=k for a Riemann sum.")

    def warn(self, exact: np.ndarray, regions: np.ndarray):
        if exact.all():
            return
        warnings.warn(
            f"{int((~exact).sum())} of {exact.size} paths cross more than max_regions="
            f"{self.max_regions} linear regions (up to about {int(regions[~exact].max())}); "
            f"their integrated gradients are Riemann sums of fallback_steps="
            f"{self.fallback_steps} points (result.exact False, result.error their "
            f"estimated error). Raise max_regions for exact ones.", RuntimeWarning,
            stacklevel=3)


def _exact(engine, x, base, weights, cap: _Cap, budget, bar, first: int):
    """`(attributions, regions, exact [n] bool, error [n])` of the exact walk, with the
    paths over the cap integrated by Riemann sums (or an error)."""
    attr, regions, over = exact_walk(engine, x, base, weights, cap.max_regions, budget, bar)
    cap.check(over, regions, first)
    error = np.zeros(x.shape[0])
    if over.any():
        sel = np.flatnonzero(over)
        k = cap.fallback_steps
        halved = max(k // 2, 2 if cap.rule is RiemannRule.TRAPEZOID else 1)
        with progress_bar(None, False, "fallback") as quiet:  # examples counted already
            full, half = (_riemann(engine, x[sel], base[sel], weights[sel], steps, cap.rule,
                                   budget, quiet) for steps in (k, halved))
        attr[sel] = full
        error[sel] = np.abs(full - half).reshape(sel.size, -1).max(axis=1)
    return attr, regions, ~over, error


def _engine(model, exact: bool):
    try:
        return gradient_engine(model, need_linear=exact)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(
            f"{e} The exact integral (steps=None) needs a piecewise-linear model; pass "
            f"steps=k for a Riemann sum, which works for any differentiable model.") from None


def riemann_points(steps: int, rule: RiemannRule | str) -> tuple[np.ndarray, np.ndarray]:
    """`(t [k], weights [k])` float64 of a Riemann rule with `k = steps` points.

    Raises:
        ValueError: for an unknown rule, or "trapezoid" with fewer than 2 points.

    Example:

    ```python
    riemann_points(4, "trapezoid")   # t = 0, 1/3, 2/3, 1; weights 1/6, 1/3, 1/3, 1/6
    ```
    """
    rule = RiemannRule.parse(rule, "rule")
    k = int(steps)
    i = np.arange(k, dtype=np.float64)
    if rule is RiemannRule.TRAPEZOID:
        if k < 2:
            raise ValueError(f"rule='trapezoid' needs steps >= 2 (both end points), got {k}.")
        w = np.full(k, 1.0 / (k - 1))
        w[[0, -1]] /= 2
        return i / (k - 1), w
    offset = {RiemannRule.RIGHT: 1.0, RiemannRule.LEFT: 0.0, RiemannRule.MIDPOINT: 0.5}[rule]
    return (i + offset) / k, np.full(k, 1.0 / k)


def _riemann_fn(engine):
    """Compiled: the weighted sums `[m, D]` float64 of the gradients at the points
    `base + t (x - base)` of `m` examples, `size` points of each per gradient call,
    the blocks looped over in the graph (one call per group of examples)."""
    return cached(engine, ("riemann",), lambda: _compile_riemann(engine))


def _compile_riemann(engine):
    # Behind an affine prefix (a first Dense / convolution layer) the points stay on
    # a segment in the prefix's output `u`: the prefix runs on the two end points,
    # the gradients are taken at `u` and summed there, and the sum goes back to the
    # input through the prefix's transpose once (`keras_roll.compile.prefix`).
    prefix = engine.affine_prefix

    def block(x, base, t, w, weights):
        m, k = tf.shape(x)[0], tf.shape(t)[0]
        rank = len(x.shape) - 1
        alpha = tf.reshape(tf.cast(t, x.dtype), [1, -1] + [1] * rank)
        pts = base[:, None] + alpha * (x - base)[:, None]
        pts = tf.reshape(pts, tf.concat([[m * k], tf.shape(x)[1:]], 0))
        weights = tf.repeat(weights, k, axis=0)
        if prefix is None:
            grad, _ = engine.objective_gradient(pts, weights)
        else:
            grad, _ = engine.objective_gradient(pts, weights, entry=prefix)
        grad = tf.reshape(tf.cast(grad, tf.float64), tf.stack([m, k, -1]))
        return tf.einsum("mkd,k->md", grad, w)

    def riemann(x, base, t, w, weights, size):
        ends = (x, base)
        if prefix is not None:
            ends = tuple(prefix.apply(e, engine.dtype) for e in ends)
        d = int(np.prod(ends[0].shape[1:]))
        steps = tf.shape(t)[0]

        def body(i, acc):
            sl = slice(i * size, tf.minimum((i + 1) * size, steps))
            return i + 1, acc + block(*ends, t[sl], w[sl], weights)

        acc = tf.zeros(tf.stack([tf.shape(x)[0], d]), tf.float64)
        acc = tf.ensure_shape(acc, [None, d])
        _, acc = tf.while_loop(lambda i, _: i * size < steps, body, (0, acc))
        if prefix is not None:
            acc = tf.reshape(prefix.transpose(acc, x), tf.stack([tf.shape(x)[0], -1]))
        return acc

    x_spec = TracedOnce.batch_spec(engine.input_shape, engine.dtype)
    t_spec = tf.TensorSpec((None,), tf.float64)
    return TracedOnce(riemann, x_spec and [x_spec, x_spec, t_spec, t_spec,
                                           tf.TensorSpec((None, None), engine.dtype),
                                           tf.TensorSpec((), tf.int32)])


def _riemann(engine, x, base, weights, steps, rule, budget, bar):
    n = x.shape[0]
    t, w = riemann_points(steps, rule)
    chunk = engine.chunk_size(x.shape[1:], budget, total=n * steps)
    fn = _riemann_fn(engine)
    weights = weights.astype(engine.dtype)
    total = np.zeros((n, int(np.prod(x.shape[1:]))))
    if steps <= chunk:  # several examples per gradient call
        group, size = max(1, chunk // steps), steps
    else:  # one example per call, its points in balanced blocks
        group, size = 1, -(-steps // -(-steps // chunk))
    t, w, size = tf.constant(t), tf.constant(w), tf.constant(size)
    for e0 in range(0, n, group):
        sl = slice(e0, e0 + group)
        total[sl] = fn(tf.constant(x[sl]), tf.constant(base[sl]), t, w,
                       tf.constant(weights[sl]), size).numpy()
        bar.update(x[sl].shape[0])
    diff = x.reshape(n, -1).astype(np.float64) - base.reshape(n, -1).astype(np.float64)
    return (diff * total).reshape(x.shape)
