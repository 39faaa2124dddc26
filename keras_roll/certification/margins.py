"""Certified margins: the largest lp balls and directional segments that stay
inside the linear region of each input (`certify`, `lp_margins`, `l2_margins`).

For a piecewise-linear network every neuron is affine in the input on the
linear region of `x`, so the lp margin is `eps_p(x) = min_j dist_j / ||g_j||_q`
(Lee, Alvarez-Melis & Jaakkola, ICLR 2019, Prop. 6 in its dual-norm form) and
the directional margins are the first breakpoint crossings along each direction
(docs/design.md, section "The maths"). This module runs them over a data set,
batch by batch (`keras_roll.inputs`), each batch a `Certificate` of its own that
`Certificate.concat` joins; the work is split by job:

* `keras_roll.certification.margin_math`: the closed forms;
* `keras_roll.certification.gradient_norms`: the streamed Jacobian reduced on the
  fly to gradient norms (`[B, N, D]` is never materialised);
* `keras_roll.certification.rounding_errors`: the rounding guard of a `Rigor`;
* `keras_roll.certification.bisection`: the paper's cross-check (`method="bisect"`);
* `keras_roll.certification.zero_radii`: why a radius is zero;
* `keras_roll.certification.certificates`: the result classes.

`keras_roll.certification.stability` computes the per-coordinate bounds and
`keras_roll.certification.regions` counts regions. Results hold numpy arrays
(docs/design.md, section "Return types").
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from keras_roll.certification.bisection import bisect_slice
from keras_roll.certification.certificates import Certificate
from keras_roll.certification.gradient_norms import iter_jacobian_slices
from keras_roll.certification.margin_math import (
    Margin,
    SliceMargins,
    directional_margins,
    exact_zeros,
    margins_from_norms,
    neuron_arrays,
    neuron_distances,
)
from keras_roll.certification.rounding_errors import (  # noqa: F401  (rounding_errors re-exported)
    GuardedSlice,
    RoundingErrors,
    errors_and_norms,
    rounding_errors,
)
from keras_roll.certification.runs import input_mask, nonfinite, warn_nonfinite
from keras_roll.certification.zero_radii import explain_zeros
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.twin import Linearized, linearize
from keras_roll.compile.units import resolve_units
from keras_roll.distribute import Replicas
from keras_roll.geometry import NormDict, to_numpy
from keras_roll.inputs import Array, Batch, ModelOrTwin, read_batches
from keras_roll.options import (
    FIELDS,
    Method,
    Norm,
    Norms,
    RunOptions,
    check_bisect_tol,
    fixed_budget,
    parse_norm,
    parse_norms,
)
from keras_roll.rounding.guard import guard_for

__all__ = ["Certificate", "certify", "l2_margins", "lp_margins"]

MARGIN_FIELDS = ("batch_size", "memory_budget", "rigor")
"""The run options `lp_margins` reads (it shows no progress bar)."""

INF = math.inf
KEEP_STREAM_BYTES = 512 * 2**20  # inputs of a stream kept for binding directions


@dataclasses.dataclass(frozen=True)
class _Run:
    """What every batch of one `certify` call shares."""

    lin: Linearized
    twin: Linearized
    norms: tuple
    method: Method
    bisect_tol: float
    options: RunOptions
    budget: int

    @classmethod
    def make(cls, model, norms, method, bisect_tol, options: RunOptions) -> _Run:
        lin = linearize(model)
        return cls(lin, guard_for(options.rigor).twin(lin), norms,
                   Method.parse(method, default=Method.ANALYTIC),
                   check_bisect_tol(bisect_tol), options, options.budget(lin.memory_budget))

    @property
    def stream_budget(self) -> int | None:
        """The gradient-norm stream's budget: None lets an "auto" twin time its chunks."""
        auto = fixed_budget(self.options.memory_budget) is None and self.twin.auto_budget
        return None if auto else self.budget


def certify(model: ModelOrTwin, x, norms: Norms = (1, 2, np.inf),
            directions: Array | None = None, method: Method | str | None = "analytic",
            bisect_tol: float = 1e-4, options: RunOptions | None = None, *,
            wrt: str | None = None, **overrides) -> Certificate:
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

    **Units** (`wrt=`). By default radii are in the model's input units. With
    `wrt="<layer>"`, naming a leading Rescaling / Normalization (possibly after
    others) whose scale is one number, `u = a x + b`, they are in the units of
    its output: the lp ball of radius `r` around `u(x)` is the ball of radius
    `r / |a|` around `x`, so every radius is `|a|` times the input-unit one (a
    model taking 0-255 pixels behind `Rescaling(1 / 255)` certifies in [0, 1]
    pixels with `wrt="rescaling"`); `directions` are then read in those units.
    `x` stays in the model's input units. docs/design.md, section "Units (wrt=)".

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
        method: "analytic" (the default, also for None) or "bisect" (or a
            `keras_roll.options.Method`).
        bisect_tol: relative tolerance of the bisection.
        options: a `keras_roll.RunOptions` (batch_size, memory_budget, verbose,
            rigor, strategy); the defaults if None.
        wrt: None (input units), or the name of a leading Rescaling /
            Normalization layer with a scalar scale: the radii (and directions)
            are in the units of its output (`Certificate.units`).
        **overrides: any of those fields, replacing the one of `options`:
            `batch_size` (examples per chunk, default from the memory budget;
            for streams of single examples, also the batch they are grouped
            into), `memory_budget` (bytes of tangents per chunk, default the
            twin's), `verbose` ("auto": a progress bar for runs longer than a
            second, True or False) and `rigor` ("float64", the default:
            probabilistic rounding guard; "strict": worst-case guard;
            "float32": none), `strategy` (a `tf.distribute.Strategy` whose
            replicas share each batch, the same certificate as on one device;
            default the strategy in scope).

    Returns:
        A `Certificate` (numpy arrays). Examples with a non-finite neuron or
        logit, or whose evaluation may overflow, get NaN margins and a warning.
        `Certificate.zero_cause` says why each zero radius is zero.

    Raises:
        ValueError: for bad norms, methods, options, directions or inputs
            (wrong shape, NaN or inf: the rows are named; no example at all), or a
            `wrt` that names no leading Rescaling / Normalization with a scalar scale.
        TypeError: for an unknown keyword argument.

    Example:

    ```python
    cert = keras_roll.certify(model, x_test[:100])
    cert.summary()                         # P25 / P50 / P75 / P100 of each margin
    cert.margins["l2"]                     # [100] l2 radii (also cert.margins[2])
    cert.binding[np.inf][0]                # ('dense_1', 17)
    cert.boundary_point(2)                 # where each l2 ball touches its boundary
    keras_roll.certify(model, x, rigor="strict", batch_size=32)
    keras_roll.certify(model, x, wrt="rescaling")   # radii in the Rescaling's output units
    ```
    """
    opts = RunOptions.of(options, uses=FIELDS, caller="certify", **overrides)
    norms = parse_norms(norms)
    run = _Run.make(model, norms, method, bisect_tol, opts)
    units = resolve_units(run.lin.program, wrt)
    if directions is not None and not units.is_input:
        directions = np.asarray(directions, np.float64) / units.scale  # d_u = a d_x
    if not norms and directions is None:
        raise ValueError("norms=() and no directions: there is nothing to certify. Pass "
                         "norms=(1, 2, np.inf) (or a subset), or directions=.")
    batches = read_batches(x, run.lin.input_spec, directions=directions,
                           batch_size=opts.batch_size)
    parts = []
    kept: list | None = []  # the inputs, for Certificate.binding_direction
    kept_bytes = 0
    replicas = Replicas.of(opts.strategy)
    with opts.progress(batches.total, "certify") as bar:
        bar = replicas.serial(bar)
        for batch in batches:
            parts += replicas.map_batch(lambda part: _certify_batch(run, part, bar), batch)
            if kept is not None:
                kept_bytes += int(np.prod(batch.x.shape)) * batch.x.dtype.size
                keep = not batches.stream or kept_bytes <= KEEP_STREAM_BYTES
                kept = kept + [batch.x] if keep else None
    cert = Certificate.concat(parts)
    warn_nonfinite(int(cert.nonfinite.sum()), cert.n, cert.evaluation, "margins")
    if not units.is_input:  # radii in the chosen units; t along directions unchanged
        cert = dataclasses.replace(cert, units=units, margins={
            p: units.to_units(v) for p, v in cert.margins.items()})
    cert.attach_source(run.twin, kept)
    return cert


@dataclasses.dataclass
class _BatchArrays:
    """The arrays of one batch, filled slice by slice."""

    margins: dict
    index: dict
    exact: dict
    directional: Margin | None
    bad: np.ndarray
    logits: list = dataclasses.field(default_factory=list)
    masks: list = dataclasses.field(default_factory=list)

    @classmethod
    def empty(cls, b: int, norms, k_dirs: int | None) -> _BatchArrays:
        along = None
        if k_dirs is not None:
            along = Margin(np.full((b, k_dirs), INF), np.full((b, k_dirs), -1, np.int64))
        def rows():
            return {p: np.full(b, -1, np.int64) for p in norms}

        return cls({p: np.full(b, INF) for p in norms}, rows(), rows(), along, np.zeros(b, bool))

    def put(self, sl: slice, res: SliceMargins, fwd, bad: np.ndarray) -> None:
        for p, m in res.margins.items():
            self.margins[p][sl], self.index[p][sl] = m.eps, m.index
            self.exact[p][sl] = res.exact_zero[p]
        if res.directional is not None:
            self.directional.eps[sl] = res.directional.eps
            self.directional.index[sl] = res.directional.index
        self.bad[sl] = bad
        self.logits.append(fwd.logits.numpy())
        self.masks.append(input_mask(fwd))

    def certificate(self, run: _Run, shape: tuple) -> Certificate:
        bad = self.bad
        causes = {}
        max_rows = run.twin.layout(shape).max_window_rows
        for p in run.norms:
            self.margins[p][bad], self.index[p][bad] = np.nan, -1
            causes[p], self.index[p] = explain_zeros(self.margins[p], self.index[p],
                                                     self.exact[p], max_rows,
                                                     run.options.rigor.guarded)
        along = self.directional
        if along is not None:
            along.eps[bad], along.index[bad] = np.nan, -1
        binding = {p: [run.lin.neuron_name(int(j), shape) if j >= 0 else None
                       for j in self.index[p]] for p in run.norms}
        mask = None if not self.masks or self.masks[0] is None else np.concatenate(self.masks)
        return Certificate(
            margins=NormDict(self.margins), binding=binding, binding_index=self.index,
            directional=None if along is None else along.eps,
            directional_index=None if along is None else along.index,
            logits=np.concatenate(self.logits, axis=0), method=run.method,
            rigor=run.options.rigor,
            evaluation=guard_for(run.options.rigor).evaluation(run.twin),
            mask=mask, nonfinite=bad, zero_cause=causes)


def _certify_batch(run: _Run, batch: Batch, bar) -> Certificate:
    """Certifies one checked batch: a `Certificate` of its examples."""
    x, dirs = batch.x, batch.directions
    b_total = int(x.shape[0])
    twin = run.twin
    acc = _BatchArrays.empty(b_total, run.norms, None if dirs is None else dirs.shape[1])
    if not twin.num_neurons(x.shape[1:]):  # no activation: one region, the whole space
        acc.logits.extend(_plain_logits(twin, x, run.options.batch_size))
        acc.bad[:] = ~np.all(np.isfinite(np.concatenate(acc.logits).reshape(b_total, -1)),
                             axis=1)
        bar.update(b_total)
    elif run.method is Method.ANALYTIC:
        for gs in errors_and_norms(twin, x, run.options.batch_size, run.stream_budget,
                                   run.options.rigor, run.norms):
            sl = gs.examples
            res = _analytic_slice(run, x[sl], None if dirs is None else dirs[sl], gs)
            valid = gs.forward.neurons.valid.numpy()
            overflow = None if gs.errors is None else gs.errors.overflow
            acc.put(sl, res, gs.forward, nonfinite(gs.forward, valid, overflow))
            bar.update(sl.stop - sl.start)
    else:
        for sl, fwd, jac in iter_jacobian_slices(twin, x, run.options.batch_size, run.budget):
            res = bisect_slice(twin, x[sl], fwd, jac, run.norms,
                               None if dirs is None else dirs[sl], run.bisect_tol, run.budget)
            acc.put(sl, res, fwd, nonfinite(fwd, neuron_arrays(fwd).valid))
            bar.update(sl.stop - sl.start)
    return acc.certificate(run, tuple(x.shape[1:]))


def _analytic_slice(run: _Run, xb, dirs_b, gs: GuardedSlice) -> SliceMargins:
    """The closed-form margins of one slice of examples."""
    below, above, valid, _ = neuron_arrays(gs.forward)
    dist = neuron_distances(below, above)
    terms = () if gs.errors is None else gs.errors.terms()
    margins = {}
    for p in run.norms:
        m = margins_from_norms(dist, gs.norms.dual(p), valid, *terms)
        margins[p] = Margin(to_numpy(m.eps), to_numpy(m.index))
    zeros = exact_zeros(dist, gs.norms.l1, valid)
    along = None
    if dirs_b is not None:
        along = _directional_analytic(run.twin, xb, gs.forward, dirs_b, run.budget, gs.errors)
    return SliceMargins(margins, along, {p: zeros for p in run.norms})


def _plain_logits(lin, x, batch_size):
    """Logits in forward batches (at most 1024 examples each) within the budget."""
    layout = lin.layout(x.shape[1:])
    plan = plan_chunks(int(x.shape[0]), 1, layout.tangent_bytes(np.dtype(lin.dtype).itemsize),
                       lin.memory_budget, batch_size, max_examples=1024)
    return [lin.forward(x[sl]).logits.numpy() for sl in plan.example_slices()]


def _directional_analytic(lin, xb, fwd, dirs_b, budget, err: RoundingErrors | None) -> Margin:
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
    return Margin(eps, idx)


def lp_margins(model: ModelOrTwin, x, p: Norm = 2, options: RunOptions | None = None,
               **overrides) -> np.ndarray:
    """The exact lp margin of every example, `[B]` float64 (Prop. 6).

    A cheap, silent shortcut of `certify` for monitoring (one norm, no names,
    no progress bar); the same numbers as `certify(model, x, norms=(p,),
    options=options, **overrides).margins[p]` (NaN, with a warning, for
    examples with non-finite neurons or logits).

    Args:
        model: a Keras model or a `Linearized`.
        x: `[B, *input_shape]` inputs or a stream of batches (see `certify`).
        p: 1, 2 or np.inf.
        options: a `keras_roll.RunOptions`, or None.
        **overrides: its fields (`batch_size`, `memory_budget`, `rigor`; see
            `certify`); rigor "float32" is the fastest. `verbose` is a
            `TypeError` (there is no progress bar).

    Example:

    ```python
    eps = lp_margins(lin, x_batch, p=np.inf, rigor="float32")
    ```
    """
    p = parse_norm(p)
    opts = RunOptions.of(options, uses=MARGIN_FIELDS, caller="lp_margins", **overrides)
    lin = linearize(model)
    guard = guard_for(opts.rigor)
    twin = guard.twin(lin)
    budget = opts.budget(lin.memory_budget)
    outs, bad_total = [], 0
    for batch in read_batches(x, lin.input_spec, batch_size=opts.batch_size):
        xb = batch.x
        out = np.full(int(xb.shape[0]), INF)
        outs.append(out)
        if not twin.num_neurons(xb.shape[1:]):
            continue
        for sl, fwd, gn, err in errors_and_norms(twin, xb, opts.batch_size, budget, opts.rigor,
                                                 (p,)):
            below, above, valid, _ = neuron_arrays(fwd)
            terms = () if err is None else err.terms()
            eps, _ = margins_from_norms(neuron_distances(below, above), gn.dual(p), valid, *terms)
            out[sl] = to_numpy(eps)
            bad = nonfinite(fwd, valid, None if err is None else err.overflow)
            out[sl][bad] = np.nan
            bad_total += int(bad.sum())
    out = np.concatenate(outs)
    warn_nonfinite(bad_total, out.size, guard.evaluation(twin), "margins")
    return out


def l2_margins(model: ModelOrTwin, x, options: RunOptions | None = None,
               **overrides) -> np.ndarray:
    """The exact l2 margin of every example, `[B]` float64 (Prop. 6); see `lp_margins`.

    Example:

    ```python
    print("median l2 margin", np.median(l2_margins(model, x_val)))
    ```
    """
    opts = RunOptions.of(options, uses=MARGIN_FIELDS, caller="l2_margins", **overrides)
    return lp_margins(model, x, 2, opts)
