"""SmoothGrad and VarGrad: the mean and the variance of the input gradient under noise.

SmoothGrad (Smilkov et al., 2017) averages the gradient of the target logit over
`x + e`, `e ~ N(0, sigma^2 I)`; VarGrad (Adebayo et al., 2018) takes its variance.
For a piecewise-linear network every noise sample that stays in the linear region
of `x` has exactly the gradient of `x`: the result reports the fraction of samples
that did (their activation pattern equals that of `x`, checked in the same pass),
the certified radius of `x`'s region, and the probability that a noise sample stays
within it, `P(||e||_2 < r_2)` (a chi-square tail), a lower bound on that fraction's
expectation. See docs/design.md, section "SmoothGrad".

Example:

```python
res = keras_roll.smoothgrad(model, x, y, noise=0.15, samples=50, seed=0, radius=True)
res.maps, res.vargrad             # [B, *input_shape] each
res.in_region                     # [B] fraction of samples in x's linear region
res.certified_fraction            # [B] P(||e||_2 < certified l2 radius)
```
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from keras_roll.attribution.gradients import check_count, same_pattern
from keras_roll.attribution.result import WithRadius, deprecated_alias
from keras_roll.attribution.saliency import (
    attribution_options,
    certified_radius,
    target_gradients,
)
from keras_roll.attribution.targets import check_scalar
from keras_roll.compile.caches import cached
from keras_roll.options import RunOptions, check_seed, fixed_budget

__all__ = ["SmoothGrad", "smoothgrad"]



@dataclasses.dataclass(kw_only=True, repr=False)
class SmoothGrad(WithRadius):
    """SmoothGrad and VarGrad maps of a batch.

    Attributes:
        maps: `[B, *input_shape]` float64, the SmoothGrad map: the mean gradient
            over the samples (`smoothgrad` is its deprecated name).
        vargrad: `[B, *input_shape]` float64, its variance over the samples.
        gradient: `[B, *input_shape]` the gradient at `x` itself.
        noise_std: `[B]` the standard deviation `sigma` of each example's noise.
        samples: noise samples per example.
        labels: `[B]` the class whose logit was differentiated (-1 for several).
        targets: `[B, L]` the weights of the differentiated logits.
        in_region: `[B]` the fraction of samples in the linear region of `x` (same
            activation pattern), None for a model that is not piecewise linear.
        seed: the seed that reproduces the run (the drawn entropy when `seed=None`).
        piecewise_linear: False for a model that is not piecewise linear.
        note: why there is no radius, for such a model.
        radius: `{p: [B]}` certified l2 and l_inf radii of `x`'s region
            (`smoothgrad(..., radius=True)`, `keras_roll.stable_radius`).
        certified_fraction: `[B]` `P(||e||_2 < radius[2])`: the probability that a
            noise sample stays in `x`'s region by the certificate alone (needs
            `radius`).

    Example:

    ```python
    res = keras_roll.smoothgrad(model, x, samples=32, seed=0, radius=True)
    res.maps, res.vargrad, res.certified_fraction
    ```
    """

    vargrad: np.ndarray
    gradient: np.ndarray
    noise_std: np.ndarray
    samples: int
    in_region: np.ndarray | None
    seed: int

    smoothgrad = deprecated_alias("maps", "smoothgrad")

    @property
    def smoothgrad_sq(self) -> np.ndarray:
        """The mean squared gradient (captum's "smoothgrad_sq")."""
        return self.vargrad + self.maps ** 2

    @property
    def certified_fraction(self) -> np.ndarray:
        """`P(||e||_2 < r_2)` for `e ~ N(0, sigma^2 I_D)`: `P(chi2_D < (r_2 / sigma)^2)`."""
        r = np.asarray(self.radius[2], np.float64)
        d = float(np.prod(self.maps.shape[1:]))
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(self.noise_std > 0, (r / self.noise_std) ** 2, np.inf)
        q = np.where(np.isfinite(q), q, 1e300)
        return tf.math.igamma(d / 2, q / 2).numpy()

    def __repr__(self) -> str:
        n = self.maps.shape[0]
        extra = (f", median_in_region={float(np.median(self.in_region)):.3g}"
                 if self.in_region is not None and n else "")
        return f"SmoothGrad(n={n}, samples={self.samples}{extra})"


def smoothgrad(model, x, y=None, noise: float = 0.15, samples: int = 50,
               seed: int | None = None, absolute_noise: bool = False, radius: bool = False,
               options: RunOptions | None = None, **overrides) -> SmoothGrad:
    """SmoothGrad and VarGrad of the target logit, reproducible per example.

    Each example `x_i` gets `samples` points `x_i + e`, `e ~ N(0, sigma_i^2 I)`, with
    `sigma_i = noise * (max(x_i) - min(x_i))` (the noise level of Smilkov et al.;
    PAIR saliency's `stdev_spread`), or `sigma_i = noise` with `absolute_noise=True`.
    Every example draws from its own stream of `np.random.SeedSequence(seed)`, so a
    fixed `seed` reproduces a run bit for bit, and an example's result does not depend
    on the others in the batch or on the chunking.

    Args:
        model: a Keras model or a `Linearized`; a model that is not piecewise linear
            is differentiated by `tf.GradientTape` (no radius, no `in_region`).
        x: `[B, *input_shape]` inputs, or a stream of `x` or `(x, y)` elements.
        y: the targets: None (the predicted class; a stream's labels), an int, `[B]`
            integer labels, or `[B, L]` one-hot / multi-hot targets (summed logits).
        noise: the noise level (relative to each example's range), >= 0.
        samples: noise samples per example.
        seed: None or a non-negative integer.
        absolute_noise: `noise` is the standard deviation itself, in input units.
        radius: also certify the radii of `x`'s regions (`SmoothGrad.radius`,
            `certified_fraction`; one `keras_roll.certify` of `x`).
        options: a `keras_roll.RunOptions`, or None.
        **overrides: its fields: `memory_budget` (bytes of live tensors per
            compiled chunk) and `verbose` ("auto": a progress bar for runs
            longer than a second, True or False); `batch_size` and `rigor`
            apply to the radius (`radius=True`; see `keras_roll.certify`) and
            are a `TypeError` without it.

    Returns:
        A `SmoothGrad`.

    Raises:
        ValueError: naming the argument, for bad inputs, targets, noise or seeds.

    Example:

    ```python
    res = keras_roll.smoothgrad(model, x_test[:8], y_test[:8], noise=0.15, seed=0)
    plt.imshow(keras_roll.attribution.postprocess_saliency(res.maps)[0])
    res.in_region
    ```
    """
    opts = attribution_options(options, overrides, radius, "smoothgrad",
                               uses=("memory_budget", "verbose"))
    budget = fixed_budget(opts.memory_budget)
    noise = check_scalar(noise, "noise", 0.0, low_open=False)
    samples = check_count(samples, "samples")
    check_seed(seed)
    engine, x, targets, grad, _ = target_gradients(model, x, y, budget)
    n = x.shape[0]
    flat = x.reshape(n, -1).astype(np.float64)
    sigma = np.full(n, noise) if absolute_noise else noise * (flat.max(1) - flat.min(1))
    seq = np.random.SeedSequence(seed)
    streams = [np.random.default_rng(s) for s in seq.spawn(n)]
    with opts.progress(n, "smoothgrad") as bar:
        mean, var, same = _noisy_gradients(engine, x, grad, targets.weights, sigma, samples,
                                           streams, budget, bar)
    linear = engine.piecewise_linear
    return SmoothGrad(
        maps=mean.reshape(x.shape), vargrad=var.reshape(x.shape), gradient=grad,
        noise_std=sigma, samples=samples, labels=targets.labels, targets=targets.weights,
        in_region=same / samples if linear else None, seed=int(seq.entropy),
        piecewise_linear=linear, note=engine.note,
        _radius=certified_radius(engine, x, opts, radius))


def _function(engine):
    """Compiled: per-example sums of the differences to the gradient at `x` and of
    their squares (float64), and how many points keep their example's pattern."""
    return cached(engine, ("smoothgrad",), lambda: _compile_sums(engine))


def _compile_sums(engine):
    linear = engine.piecewise_linear

    def sums(points, weights, owner, groups, ref_grad, ref_piece, ref_valid):
        if linear:
            grad, _, neurons = engine.objective_gradient(points, weights, neurons=True)
            same = tf.cast(same_pattern(neurons, owner, ref_piece, ref_valid), tf.float64)
        else:
            grad, _ = engine.objective_gradient(points, weights)
            same = tf.zeros(tf.shape(owner), tf.float64)
        g = tf.cast(tf.reshape(grad, tf.stack([tf.shape(points)[0], -1])), tf.float64)
        g -= tf.gather(ref_grad, owner)  # shifted by the gradient at x: exact variances
        seg = lambda v: tf.math.unsorted_segment_sum(v, owner, groups)  # noqa: E731
        return seg(g), seg(g * g), seg(same)

    return tf.function(sums, reduce_retracing=True, autograph=False)


def _noisy_gradients(engine, x, grad, weights, sigma, samples, streams, budget, bar):
    """`(mean [n, D], variance [n, D], samples in x's region [n])` over the noise;
    `grad` is the gradient at `x`, by which the sums are shifted."""
    n, ex_shape = x.shape[0], x.shape[1:]
    fn = _function(engine)
    acc = np.zeros((3, n, int(np.prod(ex_shape))))  # sums, sums of squares, same (col 0)
    chunk = engine.chunk_size(ex_shape, budget, total=n * samples)
    if engine.piecewise_linear:
        _, _, piece, valid = engine.gradients(x, np.zeros(n, np.int32), np.ones(n), budget,
                                              pattern=True)
    else:
        piece = valid = np.zeros((n, 0), np.int32)
    weights = weights.astype(engine.dtype)
    ref = grad.reshape(n, -1).astype(np.float64)

    def run(examples, counts):
        """One compiled call: `counts[j]` more samples of each example `examples[j]`."""
        eps = [streams[e].standard_normal((c, *ex_shape)) * sigma[e]
               for e, c in zip(examples, counts)]
        points = np.concatenate([x[e].astype(np.float64) + d for e, d in zip(examples, eps)])
        owner = np.repeat(np.arange(len(examples), dtype=np.int32), counts)
        out = fn(tf.constant(points.astype(engine.dtype)), tf.constant(weights[examples][owner]),
                 tf.constant(owner), tf.constant(len(examples)), tf.constant(ref[examples]),
                 tf.constant(piece[examples]), tf.constant(valid[examples]))
        for k, part in enumerate(out):
            part = part.numpy()
            if k < 2:
                acc[k, examples] += part
            else:
                acc[2, examples, 0] += part

    if samples <= chunk:
        group = max(1, chunk // samples)
        for e0 in range(0, n, group):
            examples = np.arange(e0, min(n, e0 + group))
            run(examples, np.full(examples.size, samples))
            bar.update(examples.size)
    else:
        for e in range(n):
            for s0 in range(0, samples, chunk):
                run(np.array([e]), np.array([min(chunk, samples - s0)]))
            bar.update(1)
    shift = acc[0] / samples
    var = np.maximum(acc[1] / samples - shift ** 2, 0.0)
    return ref + shift, var, acc[2, :, 0]
