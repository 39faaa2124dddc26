"""Certified margins: the largest lp balls and directional segments that stay
inside the linear region of each input (`certify`, `stability_bounds`,
`lp_margins`).

For a piecewise-linear network every neuron is affine in the input on the
linear region of `x`, so the lp margin is `eps_p(x) = min_j dist_j / ||g_j||_q`
(Lee, Alvarez-Melis & Jaakkola, ICLR 2019, Prop. 6 in its dual-norm form) and
the directional margins are the first breakpoint crossings along each direction
(docs/design.md, section "The maths"). This module runs them over a data set;
the work is split by job:

* `keras_roll.margin_math`: the closed forms (`dual_norm`, `margins_from_norms`,
  `directional_margins`, `neuron_distances`);
* `keras_roll.gradient_norms`: the streamed Jacobian reduced on the fly to
  gradient norms (`[B, N, D]` is never materialised) and axis margins;
* `keras_roll.bisection`: the paper's cross-check, a binary search on pattern
  feasibility evaluated on the real network (`method="bisect"`);
* `keras_roll.certificates`: the result classes and their tables;
* `keras_roll.arguments`: argument validation (shared with `count_regions`).

The public names of those modules stay importable from here.
"""

from __future__ import annotations

import math

import numpy as np

from keras_roll.api_types import Array, Method, ModelOrTwin, Norm, Norms, Verbose
from keras_roll.arguments import (
    as_linearized,
    check_batch_size,
    check_bisect_tol,
    check_directions,
    check_memory_budget,
    check_method,
    check_verbose,
    parse_norm,
    parse_norms,
)
from keras_roll.bisection import bisect_region, bisect_slice
from keras_roll.certificates import Certificate, StabilityBounds
from keras_roll.chunking import plan_chunks
from keras_roll.gradient_norms import (
    AxisBounds,
    GradNorms,
    iter_gradient_norms,
    iter_jacobian_slices,
)
from keras_roll.margin_math import (
    directional_margins,
    dual_norm,
    margins_from_norms,
    neuron_arrays,
    neuron_distances,
    to_numpy,
)
from keras_roll.progress import progress_bar

__all__ = [
    "Certificate",
    "GradNorms",
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
    "stability_bounds",
]

INF = math.inf


def _check_arguments(method, bisect_tol, batch_size, memory_budget, verbose):
    check_method(method)
    check_bisect_tol(bisect_tol)
    check_batch_size(batch_size)
    check_memory_budget(memory_budget)
    check_verbose(verbose)


def certify(model: ModelOrTwin, x: Array, norms: Norms = (1, 2, np.inf),
            directions: Array | None = None, method: Method = "analytic",
            batch_size: int | None = None, memory_budget: int | None = None,
            verbose: Verbose = "auto", bisect_tol: float = 1e-4) -> Certificate:
    """Certifies the lp and directional margins of every example.

    The l_p margin is the radius of the largest l_p ball around `x` inside its
    linear region, `eps_p = min_j dist_j / ||g_j||_q` (Lee et al., ICLR 2019,
    Prop. 6): exact for piecewise-linear networks, computed from streamed
    gradient norms without materialising the Jacobian. Neurons exactly on a
    breakpoint (with nonzero gradient) give 0; neurons with zero gradient never
    bind (0/0 = inf).

    `method="bisect"` replaces the closed forms by the paper's binary search on
    pattern feasibility, run on the real network: the directional margin along
    `d` is the largest `t` such that `x + t d` has the activation pattern of
    `x` (every valid neuron on the same linear piece, every max window with the
    same winner), found by doubling then bisection to the relative tolerance
    `bisect_tol`; the lp margin is the minimum of directional margins along the
    dual-norm steepest direction of every neuron toward its nearest breakpoint.
    It needs the dense per-example Jacobian and about N * len(norms) forward
    passes per example and bisection step: use it as a cross-check on small
    models. It reports the points reached by the pattern test; on masked
    (padded) sequence inputs a perturbation of padded steps changes the mask,
    which the analytic margins hold fixed, so there the two disagree by design.

    Args:
        model: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs.
        norms: any of 1, 2, np.inf (or 'inf').
        directions: optional `[B, K, *input_shape]` (or `[K, *input_shape]`
            shared) directions for directional margins.
        method: "analytic" or "bisect".
        batch_size: examples per chunk (default from the memory budget).
        memory_budget: bytes of tangents per chunk (default the model's).
        verbose: "auto" (a progress bar for runs longer than a second), True or False.
        bisect_tol: relative tolerance of the bisection.

    Returns:
        A `Certificate`.

    Raises:
        ValueError: for bad norms, methods, directions or inputs (wrong shape,
            NaN or inf).

    Example:

    ```python
    cert = keras_roll.certify(model, x_test[:100])
    cert.summary()                         # P25 / P50 / P75 / P100 of each margin
    cert.margins[2]                        # [100] l2 radii
    cert.binding[np.inf][0]                # ('dense_1', 17)
    ```
    """
    norms = parse_norms(norms)
    _check_arguments(method, bisect_tol, batch_size, memory_budget, verbose)
    lin = as_linearized(model)
    x = lin.check_input(x)
    b_total = int(x.shape[0])
    dirs = check_directions(directions, x, lin.dtype)
    budget = int(memory_budget or lin.memory_budget)

    margins = {p: np.full(b_total, INF) for p in norms}
    index = {p: np.full(b_total, -1, np.int64) for p in norms}
    k_dirs = 0 if dirs is None else dirs.shape[1]
    dir_eps = np.full((b_total, k_dirs), INF)
    dir_idx = np.full((b_total, k_dirs), -1, np.int64)
    logits = []

    if b_total == 0:
        logits.append(lin.forward(x).logits.numpy())
    else:
        n_neurons = lin.num_neurons(x.shape[1:])
        with progress_bar(b_total, verbose, "certify") as bar:
            if not n_neurons:  # no activation at all: one region, the whole input space
                logits.extend(_plain_logits(lin, x, batch_size))
                bar.update(b_total)
            elif method == "analytic":
                for sl, fwd, gn in iter_gradient_norms(lin, x, batch_size, budget):
                    below, above, valid, _ = neuron_arrays(fwd)
                    dist = np.minimum(below, above)
                    for p in norms:
                        eps, j = margins_from_norms(dist, gn.dual(p), valid)
                        margins[p][sl], index[p][sl] = to_numpy(eps), to_numpy(j)
                    if dirs is not None:
                        dir_eps[sl], dir_idx[sl] = _directional_analytic(
                            lin, x[sl], fwd, dirs[sl], budget)
                    logits.append(fwd.logits.numpy())
                    bar.update(sl.stop - sl.start)
            else:
                for sl, fwd, jac in iter_jacobian_slices(lin, x, batch_size, budget):
                    res = bisect_slice(lin, x[sl], fwd, jac, norms,
                                                None if dirs is None else dirs[sl],
                                                bisect_tol, budget)
                    for p in norms:
                        margins[p][sl], index[p][sl] = res[p]
                    if dirs is not None:
                        dir_eps[sl], dir_idx[sl] = res["directional"]
                    logits.append(fwd.logits.numpy())
                    bar.update(sl.stop - sl.start)

    shape = tuple(x.shape[1:])
    binding = {p: [lin.neuron_name(int(j), shape) if j >= 0 else None for j in index[p]]
               for p in norms}
    return Certificate(
        margins=margins, binding=binding, binding_index=index,
        directional=None if dirs is None else dir_eps,
        directional_index=None if dirs is None else dir_idx,
        logits=np.concatenate(logits, axis=0), method=method,
    )


def _plain_logits(lin, x, batch_size):
    """Logits in forward batches (at most 1024 examples each) within the budget."""
    layout = lin.layout(x.shape[1:])
    plan = plan_chunks(int(x.shape[0]), 1, layout.tangent_bytes(np.dtype(lin.dtype).itemsize),
                       lin.memory_budget, batch_size, max_examples=1024)
    return [lin.forward(x[sl]).logits.numpy() for sl in plan.example_slices()]


def lp_margins(model: ModelOrTwin, x: Array, p: Norm = 2, batch_size: int | None = None,
               memory_budget: int | None = None) -> np.ndarray:
    """The exact lp margin of every example, `[B]` float64 (Prop. 6).

    A cheap, silent shortcut of `certify` for monitoring (one norm, no names).

    Example:

    ```python
    eps = lp_margins(lin, x_batch, p=np.inf)
    ```
    """
    p = parse_norm(p)
    check_batch_size(batch_size)
    check_memory_budget(memory_budget)
    lin = as_linearized(model)
    x = lin.check_input(x)
    out = np.full(int(x.shape[0]), INF)
    if not int(x.shape[0]) or not lin.num_neurons(x.shape[1:]):
        return out
    for sl, fwd, gn in iter_gradient_norms(lin, x, batch_size, memory_budget):
        below, above, valid, _ = neuron_arrays(fwd)
        eps, _ = margins_from_norms(np.minimum(below, above), gn.dual(p), valid)
        out[sl] = to_numpy(eps)
    return out


def l2_margins(model: ModelOrTwin, x: Array, batch_size: int | None = None,
               memory_budget: int | None = None) -> np.ndarray:
    """The exact l2 margin of every example, `[B]` float64 (Prop. 6).

    Example:

    ```python
    print("median l2 margin", np.median(l2_margins(model, x_val)))
    ```
    """
    return lp_margins(model, x, 2, batch_size=batch_size, memory_budget=memory_budget)


def _directional_analytic(lin, xb, fwd, dirs_b, budget):
    """Directional margins of one example slice, directions chunked to the budget."""
    below, above, valid, _ = neuron_arrays(fwd)
    b, k = dirs_b.shape[:2]
    per = lin.layout(xb.shape[1:]).tangent_bytes(np.dtype(lin.dtype).itemsize)
    plan = plan_chunks(b, k, per, budget)
    bb, kk = plan.examples_per_chunk, plan.per_chunk
    eps = np.full((b, k), INF)
    idx = np.full((b, k), -1, np.int64)
    for i in range(0, b, bb):
        for j in range(0, k, kk):
            rates = lin.jvp(xb[i:i + bb], dirs_b[i:i + bb, j:j + kk]).neurons
            e, m = directional_margins(np.asarray(rates.numpy(), np.float64),
                                       below[i:i + bb], above[i:i + bb], valid[i:i + bb])
            eps[i:i + bb, j:j + kk], idx[i:i + bb, j:j + kk] = to_numpy(e), to_numpy(m)
    return eps, idx


def stability_bounds(model: ModelOrTwin, x: Array, batch_size: int | None = None,
                     memory_budget: int | None = None, method: Method = "analytic",
                     verbose: Verbose = "auto", bisect_tol: float = 1e-4) -> StabilityBounds:
    """Per-coordinate stability intervals `[-eps(x, -e_k), +eps(x, +e_k)]`.

    How far each input coordinate can move on its own before the activation
    pattern changes: the directional margins along every axis (the paper's
    Figure 3). The axes are streamed through the frozen-pattern twin in chunks
    and reduced to margins chunk by chunk, so only `[b, k, N]` is ever held.

    Args:
        model: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs.
        batch_size: examples per chunk (default from the memory budget).
        memory_budget: bytes of tangents per chunk.
        method: "analytic", or "bisect" (binary search on the real network along
            every `+-e_k`: 2 D rays per example, a slow cross-check).
        verbose: "auto", True or False.
        bisect_tol: relative tolerance of the bisection.

    Returns:
        A `StabilityBounds` with `lower`, `upper` shaped like `x`.

    Example:

    ```python
    sb = keras_roll.stability_bounds(model, x[:1])
    plt.imshow(np.minimum(sb.upper, -sb.lower)[0, ..., 0])   # stable pixels
    ```
    """
    _check_arguments(method, bisect_tol, batch_size, memory_budget, verbose)
    lin = as_linearized(model)
    x = lin.check_input(x)
    b_total = int(x.shape[0])
    d = int(np.prod(x.shape[1:]))
    upper = np.full((b_total, d), INF)
    lower = np.full((b_total, d), -INF)
    up_i = np.full((b_total, d), -1, np.int64)
    lo_i = np.full((b_total, d), -1, np.int64)
    budget = int(memory_budget or lin.memory_budget)
    with progress_bar(b_total, verbose, "stability bounds") as bar:
        if not b_total or not lin.num_neurons(x.shape[1:]):
            pass  # no neuron: every coordinate is free
        elif method == "analytic":
            axis_bounds = AxisBounds()
            ref = None
            for sl, fwd, start, k, jvp in lin.iter_axis_chunks(
                    x, batch_size=batch_size, memory_budget=budget):
                if start == 0:
                    n = fwd.neurons
                    ref = (n.below, n.above, n.valid)
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
            eye = np.eye(d, dtype=lin.dtype)
            dirs = np.concatenate([eye, -eye]).reshape(2 * d, *x.shape[1:])
            # Examples per batch of rays: 2 D float64 rays of D entries each.
            plan = plan_chunks(b_total, 1, 8 * 2 * d * d, budget, batch_size, max_examples=None)
            for sl in plan.example_slices():
                b = sl.stop - sl.start
                _, _, valid, piece = neuron_arrays(lin.forward(x[sl]))
                base = np.repeat(np.arange(b), 2 * d)
                rays = np.broadcast_to(dirs[None], (b, *dirs.shape)).reshape(b * 2 * d,
                                                                             *dirs.shape[1:])
                t, j = bisect_region(lin, x[sl], base, rays, piece, valid, bisect_tol, budget)
                t, j = t.reshape(b, 2 * d), j.reshape(b, 2 * d)
                upper[sl], up_i[sl] = t[:, :d], j[:, :d]
                lower[sl], lo_i[sl] = -t[:, d:], j[:, d:]
                bar.update(b)
    shape = (b_total, *x.shape[1:])
    return StabilityBounds(lower.reshape(shape), upper.reshape(shape), lo_i.reshape(shape),
                           up_i.reshape(shape), method)

