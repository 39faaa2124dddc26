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
margin by `certify`'s own guard (docs/design.md, section "Robustness radius").

Example:

```python
terms = decision_terms(twin, x, pred, guard=True)
terms.margins[0], terms.classes[0]         # m_j and the class j of every row
```
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.certification.bisection import steepest_directions
from keras_roll.certification.margin_math import dual_norm, to_numpy
from keras_roll.compile.bounds.ibp import abs_sum
from keras_roll.compile.bounds.traversal import capture, forward_nodes, pull_back
from keras_roll.compile.caches import cached
from keras_roll.compile.chunking import plan_chunks
from keras_roll.compile.structure import structure_of
from keras_roll.robust.adversarial import confirm
from keras_roll.robust.compiled import compile_batched
from keras_roll.robust.float_error import OpRounding
from keras_roll.rounding import rules
from keras_roll.rounding.precision import evaluation_precision, unit_roundoff

__all__ = ["DecisionTerms", "NormBounds", "decision_terms", "link_gap", "margin_rows",
           "region_bounds"]

# The guard's first-order terms doubled for second-order ones (the inputs an op
# rounds already carry errors), as `keras_roll.certification.margins.rounding_errors` does.
SECOND_ORDER = 2.0
# Roundings of a softmax output beyond the number of classes (the subtraction of the
# largest logit, exp, the division), with a factor of 2 to spare (see `link_gap`).
SOFTMAX_ROUNDINGS = 8
LINK_SAFETY = 2.0


class DecisionTerms(NamedTuple):
    """The affine map of the logit margins on the region of each `x` (numpy, float64).

    Attributes:
        margins: `[B, L-1]` `m_j = f_y(x) - f_j(x)` in the float64 twin.
        gradients: `[B, L-1, D]` their gradients `G_j` (the pattern of `x` frozen).
        classes: `[B, L-1]` the class `j` of every row.
        err_at_x: `[B, L-1]` bound on the rounding error of `m_j` (0 without guard).
        err_per_radius: `[B, L-1]` its growth per unit of `||x' - x||_inf`.
    """

    margins: np.ndarray
    gradients: np.ndarray
    classes: np.ndarray
    err_at_x: np.ndarray
    err_per_radius: np.ndarray


class NormBounds(NamedTuple):
    """What one method found for one norm (numpy).

    Attributes:
        lower: `[B]` lower bounds (0 where the method knows nothing).
        upper: `[B]` upper bounds (NaN where no adversarial point was found).
        adversarial: `[B, *input_shape]` the points (NaN rows where none).
        runner_up: `[B]` int64 the class of the binding hyperplane or of the point (-1).
    """

    lower: np.ndarray
    upper: np.ndarray
    adversarial: np.ndarray
    runner_up: np.ndarray


def margin_rows(pred: tf.Tensor, classes: int, dtype) -> tuple:
    """`([B, L-1, L] rows e_y - e_j, [B, L-1] classes j)` for `j != y`, in cyclic order."""
    others = (pred[:, None] + 1 + tf.range(classes - 1, dtype=pred.dtype)[None]) % classes
    rows = tf.one_hot(pred, classes, dtype=dtype)[:, None] - tf.one_hot(others, classes,
                                                                         dtype=dtype)
    return rows, others


def _terms_fn(twin, guard: bool, x, pred):
    """The compiled body of `decision_terms` for one chunk."""
    graph = structure_of(twin.program)
    values = capture(twin.interpreter, x)
    logits = values.value(graph, graph.output_key)
    rows, others = margin_rows(pred, int(logits.shape[-1]), logits.dtype)
    visit, e0, e1 = None, [], []
    if guard:
        opr = OpRounding(evaluation_precision(twin.program))
        for node in graph.nodes:
            opr.check(node)
        growth = forward_nodes(graph, tf.ones_like(x), lambda node, i, ins: rules.magnitude(
            node.op, ins, values.records[i], False, values.masks[i], values.inputs[i]))

        def visit(node, index, lam):
            mags = [tf.abs(v) for v in values.inputs[index]]
            rec, mask = values.records[index], values.masks[index]
            d0 = opr(node, mags, rec, mask, values=values.inputs[index])
            if d0 is not None:
                d1 = opr(node, [growth[k] for k in node.inputs], rec, mask, affine=False,
                         values=values.inputs[index])
                e0.append(abs_sum(lam, d0))
                e1.append(abs_sum(lam, d1))
            return None

    res = pull_back(graph, values, graph.output_key, rows, visit=visit)
    margins = tf.reduce_sum(rows * logits[:, None], -1)
    zero = tf.zeros_like(margins)
    grads = tf.reshape(res.lam_input, tf.concat([tf.shape(rows)[:2], [-1]], 0))
    return (margins, grads, others, tf.add_n(e0) if e0 else zero,
            tf.add_n(e1) if e1 else zero)


def _compiled(twin, guard: bool):
    return cached(twin, ("decision_terms", guard), lambda: compile_batched(
        functools.partial(_terms_fn, twin, guard), twin, "xy"))


def decision_terms(twin, x, pred: np.ndarray, guard: bool,
                   memory_budget: int | None = None) -> DecisionTerms:
    """The `DecisionTerms` of a batch, in chunks within the memory budget.

    Args:
        twin: a float64 `Linearized`.
        x: `[B, *input_shape]` inputs.
        pred: `[B]` the class each margin is measured from.
        guard: whether to bound the rounding of the model's evaluation.
        memory_budget: bytes per chunk (default the twin's).
    """
    x = np.asarray(x, np.float64)
    b = x.shape[0]
    layout = twin.layout(x.shape[1:])
    logits = int(np.prod(twin.compiled.primal(tf.constant(x[:1])).logits.shape[1:]))
    rows = max(logits - 1, 1)
    per = layout.tangent_bytes(8) * 2  # functionals and their transposes
    plan = plan_chunks(b, rows, per, memory_budget or twin.memory_budget,
                       max_examples=None, min_directions=rows)
    fn = _compiled(twin, bool(guard))
    parts = []
    for sl in plan.example_slices():
        out = fn(tf.constant(x[sl]), tf.constant(np.asarray(pred[sl], np.int64)))
        parts.append([to_numpy(o) for o in out])
    if not parts:
        z = np.zeros((0, rows))
        return DecisionTerms(z, np.zeros((0, rows, layout.input_size)), z.astype(np.int64),
                             z, z)
    return DecisionTerms(*(np.concatenate(p, axis=0) for p in zip(*parts)))


def link_gap(model, output_link, classes: int, guarded: bool) -> float:
    """The logit margin `f_y - f_j` below which the model's rounded output may not keep
    class `y` ahead (0 for logits, or without a rounding guard).

    A folded softmax computes `p_k = exp(z_k - max z) / sum` with a relative error
    `gamma <= (L + 4) u` in its output dtype (one rounding per term of the sum, the
    subtraction, exp, the division); `p_y > p_j` survives it wherever `z_y - z_j >
    2 gamma / (1 - gamma)`. Without this term, logits within a few units in the last
    place of each other tie in the softmax and argmax keeps the lower class index.
    """
    if not guarded or output_link != "softmax":
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
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = np.where(gq > 0, np.maximum(m, 0.0) / gq, np.inf)
        num = np.maximum(m - SECOND_ORDER * terms.err_at_x - gap, 0.0)
        den = gq * (1.0 + slack) + SECOND_ORDER * terms.err_per_radius
        guarded = np.where(den > 0, num / den, np.inf)
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
        little beyond, changes the model's prediction (inside the region this is
        the exact minimal perturbation).
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
    return NormBounds(lower, upper, points.astype(np.float64), runner.astype(np.int64))
