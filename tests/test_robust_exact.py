"""robust_radius against exact minimal perturbations computed independently.

The references do not use keras_roll: the networks are read layer by layer into
float64 affine maps (each Keras layer applied to a basis, in a float64 copy), and

* a MILP (`scipy.optimize.milp`, HiGHS; big-M bounds from numpy interval
  arithmetic over the ball), polished by the LP of the activation pattern it
  chose (exact, no big-M), gives the exact minimal l_inf and l1 perturbation of
  small ReLU / LeakyReLU MLPs and a small CNN (convolution, BatchNormalization,
  average pooling);
* on 2-D nets, a brute-force search along 360 rays (2000 samples each, then
  bisection) gives the minimal l2 perturbation to within its angular resolution.

Checked on every input: lower <= exact <= upper, lower == exact wherever `exact`
is claimed, and every adversarial point changes the prediction of the float32
Keras model, at the distance reported.
"""

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.robust.adversarial import lp_norm

scipy_optimize = pytest.importorskip("scipy.optimize")
scipy_sparse = pytest.importorskip("scipy.sparse")

RTOL = 2e-5  # MILP feasibility / float32 rounding of the compared quantities
EXACT_RTOL = 2e-3  # robust_radius's exact_rtol (1e-3) and the references' own error
# A short attack where the attack is not the subject: the upper bounds are checked
# against the references whatever their tightness (the attack's own tests:
# tests/test_attacks.py, tests/test_attack_*.py; tests/test_robust.py uses it too).
CHEAP = keras_roll.robust.AttackOptions(steps=30, restarts=2, polish=1, probe_steps=10,
                                        probe_budget=40)


# --------------------------------------------------------------------------- networks


def _mlp(widths, alpha, in_dim, out, seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((in_dim,))
    h = inp
    for w in widths:
        h = keras.layers.Dense(w)(h)
        h = keras.layers.LeakyReLU(alpha)(h) if alpha else keras.layers.ReLU()(h)
    return keras.Model(inp, keras.layers.Dense(out)(h))


def _cnn(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(3, 3)(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.AveragePooling2D(2)(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(8)(h)
    h = keras.layers.ReLU()(h)
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    bn = model.layers[2]
    rng = np.random.default_rng(seed)
    bn.set_weights([rng.uniform(0.5, 1.5, 3), rng.normal(0, 0.2, 3), rng.normal(0, 0.2, 3),
                    rng.uniform(0.5, 2.0, 3)])
    return model


def affine_stack(model):
    """`[("linear", W, b) | ("act", alpha)]` in float64, from the Keras layers alone."""
    stages = []
    for layer in model.layers[1:]:
        if isinstance(layer, keras.layers.ReLU):
            stages.append(("act", 0.0))
        elif isinstance(layer, keras.layers.LeakyReLU):
            stages.append(("act", float(layer.negative_slope)))
        else:
            config = dict(layer.get_config(), dtype="float64")
            clone = type(layer).from_config(config)
            shape = tuple(layer.input.shape[1:])
            clone.build((None, *shape))
            clone.set_weights([np.asarray(w, np.float64) for w in layer.get_weights()])
            d = int(np.prod(shape))
            basis = np.concatenate([np.zeros((1, d)), np.eye(d)]).reshape(-1, *shape)
            out = np.asarray(clone(basis, training=False), np.float64).reshape(d + 1, -1)
            stages.append(("linear", out[1:] - out[:1], out[0]))
    return stages


def pre_activations(stages, h):
    """`(inputs of every activation stage, outputs)` of the stages on `h` `[..., d]`."""
    out = []
    for st in stages:
        if st[0] == "linear":
            h = h @ st[1] + st[2]
        else:
            out.append(h)
            h = np.maximum(h, st[1] * h)
    return out, h


def grid_margins(stages, x, eps, n, pred, classes=3):
    """`(every activation stage's inputs [n * n, units], margins [n * n, classes - 1])`
    on an `n x n` grid of the l_inf ball of radius `eps` around the 2-D point `x`: the
    margins of class `pred` over the other classes, in the order `pred + 1, ...`."""
    t = np.linspace(-eps, eps, n)
    pre, logits = pre_activations(stages, x + np.stack(np.meshgrid(t, t), -1).reshape(-1, 2))
    others = [(pred + 1 + k) % classes for k in range(classes - 1)]
    return np.concatenate(pre, axis=1), logits[:, [pred]] - logits[:, others]


def forward(stages, x):
    return pre_activations(stages, np.asarray(x, np.float64).reshape(len(x), -1))[1]


def interval_bounds(stages, x, radius, p=np.inf):
    """Pre-activation bounds of every linear stage over the lp ball of `radius` (the
    first layer by its dual norm, the rest by intervals)."""
    lo = hi = None
    out = []
    for st in stages:
        if st[0] == "linear":
            if lo is None:
                q = np.abs(st[1]).max(axis=0) if p == 1 else np.abs(st[1]).sum(axis=0)
                c, r = x @ st[1] + st[2], radius * q
            else:
                c, r = (lo + hi) / 2, (hi - lo) / 2
                c, r = c @ st[1] + st[2], r @ np.abs(st[1])
            lo, hi = c - r, c + r
            out.append((lo, hi))
        else:
            lo, hi = np.maximum(lo, st[1] * lo), np.maximum(hi, st[1] * hi)
    return out


# --------------------------------------------------------------------------- MILP


class _Program:
    """Rows of a MILP: `lb <= A v <= ub`, variables added as we go."""

    def __init__(self):
        self.lb, self.ub, self.integer, self.rows = [], [], [], []

    def var(self, n, lb, ub, integer=False):
        start = len(self.lb)
        self.lb.extend(np.broadcast_to(lb, n))
        self.ub.extend(np.broadcast_to(ub, n))
        self.integer.extend([int(integer)] * n)
        return np.arange(start, start + n)

    def row(self, coeffs, lb, ub):
        self.rows.append((coeffs, lb, ub))

    def solve(self, objective):
        """`(MILP value, value of the LP with its binaries fixed)`: big-M rows are only
        as accurate as the integrality tolerance times M; with the binaries fixed at
        0 / 1 they are exact linear constraints, so the LP's value is the exact
        distance within the activation pattern the MILP chose (inf if infeasible)."""
        n = len(self.lb)
        a = scipy_sparse.lil_matrix((len(self.rows), n))
        lbs, ubs = [], []
        for i, (coeffs, lb, ub) in enumerate(self.rows):
            for j, v in coeffs:
                a[i, j] += v
            lbs.append(lb)
            ubs.append(ub)
        c = np.zeros(n)
        for j, v in objective:
            c[j] += v
        rows = scipy_optimize.LinearConstraint(a.tocsr(), lbs, ubs)
        lb, ub, integer = np.array(self.lb), np.array(self.ub), np.array(self.integer)
        res = scipy_optimize.milp(c, integrality=integer,
                                  bounds=scipy_optimize.Bounds(lb, ub), constraints=rows,
                                  options={"mip_rel_gap": 1e-9, "time_limit": 120})
        if res.status == 2:  # infeasible: no point of that class in the ball
            return np.inf, np.inf
        assert res.status == 0, res.message
        fixed = np.where(integer == 1, np.round(res.x), lb), np.where(integer == 1,
                                                                     np.round(res.x), ub)
        lp = scipy_optimize.milp(c, bounds=scipy_optimize.Bounds(*fixed), constraints=rows)
        return float(res.fun), (float(lp.fun) if lp.status == 0 else np.inf)


def milp_distance(stages, x, y, j, p, radius):
    """Min ||x' - x||_p (p = 1 or inf) with f_j(x') >= f_y(x'), ||x' - x||_p <= radius:
    `(MILP value, exact value in the MILP's activation pattern)` (`_Program.solve`)."""
    prog = _Program()
    d = x.size
    xv = prog.var(d, x - radius, x + radius)
    bounds = interval_bounds(stages, x, radius, p)
    h, k = xv, 0
    for st in stages:
        if st[0] == "linear":
            lo, hi = bounds[k]
            k += 1
            z = prog.var(lo.size, lo - 1e-6, hi + 1e-6)
            for o in range(lo.size):
                coeffs = [(int(z[o]), -1.0)] + [(int(h[i]), st[1][i, o]) for i in range(len(h))
                                                if st[1][i, o] != 0]
                prog.row(coeffs, -st[2][o], -st[2][o])
            h = z
            pre = (lo, hi)
        else:
            h = _activation_rows(prog, h, pre, st[1])
    objective = _norm_rows(prog, xv, x, p, radius)
    prog.row([(int(h[j]), 1.0), (int(h[y]), -1.0)], 0.0, np.inf)
    return prog.solve(objective)


def _activation_rows(prog, z, pre, alpha):
    lo, hi = pre
    out = prog.var(len(z), np.minimum(lo, alpha * lo) - 1e-6, np.maximum(hi, alpha * hi) + 1e-6)
    for o in range(len(z)):
        zi, hi_o, lo_o, hv = int(z[o]), hi[o], lo[o], int(out[o])
        if lo_o >= 0:
            prog.row([(hv, 1.0), (zi, -1.0)], 0.0, 0.0)
        elif hi_o <= 0:
            prog.row([(hv, 1.0), (zi, -alpha)], 0.0, 0.0)
        else:
            a = int(prog.var(1, 0, 1, integer=True)[0])
            prog.row([(hv, 1.0), (zi, -1.0)], 0.0, np.inf)
            prog.row([(hv, 1.0), (zi, -alpha)], 0.0, np.inf)
            prog.row([(hv, 1.0), (zi, -1.0), (a, (1 - alpha) * -lo_o)], -np.inf,
                     (1 - alpha) * -lo_o)
            prog.row([(hv, 1.0), (zi, -alpha), (a, -(1 - alpha) * hi_o)], -np.inf, 0.0)
    return out


def _norm_rows(prog, xv, x, p, radius):
    if p == np.inf:
        t = int(prog.var(1, 0, radius)[0])
        for i, v in enumerate(xv):
            prog.row([(int(v), 1.0), (t, -1.0)], -np.inf, x[i])
            prog.row([(int(v), -1.0), (t, -1.0)], -np.inf, -x[i])
        return [(t, 1.0)]
    ts = prog.var(len(xv), 0, radius)
    for i, v in enumerate(xv):
        prog.row([(int(v), 1.0), (int(ts[i]), -1.0)], -np.inf, x[i])
        prog.row([(int(v), -1.0), (int(ts[i]), -1.0)], -np.inf, -x[i])
    prog.row([(int(t), 1.0) for t in ts], 0.0, radius)  # inside the l1 ball
    return [(int(t), 1.0) for t in ts]


def exact_milp(stages, x, pred, p, radius, classes):
    """`(MILP value, polished value)`, each the minimum over the other classes."""
    vals = [milp_distance(stages, x, pred, j, p, radius) for j in range(classes) if j != pred]
    return min(v[0] for v in vals), min(v[1] for v in vals)


def brute_force_l2(stages, x, pred, radius, rays=360, samples=2000):
    """Min over rays of the first class change (then 50 bisection steps): an upper
    bound on the exact l2 distance, tight to the angular resolution."""
    theta = np.linspace(0, 2 * np.pi, rays, endpoint=False)
    dirs = np.stack([np.cos(theta), np.sin(theta)], 1)
    r = np.linspace(0, radius, samples + 1)[1:]
    first = np.full(rays, np.inf)
    for k in range(0, rays, 60):  # [60, samples] points at a time
        pts = x + r[None, :, None] * dirs[k:k + 60, None]
        cls = np.argmax(forward(stages, pts.reshape(-1, 2)), 1).reshape(-1, samples)
        other = cls != pred
        hit = np.argmax(other, axis=1)
        first[k:k + 60] = np.where(other.any(axis=1), hit, np.inf)
    live = np.isfinite(first)
    idx = first[live].astype(int)
    a, b = np.where(idx > 0, r[np.maximum(idx - 1, 0)], 0.0), r[idx]
    d = dirs[live]
    for _ in range(50):
        mid = (a + b) / 2
        flip = np.argmax(forward(stages, x + mid[:, None] * d), 1) != pred
        a, b = np.where(flip, a, mid), np.where(flip, mid, b)
    return float(np.min(b)) if b.size else np.inf


# --------------------------------------------------------------------------- checks


def _check_against(rr, model, x, p, exact, below=None):
    """`exact`: the exact distance (or an achievable one: `lower` must not exceed it);
    `below`: a value the exact distance is at least (default `exact`)."""
    lower, upper = rr.lower[p], rr.upper[p]
    below = exact if below is None else below
    tol = RTOL * exact + 1e-7
    assert np.all(lower <= exact + tol), (lower, exact)
    assert np.all(np.isfinite(upper)), upper
    assert np.all(below <= upper + tol), (below, upper)
    claimed = rr.exact[p]
    # Where exact is claimed, exact_value is the minimal perturbation (of exact
    # arithmetic on the weights; [lower, upper] brackets it for the model's rounding).
    value = rr.exact_value[p]
    assert np.all(np.abs(value[claimed] - exact[claimed]) <= EXACT_RTOL * exact[claimed] + 1e-7)
    assert np.all(np.isnan(value[~claimed]))
    adv = rr.adversarial[p].astype(np.float32)
    pred = np.argmax(np.asarray(model(x.astype(np.float32))), -1)
    assert np.all(np.argmax(np.asarray(model(adv)), -1) != pred)
    np.testing.assert_allclose(lp_norm(adv.astype(np.float64) - x.astype(np.float64), p),
                               upper, rtol=1e-12)


CASES = {
    "relu_mlp": lambda: (_mlp((12, 12), 0.0, 4, 3, 0), (4,)),
    "leaky_mlp": lambda: (_mlp((10, 10), 0.1, 4, 3, 1), (4,)),
    "cnn": lambda: (_cnn(2), (6, 6, 1)),
}


def near_boundary(stages, shape, n, seed, back=0.15):
    """`n` inputs a little inside the decision boundary (small exact distances keep
    the MILPs' big-M bounds tight): on the segment between two random points of
    different classes, `back` of the way from its boundary point toward one end."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        a, b = rng.normal(size=(2, int(np.prod(shape))))
        ca, cb = np.argmax(forward(stages, np.stack([a, b])), 1)
        if ca == cb:
            continue
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            if np.argmax(forward(stages, (a + mid * (b - a))[None]), 1)[0] == ca:
                lo = mid
            else:
                hi = mid
        out.append(a + lo * (1 - back) * (b - a))
    return np.array(out).reshape(n, *shape).astype(np.float32)


_CACHE = {}


def _case(name):
    if name not in _CACHE:
        model, shape = CASES[name]()
        stages = affine_stack(model)
        x = near_boundary(stages, shape, 4, seed=7)
        ref = forward(stages, x)
        np.testing.assert_allclose(ref, np.asarray(model(x)), rtol=1e-4, atol=1e-5)
        _CACHE[name] = (model, x, stages)
    return _CACHE[name]


def _grid():
    """(case, rigor, norm): the default rigor on the ReLU MLP in l_inf runs by default,
    the rest (LeakyReLU, the CNN, l1, no rounding guard) is slow."""
    out = []
    for name in sorted(CASES):
        for rigor in ("float64", "float32"):
            for p in (np.inf, 1):
                fast = (name, rigor, p) == ("relu_mlp", "float64", np.inf)
                marks = () if fast else (pytest.mark.slow,)
                out.append(pytest.param(name, rigor, p, marks=marks,
                                        id=f"{name}-{rigor}-l{'inf' if p == np.inf else p}"))
    return out


@pytest.mark.parametrize("name,rigor,p", _grid())
def test_bounds_bracket_the_milp_optimum(name, rigor, p):
    model, x, stages = _case(name)
    rr = keras_roll.robust_radius(model, x, norms=(p,), rigor=rigor, attack=CHEAP,
                                  verbose=False)
    flat = x.reshape(len(x), -1).astype(np.float64)
    radius = 1.5 * rr.upper[p]
    raw, exact = np.array([exact_milp(stages, flat[i], rr.predicted[i], p, radius[i], 3)
                           for i in range(len(x))]).T
    assert np.all(exact < radius * (1 - 1e-6)), "the MILP ball was binding"
    np.testing.assert_allclose(raw, exact, rtol=1e-3)  # the MILP and its polish agree
    _check_against(rr, model, x, p, exact, below=np.minimum(raw, exact))
    # The relaxation alone is a lower bound too (no help from the region).
    alone = keras_roll.robust_radius(model, x, norms=(p,), method="relaxation", rigor=rigor,
                                     verbose=False)
    assert np.all(alone.lower[p] <= exact * (1 + RTOL) + 1e-7)
    assert np.all(alone.lower[p] > 0)


@pytest.mark.parametrize("seed,alpha", [(3, 0.0), pytest.param(4, 0.2, marks=pytest.mark.slow)])
def test_two_dimensional_nets_against_brute_force(seed, alpha):
    model = _mlp((16, 16), alpha, 2, 3, seed)
    stages = affine_stack(model)
    x = np.random.default_rng(seed).normal(size=(4, 2)).astype(np.float32)
    rr = keras_roll.robust_radius(model, x, norms=(2,), rigor="float32", attack=CHEAP,
                                  verbose=False)
    for i in range(len(x)):
        ref = brute_force_l2(stages, x[i].astype(np.float64), rr.predicted[i],
                             1.5 * rr.upper[2][i])
        assert rr.lower[2][i] <= ref * (1 + 1e-9)
        assert rr.upper[2][i] >= ref * (1 - 2e-3)
        if rr.exact[2][i]:
            assert abs(rr.lower[2][i] - ref) <= 2e-3 * ref
    _check_against(rr, model, x, 2, rr.upper[2])  # the points and their distances
