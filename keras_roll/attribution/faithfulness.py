"""Faithfulness metrics of attributions: Deletion, Insertion and MuFidelity.

Each metric asks whether the features an attribution ranks high really move the
model's score (the model's output for the target, the probability when it ends in
a softmax; or the logit with `score="logit"`):

* **Deletion** (Petsiuk et al., 2018): set the features to the baseline value in
  decreasing order of attribution, `step_size` of them at a time; the curve of
  scores falls fast for a faithful attribution: a *lower* area under it is better.
* **Insertion**: start from the baseline and put the features of `x` back in the
  same order; a *higher* area is better.
* **MuFidelity** (Bhatt et al., 2020): the correlation, over random subsets `S` of
  `subset_fraction` of the features, between the attributions summed over `S` and
  the score's drop when `S` is set to the baseline; *higher* is better (1 for the
  exact attribution of a linear model).

A feature is an input entry, or for images (`channel_axis`) a pixel with all its
channels, ranked by its attributions summed over the channels. Areas are trapezoids
over the fraction of features changed. See docs/design.md, section "Faithfulness".

Example:

```python
ig = keras_roll.integrated_gradients(model, x, y)
f = keras_roll.faithfulness(model, x, y, ig.maps, seed=0)
f.summary()                      # mean Deletion / Insertion AUC, MuFidelity
f.curves["deletion"]             # [B, steps + 1] scores along the curve
```
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from keras_roll.attribution.gradients import check_count
from keras_roll.attribution.tape_gradients import gradient_engine
from keras_roll.attribution.targets import (
    check_baseline,
    check_scalar,
    read_examples,
    resolve_targets,
)
from keras_roll.compile.caches import compiled_call
from keras_roll.compile.twin import Linearized, unwrap
from keras_roll.options import GRADIENT_FIELDS, Choice, RunOptions, check_seed, fixed_budget
from keras_roll.summary import Summary

__all__ = ["METRICS", "Faithfulness", "Score", "faithfulness"]

_BETTER = {"deletion": "lower", "insertion": "higher", "mufidelity": "higher"}
METRICS = tuple(_BETTER)


class Score(Choice):
    """What `faithfulness` scores: `MODEL` ("model", the default: the model's output
    for the target, the peers' convention) or `LOGIT` ("logit": before a final
    softmax / sigmoid).

    Example:

    ```python
    keras_roll.faithfulness(model, x, y, maps, score="logit").score_kind is Score.LOGIT
    ```
    """

    MODEL = "model"
    LOGIT = "logit"


@dataclasses.dataclass(repr=False)
class Faithfulness:
    """Faithfulness scores of the attributions of a batch.

    Attributes:
        scores: `{metric: [B]}` per example: the Deletion and Insertion areas under
            their curves, the MuFidelity correlation (NaN where it is undefined).
        curves: `{"deletion" / "insertion": [B, K]}` the scores along the curves.
        fractions: `[K]` the fraction of features changed at each curve point.
        score_kind: `Score.MODEL` (the model's output) or `Score.LOGIT` (equal to
            "model", "logit").
        step_size, subset_fraction, samples: the arguments of the run.
        seed: the seed of MuFidelity's subsets (the drawn entropy when `seed=None`).
    """

    scores: dict
    curves: dict
    fractions: np.ndarray
    score_kind: Score
    step_size: float
    subset_fraction: float
    samples: int
    seed: int

    def mean(self) -> dict:
        """`{metric: mean over examples}` (NaN entries left out)."""
        return {m: float(np.nanmean(v)) if np.any(np.isfinite(v)) else float("nan")
                for m, v in self.scores.items()}

    def __repr__(self) -> str:
        means = ", ".join(f"{m}={v:.4g}" for m, v in self.mean().items())
        n = next(iter(self.scores.values())).shape[0] if self.scores else 0
        return f"Faithfulness(n={n}, {means})"

    def summary(self, print_fn=None) -> Summary:
        """The mean and quartiles of every metric, and which way is better: a
        `Summary` (its `str` is the table; a notebook shows it); `print_fn` also
        receives the text.

        Example:

        ```python
        keras_roll.faithfulness(model, x, y, ig.maps).summary()
        ```
        """
        n = next(iter(self.scores.values())).shape[0] if self.scores else 0
        lines = [f"Faithfulness of {n} attributions (score: {self.score_kind}, step "
                 f"{self.step_size:g} of the features)",
                 f"{'metric':<14}{'better':>8}{'mean':>11}{'P25':>11}{'P50':>11}{'P75':>11}"]
        for m, v in self.scores.items():
            ok = v[np.isfinite(v)]
            q = np.percentile(ok, [25, 50, 75]) if ok.size else [float("nan")] * 3
            lines.append(f"{m:<14}{_BETTER[m]:>8}{self.mean()[m]:>11.4g}"
                         + "".join(f"{p:>11.4g}" for p in q))
        return Summary.emit(lines, print_fn)


def faithfulness(model, x, y, attributions, metrics=METRICS, baseline=0.0,
                 step_size: float = 0.05, subset_fraction: float = 0.2, samples: int = 128,
                 score: Score | str | None = "model", channel_axis="auto", seed: int | None = None,
                 options: RunOptions | None = None, **overrides) -> Faithfulness:
    """Deletion, Insertion and MuFidelity of attributions (see the module docstring).

    Args:
        model: a Keras model or a `Linearized` (any differentiable model).
        x: `[B, *input_shape]` inputs, or a stream of `x` or `(x, y)` elements.
        y: the targets, as for `saliency`: None (the predicted class), an int, `[B]`
            labels, or `[B, L]` one-hot / multi-hot targets (their scores summed).
        attributions: `[B, *input_shape]` attributions of `x` (e.g. `ig.maps`).
        metrics: any of "deletion", "insertion", "mufidelity".
        baseline: the value a removed feature takes: a number, one example, or one
            per example.
        step_size: the fraction of the features changed per step of the curves.
        subset_fraction: MuFidelity's subset size, a fraction of the features.
        samples: MuFidelity's random subsets per example.
        score: "model" (the model's output for the target: the peers' convention)
            or "logit" (before a final softmax / sigmoid).
        channel_axis: "auto" (the last axis of image-like examples of rank >= 3 is
            a pixel's channels), an axis of the example, or None.
        seed: None or a non-negative integer (MuFidelity's subsets, per example).
        options: a `keras_roll.RunOptions`, or None.
        **overrides: `RunOptions` fields (`memory_budget`: bytes of live tensors per
            compiled chunk; `verbose`).

    Returns:
        A `Faithfulness`.

    Raises:
        ValueError: naming the argument, for unknown metrics, shapes or values.

    Example:

    ```python
    f = keras_roll.faithfulness(model, x, y, sal.gradient * x, step_size=0.1, seed=0)
    f.scores["deletion"], f.mean()
    ```
    """
    opts = RunOptions.of(options, uses=GRADIENT_FIELDS, caller="faithfulness", **overrides)
    budget = fixed_budget(opts.memory_budget)
    metrics = _check_metrics(metrics)
    step_size = check_scalar(step_size, "step_size")
    subset_fraction = check_scalar(subset_fraction, "subset_fraction")
    if step_size > 1 or subset_fraction > 1:
        raise ValueError(f"step_size and subset_fraction are fractions of the features, in "
                         f"(0, 1]; got {step_size!r} and {subset_fraction!r}.")
    samples = check_count(samples, "samples")
    score = Score.parse(score, "score", default=Score.MODEL)
    check_seed(seed)
    engine = gradient_engine(model)
    x, y = read_examples(x, y, engine.spec)
    n = x.shape[0]
    attr = np.asarray(attributions.numpy() if tf.is_tensor(attributions) else attributions,
                      np.float64)
    if attr.shape != x.shape or not np.all(np.isfinite(attr)):
        raise ValueError(f"attributions must be finite and shaped like x {x.shape}, got shape "
                         f"{attr.shape}.")
    base = check_baseline(baseline, x, engine.check)
    scorer = _Scorer(engine, model, score, budget)
    logits = engine.logits(x, budget) if y is None else None
    targets = resolve_targets(y, n, engine.num_logits(x.shape[1:]), engine.output_link, logits,
                              engine.spec.name)
    features = _Features(x, attr, channel_axis)
    seq = np.random.SeedSequence(seed)
    result = Faithfulness({}, {}, np.zeros(0), score, step_size, subset_fraction, samples,
                          int(seq.entropy))
    with opts.progress(n * len(metrics), "faithfulness", unit="metric") as bar:
        for m in metrics:
            if m == "mufidelity":
                streams = [np.random.default_rng(s) for s in seq.spawn(n)]
                result.scores[m] = _mufidelity(scorer, features, x, base, targets.weights,
                                               subset_fraction, samples, streams)
            else:
                result.fractions, result.curves[m] = _curve(scorer, features, x, base,
                                                            targets.weights, step_size,
                                                            insertion=m == "insertion")
                result.scores[m] = _area(result.fractions, result.curves[m])
            bar.update(n)
    return result


def _check_metrics(metrics) -> tuple:
    metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    bad = [m for m in metrics if m not in METRICS]
    if bad or not metrics:
        raise ValueError(f"metrics must be some of {', '.join(map(repr, METRICS))}, got "
                         f"{metrics!r}.")
    return tuple(dict.fromkeys(metrics))


class _Features:
    """The features of a batch (entries or pixels) and their ranking."""

    def __init__(self, x: np.ndarray, attr: np.ndarray, channel_axis):
        ex_shape = x.shape[1:]
        if channel_axis == "auto":
            channel_axis = -1 if len(ex_shape) >= 3 else None
        if channel_axis is not None:
            rank = len(ex_shape)
            if not isinstance(channel_axis, int) or not -rank <= channel_axis < rank:
                raise ValueError(f"channel_axis must be 'auto', None or an axis of an example "
                                 f"(rank {rank}), got {channel_axis!r}.")
            channel_axis %= rank
        self.axis = channel_axis
        per = attr.sum(axis=channel_axis + 1) if channel_axis is not None else attr
        self.importance = per.reshape(x.shape[0], -1)
        self.count = self.importance.shape[1]
        # decreasing importance, ties in index order
        self.order = np.argsort(-self.importance, axis=1, kind="stable")

    def mask(self, chosen: np.ndarray, ex_shape) -> np.ndarray:
        """`[m, *ex_shape]` bool, True on the entries of the chosen features `[m, F]`."""
        if self.axis is None:
            return chosen.reshape(-1, *ex_shape)
        shape = list(ex_shape)
        shape.pop(self.axis)
        m = chosen.reshape(-1, *shape)
        return np.broadcast_to(np.expand_dims(m, self.axis + 1), (m.shape[0], *ex_shape))


class _Scorer:
    """Scores of the targets at batches of points, in compiled chunks."""

    def __init__(self, engine, model, score, budget):
        self.engine, self.budget = engine, budget
        self.model = model.model if isinstance(model, Linearized) else unwrap(model)
        self.use_logits = score is Score.LOGIT
        self.fn = compiled_call(self.model)

    def __call__(self, points: np.ndarray, weights: np.ndarray) -> np.ndarray:
        if self.use_logits:
            out = self.engine.logits(points, self.budget)
        else:
            step = self.engine.chunk_size(points.shape[1:], self.budget, total=len(points))
            out = np.concatenate([np.asarray(self.fn(tf.constant(points[i:i + step])))
                                  for i in range(0, len(points), step)])
        return np.sum(out.reshape(len(points), -1).astype(np.float64) * weights, axis=1)


def _curve(scorer, features, x, base, weights, step_size, insertion):
    """`(fractions [K], scores [B, K])` of the Deletion (or Insertion) curve."""
    n, ex_shape = x.shape[0], x.shape[1:]
    f = features.count
    steps = int(np.ceil(1.0 / step_size - 1e-9))
    counts = np.minimum(np.round(np.arange(steps + 1) * step_size * f).astype(int), f)
    counts[-1] = f
    scores = np.empty((n, steps + 1))
    for i in range(n):
        rank = np.empty(f, int)
        rank[features.order[i]] = np.arange(f)
        chosen = rank[None, :] < counts[:, None]  # [K, F] the first k features
        mask = features.mask(chosen, ex_shape)
        start, other = (base[i], x[i]) if insertion else (x[i], base[i])
        points = np.where(mask, other[None], start[None]).astype(x.dtype)
        scores[i] = scorer(points, np.repeat(weights[i:i + 1], steps + 1, axis=0))
    return counts / f, scores


def _area(fractions: np.ndarray, curves: np.ndarray) -> np.ndarray:
    """Trapezoid areas under the curves `[B, K]` over `fractions [K]`."""
    widths = np.diff(fractions)
    return np.sum(widths * (curves[:, 1:] + curves[:, :-1]) / 2, axis=1)


def _mufidelity(scorer, features, x, base, weights, subset_fraction, samples, streams):
    n, ex_shape = x.shape[0], x.shape[1:]
    f = features.count
    k = max(1, int(round(subset_fraction * f)))
    out = np.full(n, np.nan)
    for i in range(n):
        picks = np.argsort(streams[i].random((samples, f)), axis=1)[:, :k]
        chosen = np.zeros((samples, f), bool)
        np.put_along_axis(chosen, picks, True, axis=1)
        mask = features.mask(chosen, ex_shape)
        points = np.where(mask, base[i][None], x[i][None]).astype(x.dtype)
        w = np.repeat(weights[i:i + 1], samples + 1, axis=0)
        s = scorer(np.concatenate([x[i:i + 1], points]), w)
        drop = s[0] - s[1:]
        summed = (chosen * features.importance[i]).sum(axis=1)
        if np.std(drop) > 0 and np.std(summed) > 0:
            out[i] = np.corrcoef(summed, drop)[0, 1]
    return out
