"""Certified margins: the largest lp balls and directional segments that stay
inside the linear region of each input (`certify`, `stability_bounds`,
`lp_margins`).

For a piecewise-linear network every neuron is affine in the input on the
linear region of `x`, so the lp margin is `eps_p(x) = min_j dist_j / ||g_j||_q`
(Lee, Alvarez-Melis & Jaakkola, ICLR 2019, Prop. 6 in its dual-norm form) and
the directional margins are the first breakpoint crossings along each direction
(docs/design.md, section "The maths"). This module runs them over a data set;
the work is split by job:

* `keras_roll.certification.margin_math`: the closed forms (`dual_norm`, `margins_from_norms`,
  `directional_margins`, `neuron_distances`);
* `keras_roll.certification.gradient_norms`: the streamed Jacobian reduced on the fly to
  gradient norms (`[B, N, D]` is never materialised) and axis margins;
* `keras_roll.certification.bisection`: the paper's cross-check, a binary search on pattern
  feasibility evaluated on the real network (`method="bisect"`);
* `keras_roll.certification.certificates`: the result classes and their tables;
* `keras_roll.arguments`: argument validation (shared with `count_regions`);
* `keras_roll.rounding.noise` / `keras_roll.rounding.worst_case`: the probabilistic
  (`rigor="float64"`, the default) and worst-case (`rigor="strict"`) guards on
  floating-point rounding subtracted from every distance.

Inputs are arrays or tensors, or streams of batches (`tf.data.Dataset`,
generators, `keras.utils.PyDataset`: `keras_roll.batches`), certified batch by
batch. Results hold numpy arrays (docs/design.md, section "Return types").

The public names of those modules stay importable from here.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import tensorflow as tf

from keras_roll.api_types import Array, Method, ModelOrTwin
from keras_roll.arguments import (
    as_linearized,
    check_bisect_tol,
    check_directions,
    check_method,
)
from keras_roll.batches import is_stream, iter_input_batches, stream_length
from keras_roll.certification.bisection import bisect_region, bisect_slice
from keras_roll.certification.certificates import (
    Certificate,
    NormDict,
    StabilityBounds,
    concat_padded,
)
from keras_roll.certification.gradient_norms import (
    AxisBounds,
    GradNorms,
    iter_gradient_norms,
    iter_jacobian_slices,
)
from keras_roll.certification.margin_math import (
    directional_margins,
    dual_norm,
    margins_from_norms,
    neuron_arrays,
    neuron_distances,
    to_numpy,
)
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.streaming import check_input_keep_float
from keras_roll.options import (
    Norm,
    Norms,
    Rigor,
    Verbose,
    check_batch_size,
    check_memory_budget,
    check_verbose,
    parse_norm,
    parse_norms,
    progress_bar,
)
from keras_roll.rounding.guard import BOUND_SAFETY, RoundingErrors, guard_for  # noqa: F401

__all__ = [
    "Certificate",
    "GradNorms",
    "RoundingErrors",
    "StabilityBounds",
    "bisect_region",
    "certify",
    "directional_margins",
    "dual_norm",
    "iter_gradient_norms",
    "l2_margins",
    "lp_margins",
    "margins_from_norms",
    "neuron_distances",
    "rounding_errors",
    "stability_bounds",
]

INF = math.inf


def _check_arguments(method, bisect_tol, batch_size, memory_budget, verbose, rigor):
    check_method(method)
    check_bisect_tol(bisect_tol)
    check_batch_size(batch_size)
    check_memory_budget(memory_budget)
    check_verbose(verbose)
    Rigor.parse(rigor)


def rounding_errors(twin, fwd, rigor: Rigor = "float64", l1=None,
                    memory_budget: int | None = None) -> RoundingErrors:
    """The `RoundingErrors` of a float64 forward pass `fwd` of `twin` under `rigor`
    ("float64" or "strict"): `keras_roll.rounding.guard_for(rigor).errors(...)`.

    Example:

    ```python
    twin = keras_roll.linearize(model).at_dtype("float64")
    err = rounding_errors(twin, twin.forward(x))
    ```
    """
    guard = guard_for(rigor)
    if guard.rigor is Rigor.FLOAT32:
        raise ValueError(f"rounding_errors computes rigor 'float64' or 'strict', got {rigor!r}.")
    return guard.errors(twin, fwd, l1=l1, memory_budget=memory_budget)


def _errors_and_norms(twin, x, batch_size, budget, rigor):
    """`(example_slice, forward_pass, GradNorms, RoundingErrors or None)` per slice."""
    guard = guard_for(rigor)
    for sl, fwd, gn in iter_gradient_norms(twin, x, batch_size, budget):
        yield sl, fwd, gn, guard.errors(twin, fwd, l1=gn.l1, memory_budget=budget)


def _nonfinite(fwd, valid, err: RoundingErrors | None) -> np.ndarray:
    """`[b]` examples with a non-finite neuron or logit, or whose evaluation may overflow."""
    z = fwd.neurons.z.numpy()
    logits = fwd.logits.numpy().reshape(z.shape[0], -1)
    bad = ~np.all(np.isfinite(z) | ~valid, axis=1) | ~np.all(np.isfinite(logits), axis=1)
    if err is not None:
        bad |= err.overflow
    return bad


def _warn_nonfinite(count: int, total: int, evaluation: str, what: str) -> None:
    if count:
        warnings.warn(
            f"{count} of {total} examples have a non-finite neuron or logit (NaN / inf), or "
            f"may overflow when the model evaluates itself in {evaluation}: their {what} "
            f"are NaN (see .nonfinite). Check the inputs' scale.", stacklevel=3)


def _input_mask(twin, fwd) -> np.ndarray | None:
    """`[b, T]` True at the unpadded steps of a masked sequence model, else None."""
    for step_rec in fwd.trace.steps:
        for rec in step_rec.ops:
            keep = getattr(rec, "keep", None)
            if keep is not None:
                return keep.numpy()[..., 0] > 0
    return None


def _stream_batches(x, lin, batch_size):
    """Checked tensors of the batches of `x` (a stream) or of `x` itself."""
    if is_stream(x):
        for xb in iter_input_batches(x, lin.input_shape, batch_size):
            yield check_input_keep_float(lin, xb)
    else:
        yield check_input_keep_float(lin, x)


def _batches_and_total(x, lin, batch_size):
    """`(batches, examples or None)`: an array is checked at once, a stream lazily."""
    if is_stream(x):
        return _stream_batches(x, lin, batch_size), stream_length(x)
    xb = check_input_keep_float(lin, x)
    return [xb], int(xb.shape[0])


def certify(model: ModelOrTwin, x, norms: Norms = (1, 2, np.inf),
            directions: Array | None = None, method: Method = "analytic",
            batch_size: int | None = None, memory_budget: int | None = None,
            verbose: Verbose = "auto", bisect_tol: float = 1e-4,
            rigor: Rigor = "float64") -> Certificate:
    """Certifies the lp and directional margins of every example.

    The l_p margin is the radius of the largest l_p ball around `x` inside its
    linear region, `eps_p = min_j dist_j / ||g_j||_q` (Lee et al., ICLR 2019,
    Prop. 6): exact for piecewise-linear networks, computed from streamed
    gradient norms without materialising the Jacobian. Neurons exactly on a
    breakpoint (with nonzero gradient) give 0; neurons with zero gradient never
    bind (0/0 = inf).

    **Rounding.** With `rigor="float64"` (the default) the neurons and their
    gradients are computed in float64 from the model's float32 weights, and
    every distance is shrunk by a guard on the rounding error of the model's
    own evaluation (float32; float16 / bfloat16 under mixed precision; TF32
    on GPUs that use it) and a rigorous bound on the float64 computation's,
    so that the model evaluated at any point of the ball, in its own dtype,
    has the activation pattern of `x`. The guard on the model's evaluation is
    *probabilistic* (`keras_roll.rounding.noise`): in Higham & Mary's model
    of rounding (independent, mean-zero relative errors bounded by `u`), at
    any point of the ball each neuron stays on its piece except with
    probability below 6.3e-14 (`LAMBDA = 8` estimated standard deviations of
    its error, times `KAPPA = 4` for the estimate from 32 Gaussian probes),
    or for sure where the worst-case bound is the smaller one. It certifies
    normally trained float32 networks that the worst case certifies 0 for.
    `rigor="strict"` uses the worst-case bound alone (Higham, Sec. 3.1): sound
    whatever the rounding errors, but about `width` times too pessimistic per
    layer, so wide float32 networks often get 0. `rigor="float32"` computes
    in the twin's dtype with no guard (a certified ball can then be broken by
    rounding for neurons within ~1e-6 of a breakpoint). docs/design.md,
    section "The rounding bound", states the bounds and what they assume.

    **Masked sequences.** For a model with a `Masking` layer the ball is in the
    unpadded coordinates: the certificate holds while padded steps stay at
    the mask value (moving one changes the mask itself). `Certificate.mask`
    says which steps each ball covers; the gradients, and so the margins, are
    those of the unpadded coordinates.

    **Directional margins** are in units of `t` along each direction as given
    (`x + t d`), not normalised: divide by `||d||` for a distance.

    `method="bisect"` replaces the closed forms by the paper's binary search on
    pattern feasibility, run on the twin's forward pass (in float64 under
    `rigor="float64"` / `"strict"`, without the rounding guard): the
    directional margin along `d` is the largest `t` such that `x + t d` has the
    activation pattern of `x` (every valid neuron on the same linear piece,
    every max window with the same winner), found by doubling then bisection
    to the relative tolerance
    `bisect_tol`; the lp margin is the minimum of directional margins along the
    dual-norm steepest direction of every neuron toward its nearest breakpoint.
    It needs the dense per-example Jacobian and about N * len(norms) forward
    passes per example and bisection step: use it as a cross-check on small
    models. On masked (padded) sequence inputs a perturbation of padded steps
    changes the mask, which the analytic margins hold fixed, so there the two
    disagree by design.

    Args:
        model: a Keras model (a model made by `keras_roll.wrap` is unwrapped)
            or a `Linearized`.
        x: `[B, *input_shape]` inputs, or a stream of batches: a `tf.data.Dataset`,
            a generator or a `keras.utils.PyDataset` yielding `x`, `(x, y)` or
            `(x, y, w)`, batched or not (certified batch by batch).
        norms: any of 1, 2, np.inf (or 'l1', 'l2', 'linf', 'inf'); at least one
            unless `directions` are given.
        directions: optional `[B, K, *input_shape]` (or `[K, *input_shape]`
            shared; shared only for streams) directions for directional margins.
        method: "analytic" or "bisect".
        batch_size: examples per chunk (default from the memory budget); for
            streams of single examples, also the batch they are grouped into.
        memory_budget: bytes of tangents per chunk (default the model's).
        verbose: "auto" (a progress bar for runs longer than a second), True or False.
        bisect_tol: relative tolerance of the bisection.
        rigor: "float64" (default: probabilistic rounding guard), "strict"
            (worst-case guard) or "float32" (none).

    Returns:
        A `Certificate` (numpy arrays). Examples with a non-finite neuron or
        logit, or whose evaluation may overflow, get NaN margins and a warning.

    Raises:
        ValueError: for bad norms, methods, directions or inputs (wrong shape,
            NaN or inf).

    Example:

    ```python
    cert = keras_roll.certify(model, x_test[:100])
    cert.summary()                         # P25 / P50 / P75 / P100 of each margin
    cert.margins["l2"]                     # [100] l2 radii (also cert.margins[2])
    cert.binding[np.inf][0]                # ('dense_1', 17)
    cert.boundary_point(2)                 # where each l2 ball touches its boundary
    ```
    """
    norms = parse_norms(norms)
    _check_arguments(method, bisect_tol, batch_size, memory_budget, verbose, rigor)
    if not norms and directions is None:
        raise ValueError("norms=() and no directions: there is nothing to certify. Pass "
                         "norms=(1, 2, np.inf) (or a subset), or directions=.")
    lin = as_linearized(model)
    twin = guard_for(rigor).twin(lin)
    budget = int(memory_budget or lin.memory_budget)
    stream = is_stream(x)
    if stream and directions is not None and np.ndim(directions) != len(lin.input_shape) + 1:
        raise ValueError(f"With a stream of batches, directions must be shared by all "
                         f"examples: shape [K, *input_shape], got shape "
                         f"{np.shape(directions)}.")
    batches, total = _batches_and_total(x, lin, batch_size)
    parts = []
    kept: list | None = []  # the inputs, for Certificate.binding_direction
    kept_bytes = 0
    with progress_bar(total, verbose, "certify") as bar:
        for xb in batches:
            part = _certify_batch(lin, twin, xb, norms, directions, method, batch_size,
                                  budget, bisect_tol, bar, rigor)
            parts.append(part)
            if kept is not None:
                kept_bytes += int(np.prod(xb.shape)) * xb.dtype.size
                kept = kept + [xb] if (not stream or kept_bytes <= KEEP_STREAM_BYTES) else None
    cert = _assemble(parts, norms, method, rigor, twin)
    _warn_nonfinite(int(cert.nonfinite.sum()), cert.n, cert.evaluation, "margins")
    cert.attach_source(twin, kept)
    return cert


KEEP_STREAM_BYTES = 512 * 2**20  # inputs of a stream kept for binding directions


def _certify_batch(lin, twin, x, norms, directions, method, batch_size, budget, bisect_tol,
                   bar, rigor) -> dict:
    """Certifies one checked batch; returns its arrays."""
    b_total = int(x.shape[0])
    dirs = check_directions(directions, x, twin.dtype)
    margins = {p: np.full(b_total, INF) for p in norms}
    index = {p: np.full(b_total, -1, np.int64) for p in norms}
    k_dirs = 0 if dirs is None else dirs.shape[1]
    dir_eps = np.full((b_total, k_dirs), INF)
    dir_idx = np.full((b_total, k_dirs), -1, np.int64)
    bad = np.zeros(b_total, bool)
    logits, masks = [], []
    if b_total == 0:
        logits.append(twin.forward(x).logits.numpy())
    elif not twin.num_neurons(x.shape[1:]):  # no activation: one region, the whole space
        logits.extend(_plain_logits(twin, x, batch_size))
        bad = ~np.all(np.isfinite(np.concatenate(logits).reshape(b_total, -1)), axis=1)
        bar.update(b_total)
    elif method == "analytic":
        for sl, fwd, gn, err in _errors_and_norms(twin, x, batch_size, budget, rigor):
            below, above, valid, _ = neuron_arrays(fwd)
            dist = np.minimum(below, above)
            for p in norms:
                terms = () if err is None else err.terms()
                eps, j = margins_from_norms(dist, gn.dual(p), valid, *terms)
                margins[p][sl], index[p][sl] = to_numpy(eps), to_numpy(j)
            if dirs is not None:
                dir_eps[sl], dir_idx[sl] = _directional_analytic(
                    twin, x[sl], fwd, dirs[sl], budget, err)
            bad[sl] = _nonfinite(fwd, valid, err)
            logits.append(fwd.logits.numpy())
            masks.append(_input_mask(twin, fwd))
            bar.update(sl.stop - sl.start)
    else:
        for sl, fwd, jac in iter_jacobian_slices(twin, x, batch_size, budget):
            res = bisect_slice(twin, x[sl], fwd, jac, norms,
                               None if dirs is None else dirs[sl], bisect_tol, budget)
            for p in norms:
                margins[p][sl], index[p][sl] = res[p]
            if dirs is not None:
                dir_eps[sl], dir_idx[sl] = res["directional"]
            bad[sl] = _nonfinite(fwd, neuron_arrays(fwd).valid, None)
            logits.append(fwd.logits.numpy())
            masks.append(_input_mask(twin, fwd))
            bar.update(sl.stop - sl.start)
    for p in norms:
        margins[p][bad], index[p][bad] = np.nan, -1
    dir_eps[bad], dir_idx[bad] = np.nan, -1
    shape = tuple(x.shape[1:])
    binding = {p: [lin.neuron_name(int(j), shape) if j >= 0 else None for j in index[p]]
               for p in norms}
    mask = None if not masks or masks[0] is None else np.concatenate(masks)
    return {"margins": margins, "index": index, "binding": binding,
            "directional": None if dirs is None else dir_eps,
            "directional_index": None if dirs is None else dir_idx,
            "logits": np.concatenate(logits, axis=0), "nonfinite": bad, "mask": mask}


def _assemble(parts, norms, method, rigor, twin) -> Certificate:
    """One `Certificate` from the arrays of every batch."""
    margins = NormDict({p: np.concatenate([q["margins"][p] for q in parts]) for p in norms})
    index = NormDict({p: np.concatenate([q["index"][p] for q in parts]) for p in norms})
    binding = NormDict({p: [b for q in parts for b in q["binding"][p]] for p in norms})
    directional = directional_index = None
    if parts[0]["directional"] is not None:
        directional = np.concatenate([q["directional"] for q in parts])
        directional_index = np.concatenate([q["directional_index"] for q in parts])
    masks = [q["mask"] for q in parts]
    mask = None if any(m is None for m in masks) else concat_padded(masks, False)
    return Certificate(
        margins=margins, binding=binding, binding_index=index,
        directional=directional, directional_index=directional_index,
        logits=concat_padded([q["logits"] for q in parts], np.nan), method=method,
        rigor=rigor, evaluation=guard_for(rigor).evaluation(twin), mask=mask,
        nonfinite=np.concatenate([q["nonfinite"] for q in parts]))


def _plain_logits(lin, x, batch_size):
    """Logits in forward batches (at most 1024 examples each) within the budget."""
    layout = lin.layout(x.shape[1:])
    plan = plan_chunks(int(x.shape[0]), 1, layout.tangent_bytes(np.dtype(lin.dtype).itemsize),
                       lin.memory_budget, batch_size, max_examples=1024)
    return [lin.forward(x[sl]).logits.numpy() for sl in plan.example_slices()]


def lp_margins(model: ModelOrTwin, x, p: Norm = 2, batch_size: int | None = None,
               memory_budget: int | None = None, rigor: Rigor = "float64") -> np.ndarray:
    """The exact lp margin of every example, `[B]` float64 (Prop. 6).

    A cheap, silent shortcut of `certify` for monitoring (one norm, no names);
    the same numbers as `certify(model, x, norms=(p,), rigor=rigor).margins[p]`
    (NaN, with a warning, for examples with non-finite neurons or logits).

    Args:
        model: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs or a stream of batches (see `certify`).
        p: 1, 2 or np.inf.
        batch_size: examples per chunk.
        memory_budget: bytes of tangents per chunk.
        rigor: "float64" (default: probabilistic rounding guard), "strict"
            (worst-case guard) or "float32" (none, faster).

    Example:

    ```python
    eps = lp_margins(lin, x_batch, p=np.inf)
    ```
    """
    p = parse_norm(p)
    check_batch_size(batch_size)
    check_memory_budget(memory_budget)
    lin = as_linearized(model)
    twin = guard_for(rigor).twin(lin)
    outs, bad_total = [], 0
    for xb in _stream_batches(x, lin, batch_size):
        out = np.full(int(xb.shape[0]), INF)
        outs.append(out)
        if not int(xb.shape[0]) or not twin.num_neurons(xb.shape[1:]):
            continue
        for sl, fwd, gn, err in _errors_and_norms(twin, xb, batch_size, memory_budget, rigor):
            below, above, valid, _ = neuron_arrays(fwd)
            terms = () if err is None else err.terms()
            eps, _ = margins_from_norms(np.minimum(below, above), gn.dual(p), valid, *terms)
            out[sl] = to_numpy(eps)
            bad = _nonfinite(fwd, valid, err)
            out[sl][bad] = np.nan
            bad_total += int(bad.sum())
    out = np.concatenate(outs) if outs else np.zeros(0)
    _warn_nonfinite(bad_total, out.size, guard_for(rigor).evaluation(twin), "margins")
    return out


def l2_margins(model: ModelOrTwin, x, batch_size: int | None = None,
               memory_budget: int | None = None, rigor: Rigor = "float64") -> np.ndarray:
    """The exact l2 margin of every example, `[B]` float64 (Prop. 6).

    Example:

    ```python
    print("median l2 margin", np.median(l2_margins(model, x_val)))
    ```
    """
    return lp_margins(model, x, 2, batch_size=batch_size, memory_budget=memory_budget,
                      rigor=rigor)


def _directional_analytic(lin, xb, fwd, dirs_b, budget, err: RoundingErrors | None):
    """Directional margins of one example slice, directions chunked to the budget."""
    below, above, valid, _ = neuron_arrays(fwd)
    b, k = dirs_b.shape[:2]
    per = lin.layout(xb.shape[1:]).tangent_bytes(np.dtype(lin.dtype).itemsize)
    plan = plan_chunks(b, k, per, budget)
    bb, kk = plan.examples_per_chunk, plan.per_chunk
    eps = np.full((b, k), INF)
    idx = np.full((b, k), -1, np.int64)
    dinf = np.abs(dirs_b.reshape(b, k, -1)).max(axis=-1, initial=0.0)  # [b, K]
    for i in range(0, b, bb):
        for j in range(0, k, kk):
            rates = lin.jvp(xb[i:i + bb], dirs_b[i:i + bb, j:j + kk]).neurons
            terms = ()
            if err is not None:  # the error grows by F_j per unit of ||t d||_inf
                terms = err.terms(slice(i, i + bb), dinf[i:i + bb, j:j + kk, None])
            e, m = directional_margins(np.asarray(rates.numpy(), np.float64),
                                       below[i:i + bb], above[i:i + bb], valid[i:i + bb],
                                       *terms)
            eps[i:i + bb, j:j + kk], idx[i:i + bb, j:j + kk] = to_numpy(e), to_numpy(m)
    return eps, idx


def stability_bounds(model: ModelOrTwin, x, batch_size: int | None = None,
                     memory_budget: int | None = None, method: Method = "analytic",
                     verbose: Verbose = "auto", bisect_tol: float = 1e-4,
                     rigor: Rigor = "float64") -> StabilityBounds:
    """Per-coordinate stability intervals `[-eps(x, -e_k), +eps(x, +e_k)]`.

    How far each input coordinate can move on its own before the activation
    pattern changes: the directional margins along every axis (the paper's
    Figure 3). The axes are streamed through the frozen-pattern twin in chunks
    and reduced to margins chunk by chunk, so only `[b, k, N]` is ever held.
    Under `rigor="float64"` (the default) or `"strict"` they are computed in
    float64 and shrunk by the rounding guard of `certify` (the probabilistic
    guard's growth term compounds `|A|` through the layers here: no gradient
    norms are known before the axes are streamed).

    Args:
        model: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs, or a stream of batches (see `certify`).
        batch_size: examples per chunk (default from the memory budget).
        memory_budget: bytes of tangents per chunk.
        method: "analytic", or "bisect" (binary search on the twin's forward pass
            along every `+-e_k`: 2 D rays per example, a slow cross-check).
        verbose: "auto", True or False.
        bisect_tol: relative tolerance of the bisection.
        rigor: "float64" (default: probabilistic rounding guard), "strict"
            (worst-case guard) or "float32" (none).

    Returns:
        A `StabilityBounds` with `lower`, `upper` shaped like `x` (NaN, with a
        warning, for examples with non-finite neurons or logits).

    Example:

    ```python
    sb = keras_roll.stability_bounds(model, x[:1])
    plt.imshow(np.minimum(sb.upper, -sb.lower)[0, ..., 0])   # stable pixels
    ```
    """
    _check_arguments(method, bisect_tol, batch_size, memory_budget, verbose, rigor)
    lin = as_linearized(model)
    twin = guard_for(rigor).twin(lin)
    budget = int(memory_budget or lin.memory_budget)
    parts = []
    batches, total = _batches_and_total(x, lin, batch_size)
    with progress_bar(total, verbose, "stability bounds") as bar:
        for xb in batches:
            parts.append(_stability_batch(twin, xb, batch_size, budget, method, bisect_tol,
                                          rigor, bar))
    fields = [concat_padded([q[i] for q in parts], fill)
              for i, fill in enumerate((-INF, INF, -1, -1))]
    bad = np.concatenate([q[4] for q in parts])
    _warn_nonfinite(int(bad.sum()), bad.size, guard_for(rigor).evaluation(twin), "bounds")
    return StabilityBounds(*fields, method, rigor=rigor, nonfinite=bad)


def _stability_batch(twin, x, batch_size, budget, method, bisect_tol, rigor, bar):
    b_total = int(x.shape[0])
    d = int(np.prod(x.shape[1:]))
    upper = np.full((b_total, d), INF)
    lower = np.full((b_total, d), -INF)
    up_i = np.full((b_total, d), -1, np.int64)
    lo_i = np.full((b_total, d), -1, np.int64)
    bad = np.zeros(b_total, bool)
    if not b_total or not twin.num_neurons(x.shape[1:]):
        bar.update(b_total)  # no neuron: every coordinate is free
    elif method == "analytic":
        axis_bounds = AxisBounds()
        ref = None
        for sl, fwd, start, k, jvp in twin.iter_axis_chunks(
                x, batch_size=batch_size, memory_budget=budget):
            if start == 0:
                n = fwd.neurons
                ref = (n.below, n.above, n.valid)
                err = guard_for(rigor).errors(twin, fwd, memory_budget=budget)
                if err is not None:
                    e, f, slack = err.terms(scale=np.ones((1, 1, 1)))
                    ref = ref + (tf.nest.map_structure(tf.constant, e),
                                 tf.nest.map_structure(tf.constant, f), slack)
                bad[sl] = _nonfinite(fwd, n.valid.numpy(), err)
            up, ui, dn, di = axis_bounds(jvp.neurons, *ref)
            stop = min(start + k, d)
            w = stop - start
            upper[sl, start:stop] = up.numpy()[:, :w]
            up_i[sl, start:stop] = ui.numpy()[:, :w]
            lower[sl, start:stop] = -dn.numpy()[:, :w]
            lo_i[sl, start:stop] = di.numpy()[:, :w]
            if stop >= d:
                bar.update(sl.stop - sl.start)
    else:
        eye = np.eye(d, dtype=twin.dtype)
        dirs = np.concatenate([eye, -eye]).reshape(2 * d, *x.shape[1:])
        # Examples per batch of rays: 2 D float64 rays of D entries each.
        plan = plan_chunks(b_total, 1, 8 * 2 * d * d, budget, batch_size, max_examples=None)
        for sl in plan.example_slices():
            b = sl.stop - sl.start
            fwd = twin.forward(x[sl])
            _, _, valid, piece = neuron_arrays(fwd)
            bad[sl] = _nonfinite(fwd, valid, None)
            base = np.repeat(np.arange(b), 2 * d)
            rays = np.broadcast_to(dirs[None], (b, *dirs.shape)).reshape(b * 2 * d,
                                                                         *dirs.shape[1:])
            t, j = bisect_region(twin, x[sl], base, rays, piece, valid, bisect_tol, budget)
            t, j = t.reshape(b, 2 * d), j.reshape(b, 2 * d)
            upper[sl], up_i[sl] = t[:, :d], j[:, :d]
            lower[sl], lo_i[sl] = -t[:, d:], j[:, d:]
            bar.update(b)
    upper[bad], lower[bad], up_i[bad], lo_i[bad] = np.nan, np.nan, -1, -1
    shape = (b_total, *x.shape[1:])
    return (lower.reshape(shape), upper.reshape(shape), lo_i.reshape(shape),
            up_i.reshape(shape), bad)
