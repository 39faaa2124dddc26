"""Counting the complete linear regions (#CLR) met by a data set.

Lee, Alvarez-Melis & Jaakkola ("Towards Robust, Locally Linear Deep Networks",
ICLR 2019, Lemma 7): among a set of points, none of which lies on a region
boundary, the number of complete linear regions is

* at most the number of distinct activation patterns (points with the same
  pattern share one region), and
* at least the number of distinct output Jacobians (points in one region share
  their Jacobian, so distinct Jacobians mean distinct regions).

A point on a boundary (a valid neuron exactly at a breakpoint, with nonzero
gradient) belongs to several closed regions at once, and the bounds need not
hold; `count_regions` reports how many there are. See docs/design.md, section
"The maths" (Lemma 7).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.certification.gradient_norms import iter_gradient_norms
from keras_roll.certification.margin_math import neuron_arrays, neuron_distances
from keras_roll.certification.runs import nonfinite
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.twin import linearize
from keras_roll.compile.units import resolve_units
from keras_roll.inputs import ModelOrTwin, read_batches
from keras_roll.options import RunOptions
from keras_roll.rounding.guard import guard_for
from keras_roll.summary import Summary

__all__ = ["RegionCount", "count_regions"]


@dataclasses.dataclass(repr=False)
class RegionCount:
    """Bounds on the number of complete linear regions among `n` points (Lemma 7).

    All arrays are numpy (docs/design.md, section "Return types").

    Attributes:
        patterns: number of distinct activation patterns (upper bound on #CLR).
        jacobians: number of distinct output Jacobians (lower bound on #CLR).
        on_boundary: number of points lying on a region boundary; the bounds
            are guaranteed only when it is 0.
        n: number of points.
        pattern_ids: `[n]` int, the pattern of every point (numbered in order
            of first appearance).
        jacobian_ids: `[n]` int, the Jacobian class of every point.
        boundary: `[n]` bool, which points lie on a boundary.
    """

    patterns: int
    jacobians: int
    on_boundary: int
    n: int
    pattern_ids: np.ndarray
    jacobian_ids: np.ndarray
    boundary: np.ndarray

    @property
    def bounds_hold(self) -> bool:
        """Whether Lemma 7 applies (no point on a boundary)."""
        return self.on_boundary == 0

    def __repr__(self) -> str:
        return (f"RegionCount(n={self.n}, jacobians={self.jacobians} <= #CLR <= "
                f"patterns={self.patterns}, on_boundary={self.on_boundary})")

    def summary(self, print_fn=None) -> Summary:
        """The bounds as a small table: a `Summary` (its `str` is the table; a
        notebook shows it); `print_fn` also receives the text.

        Example:

        ```python
        keras_roll.count_regions(model, x_test).summary()
        ```
        """
        width = 56
        rows = [("points", self.n),
                ("#CLR lower bound (distinct Jacobians)", self.jacobians),
                ("#CLR upper bound (distinct patterns)", self.patterns),
                ("points on a boundary", self.on_boundary)]
        lines = ["Complete linear regions (Lee et al., ICLR 2019, Lemma 7)", "_" * width]
        lines += [f"{label:<44}{value:>12d}" for label, value in rows]
        lines.append("_" * width)
        if not self.bounds_hold:
            lines.append(f"{self.on_boundary} point(s) lie on a region boundary: the bounds "
                         f"are not guaranteed.")
        return Summary.emit(lines, print_fn)


def count_regions(model: ModelOrTwin, x, rtol: float = 1e-5, projections: int = 16,
                  seed: int = 0, options: RunOptions | None = None, *,
                  wrt: str | None = None, **overrides) -> RegionCount:
    """Bounds the number of complete linear regions among the points of `x`.

    Implements Lemma 7 of Lee et al. (ICLR 2019): the number of distinct
    activation patterns (the linear piece of every valid neuron, the winner of
    every max window) bounds #CLR from above, the number of distinct output
    Jacobians (of the logits) from below, provided no point lies on a boundary.

    Jacobians are compared through `J R` for a fixed random `[D, projections]`
    Gaussian `R` (exactly `J` when `D <= projections`), computed by one
    forward-mode pass per distinct pattern; two Jacobians count as equal when
    these projections agree up to `rtol` times the largest projected entry.
    Projecting can only merge distinct Jacobians, so the count stays a lower
    bound. A point lies on a boundary when some valid neuron sits on a
    breakpoint with a nonzero gradient; a warning says how many do.

    With `rigor="float64"` (the default) or `"strict"` patterns and Jacobians
    are those of exact arithmetic on the model's weights: computed in float64,
    and a neuron within a rigorous bound on the float64 twin's rounding of its
    breakpoint counts as on it (from the actual magnitudes under "float64",
    `keras_roll.rounding.noise`; the worst-case bound of `keras_roll.rounding.worst_case`
    under "strict"). `rigor="float32"` uses the twin's own dtype and exact zeros.

    Args:
        model: a Keras model (a model made by `keras_roll.wrap` is unwrapped) or
            a `Linearized`.
        x: `[B, *input_shape]` points, or a stream of batches (`tf.data.Dataset`,
            generator, `keras.utils.PyDataset` of `x` or `(x, y)`), read once.
        rtol: relative tolerance for equal Jacobians.
        projections: number of random directions the Jacobians are compared on.
        seed: seed of the random projections.
        options: a `keras_roll.RunOptions`, or None.
        wrt: None, or the name of a leading Rescaling / Normalization layer with a
            scalar scale (as `keras_roll.certify`'s `wrt`): the Jacobians are then
            with respect to its output, `J / a`; their classes, compared up to
            `rtol` times the largest entry, and so the counts, are the same.
        **overrides: its fields: `batch_size` (examples per forward batch,
            default from the memory budget), `memory_budget` (bytes of tangents
            per chunk), `verbose` (a progress bar over the points) and `rigor`
            ("float64", "strict" or "float32").

    Returns:
        A `RegionCount` (numpy arrays).

    Raises:
        ValueError: bad arguments, points with non-finite neurons or logits
            (their pattern is undefined), or a `wrt` that names no leading
            Rescaling / Normalization with a scalar scale.

    Example:

    ```python
    rc = keras_roll.count_regions(model, x_test)
    print(rc.jacobians, "<= #CLR <=", rc.patterns)
    ```
    """
    opts = RunOptions.of(options, caller="count_regions", **overrides)
    if not (0 <= rtol < 1):
        raise ValueError(f"rtol must be in [0, 1), got {rtol!r}.")
    if int(projections) != projections or projections < 1:
        raise ValueError(f"projections must be a positive integer, got {projections!r}.")
    lin = linearize(model)
    resolve_units(lin.program, wrt)  # the counts do not depend on the units
    twin = guard_for(opts.rigor).twin(lin)
    budget = opts.budget(lin.memory_budget)
    keys: dict[bytes, int] = {}
    pattern_ids, boundary, reps = [], [], []  # reps: the first point of every pattern
    seen = 0
    batches = read_batches(x, lin.input_spec, batch_size=opts.batch_size)
    with opts.progress(batches.total, "count_regions") as bar:
        for xb in (batch.x for batch in batches):
            part = _patterns_of_batch(twin, xb, keys, opts, budget, bar, seen)
            pattern_ids.append(part.ids)
            boundary.append(part.boundary)
            reps.extend(part.new)
            seen += int(xb.shape[0])
    pattern_ids = np.concatenate(pattern_ids)
    boundary = np.concatenate(boundary)
    b_total = int(pattern_ids.size)
    if not keys:  # an affine model: a single region
        zeros = np.zeros(b_total, np.int64)
        return RegionCount(1, 1, 0, b_total, zeros, zeros.copy(), np.zeros(b_total, bool))
    on_boundary = int(boundary.sum())
    if on_boundary:
        warnings.warn(
            f"{on_boundary} of {b_total} points lie on a linear-region boundary (a neuron "
            f"at a breakpoint); the #CLR bounds of Lemma 7 assume none does. See "
            f"RegionCount.boundary.", stacklevel=2)

    # Output Jacobians, one representative per pattern (in order of first appearance).
    xr = np.stack([r for _, r in sorted(reps, key=lambda item: item[0])])
    feats = _projected_jacobians(twin, xr, int(projections), seed, budget)
    classes = _cluster(feats, rtol)
    jacobian_ids = classes[pattern_ids]
    return RegionCount(
        patterns=len(keys), jacobians=int(classes.max()) + 1 if classes.size else 0,
        on_boundary=on_boundary, n=b_total, pattern_ids=pattern_ids,
        jacobian_ids=jacobian_ids, boundary=boundary)


class _BatchPatterns(NamedTuple):
    """Pattern ids, boundary flags and new representatives `(id, point)` of one batch."""

    ids: np.ndarray
    boundary: np.ndarray
    new: list


def _patterns_of_batch(twin, x, keys, opts: RunOptions, budget, bar, seen) -> _BatchPatterns:
    """The patterns of one batch (new ones are added to `keys`)."""
    b_total = int(x.shape[0])
    pattern_ids = np.empty(b_total, np.int64)
    candidate = np.zeros(b_total, bool)
    new = []
    if b_total == 0:
        return _BatchPatterns(pattern_ids, candidate, new)
    if not twin.num_neurons(x.shape[1:]):
        bar.update(b_total)
        return _BatchPatterns(np.zeros(b_total, np.int64), candidate, new)
    # A forward batch holds about 4 copies of every op output and neuron.
    per_example = 4 * twin.layout(x.shape[1:]).tangent_bytes(np.dtype(twin.dtype).itemsize)
    plan = plan_chunks(b_total, 1, per_example, budget, opts.batch_size, max_examples=None)
    tolerances = []
    for sl in plan.example_slices():
        fwd = twin.forward(tf.cast(x[sl], twin.dtype))
        below, above, valid, piece = neuron_arrays(fwd)
        tol, overflow = guard_for(opts.rigor).pattern_tolerance(twin, fwd, budget)
        bad = nonfinite(fwd, valid, overflow)
        if bad.any():
            raise ValueError(
                f"{int(bad.sum())} point(s) (e.g. point {seen + sl.start + int(np.argmax(bad))}) "
                f"have non-finite neurons or logits, or overflow when the model evaluates "
                f"itself, so their activation pattern is undefined; check the inputs' scale.")
        tolerances.append(tol)
        code = np.where(valid, piece, -1).astype(np.int16)
        for r, row in enumerate(code):
            key = row.tobytes()
            if key not in keys:
                keys[key] = len(keys)
                new.append((keys[key], x[sl.start + r].numpy()))
            pattern_ids[sl.start + r] = keys[key]
        candidate[sl] = np.any(valid & (neuron_distances(below, above) <= tol), axis=1)
        bar.update(code.shape[0])
    tolerance = np.concatenate(tolerances)

    # Points on a boundary: a valid neuron at a breakpoint with a nonzero gradient.
    boundary = np.zeros(b_total, bool)
    cand = np.flatnonzero(candidate)
    if cand.size:
        xc = tf.gather(x, cand)
        for sl, fwd, gn in iter_gradient_norms(twin, xc, opts.batch_size, budget):
            below, above, valid, _ = neuron_arrays(fwd)
            on = valid & (neuron_distances(below, above) <= tolerance[cand[sl]]) & (gn.linf > 0)
            boundary[cand[sl]] = np.any(on, axis=1)
    return _BatchPatterns(pattern_ids, boundary, new)


def _projected_jacobians(lin, xr, m, seed, budget):
    """`[len(xr), m * L]` output Jacobians of the points `xr` times a fixed `[D, m]` matrix."""
    ex_shape = tuple(xr.shape[1:])
    d = int(np.prod(ex_shape))
    if d <= m:
        r = np.eye(d)
    else:
        r = np.random.default_rng(seed).normal(size=(m, d)) / np.sqrt(d)
    v = r.reshape(-1, *ex_shape).astype(lin.dtype)
    k = v.shape[0]
    per = lin.layout(ex_shape).tangent_bytes(np.dtype(lin.dtype).itemsize)
    plan = plan_chunks(len(xr), k, per, budget)
    b, kk = plan.examples_per_chunk, plan.per_chunk
    out = []
    for i in range(0, len(xr), b):
        parts = [lin.jvp(xr[i:i + b], v[j:j + kk]).logits.numpy() for j in range(0, k, kk)]
        block = np.concatenate(parts, axis=1)  # [b, k, L]
        out.append(block.reshape(block.shape[0], -1).astype(np.float64))
    return np.concatenate(out, axis=0)


def _cluster(feats, rtol):
    """Greedy classes of rows equal up to `rtol * max|feats|` (sup norm).

    Rows are visited in order of their first feature, and each is compared only
    with class leaders whose first feature is within the tolerance.
    """
    n = feats.shape[0]
    classes = np.full(n, -1, np.int64)
    if n == 0:
        return classes
    atol = rtol * float(np.max(np.abs(feats))) if feats.size else 0.0
    if feats.shape[1] == 0:
        return np.zeros(n, np.int64)
    order = np.argsort(feats[:, 0], kind="stable")
    leaders: list[int] = []  # row indices, increasing first feature
    start = 0
    for i in order:
        while start < len(leaders) and feats[leaders[start], 0] < feats[i, 0] - atol:
            start += 1
        window = leaders[start:]
        if window:
            diff = np.max(np.abs(feats[window] - feats[i]), axis=1)
            hit = int(np.argmin(diff))
            if diff[hit] <= atol:
                classes[i] = classes[window[hit]]
                continue
        classes[i] = len(leaders)
        leaders.append(i)
    # Number the classes in order of first appearance among the rows.
    _, first = np.unique(classes, return_index=True)
    return np.argsort(np.argsort(first))[classes]
