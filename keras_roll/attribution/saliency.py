"""Gradient saliency maps, their usual visual post-processing, and the certified
radius within which a saliency map provably does not change.

Inside the linear region of `x` the input gradient is constant, so the saliency map
of `x` is also the saliency map of every input within the region's margin
(Lee, Alvarez-Melis & Jaakkola, ICLR 2019): `stable_radius` certifies that radius.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from keras_roll.attribution.result import WithRadius
from keras_roll.attribution.tape_gradients import gradient_engine
from keras_roll.attribution.targets import read_examples, resolve_targets
from keras_roll.certification import certify
from keras_roll.compile.units import resolve_units
from keras_roll.distribute import Replicas
from keras_roll.errors import UnsupportedModelError
from keras_roll.options import FIELDS, RunOptions, fixed_budget

__all__ = ["Saliency", "attribution_options", "certified_radius", "postprocess_saliency",
           "saliency", "stable_radius"]


SALIENCY_FIELDS = ("memory_budget", "strategy")
"""The run options of the maps (no progress bar); `radius=True` reads all of them."""


def attribution_options(options, overrides: dict, radius: bool, caller: str,
                        uses: tuple = SALIENCY_FIELDS) -> RunOptions:
    """The `RunOptions` of an attribution with an optional certified radius.

    Args:
        options: the caller's `options` (a `RunOptions` or None).
        overrides: the caller's keyword overrides.
        radius: whether the call certifies the radius too (then every field of
            `certify` is read).
        caller: the public function, for the error message.
        uses: the fields the maps read without the radius.

    Raises:
        TypeError: a field the call does not read (the message says that the
            certificate's fields need `radius=True`).

    Example:

    ```python
    opts = attribution_options(None, {"memory_budget": 2**24}, False, "saliency")
    ```
    """
    try:
        return RunOptions.of(options, uses=FIELDS if radius else uses, caller=caller,
                             **overrides)
    except TypeError as e:
        if radius or set(overrides) - set(FIELDS):
            raise
        raise TypeError(f"{e} (batch_size, rigor and verbose apply to the certified radius: "
                        f"pass radius=True.)") from None


def certified_radius(engine, x, opts: RunOptions, radius: bool) -> dict | None:
    """`stable_radius` of `x` when `radius` is True (else None).

    Raises:
        UnsupportedModelError: `radius=True` for a model that is not piecewise
            linear (it has no linear regions).

    Example:

    ```python
    radius = certified_radius(gradient_engine(model), x, RunOptions(), True)   # {2:, inf:}
    ```
    """
    if not radius:
        return None
    if not engine.piecewise_linear:
        raise UnsupportedModelError(f"radius=True needs a piecewise-linear model: "
                                    f"{engine.note}.")
    return certify(engine.lin, x, norms=(2, np.inf), options=opts).margins


@dataclasses.dataclass(kw_only=True, repr=False)
class Saliency(WithRadius):
    """Saliency maps of a batch.

    Attributes:
        maps: `[B, ...]` the maps: the raw gradient, or the post-processed maps in
            [0, 1] (`[B, H, W]` for images) with `postprocess=True`.
        gradient: `[B, *input_shape]` the input gradient of the target logit (or of
            the sum of the target logits).
        labels: `[B]` the class whose logit was differentiated (-1 for a target of
            several classes).
        logits: `[B, L]` the (flattened) logits at `x`.
        postprocessed: whether `maps` are post-processed.
        targets: `[B, L]` the weights of the differentiated logits.
        piecewise_linear: False for a model that is not piecewise linear (gradients
            from `tf.GradientTape`, no radius).
        note: why, in words, for such a model.
        radius: `{p: [B]}` certified l2 and l_inf radii within which `gradient`
            (hence `maps`) is provably unchanged: the margins of the examples'
            linear regions (`keras_roll.certify`), computed by
            `saliency(..., radius=True)`.

    Example:

    ```python
    sal = keras_roll.saliency(model, x, radius=True)
    sal.maps.shape, sal.radius[2]
    ```
    """

    gradient: np.ndarray
    logits: np.ndarray
    postprocessed: bool

    EXAMPLE_FIELDS: ClassVar[tuple] = (*WithRadius.EXAMPLE_FIELDS, "gradient", "logits")

    def __repr__(self) -> str:
        return (f"Saliency(n={self.maps.shape[0]}, map_shape={self.maps.shape[1:]}, "
                f"postprocessed={self.postprocessed})")


def saliency(model, x, y=None, postprocess: bool = False, channel_axis="auto",
             radius: bool = False, options: RunOptions | None = None,
             **overrides) -> Saliency:
    """The input gradient of the label logit: a saliency map per example.

    The logit is the model output before a final softmax / sigmoid (folded as
    everywhere in keras_roll); gradients are in the model's raw input space.

    With `postprocess=True` the maps get the visual steps of the paper's
    Appendix K: sum over channels, absolute value, division by the example's
    99th percentile, clipping to [0, 1] (`postprocess_saliency`).

    Args:
        model: a Keras model or a `Linearized`; a model that is not piecewise
            linear is differentiated by `tf.GradientTape` (no radius).
        x: `[B, *input_shape]` inputs, or a stream (`tf.data.Dataset`, generator,
            `PyDataset`) of `x` or `(x, y)` elements, batched or not.
        y: the targets: None (the predicted class; a stream's labels if it has
            them), an int, `[B]` integer labels (a single sigmoid output takes
            0 / 1: class 0 is the negated logit), or `[B, L]` one-hot / multi-hot
            targets (the sum of the hot logits is differentiated).
        postprocess: apply the Appendix K post-processing to `maps`.
        channel_axis: the channel axis summed by the post-processing: "auto"
            (the last axis of image-like inputs of rank >= 3, none otherwise),
            an int axis of the example, or None.
        radius: also certify the l2 and l_inf radii within which the map is
            unchanged (`Saliency.radius`; one `keras_roll.certify` of `x`).
        options: a `keras_roll.RunOptions`, or None.
        **overrides: its fields: `memory_budget` (bytes of live tensors per
            compiled chunk), `strategy` (a `tf.distribute.Strategy` whose
            replicas share the examples; default the strategy in scope) and,
            with `radius=True`, `batch_size`, `verbose` and `rigor` (see
            `keras_roll.certify`); any other is a `TypeError`.

    Returns:
        A `Saliency`; with `radius=True` its `radius` gives the certified radii
        within which the map is unchanged.

    Raises:
        ValueError: naming the argument, for bad inputs or labels.

    Example:

    ```python
    sal = keras_roll.saliency(model, x_test[:8], y_test[:8], postprocess=True, radius=True)
    plt.imshow(sal.maps[0], cmap="gray")
    print("holds for every input within l2 distance", sal.radius[2][0])
    ```
    """
    opts = attribution_options(options, overrides, radius, "saliency")
    budget = fixed_budget(opts.memory_budget)
    engine, x, targets, grad, logits = target_gradients(model, x, y, budget,
                                                        Replicas.of(opts.strategy))
    maps = postprocess_saliency(grad, channel_axis) if postprocess else grad
    return Saliency(maps=maps, gradient=grad, labels=targets.labels, logits=logits,
                    postprocessed=bool(postprocess), targets=targets.weights,
                    piecewise_linear=engine.piecewise_linear, note=engine.note,
                    _radius=certified_radius(engine, x, opts, radius))


def postprocess_saliency(maps, channel_axis="auto", percentile: float = 99.0) -> np.ndarray:
    """The visual post-processing of the paper's Appendix K.

    Per example: sum over the channel axis, absolute value, division by the
    `percentile`-th percentile of the result (skipped where it is 0), clip to [0, 1].

    Args:
        maps: `[B, *input_shape]` gradients (not modified).
        channel_axis: "auto" (the last axis when an example has rank >= 3, as
            `[H, W, C]` images; none otherwise), an axis of the example
            (e.g. -1), or None.
        percentile: the normalising percentile, in (0, 100].

    Returns:
        `[B, ...]` float64 maps in [0, 1].

    Example:

    ```python
    vis = postprocess_saliency(grad)      # [B, H, W] for [B, H, W, C] gradients
    ```
    """
    g = np.asarray(maps, np.float64)
    if g.ndim < 1:
        raise ValueError(f"maps must have shape [B, ...], got shape {g.shape}.")
    if not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}.")
    if channel_axis == "auto":
        channel_axis = -1 if g.ndim >= 4 else None
    elif channel_axis is not None:
        rank = g.ndim - 1
        if not isinstance(channel_axis, int) or not -rank <= channel_axis < rank:
            raise ValueError(f"channel_axis must be 'auto', None or an axis of an example "
                             f"(rank {rank}), got {channel_axis!r}.")
        channel_axis = channel_axis if channel_axis < 0 else channel_axis + 1
    if channel_axis is not None:
        g = g.sum(axis=channel_axis)
    g = np.abs(g)
    flat = g.reshape(g.shape[0], int(np.prod(g.shape[1:])))
    scale = np.percentile(flat, percentile, axis=1) if flat.shape[1] else np.zeros(len(flat))
    scale = np.where(scale > 0, scale, 1.0).reshape(-1, *([1] * (g.ndim - 1)))
    return np.clip(g / scale, 0.0, 1.0)


def target_gradients(model, x, y, budget, replicas: Replicas = Replicas()):
    """`(engine, x, targets, gradients, logits)`: the inputs read and checked, the
    targets resolved (the predicted class for `y=None`) and the gradient of the
    targets' weighted logits at `x`, in chunks of `budget` bytes, the examples
    shared by `replicas`."""
    engine = gradient_engine(model)
    x, y = read_examples(x, y, engine.spec)
    n = x.shape[0]
    logits = None
    if y is None:
        logits = np.concatenate(replicas.map(lambda sl: engine.logits(x[sl], budget), n))
    targets = resolve_targets(y, n, engine.num_logits(x.shape[1:]),
                              engine.output_link, logits, engine.spec.name)
    parts = replicas.map(lambda sl: engine.weighted_gradients(x[sl], targets.weights[sl],
                                                              budget), n)
    grad = np.concatenate([g for g, _ in parts])
    logits = np.concatenate([lg for _, lg in parts])
    return engine, x, targets, grad, logits


def stable_radius(model, x, norms=(2, np.inf), options: RunOptions | None = None, *,
                  wrt: str | None = None, **overrides) -> dict:
    """Certified radii within which the saliency map of each example is unchanged.

    Every input within the returned lp distance of `x[i]` lies in the linear
    region of `x[i]`, where the input gradient of every logit (hence its
    saliency map, raw or post-processed) is exactly the same. These are the
    exact lp margins of `keras_roll.certify` (Lee et al., ICLR 2019, Prop. 6).

    Args:
        model: a piecewise-linear Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs, or a stream of them.
        norms: any of 1, 2, np.inf.
        options: a `keras_roll.RunOptions`, or None.
        wrt: None (radii in input units), or the name of a leading Rescaling /
            Normalization layer with a scalar scale: radii in its output's units
            (as `keras_roll.certify`'s `wrt`).
        **overrides: its fields (`batch_size`, `memory_budget`, `verbose`,
            `rigor`; see `keras_roll.certify`).

    Returns:
        `{p: [B] float64}`.

    Example:

    ```python
    r = keras_roll.stable_radius(model, x)
    print(f"this explanation holds for every input within l_inf {r[np.inf][0]:.3g}")
    keras_roll.stable_radius(model, x, wrt="rescaling")   # in the Rescaling's output units
    ```
    """
    opts = RunOptions.of(options, uses=FIELDS, caller="stable_radius", **overrides)
    engine = gradient_engine(model, need_linear=True)
    resolve_units(engine.lin.program, wrt)  # a bad wrt fails before the inputs are read
    x, _ = read_examples(x, None, engine.spec)
    return certify(engine.lin, x, norms=norms, options=opts, wrt=wrt).margins
