"""Branch and bound over one ball: is every point within `eps` of `x` given the
model's class, is there an adversarial point, or is the budget spent?

For one input `x` and one radius `eps`, the ball is split into subdomains (leaves) by
fixing unstable ReLU-family units active or inactive (`keras_roll.compile.bounds.splits`),
in the manner of alpha,beta-CROWN (Wang et al., NeurIPS 2021):

* every leaf is bounded by the relaxation with its splits: its layer bounds recomputed
  on the subdomain (`refine=True`) or cut from the ball's, the split constraints'
  Lagrange multipliers `beta >= 0` and (`alpha=True`) the lower slopes of the unstable
  units per margin raised by projected gradient ascent (Adam), warm started from the
  parent's; every iterate is a sound bound, the best is kept;
* leaves are bounded in batches through the same passes (a batch dimension of leaves);
* the leaves with the lowest bounds are split first, on the unit with the best BaBSR
  score (the offset its upper line costs the bound), or (`candidates > 1`) on the best
  of the top BaBSR units by one pass over their children (filtered smart branching);
  while the frontier is small, each leaf is split on that unit and the next best by
  BaBSR at once (up to `MAX_DEPTH` units, `2^d` children: the batch fills in one
  pass); a leaf with every unstable unit split is bounded again, its multipliers
  raised further from where they were;
* the ball is *certified* when every leaf's bound of every margin exceeds the gap;
  it holds an *adversarial point* when the minimiser of a leaf's linear bound over the
  ball changes the Keras model's prediction (checked in its own dtype); otherwise the
  search stops at its budget (time or leaves) undecided;
* a certified ball hands on its leaves (`BallVerdict.cover`, verified ones included:
  their subdomains partition the input space) with their multipliers and slopes, and
  the search over a larger ball can start from them instead of from the whole ball
  (the radius search's later probes, all above the last certified one, do).

The compiled passes themselves are `keras_roll.robust.leaf_passes.LeafPasses`.

Example:

```python
passes = LeafPasses(twin, np.inf, True, twin.memory_budget, 64)
verdict = verify_ball(passes, model, x, pred, eps, 0.0, BranchOptions(), deadline)
verdict.status     # "certified", "adversarial" or "unknown"
larger = verify_ball(passes, model, x, pred, 1.05 * eps, 0.0, BranchOptions(), deadline,
                     cover=verdict.cover)  # where certified
```
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.geometry import steepest_directions
from keras_roll.robust.adversarial import clearly_other, model_outputs
from keras_roll.robust.arguments import BranchOptions
from keras_roll.robust.attacks import ball_attack
from keras_roll.robust.leaf_lp import available, solve_leaves
from keras_roll.robust.leaf_passes import LeafPasses

__all__ = ["BallVerdict", "Cover", "LeafPasses", "verify_ball"]


PGD_STEPS = 40  # steps of the attack at a fixed radius from the leaves' optima
ATTACK_STARTS = 8  # leaves per batch whose optima start the attack
MAX_DEPTH = 6  # units split at once in one leaf (2^MAX_DEPTH children)
MAX_COVER_BYTES = 2**26  # the most a certified ball's cover keeps: its splits (int8),
# and while they fit, the multipliers and slopes of its leaves (float32)


def _padded(a: np.ndarray, n: int) -> np.ndarray:
    """`a` with its first row repeated up to `n` rows."""
    if a.shape[0] == n:
        return a
    return np.concatenate([a, np.repeat(a[:1], n - a.shape[0], axis=0)])


ALPHA_RATE = 0.1  # Adam's step on the lower slopes (ReLU's lie in [0, 1])


class _Adam:
    """Projected Adam ascent on `[beta | alpha]` rows: the multipliers stay >= 0; the
    bound pass clips the slopes to their range (the slopes it used replace them)."""

    def __init__(self, params: np.ndarray, beta_rate: float, alpha_rate: float):
        self.m, self.v = np.zeros_like(params), np.zeros_like(params)
        self.t = np.zeros(len(params))
        self.rates = (beta_rate, alpha_rate)

    def step(self, params: np.ndarray, grad: np.ndarray, size: int, rows) -> np.ndarray:
        """`params` with leaves `rows` (the ones still open) one step further up
        `grad` (`[len(rows), C, 2 size]`)."""
        self.t[rows] += 1
        t = self.t[rows][:, None, None]
        self.m[rows] = 0.9 * self.m[rows] + 0.1 * grad
        self.v[rows] = 0.999 * self.v[rows] + 0.001 * grad * grad
        step = (self.m[rows] / (1 - 0.9 ** t)) / (np.sqrt(self.v[rows] / (1 - 0.999 ** t)) + 1e-12)
        out, rate = params.copy(), np.where(np.arange(2 * size) < size, *self.rates)
        out[rows] = params[rows] + rate * step
        out[rows, :, :size] = np.maximum(out[rows, :, :size], 0)
        return out


class BallVerdict(NamedTuple):
    """What `verify_ball` found.

    Attributes:
        status: "certified", "adversarial" or "unknown" (budget spent).
        point: the adversarial point (model dtype, as float64), or None.
        leaves: leaves bounded.
        lower: the smallest margin bound over the open leaves (inf when certified).
        passes: batched bound passes run (each bounds up to `options.batch` leaves).
        attack_steps: gradient steps of the attacks from the leaves' optima (per start).
        cover: where certified, the leaves that verified the ball (a `Cover`): their
            subdomains partition the input space, so the search over a larger ball
            can start from them (`verify_ball`'s `cover`); None where not certified
            or where the splits exceed `MAX_COVER_BYTES`.
    """

    status: str
    point: np.ndarray | None
    leaves: int
    lower: float
    passes: int = 0
    attack_steps: int = 0
    cover: Cover | None = None


class Cover(NamedTuple):
    """The leaves of a certified ball.

    Attributes:
        splits: `[L, size]` int8, +1, -1 or 0 per unit: subdomains that partition the
            input space.
        params: `[L, C, 2 size]` float32, their split multipliers and lower slopes
            (a warm start; any values are sound), or None (more than
            `MAX_COVER_BYTES`: the search starts them from 0 and CROWN's slopes).
    """

    splits: np.ndarray
    params: np.ndarray | None = None


class _Done:
    """The verified leaves of one search: their splits, and their multipliers and
    slopes (float32) while the whole fits in `MAX_COVER_BYTES`."""

    def __init__(self):
        self.splits, self.params, self.bytes = [], [], 0

    def add(self, splits: np.ndarray, params: np.ndarray) -> None:
        self.splits.append(splits.astype(np.int8))
        self.bytes += splits.size
        if self.params is not None:
            self.params.append(params.astype(np.float32))
            self.bytes += 4 * params.size
            if self.bytes > MAX_COVER_BYTES:
                self.params = None  # the splits alone from here on
                self.bytes = sum(t.size for t in self.splits)

    def cover(self) -> Cover | None:
        if self.bytes > MAX_COVER_BYTES:
            return None
        return Cover(np.concatenate(self.splits),
                     None if self.params is None else np.concatenate(self.params))


class _Ball:
    """One branch and bound over the ball of radius `eps` around `x`."""

    def __init__(self, passes: LeafPasses, model, x, pred, eps, gap, options: BranchOptions):
        self.passes, self.model, self.options = passes, model, options
        self.x, self.pred, self.eps, self.gap = x, int(pred), float(eps), gap
        self.xt = tf.constant(x[None], tf.float64)
        self.pt = tf.constant([int(pred)], tf.int64)
        self.et = tf.constant(float(eps), tf.float64)
        self.root = None
        self.repeated: dict = {}  # rows -> the root's boxes repeated
        self.leaves = self.calls = self.attack_steps = self.linear = self.looks = 0
        self.solved: set = set()  # the split patterns of the leaves solved as programs

    def layer_boxes(self, splits: np.ndarray):
        """`(los, his, deltas, empty)` of a batch of leaves: their own (`refine`) or
        the ball's (kept in `root`, computed first: a search from a cover starts with
        split leaves)."""
        if self.root is None:
            zero = np.zeros((1, splits.shape[1]))
            los, his, deltas, empty = self.passes.boxes(self.xt, self.et, tf.constant(zero))
            self.root = (los, his, deltas, empty)
            if len(splits) == 1 and not splits.any():
                return los, his, deltas, np.asarray(empty)
        if not self.options.refine:
            n = splits.shape[0]
            return (*self._root_rows(n), np.zeros(n, bool))
        los, his, deltas, empty = self.passes.boxes(self.xt, self.et, tf.constant(splits))
        return los, his, deltas, np.asarray(empty)

    def _root_rows(self, rows: int) -> tuple:
        """The ball's `(los, his, deltas)` repeated for `rows` leaves (kept per size)."""
        if rows not in self.repeated:
            self.repeated[rows] = tuple(
                tuple(tf.tile(t, [rows] + [1] * (len(t.shape) - 1)) for t in part)
                for part in self.root[:3])
        return self.repeated[rows]

    def evaluate(self, splits: np.ndarray, params: np.ndarray):
        """Bounds a batch of leaves: `(lower [n, C], params, g [n, *in], scores [n, N])`;
        `params` `[n, C, 2 N]` are the split multipliers `beta` and the lower slopes
        `alpha` (NaN: CROWN's), raised by `options.beta_steps` Adam steps (the slopes
        only with `options.alpha`; every iterate is sound, the best bound is kept)."""
        n, size = splits.shape
        s, par = splits.astype(np.float64), params.copy()
        los, his, deltas, empty = self.layer_boxes(s)
        adam = _Adam(par, self.options.beta_rate, ALPHA_RATE if self.options.alpha else 0.0)
        best = np.full(par.shape[:2], -np.inf)
        g, scores = np.zeros((n, *self.x.shape)), np.zeros((n, size))
        steps = self.options.beta_steps if self.options.alpha or np.any(splits) else 0
        live = np.arange(n)  # the leaves still open: a verified one leaves the batch
        for t in range(steps + 1):
            lower, grad, gl, sl, used = self.passes.bounds(
                self.xt, self.pt, self.et, los, his, deltas, s[live], par[live, :, :size],
                par[live, :, size:], live)
            self.calls += 1
            par[live, :, size:] = used.numpy()
            g[live], scores[live] = gl.numpy(), sl.numpy()
            best[live] = np.maximum(best[live], np.where(empty[live, None], np.inf,
                                                         lower.numpy()))
            still = best[live].min(axis=1) <= self.gap
            if t == steps or not still.any():
                break
            par = adam.step(par, grad.numpy()[still], size, live[still])
            live = live[still]
        self.leaves += n
        return best, par, g, scores

    def adversarial(self, g: np.ndarray):
        """The first leaf optimum (the linear bound's minimiser over the ball) that the
        model classifies as another class, else (at the 1st, 2nd, 4th, 8th... call:
        the leaves' optima move little from one level to the next) the first such
        point of a projected gradient attack from the optima of up to `ATTACK_STARTS`
        leaves; or None."""
        self.looks += 1
        flat = g.reshape(g.shape[0], -1)[:ATTACK_STARTS]
        live = np.any(flat != 0, axis=1)
        if not live.any():
            return None
        u = steepest_directions(flat[live], self.p_norm, -np.ones(int(live.sum())))
        pts = self.x[None] + self.eps * u.reshape(-1, *self.x.shape)
        found = self._flipped(pts)
        if found is None and self.looks & (self.looks - 1) == 0:
            self.attack_steps += PGD_STEPS * len(pts)
            pts = _padded(pts, ATTACK_STARTS)  # one batch size: the loop compiles once
            out = ball_attack(self.model, self.x, pts - self.x[None], self.pred,
                              self.eps * (1 - 1e-6), self.p_norm, PGD_STEPS)
            hit = np.isfinite(out.reshape(len(out), -1)).all(axis=1)
            found = out[np.argmax(hit)] if hit.any() else None
        return found

    def _flipped(self, pts: np.ndarray):
        """The first of `pts` (cast to the model's dtype) whose prediction clearly
        differs, as float64, or None (a point the cast moved out of the ball is still
        an adversarial point, at its own distance)."""
        dtype = np.dtype(self.model.inputs[0].dtype)
        pts = pts.astype(dtype)
        flip = clearly_other(model_outputs(self.model, pts), np.full(len(pts), self.pred))
        return pts[np.argmax(flip)].astype(np.float64) if flip.any() else None

    @property
    def p_norm(self):
        return self.passes.p

    def run(self, deadline: float, cover: Cover | None = None) -> BallVerdict:
        """The search, from the whole ball or from the leaves of `cover` (subdomains
        that partition the input space, from a smaller certified ball)."""
        n = self.passes.layout.size
        start = np.zeros((1, n), np.int8) if cover is None or not len(cover.splits) \
            else cover.splits
        parts, b = [], self.options.batch
        for i in range(0, len(start), b):
            splits = start[i:i + b]
            if cover is None or cover.params is None:
                betas = np.zeros((len(splits), self.passes.rows, n))
                betas = np.concatenate([betas, np.full_like(betas, np.nan)], -1)  # CROWN's
            else:
                betas = cover.params[i:i + b].astype(np.float64)
            lower, betas, g, scores = self.evaluate(splits, betas)
            parts.append((lower, splits, betas, scores, g))
            if i + b < len(start) and self.options.now() > deadline:
                return self._verdict("unknown", None, float(min(
                    part[0].min() for part in parts)))
        frontier = [tuple(np.concatenate(part) for part in zip(*parts))]
        done = _Done()  # the leaves verified
        while True:
            for _, _, _, _, gs in frontier[-1:]:
                order = np.argsort(frontier[-1][0].min(axis=1))  # the lowest bounds first
                point = self.adversarial(gs[order])
                if point is not None:
                    return self._verdict("adversarial", point, -np.inf)
            low, sp, be, sc = [np.concatenate([f[i] for f in frontier]) for i in range(4)]
            worst = low.min(axis=1)
            open_ = worst <= self.gap
            done.add(sp[~open_], be[~open_])
            if not open_.any():
                return self._verdict("certified", None, np.inf, done.cover())
            low, sp, be, sc, worst = low[open_], sp[open_], be[open_], sc[open_], worst[open_]
            if self.options.now() > deadline or self.leaves >= self.options.max_leaves:
                return self._verdict("unknown", None, float(worst.min()))
            take = np.argsort(worst)[:max(1, self.options.batch // 2)]  # the lowest first
            rest = np.setdiff1d(np.arange(len(worst)), take)
            verdict, params = self._linear_leaves(low[take], sp[take], be[take], sc[take])
            if verdict is not None:
                return verdict
            children = self._next(sp[take], params, sc[take])
            new = self.evaluate(*children)
            frontier = [(low[rest], sp[rest], be[rest], sc[rest], np.zeros((0,))),
                        (new[0], children[0], new[1], new[3], new[2])]

    def _linear_leaves(self, lower, splits, params, scores):
        """`(verdict or None, params)`: the complete leaves taken (no unstable unit left)
        solved as linear programs (`leaf_lp`), their multipliers set to the programs'
        duals (bounded again, they verify each leaf whose minimum exceeds the gap). The
        verdict is adversarial where a minimiser at most the gap changes the model's
        class, unknown where it does not or where a leaf solved before is still open
        (nothing else decides such a leaf)."""
        complete = scores.max(axis=1) <= 0
        if not complete.any() or not available(self.p_norm):
            return None, params
        idx = np.flatnonzero(complete)
        keys = [splits[i].tobytes() for i in idx]
        again = np.array([k in self.solved for k in keys])
        if again.any():
            return self._verdict("unknown", None, float(lower[idx[again]].min())), params
        self.solved.update(keys)
        n, size = len(idx), splits.shape[1]
        s = _padded(splits[idx].astype(np.float64), 1 << max(0, (n - 1).bit_length()))
        los, his, deltas, _ = self.layer_boxes(s)
        forms = self.passes.forms(self.xt, self.pt, los, his, deltas, s)
        forms = (*(f[:n] for f in forms[:4]), forms[4])
        sol = solve_leaves(forms, splits[idx], params[idx, :, :size], lower[idx], self.eps,
                           self.gap)
        self.linear += n
        below = np.isfinite(sol.below)
        if below.any():
            point = self._flipped(self.x[None] + sol.points[below].reshape(-1, *self.x.shape))
            status = "unknown" if point is None else "adversarial"
            return self._verdict(status, point, float(sol.below.min())), params
        params = params.copy()
        params[idx, :, :size] = sol.betas
        return None, params

    def _verdict(self, status: str, point, lower: float, cover=None) -> BallVerdict:
        return BallVerdict(status, point, self.leaves, lower, self.calls, self.attack_steps,
                           cover)

    def _units(self, splits, params, scores) -> np.ndarray:
        """The unit to split in each leaf: BaBSR's best, or among the
        `options.candidates` best by BaBSR, the one whose worse child bounds highest in
        one pass on the ball's layer bounds (FSB: De Palma et al., "Improved Branch and
        Bound for Neural Network Verification via Lagrangian Decomposition", 2021)."""
        k = min(self.options.candidates, scores.shape[1])
        if k <= 1 or self.root is None:
            return np.argmax(scores, axis=1)
        m = len(splits)
        cand = np.argsort(-scores, axis=1)[:, :k]
        rows, units = np.repeat(np.arange(m), k), cand.ravel()
        up, down = splits[rows].copy(), splits[rows].copy()
        up[np.arange(m * k), units], down[np.arange(m * k), units] = 1, -1
        worst = self._estimate(np.concatenate([up, down]),
                               np.concatenate([params[rows], params[rows]])).min(axis=1)
        value = np.minimum(worst[:m * k], worst[m * k:]).reshape(m, k)
        value = np.where(np.take_along_axis(scores, cand, 1) > 0, value, -np.inf)
        return cand[np.arange(m), np.argmax(value, axis=1)]

    def _estimate(self, splits: np.ndarray, params: np.ndarray) -> np.ndarray:
        """`[n, C]` bounds of leaves in one pass on the ball's layer bounds (cut by
        their splits), with the given multipliers and slopes."""
        n, size = splits.shape
        rows = 1 << max(0, (n - 1).bit_length())
        s, par = _padded(splits.astype(np.float64), rows), _padded(params, rows)
        los, his, deltas = self._root_rows(rows)
        lower, *_ = self.passes.bounds(self.xt, self.pt, self.et, los, his, deltas, s,
                                       par[..., :size], par[..., size:])
        self.calls += 1
        return lower.numpy()[:n]

    def _next(self, splits, params, scores):
        """`(splits, params)` of the leaves that replace the `m` leaves taken: the
        children of those with a unit left to split, and those without (every unstable
        unit split: a linear program whose bound only its multipliers can still raise)
        again, for more steps from their multipliers and slopes."""
        can = scores.max(axis=1) > 0
        parts = []
        if can.any():
            first = self._units(splits[can], params[can], scores[can])
            units = self._deeper(first, scores[can], len(can))
            parts.append(_children(splits[can], params[can], units))
        if not can.all():
            parts.append((splits[~can], params[~can]))
        return tuple(np.concatenate(part) for part in zip(*parts))

    def _deeper(self, first: np.ndarray, scores: np.ndarray, taken: int) -> np.ndarray:
        """`[m, d]` units to split in each of `m` leaves: `first`, then the next best by
        BaBSR, as many (`d`) as keep the `2^d m` children of `taken >= m` leaves within
        one batch (a small frontier fills the batch at once, not one level per pass)."""
        m = len(first)
        rows = np.arange(m)
        rest = scores.copy()
        rest[rows, first] = 0.0
        depth = int(np.log2(max(1, self.options.batch // taken)))
        depth = min(depth, MAX_DEPTH, 1 + int((rest > 0).sum(axis=1).min()))
        more = np.argsort(-rest, axis=1)[:, :max(0, depth - 1)]
        return np.concatenate([first[:, None], more], axis=1)



def _children(splits, params, units):
    """The `2^d m` children of `m` leaves split on `units` `[m, d]`: every sign
    pattern of the `d` units (pattern-major: child `k m + i` is leaf `i`'s `k`-th)."""
    m, d = units.shape
    signs = 1 - 2 * ((np.arange(2 ** d)[:, None] >> np.arange(d)) & 1)  # [2^d, d]
    kids = np.repeat(splits[None], 2 ** d, axis=0)
    rows = np.arange(m)
    for k in range(d):
        kids[:, rows, units[:, k]] = signs[:, k:k + 1]
    return kids.reshape(-1, splits.shape[1]), np.tile(params, (2 ** d, 1, 1))


def verify_ball(passes: LeafPasses, model, x: np.ndarray, pred: int, eps: float, gap: float,
                options: BranchOptions, deadline: float,
                cover: Cover | None = None) -> BallVerdict:
    """Branch and bound over the ball of radius `eps` around one input `x`, from the
    whole ball or (`cover`: a certified smaller ball's `BallVerdict.cover`) from the
    leaves that verified a smaller ball (the same tree, grown further)."""
    return _Ball(passes, model, x, pred, eps, gap, options).run(deadline, cover)
