"""Certified margins: the largest lp balls and directional segments that stay
inside the linear region of each input.

For a piecewise-linear network every neuron is affine in the input on the
linear region of `x`: `z_j(x') = z_j(x) + g_j . (x' - x)` with `g_j` its input
gradient under the frozen activation pattern. The region is the polyhedron
where every neuron stays between its breakpoints, so (Lee, Alvarez-Melis &
Jaakkola, "Towards Robust, Locally Linear Deep Networks", ICLR 2019, Prop. 6 in
its dual-norm form)

    eps_p(x) = min_j dist_j / ||g_j||_q,     1/p + 1/q = 1,

with `dist_j = min(below_j, above_j)` the distance of `z_j` to its nearest
breakpoint, and the margin along a direction `d` is

    eps(x, d) = min over j of  above_j / (g_j . d)   if g_j . d > 0,
                               below_j / |g_j . d|  if g_j . d < 0.

Conventions: only neurons that exist for the example (`valid`) count; a
neuron exactly on a breakpoint with `g_j != 0` gives margin 0; a neuron with
`g_j = 0` never binds (we define `0 / 0 = inf`: its value cannot change inside
the region, whatever it is). A margin is `inf` when no neuron binds.

The neuron gradients are streamed from the frozen-pattern twin
(`Linearized.iter_axis_chunks`) and reduced on the fly to the three norms
(sum of squares, max-abs, sum-abs), so `[B, N, D]` is never materialised.

`method="bisect"` is the paper's cross-check: a binary search on pattern
feasibility evaluated on the real network (see `certify`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from keras import ops
from tqdm.auto import tqdm

from keras_roll.twin import Linearized, linearize, plan_chunks

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
_METHODS = ("analytic", "bisect")
_NORM_LABELS = {1: "l1", 2: "l2", INF: "linf"}
_PAPER = "Lee et al., ICLR 2019"


# ---------------------------------------------------------------------- pure math


def neuron_distances(below, above):
    """Distance of every neuron to its nearest breakpoint, `min(below, above)`.

    Args:
        below: `[..., N]` distances `z - lo` to the breakpoint below (inf if none).
        above: `[..., N]` distances `hi - z` to the breakpoint above (inf if none).

    Returns:
        `[..., N]` tensor.

    Example:

    ```python
    fwd = lin.forward(x)
    dist = neuron_distances(fwd.neurons.below, fwd.neurons.above)
    ```
    """
    return ops.minimum(_tensor(below), _tensor(above))


def dual_norm(g, p, axis=-1):
    """The dual norm `||g||_q` (1/p + 1/q = 1) that turns distances into lp margins.

    `p=2 -> ||g||_2`, `p=1 -> ||g||_inf = max|g|`, `p=inf -> ||g||_1 = sum|g|`.

    Args:
        g: gradients, the input axis at `axis`.
        p: 1, 2 or `np.inf`, the norm of the ball being certified.
        axis: the input axis to reduce.

    Example:

    ```python
    dual_norm(np.array([3.0, -4.0]), 2)       # 5.0
    dual_norm(np.array([3.0, -4.0]), np.inf)  # 7.0
    ```
    """
    p = _parse_norm(p)
    g = _tensor(g)
    if p == 2:
        return ops.sqrt(ops.sum(g * g, axis=axis))
    if p == 1:
        return ops.max(ops.abs(g), axis=axis)
    return ops.sum(ops.abs(g), axis=axis)


def margins_from_norms(dist, gnorm, valid=None):
    """lp margins from distances and dual gradient norms (Prop. 6, dual-norm form).

    `eps = min_j dist_j / gnorm_j` over valid neurons; a neuron with
    `gnorm_j == 0` never binds (0/0 is defined as inf), one with `dist_j == 0`
    and `gnorm_j > 0` gives 0.

    Args:
        dist: `[..., N]` distances to the nearest breakpoint (`neuron_distances`).
        gnorm: `[..., N]` dual norms `||g_j||_q` (`dual_norm`).
        valid: optional `[..., N]` bool, False for neurons that do not exist.

    Returns:
        `(eps [...], index [...])`: the margin and the binding neuron (-1 when
        no neuron binds and `eps` is inf).

    Example:

    ```python
    eps, j = margins_from_norms([[0.5, 2.0]], [[1.0, 1.0]])   # eps=[0.5], j=[0]
    ```
    """
    dist = _tensor(dist)
    gnorm = ops.cast(_tensor(gnorm), dist.dtype)
    ok = gnorm > 0
    if valid is not None:
        ok = ops.logical_and(ok, ops.cast(_tensor(valid), "bool"))
    safe = ops.where(ok, gnorm, ops.ones_like(gnorm))
    ratio = ops.where(ok, dist / safe, ops.full_like(dist, INF))
    return _min_and_index(ratio)


def directional_margins(rates, below, above, valid=None):
    """Margins along directions: how far `x + t d` stays in the region of `x`.

    For neuron j moving at rate `r_j = g_j . d`, the segment leaves its piece
    at `above_j / r_j` if `r_j > 0` and at `below_j / |r_j|` if `r_j < 0`
    (never if `r_j = 0`); the margin is the minimum over valid neurons.

    Args:
        rates: `[..., K, N]` directional derivatives (`Linearized.jvp(...).neurons`).
        below, above: `[..., N]` distances to the breakpoints below / above.
        valid: optional `[..., N]` bool.

    Returns:
        `(eps [..., K], index [..., K])`, index -1 where no neuron binds.

    Example:

    ```python
    jvp = lin.jvp(x, d)                          # d: [B, K, *input_shape]
    n = lin.forward(x).neurons
    eps, j = directional_margins(jvp.neurons, n.below, n.above, n.valid)
    ```
    """
    rates = _tensor(rates)
    below = ops.cast(_tensor(below), rates.dtype)
    above = ops.cast(_tensor(above), rates.dtype)
    if valid is not None:  # an invalid neuron has no breakpoint on either side
        v = ops.cast(_tensor(valid), "bool")
        inf = ops.full_like(below, INF)
        below, above = ops.where(v, below, inf), ops.where(v, above, inf)
    num = ops.where(rates > 0, ops.expand_dims(above, -2), ops.expand_dims(below, -2))
    speed = ops.abs(rates)
    t = ops.where(speed > 0, num / ops.where(speed > 0, speed, ops.ones_like(speed)),
                  ops.full_like(speed, INF))
    return _min_and_index(t)


def _min_and_index(t):
    """Minimum over the last axis and its index (-1 where the minimum is inf)."""
    if t.shape[-1] == 0:  # no neuron: nothing binds
        lead = ops.shape(t)[:-1]
        return ops.full(lead, INF, dtype=t.dtype), ops.full(lead, -1, dtype="int64")
    idx = ops.cast(ops.argmin(t, axis=-1), "int64")
    eps = ops.take_along_axis(t, ops.expand_dims(idx, -1), axis=-1)[..., 0]
    idx = ops.where(ops.isinf(eps), ops.full_like(idx, -1), idx)
    return eps, idx


def _tensor(x):
    """A tensor of `x`, keeping numpy / Python float64 precision."""
    return x if ops.is_tensor(x) else ops.convert_to_tensor(np.asarray(x))


def _np(t):
    return np.asarray(ops.convert_to_numpy(t))


# ---------------------------------------------------------------------- streaming


class GradNorms(NamedTuple):
    """Per-neuron norms of the input gradients, `[b, N]` float64 each.

    Attributes:
        l2: `||g_j||_2`, the dual norm for l2 balls.
        linf: `max_k |g_jk|`, the dual norm for l1 balls.
        l1: `sum_k |g_jk|`, the dual norm for l_inf balls.
    """

    l2: np.ndarray
    linf: np.ndarray
    l1: np.ndarray

    def dual(self, p) -> np.ndarray:
        """`||g||_q` for the lp ball with `1/p + 1/q = 1`."""
        p = _parse_norm(p)
        return {2: self.l2, 1: self.linf, INF: self.l1}[p]


def _norms_reduce(jvp, start):
    """Reduces one `[b, k, N]` chunk to per-neuron partial norms (inside tf.function)."""
    g = jvp.neurons
    a = tf.abs(g)
    return tf.reduce_sum(g * g, axis=1), tf.reduce_max(a, axis=1), tf.reduce_sum(a, axis=1)


def iter_gradient_norms(lin: Linearized, x, batch_size: int | None = None,
                        memory_budget: int | None = None):
    """Streams the input-gradient norms of every neuron, one example slice at a time.

    The Jacobian is pushed through the frozen-pattern twin in chunks of input
    axes and reduced on the fly (sum of squares, max-abs, sum-abs), so the
    `[B, N, D]` Jacobian is never held in memory.

    Args:
        lin: a `Linearized` model.
        x: `[B, *input_shape]` inputs.
        batch_size: examples per slice (default: as many as `memory_budget` allows).
        memory_budget: bytes of tangents per chunk (default `lin.memory_budget`).

    Yields:
        `(example_slice, forward_pass, GradNorms)`.

    Example:

    ```python
    for sl, fwd, gn in iter_gradient_norms(lin, x):
        dist = neuron_distances(fwd.neurons.below, fwd.neurons.above)
        eps2, _ = margins_from_norms(dist, gn.l2, fwd.neurons.valid)
    ```
    """
    x = lin.check_input(x)
    d = int(np.prod(x.shape[1:]))
    acc = None
    for sl, fwd, start, k, (sq, mx, sm) in lin.iter_axis_chunks(
            x, batch_size=batch_size, reduce=_norms_reduce, memory_budget=memory_budget,
            per_neuron=True):
        sq, mx, sm = (np.asarray(t.numpy(), np.float64) for t in (sq, mx, sm))
        if start == 0:
            acc = [sq, mx, sm]
        else:
            acc[0] += sq
            np.maximum(acc[1], mx, out=acc[1])
            acc[2] += sm
        if start + k >= d:
            yield sl, fwd, GradNorms(np.sqrt(acc[0]), acc[1], acc[2])


def _iter_jacobian_slices(lin: Linearized, x, batch_size, memory_budget):
    """Yields `(example_slice, forward_pass, J [b, N, D])`, dense per slice."""
    d = int(np.prod(x.shape[1:]))
    jac = None
    for sl, fwd, start, k, jvp in lin.iter_axis_chunks(
            x, batch_size=batch_size, memory_budget=memory_budget):
        block = jvp.neurons.numpy()  # [b, k, N]
        if start == 0:
            jac = np.zeros((block.shape[0], block.shape[2], d), block.dtype)
        stop = min(start + k, d)
        jac[:, :, start:stop] = np.swapaxes(block[:, : stop - start], 1, 2)
        if stop >= d:
            yield sl, fwd, jac


def _axis_bounds_impl(rates, below, above, valid):
    """Margins along `+e_k` and `-e_k` for a chunk of axes `[b, k, N] -> [b, k]`."""
    up, up_i = directional_margins(rates, below, above, valid)
    down, down_i = directional_margins(-rates, below, above, valid)
    return up, up_i, down, down_i


_AXIS_BOUNDS = {
    True: tf.function(_axis_bounds_impl, reduce_retracing=True, autograph=False,
                      jit_compile=True),  # XLA fuses the elementwise passes: ~4x on CPU
    False: tf.function(_axis_bounds_impl, reduce_retracing=True, autograph=False),
}
_XLA_OK = [True]
_XLA_MIN_ELEMENTS = 1 << 22  # below this, compiling costs more than it saves


def _axis_bounds(rates, below, above, valid):
    if _XLA_OK[0] and int(np.prod(rates.shape)) >= _XLA_MIN_ELEMENTS:
        try:
            return _AXIS_BOUNDS[True](rates, below, above, valid)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError,
                tf.errors.NotFoundError, tf.errors.InternalError):
            _XLA_OK[0] = False  # no XLA on this device: plain graph from now on
    return _AXIS_BOUNDS[False](rates, below, above, valid)


# ---------------------------------------------------------------------- results


@dataclasses.dataclass(repr=False)
class Certificate:
    """Certified margins of a batch (all arrays numpy, float64 margins).

    Attributes:
        margins: `{p: [B]}`, radius of the largest lp ball (p in 1, 2, inf)
            around each example inside its linear region (Prop. 6).
        binding: `{p: [B]}` list of the binding neuron `(layer name, unit index)`
            per example, None where no neuron binds (margin inf).
        binding_index: `{p: [B] int}`, the binding neuron's row in
            `lin.neuron_names_for(x)`, -1 where none binds.
        directional: `[B, K]` margins along the given directions, or None.
        directional_index: `[B, K]` binding neuron rows, or None.
        logits: `[B, *output_shape]` model outputs before any folded link.
        method: "analytic" or "bisect".
    """

    margins: dict
    binding: dict
    binding_index: dict
    directional: np.ndarray | None = None
    directional_index: np.ndarray | None = None
    logits: np.ndarray | None = None
    method: str = "analytic"

    @property
    def n(self) -> int:
        """Number of certified examples."""
        for v in self.margins.values():
            return int(v.shape[0])
        return 0 if self.logits is None else int(self.logits.shape[0])

    @property
    def norms(self) -> tuple:
        return tuple(self.margins)

    def __repr__(self) -> str:
        parts = [f"n={self.n}", f"method={self.method!r}"]
        for p, v in self.margins.items():
            med = _percentiles(v, (50,))[0] if v.size else float("nan")
            parts.append(f"median_{_NORM_LABELS[p]}={med:.4g}")
        if self.directional is not None:
            parts.append(f"directions={self.directional.shape[1]}")
        return f"Certificate({', '.join(parts)})"

    def summary(self, print_fn=print, percentiles=(25, 50, 75, 100)) -> None:
        """Prints the paper-style table: percentiles of every certified margin.

        Example:

        ```python
        keras_roll.certify(model, x_test).summary()
        ```
        """
        rows = []
        for p, v in self.margins.items():
            rows.append((f"{_NORM_LABELS[p]} ball", v, self.binding_index[p]))
        if self.directional is not None:
            k = self.directional.shape[1]
            rows.append((f"directional (K={k})", self.directional.reshape(-1),
                         self.directional_index.reshape(-1)))
        head = f"Certified margins: {self.n} examples, method '{self.method}' ({_PAPER})"
        print_fn(_table(head, rows, percentiles))
        if self.n and self.margins:
            p = 2 if 2 in self.margins else next(iter(self.margins))
            layers = [b[0] for b in self.binding[p] if b is not None]
            if layers:
                names, counts = np.unique(layers, return_counts=True)
                order = np.argsort(-counts)[:3]
                share = ", ".join(f"{names[i]} ({100 * counts[i] / self.n:.0f}%)"
                                  for i in order)
                print_fn(f"Binding layers ({_NORM_LABELS[p]}): {share}")


@dataclasses.dataclass(repr=False)
class StabilityBounds:
    """Per-coordinate stability intervals (the paper's Figure 3).

    Coordinate k of example i can move anywhere in
    `[x_ik + lower_ik, x_ik + upper_ik]`, all other coordinates fixed, without
    leaving the linear region of `x_i`.

    Attributes:
        lower: `[B, *input_shape]`, `-eps(x, -e_k)` (<= 0, -inf if unbounded).
        upper: `[B, *input_shape]`, `+eps(x, +e_k)` (>= 0, inf if unbounded).
        lower_index, upper_index: binding neuron rows (-1 if none), same shape.
        method: "analytic" or "bisect".
    """

    lower: np.ndarray
    upper: np.ndarray
    lower_index: np.ndarray
    upper_index: np.ndarray
    method: str = "analytic"

    def __repr__(self) -> str:
        return (f"StabilityBounds(shape={self.lower.shape}, method={self.method!r}, "
                f"median_width={self._median_width():.4g})")

    def _median_width(self) -> float:
        if self.lower.size == 0:
            return float("nan")
        return _percentiles((self.upper - self.lower).reshape(-1), (50,))[0]

    def summary(self, print_fn=print, percentiles=(25, 50, 75, 100)) -> None:
        """Prints percentiles of the upper / lower bounds and the interval widths."""
        rows = [("upper  +eps(+e_k)", self.upper.reshape(-1), None),
                ("lower  -eps(-e_k)", -self.lower.reshape(-1), None),
                ("width", (self.upper - self.lower).reshape(-1), None)]
        n = self.lower.shape[0]
        head = (f"Per-coordinate stability bounds: {n} examples x "
                f"{int(np.prod(self.lower.shape[1:]))} coordinates, method '{self.method}'")
        print_fn(_table(head, rows, percentiles))


def _percentiles(v, qs):
    v = np.asarray(v, np.float64)
    if v.size == 0:
        return [float("nan")] * len(qs)
    with np.errstate(invalid="ignore"):
        out = np.percentile(v, qs)
    out = np.where(np.isnan(out), INF, out)  # inf - inf when interpolating infinities
    return [float(o) for o in out]


def _table(head, rows, percentiles):
    cols = [f"P{q:g}" for q in percentiles]
    width = 22 + 12 * len(cols) + 10
    lines = [head, "_" * width,
             f"{'Margin':<22}" + "".join(f"{c:>12}" for c in cols) + f"{'zero':>10}",
             "=" * width]
    for label, v, _ in rows:
        vals = _percentiles(v, percentiles)
        zero = int(np.sum(np.asarray(v) == 0))
        lines.append(f"{label:<22}" + "".join(f"{x:>12.4g}" for x in vals) + f"{zero:>10d}")
    lines.append("_" * width)
    return "\n".join(lines)


# ---------------------------------------------------------------------- validation


def _parse_norm(p):
    if isinstance(p, str) and p.strip().lower() in ("inf", "np.inf"):
        return INF
    if isinstance(p, numbers.Real) and not isinstance(p, bool):
        value = float(p)
        if value == 1.0:
            return 1
        if value == 2.0:
            return 2
        if value == INF:
            return INF
    raise ValueError(f"Unsupported norm {p!r}: keras_roll certifies lp balls for p = 1, 2 "
                     f"or np.inf; pass e.g. norms=(1, 2, np.inf).")


def _parse_norms(norms) -> tuple:
    if norms is None:
        return ()
    if isinstance(norms, (str, numbers.Real)):
        norms = (norms,)
    try:
        items = list(norms)
    except TypeError:
        raise ValueError(f"norms must be a sequence of 1, 2 and np.inf, got {norms!r}.") from None
    out = []
    for p in items:
        q = _parse_norm(p)
        if q not in out:
            out.append(q)
    return tuple(out)


def _check_common(method, bisect_tol, batch_size, memory_budget, verbose):
    if method not in _METHODS:
        raise ValueError(f"Unknown method {method!r}; use 'analytic' (exact, streamed) or "
                         f"'bisect' (binary search on the real network, a slow cross-check).")
    if not (isinstance(bisect_tol, numbers.Real) and 0 < bisect_tol < 1):
        raise ValueError(f"bisect_tol must be a relative tolerance in (0, 1), got "
                         f"{bisect_tol!r}.")
    if batch_size is not None and (not isinstance(batch_size, numbers.Integral)
                                   or isinstance(batch_size, bool) or batch_size <= 0):
        raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}.")
    if memory_budget is not None and (not isinstance(memory_budget, numbers.Real)
                                      or memory_budget <= 0):
        raise ValueError(f"memory_budget must be a positive number of bytes or None, got "
                         f"{memory_budget!r}.")
    if verbose not in ("auto", True, False, 0, 1, 2):
        raise ValueError(f"verbose must be 'auto', True or False, got {verbose!r}.")


def _as_linearized(model) -> Linearized:
    return model if isinstance(model, Linearized) else linearize(model)


def _check_directions(directions, x, lin) -> np.ndarray | None:
    if directions is None:
        return None
    d = np.asarray(directions.numpy() if tf.is_tensor(directions) else directions)
    if not np.issubdtype(d.dtype, np.number):
        raise ValueError(f"directions must be numeric, got dtype {d.dtype}.")
    ex = tuple(x.shape[1:])
    b = int(x.shape[0])
    if d.ndim == len(ex) + 1 and tuple(d.shape[1:]) == ex:
        d = np.broadcast_to(d[None], (b, *d.shape))  # shared by all examples
    if d.ndim != len(ex) + 2 or d.shape[0] != b or tuple(d.shape[2:]) != ex:
        raise ValueError(
            f"directions must have shape [B, K, *input_shape] = [{b}, K, "
            f"{', '.join(map(str, ex))}] (or [K, {', '.join(map(str, ex))}] shared by all "
            f"examples); got shape {tuple(d.shape)}."
        )
    if not np.all(np.isfinite(d)):
        raise ValueError("directions contain non-finite values (NaN or inf).")
    return d.astype(lin.dtype, copy=False)


def _progress(total, verbose, desc):
    if verbose == "auto":
        return tqdm(total=total, desc=desc, unit="ex", delay=1.0, leave=False)
    return tqdm(total=total, desc=desc, unit="ex", disable=not verbose)


def _neuron_arrays(fwd):
    n = fwd.neurons
    below = np.asarray(n.below.numpy(), np.float64)
    above = np.asarray(n.above.numpy(), np.float64)
    return below, above, n.valid.numpy(), n.piece.numpy()


# ---------------------------------------------------------------------- certify


def certify(model, x, norms=(1, 2, np.inf), directions=None, method: str = "analytic",
            batch_size: int | None = None, memory_budget: int | None = None,
            verbose="auto", bisect_tol: float = 1e-4) -> Certificate:
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
    norms = _parse_norms(norms)
    _check_common(method, bisect_tol, batch_size, memory_budget, verbose)
    lin = _as_linearized(model)
    x = lin.check_input(x)
    b_total = int(x.shape[0])
    dirs = _check_directions(directions, x, lin)
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
        with _progress(b_total, verbose, "certify") as bar:
            if not n_neurons:  # no activation at all: one region, the whole input space
                logits.extend(_plain_logits(lin, x, batch_size))
                bar.update(b_total)
            elif method == "analytic":
                for sl, fwd, gn in iter_gradient_norms(lin, x, batch_size, budget):
                    below, above, valid, _ = _neuron_arrays(fwd)
                    dist = np.minimum(below, above)
                    for p in norms:
                        eps, j = margins_from_norms(dist, gn.dual(p), valid)
                        margins[p][sl], index[p][sl] = _np(eps), _np(j)
                    if dirs is not None:
                        dir_eps[sl], dir_idx[sl] = _directional_analytic(
                            lin, x[sl], fwd, dirs[sl], budget)
                    logits.append(fwd.logits.numpy())
                    bar.update(sl.stop - sl.start)
            else:
                for sl, fwd, jac in _iter_jacobian_slices(lin, x, batch_size, budget):
                    res = _certify_bisect_slice(lin, x[sl], fwd, jac, norms,
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
    step = batch_size or 1024
    return [lin.forward(x[i:i + step]).logits.numpy() for i in range(0, int(x.shape[0]), step)]


def lp_margins(model, x, p=2, batch_size: int | None = None,
               memory_budget: int | None = None) -> np.ndarray:
    """The exact lp margin of every example, `[B]` float64 (Prop. 6).

    A cheap, silent shortcut of `certify` for monitoring (one norm, no names).

    Example:

    ```python
    eps = lp_margins(lin, x_batch, p=np.inf)
    ```
    """
    p = _parse_norm(p)
    _check_common("analytic", 1e-4, batch_size, memory_budget, False)
    lin = _as_linearized(model)
    x = lin.check_input(x)
    out = np.full(int(x.shape[0]), INF)
    if not int(x.shape[0]) or not lin.num_neurons(x.shape[1:]):
        return out
    for sl, fwd, gn in iter_gradient_norms(lin, x, batch_size, memory_budget):
        below, above, valid, _ = _neuron_arrays(fwd)
        eps, _ = margins_from_norms(np.minimum(below, above), gn.dual(p), valid)
        out[sl] = _np(eps)
    return out


def l2_margins(model, x, batch_size: int | None = None,
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
    below, above, valid, _ = _neuron_arrays(fwd)
    b, k = dirs_b.shape[:2]
    n = below.shape[1]
    per = (int(fwd.tangent_size) + n) * np.dtype(lin.dtype).itemsize
    bb, kk = plan_chunks(b, k, per, budget, None)
    eps = np.full((b, k), INF)
    idx = np.full((b, k), -1, np.int64)
    for i in range(0, b, bb):
        for j in range(0, k, kk):
            rates = lin.jvp(xb[i:i + bb], dirs_b[i:i + bb, j:j + kk]).neurons
            e, m = directional_margins(np.asarray(rates.numpy(), np.float64),
                                       below[i:i + bb], above[i:i + bb], valid[i:i + bb])
            eps[i:i + bb, j:j + kk], idx[i:i + bb, j:j + kk] = _np(e), _np(m)
    return eps, idx


# ---------------------------------------------------------------------- bisection


def _steepest(g, p, sign):
    """Unit-lp directions that move `z_j` fastest, `sign` toward its breakpoint.

    The dual-norm maximiser of `g . u` over `||u||_p <= 1`: `g / ||g||_2` (p=2),
    `sign(g)` (p=inf), `sign(g_i) e_i` with `i = argmax |g_i|` (p=1).
    """
    if p == 2:
        u = g / np.linalg.norm(g, axis=-1, keepdims=True)
    elif p == INF:
        u = np.sign(g)
    else:
        u = np.zeros_like(g)
        i = np.argmax(np.abs(g), axis=-1)
        rows = np.arange(g.shape[0])
        u[rows, i] = np.sign(g[rows, i])
    return u * sign[:, None]


def _certify_bisect_slice(lin, xb, fwd, jac, norms, dirs_b, tol, budget):
    """Bisection margins for one slice of examples (see `certify`)."""
    below, above, valid, piece = _neuron_arrays(fwd)
    b, n, d = jac.shape
    ex_shape = tuple(xb.shape[1:])
    base, vecs, owner = [], [], []  # example of each direction, the direction, its tag
    jac64 = jac.astype(np.float64)
    dist = np.minimum(below, above)
    for p in norms:
        for e in range(b):
            sel = np.flatnonzero(valid[e] & np.isfinite(dist[e]) & np.any(jac[e] != 0, axis=1))
            if sel.size == 0:
                continue
            sign = np.where(above[e, sel] <= below[e, sel], 1.0, -1.0)
            vecs.append(_steepest(jac64[e, sel], p, sign))
            base.append(np.full(sel.size, e))
            owner.extend((p, e, j) for j in sel)
    if dirs_b is not None:
        k = dirs_b.shape[1]
        vecs.append(dirs_b.reshape(b * k, d).astype(np.float64))
        base.append(np.repeat(np.arange(b), k))
        owner.extend(("dir", e, j) for e in range(b) for j in range(k))
    out = {p: (np.full(b, INF), np.full(b, -1, np.int64)) for p in norms}
    if dirs_b is not None:
        out["directional"] = (np.full((b, dirs_b.shape[1]), INF),
                              np.full((b, dirs_b.shape[1]), -1, np.int64))
    if not vecs:
        return out
    base = np.concatenate(base)
    vecs = np.concatenate(vecs).reshape(-1, *ex_shape)
    t, bad = bisect_region(lin, xb, base, vecs, piece, valid, tol, budget)
    for (tag, e, j), tj, bj in zip(owner, t, bad):
        if tag == "dir":
            out["directional"][0][e, j] = tj
            out["directional"][1][e, j] = bj if np.isfinite(tj) else -1
        else:
            eps, idx = out[tag]
            if tj < eps[e]:
                eps[e], idx[e] = tj, j
    return out


def bisect_region(lin: Linearized, xb, base, dirs, ref_piece, ref_valid, tol: float = 1e-4,
                  memory_budget: int | None = None):
    """Largest `t` with `x + t d` in the (closed) linear region of `x`, by bisection.

    The paper's feasibility search, evaluated on the real network: a point is
    in the region of `x` when every neuron valid at `x` is on the same linear
    piece and every max window keeps its winner (the `piece` arrays agree).
    With ties broken as the twin does (a neuron on a breakpoint counts on the
    piece below it, a tied max window keeps its first maximum) this set is a
    convex region whose closure is the closed region of `x`, so the supremum
    along a ray is the same, with no tolerance to tune. Along a ray the set is
    an interval from 0 to `t*`, so
    doubling from a small step brackets `t*` and bisection narrows it until
    `hi - lo <= tol * hi`. Returns the last feasible `t` (a sound lower bound),
    `inf` past `1e6 * (1 + ||x||) / ||d||`.

    Args:
        lin: a `Linearized` model.
        xb: `[b, *input_shape]` reference points.
        base: `[M]` int, the reference point of every ray.
        dirs: `[M, *input_shape]` directions.
        ref_piece, ref_valid: `[b, N]` pattern and validity at the reference points.
        tol: relative tolerance.
        memory_budget: bytes per forward batch.

    Returns:
        `(t [M] float64, index [M] int64)`: the margin and the first neuron
        whose piece differs just past it (-1 when `t` is inf).

    Example:

    ```python
    fwd = lin.forward(x)
    t, j = bisect_region(lin, x, np.zeros(1, int), d[None], fwd.neurons.piece.numpy(),
                         fwd.neurons.valid.numpy())
    ```
    """
    x0 = np.asarray(xb.numpy() if tf.is_tensor(xb) else xb, np.float64)
    m = int(base.shape[0])
    flat_d = np.asarray(dirs, np.float64).reshape(m, -1)
    flat_x = x0.reshape(x0.shape[0], -1)
    dnorm = np.linalg.norm(flat_d, axis=1)
    scale = 1.0 + np.linalg.norm(flat_x, axis=1)[base]
    eps_f = np.finfo(np.dtype(lin.dtype)).eps
    moving = dnorm > 0
    safe = np.where(moving, dnorm, 1.0)
    t0, t_max = 1e-2 * scale / safe, 1e6 * scale / safe
    floor = 8 * eps_f * (1.0 + np.abs(flat_x).max(axis=1)[base]) / np.where(
        moving, np.abs(flat_d).max(axis=1), 1.0)
    lo = np.zeros(m)
    hi = np.where(moving, t0, INF)
    bad = np.full(m, -1, np.int64)
    budget = int(memory_budget or lin.memory_budget)
    ref_piece, ref_valid = np.asarray(ref_piece), np.asarray(ref_valid, bool)
    n = ref_piece.shape[1]
    per_point = max(1, 4 * n + 2 * x0[0].size) * np.dtype(lin.dtype).itemsize * 8
    chunk = max(1, budget // per_point)

    def inside(rows, t):
        pts = (flat_x[base[rows]] + t[:, None] * flat_d[rows]).astype(lin.dtype)
        pts = pts.reshape(-1, *x0.shape[1:])
        ok = np.empty(rows.size, bool)
        first = np.empty(rows.size, np.int64)
        for i in range(0, rows.size, chunk):
            piece = lin.forward(pts[i:i + chunk]).neurons.piece.numpy()
            r = base[rows[i:i + chunk]]
            same = (piece == ref_piece[r]) | ~ref_valid[r]
            ok[i:i + chunk] = same.all(axis=1)
            first[i:i + chunk] = np.argmin(same, axis=1) if n else -1
        return ok, first

    active = np.flatnonzero(moving)
    while active.size:  # doubling: bracket t* in [lo, hi]
        ok, first = inside(active, hi[active])
        lo[active[ok]] = hi[active[ok]]
        hi[active[ok]] *= 2
        bad[active[~ok]] = first[~ok]
        escaped = active[ok][hi[active[ok]] > t_max[active[ok]]]
        hi[escaped], lo[escaped] = INF, INF
        active = active[ok][hi[active[ok]] <= t_max[active[ok]]]
    active = np.flatnonzero(np.isfinite(hi))
    for _ in range(200):  # bisection
        active = active[(hi[active] - lo[active] > tol * hi[active])
                        & (hi[active] > floor[active])]
        if not active.size:
            break
        mid = 0.5 * (lo[active] + hi[active])
        ok, first = inside(active, mid)
        lo[active[ok]] = mid[ok]
        hi[active[~ok]] = mid[~ok]
        bad[active[~ok]] = first[~ok]
    bad[~np.isfinite(lo)] = -1
    return lo, bad


# ---------------------------------------------------------------------- stability bounds


def stability_bounds(model, x, batch_size: int | None = None, memory_budget: int | None = None,
                     method: str = "analytic", verbose="auto",
                     bisect_tol: float = 1e-4) -> StabilityBounds:
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
    _check_common(method, bisect_tol, batch_size, memory_budget, verbose)
    lin = _as_linearized(model)
    x = lin.check_input(x)
    b_total = int(x.shape[0])
    d = int(np.prod(x.shape[1:]))
    upper = np.full((b_total, d), INF)
    lower = np.full((b_total, d), -INF)
    up_i = np.full((b_total, d), -1, np.int64)
    lo_i = np.full((b_total, d), -1, np.int64)
    budget = int(memory_budget or lin.memory_budget)
    with _progress(b_total, verbose, "stability bounds") as bar:
        if not b_total or not lin.num_neurons(x.shape[1:]):
            pass  # no neuron: every coordinate is free
        elif method == "analytic":
            ref = None
            for sl, fwd, start, k, jvp in lin.iter_axis_chunks(
                    x, batch_size=batch_size, memory_budget=budget):
                if start == 0:
                    n = fwd.neurons
                    ref = (n.below, n.above, n.valid)
                up, ui, dn, di = _axis_bounds(jvp.neurons, *ref)
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
            itemsize = 8 * 2 * d * d  # float64 rays of one example
            step = batch_size or max(1, min(b_total, budget // itemsize))
            for i in range(0, b_total, step):
                sl = slice(i, min(i + step, b_total))
                b = sl.stop - sl.start
                _, _, valid, piece = _neuron_arrays(lin.forward(x[sl]))
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

