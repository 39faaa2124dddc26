"""Method 1, inside the region: the decision hyperplanes of the affine map at `x`.

On the linear region of `x` the logits are affine, so the margin `f_y - f_j` to
every other class is `m_j + G_j . (x' - x)` there, and the lp distance from `x` to
the hyperplane `f_y = f_j` is `m_j / ||G_j||_q` (a dual-norm division). Where the
nearest of them is closer than the certified region margin `eps` (`certify`), the
closest adversarial point lies inside the region: the minimal perturbation is known
exactly, with the point. Otherwise the prediction is constant on the region's ball
and `eps` is the lower bound. Under a rounding guard both are shrunk: the margins by
the error of the model's evaluation of the logits inside the ball, pulled back from
the margins through the frozen pattern (`keras_roll.robust.float_error`), the region
margin by `certify`'s own guard of the same rigor. Under rigor "float64" the logit
margins get `certify`'s semantics too: `LAMBDA` standard deviations of their rounding
error in Higham & Mary's probabilistic model (computed exactly from the pulled-back
functionals, no sampling), or the worst-case bound where that allows more
(docs/design.md, section "Robustness radius").

Example:

```python
terms = decision_terms(twin, x, pred, guard=True)
terms.margins[0], terms.classes[0]         # m_j and the class j of every row
```
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.compile.bounds.ibp import abs_sum
from keras_roll.compile.bounds.margins import logit_margins
from keras_roll.compile.bounds.traversal import forward_nodes, pull_back
from keras_roll.compile.caches import cached
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.rules.activations import Link
from keras_roll.compile.structure import structure_of
from keras_roll.errors import UnsupportedModelError
from keras_roll.geometry import dual_norm, steepest_directions, to_numpy
from keras_roll.options import Rigor
from keras_roll.robust.adversarial import confirm
from keras_roll.robust.compiled import compile_batched
from keras_roll.robust.float_error import OpRounding
from keras_roll.rounding import rules
from keras_roll.rounding.guard import BOUND_SAFETY
from keras_roll.rounding.noise import LAMBDA
from keras_roll.rounding.precision import (
    evaluation_precision,
    gamma,
    underflow_unit,
    unit_roundoff,
)

__all__ = ["DecisionTerms", "NormBounds", "decision_terms", "guard_mode", "link_gap",
           "region_bounds"]

# The worst-case terms doubled for second-order ones (the inputs an op rounds already
# carry errors), as `keras_roll.certification.margins.rounding_errors` does.
SECOND_ORDER = 2.0
# The probabilistic terms inflated for the magnitudes of the computed (not exact)
# inputs and products of two roundings: both are O(n u) relative, far below 2^-6.
PROBABILISTIC_SAFETY = 1.0 + 2.0**-6
# Roundings of a softmax output beyond the number of classes (the subtraction of the
# largest logit, exp, the division), with a factor of 2 to spare (see `link_gap`).
SOFTMAX_ROUNDINGS = 8
LINK_SAFETY = 2.0
_U64 = unit_roundoff("float64")
_ETA64 = underflow_unit("float64")


class DecisionTerms(NamedTuple):
    """The affine map of the logit margins on the region of each `x` (numpy, float64).

    Attributes:
        margins: `[B, L-1]` `m_j = f_y(x) - f_j(x)` in the float64 twin.
        gradients: `[B, L-1, D]` their gradients `G_j` (the pattern of `x` frozen).
        classes: `[B, L-1]` the class `j` of every row.
        err_at_x: `[B, L-1]` bound on the rounding error of `m_j` (0 without guard;
            the probabilistic bound under rigor "float64"), second-order terms
            included.
        err_per_radius: `[B, L-1]` its growth per unit of `||x' - x||_inf`.
        strict_at_x: `[B, L-1]` the worst-case bound, a second guard under rigor
            "float64" (a margin is safe where either holds), else None.
        strict_per_radius: its growth, likewise.
    """

    margins: np.ndarray
    gradients: np.ndarray
    classes: np.ndarray
    err_at_x: np.ndarray
    err_per_radius: np.ndarray
    strict_at_x: np.ndarray | None = None
    strict_per_radius: np.ndarray | None = None


class NormBounds(NamedTuple):
    """What one method found for one norm (numpy).

    Attributes:
        lower: `[B]` lower bounds (0 where the method knows nothing).
        upper: `[B]` upper bounds (NaN where no adversarial point was found).
        adversarial: `[B, *input_shape]` the points (NaN rows where none).
        runner_up: `[B]` int64 the class of the binding hyperplane or of the point (-1).
        exact_value: `[B]` or None: method 1's distance to the nearest decision
            hyperplane in exact arithmetic where it lies inside the certified region,
            its projection was confirmed and the guarded lower bound is positive (the
            minimal perturbation is then known), NaN elsewhere.
    """

    lower: np.ndarray
    upper: np.ndarray
    adversarial: np.ndarray
    runner_up: np.ndarray
    exact_value: np.ndarray | None = None


_MODES = ("none", "strict", "float64")  # the guard modes by their code in the graph


def guard_mode(guard) -> str:
    """The logit guard of `guard`: "none", "strict" (worst case) or "float64"
    (probabilistic, with the worst case as a second guard). `guard` is a `Rigor` or
    its string, or a bool (True: the worst case, False: none)."""
    if isinstance(guard, bool):
        return "strict" if guard else "none"
    rigor = Rigor.parse(guard)
    return {Rigor.FLOAT32: "none", Rigor.STRICT: "strict", Rigor.FLOAT64: "float64"}[rigor]


class _LogitGuard:
    """Accumulates, op by op of a pull-back, the rounding terms of the logit margins.

    Worst case: `sum |Lambda| Delta` (`float_error.OpRounding`). Probabilistic
    (`"float64"`): the local error of an op output computed with `n` roundings is a
    sum of independent terms whose squared bounds add up to at most `e^2`, `e = c m +
    sqrt(n) eta` (`EvaluationPrecision.noise_unit`, as the noise pass of
    `keras_roll.rounding.noise`), so by Hoeffding the margin's error is at most
    `LAMBDA sqrt(sum Lambda^2 e^2)` except with probability `2 exp(-LAMBDA^2 / 2)`;
    `Lambda` is known exactly here, so no sampling (and no `KAPPA`) is needed. The
    float64 twin's own error is added rigorously.

    The guard mode is an input of the graph (`_MODES`' index): `visit` only keeps the
    functionals, and `terms` computes the worst case and the probabilistic terms
    inside conditionals, so that one trace serves every mode and an unguarded call
    runs none of them.
    """

    def __init__(self, graph, values, x, precision):
        self.graph, self.values, self.x = graph, values, x
        self.opr = OpRounding(precision)
        self.seen: list = []  # (node, index, lam) of the pull-back

    def visit(self, node, index, lam):
        self.seen.append((node, index, lam))
        return None

    def terms(self, zero, code) -> tuple:
        """`(err_at_x, err_per_radius, strict_at_x, strict_per_radius)` `[B, L-1]`
        under the mode of `code` (zeros for "none")."""
        return tf.cond(code > 0, lambda: self._guarded(zero, code), lambda: (zero,) * 4)

    def _guarded(self, zero, code):
        values = self.values
        growth = forward_nodes(self.graph, tf.ones_like(self.x), lambda node, i, ins:
                               rules.magnitude(node.op, ins, values.records[i], False,
                                               values.masks[i], values.inputs[i]))
        strict, parts = ([], []), []
        for node, index, lam in self.seen:
            ins = values.inputs[index]
            rec, mask = values.records[index], values.masks[index]
            mags = [tf.abs(v) for v in ins]
            n = self.opr.roundings(node, mags)
            if n == 0:
                continue
            shift = self.opr.shift(node)
            m0 = rules.magnitude(node.op, [m + shift for m in mags], rec, True, mask, ins)
            m1 = rules.magnitude(node.op, [growth[k] for k in node.inputs], rec, False, mask,
                                 ins)
            g, e = self.opr.unit(node, n)
            strict[0].append(abs_sum(lam, g * m0 + e))
            strict[1].append(abs_sum(lam, g * m1))
            parts.append((node, n, lam, m0, m1))
        strict = tuple(SECOND_ORDER * _total(t, zero) for t in strict)
        return tf.cond(code == _MODES.index("float64"),
                       lambda: self._noise(parts, zero) + strict, lambda: strict + strict)

    def _noise(self, parts, zero) -> tuple:
        """The probabilistic terms (at x, per radius) of rigor "float64"."""
        noise, twin = ([], []), ([], [])
        for node, n, lam, m0, m1 in parts:
            dtype = self.opr.precision.dtype_of(node.op)
            c = self.opr.precision.noise_unit(node.op, n, rules.matmul_like(node.op))
            eta = math.sqrt(n) * underflow_unit(dtype)
            noise[0].append(abs_sum(tf.square(lam), tf.square(c * m0 + eta)))
            noise[1].append(abs_sum(tf.square(lam), tf.square(c * m1)))
            g64 = gamma(n, _U64)
            twin[0].append(abs_sum(lam, g64 * m0 + n * _ETA64))
            twin[1].append(abs_sum(lam, g64 * m1))
        return tuple((LAMBDA * PROBABILISTIC_SAFETY * tf.sqrt(_total(v, zero))
                      + SECOND_ORDER * _total(w, zero)) * BOUND_SAFETY
                     for v, w in zip(noise, twin))


def _total(parts, zero):
    return tf.add_n(parts) if parts else zero


def _terms_fn(twin, x, pred, code):
    """The compiled body of `decision_terms` for one chunk; `code` the guard mode's
    index in `_MODES` (a graph input: one trace serves every mode)."""
    lm = logit_margins(twin.interpreter, x, pred)
    zero = tf.zeros_like(lm.margins)
    guard = None
    if _guard_error(twin) is None:
        guard = _LogitGuard(lm.structure, lm.values, x, evaluation_precision(twin.program))
    res = pull_back(lm.structure, lm.values, lm.structure.output_key, lm.rows,
                    visit=None if guard is None else guard.visit)
    grads = tf.reshape(res.lam_input, tf.concat([tf.shape(lm.rows)[:2], [-1]], 0))
    errs = (zero,) * 4 if guard is None else guard.terms(zero, code)
    return (lm.margins, grads, lm.others) + tuple(errs)


def _guard_error(twin):
    """The `UnsupportedModelError` of an op whose rounding the guard does not model, or
    None (the guard modes other than "none" then raise it)."""
    def check():
        opr = OpRounding(evaluation_precision(twin.program))
        try:
            for node in structure_of(twin.program).nodes:
                opr.check(node)
        except UnsupportedModelError as err:
            return err
        return None

    return cached(twin, ("decision_terms_guard",), check)


def _compiled(twin):
    return cached(twin, ("decision_terms",), lambda: compile_batched(
        functools.partial(_terms_fn, twin), twin, "xyg"))


def decision_terms(twin, x, pred: np.ndarray, guard,
                   memory_budget: int | None = None) -> DecisionTerms:
    """The `DecisionTerms` of a batch, in chunks within the memory budget.

    Args:
        twin: a float64 `Linearized`.
        x: `[B, *input_shape]` inputs.
        pred: `[B]` the class each margin is measured from.
        guard: the rounding guard of the model's evaluation: a `Rigor` (or its
            string; "float64": probabilistic with the worst case beside it), or a
            bool (True: the worst case; False: none). See `guard_mode`.
        memory_budget: bytes per chunk (default the twin's).
    """
    x = np.asarray(x, np.float64)
    b = x.shape[0]
    layout = twin.layout(x.shape[1:])
    logits = cached(twin, ("logit_count", x.shape[1:]), lambda: int(np.prod(
        twin.compiled.primal(tf.constant(x[:1])).logits.shape[1:])))  # one forward pass
    rows = max(logits - 1, 1)
    per = layout.tangent_bytes(8) * 2  # functionals and their transposes
    plan = plan_chunks(b, rows, per, memory_budget or twin.memory_budget,
                       max_examples=None, min_directions=rows)
    mode = guard_mode(guard)
    error = _guard_error(twin)
    if mode != "none" and error is not None:
        raise error
    fn = _compiled(twin)
    code = tf.constant(_MODES.index(mode), tf.int32)
    parts = []
    for sl in plan.example_slices():
        out = fn(tf.constant(x[sl]), tf.constant(np.asarray(pred[sl], np.int64)), code)
        parts.append([to_numpy(o) for o in out])
    if not parts:
        z = np.zeros((0, rows))
        return DecisionTerms(z, np.zeros((0, rows, layout.input_size)), z.astype(np.int64),
                             z, z, z, z)
    out = [np.concatenate(p, axis=0) for p in zip(*parts)]
    if mode != "float64":  # one guard: no second alternative
        out[5:] = [None, None]
    return DecisionTerms(*out)


def link_gap(model, output_link, classes: int, guarded: bool) -> float:
    """The logit margin `f_y - f_j` below which the model's rounded output may not keep
    class `y` ahead (0 for logits, or without a rounding guard).

    A folded softmax computes `p_k = exp(z_k - max z) / sum` with a relative error
    `gamma <= (L + 4) u` in its output dtype (one rounding per term of the sum, the
    subtraction, exp, the division); `p_y > p_j` survives it wherever `z_y - z_j >
    2 gamma / (1 - gamma)`. Without this term, logits within a few units in the last
    place of each other tie in the softmax and argmax keeps the lower class index.
    """
    if not guarded or output_link is not Link.SOFTMAX:
        return 0.0
    outputs = getattr(model, "outputs", None)
    u = unit_roundoff(outputs[0].dtype if outputs else "float32")
    return LINK_SAFETY * 2.0 * (classes + SOFTMAX_ROUNDINGS) * u


def hyperplane_distances(terms: DecisionTerms, p, slack: float = 0.0, gap: float = 0.0):
    """`(guarded [B, L-1], exact [B, L-1], dual norms [B, L-1])` distances to every
    decision hyperplane of the affine map (guarded: within which the model's
    evaluation keeps `f_y > f_j + gap`, `gap` from `link_gap`)."""
    gq = to_numpy(dual_norm(terms.gradients, p))
    m = terms.margins
    alternatives = [(terms.err_at_x, terms.err_per_radius)]
    if terms.strict_at_x is not None:  # a margin is safe where either guard holds
        alternatives.append((terms.strict_at_x, terms.strict_per_radius))
    guarded = None
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = np.where(gq > 0, np.maximum(m, 0.0) / gq, np.inf)
        for at_x, per_radius in alternatives:
            num = np.maximum(m - at_x - gap, 0.0)
            den = gq * (1.0 + slack) + per_radius
            t = np.where(den > 0, num / den, np.inf)
            guarded = t if guarded is None else np.fmax(guarded, t)
    return guarded, exact, gq


def region_bounds(model, x: np.ndarray, pred: np.ndarray, terms: DecisionTerms,
                  region_margin: np.ndarray, p, slack: float = 0.0,
                  gap: float = 0.0) -> NormBounds:
    """Method 1 for one norm: exact inside the region, else the region margin.

    Args:
        model: the Keras model (adversarial points are checked in it).
        x: `[B, *input_shape]` inputs.
        pred: `[B]` the predicted classes.
        terms: their `DecisionTerms`.
        region_margin: `[B]` the certified lp margins (`certify`, same rigor).
        p: the norm.
        slack: relative error bound of the computed dual norms.
        gap: the logit margin the model's output needs (`link_gap`).

    Returns:
        `NormBounds`: `lower = min(region margin, guarded hyperplane distance)`;
        `upper` and the point where the affine map's nearest hyperplane, pushed a
        little beyond, changes the model's prediction; `exact_value`, that
        hyperplane's distance in exact arithmetic, where it is at most the region
        margin (the minimal perturbation of exact arithmetic on the weights, which
        `[lower, upper]` brackets for the model's own evaluation), its point was
        confirmed and `lower > 0`.
    """
    b = x.shape[0]
    guarded, exact, _ = hyperplane_distances(terms, p, slack, gap)
    if guarded.shape[1] == 0:  # one class: nothing to change
        inf = np.full(b, np.inf)
        return NormBounds(inf, np.full(b, np.nan), np.full(x.shape, np.nan),
                          np.full(b, -1, np.int64))
    j = np.argmin(exact, axis=1)
    rows = np.arange(b)
    lower = np.minimum(np.min(guarded, axis=1), region_margin)
    g = terms.gradients[rows, j]
    t = exact[rows, j]
    ok = np.isfinite(t) & np.any(g != 0, axis=1)
    u = np.zeros_like(g)
    if ok.any():
        u[ok] = steepest_directions(g[ok], p, -np.ones(int(ok.sum())))
    t = np.where(ok, t, np.nan)
    points, upper = confirm(model, x, u.reshape(x.shape), t, pred, p)
    runner = np.where(np.isfinite(upper), terms.classes[rows, j],
                      terms.classes[rows, np.argmin(guarded, axis=1)])
    inside = np.isfinite(upper) & (t <= region_margin) & (lower > 0)
    return NormBounds(lower, upper, points.astype(np.float64), runner.astype(np.int64),
                      np.where(inside, t, np.nan))
