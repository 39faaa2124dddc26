"""The rounding guard of a certificate: one `Guard` per rigor.

Every computation that certifies something about the model's linear regions
(`certify`, `stability_bounds`, `count_regions`, `lp_margins`, the attribution
radii) asks its guard two things:

* `twin(lin)`: the twin it runs (float64 for the guarded rigors, the model's
  own dtype for "float32");
* `errors(twin, fwd, ...)`: the shrink terms of a batch's neurons, a
  `RoundingErrors` (`E_j` at `x`, its growth `F_j` per unit of radius, the
  overflow flags), or None for no guard;

and `count_regions` a third, `pattern_tolerance`, the twin's own error alone
(patterns of exact arithmetic). `guard_for(rigor)` gives the guard of a
`Rigor`: `Float32Guard` (none), `Float64Guard` (probabilistic:
`keras_roll.rounding.noise`, with the worst-case bound as a second guard) and
`StrictGuard` (worst case: `keras_roll.rounding.worst_case`). docs/design.md,
section "The rounding bound", states what each guarantees.

Example:

```python
guard = guard_for("float64")
twin = guard.twin(lin)
fwd = twin.forward(x)
err = guard.errors(twin, fwd)                 # RoundingErrors, [b, N] arrays
eps, j = margins_from_norms(dist, gnorm, valid, *err.terms())
```
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from keras_roll.options import Rigor
from keras_roll.rounding.noise import KAPPA, LAMBDA, noise_bound
from keras_roll.rounding.precision import evaluation_precision, unit_roundoff
from keras_roll.rounding.worst_case import rounding_bound

__all__ = [
    "BOUND_SAFETY",
    "Float32Guard",
    "Float64Guard",
    "Guard",
    "GuardAtX",
    "RoundingErrors",
    "StrictGuard",
    "guard_for",
    "norm_slack",
]

# The bounds themselves are computed in float64: inflate them by far more than
# their own rounding (docs/design.md, section "The rounding bound").
BOUND_SAFETY = 1.0 + 2.0**-20
# The probabilistic estimates inflated by KAPPA (chi-square lower tail) and LAMBDA
# (Hoeffding), and by 1.6 % for the rounding of the noise pass itself (float32 tangents).
NOISE_FACTOR = LAMBDA * KAPPA * (1.0 + 2.0**-6)


class RoundingErrors(NamedTuple):
    """What a guarded rigor subtracts, for one example slice (numpy, float64).

    Attributes:
        at_x: `[b, N]` bound on `|computed z_j - exact z_j|` at `x` (the model's
            evaluation and the float64 twin together).
        per_radius: `[b, N]` its growth per unit of `||x' - x||_inf` (so of any
            lp radius), which also bounds the l1 error of the twin's gradient `g_j`.
        slack: relative error bound of the float64 gradient norms.
        overflow: `[b]` bool, the model's evaluation may overflow.
        exact_at_x: `[b, N]` the float64 twin's share of `at_x` (for patterns).
        strict_at_x: under rigor "float64", the worst-case bound of rigor
            "strict" (`at_x` is then the probabilistic one): a neuron is safe
            where either guard keeps it on its piece; None otherwise.
        strict_per_radius: its growth, likewise.
        exact_per_radius: `[b, N]` the float64 twin's share of `per_radius`: a
            rigorous bound on the l1 error of its gradients (forward or reverse
            mode), or None.
    """

    at_x: np.ndarray
    per_radius: np.ndarray
    slack: float
    overflow: np.ndarray
    exact_at_x: np.ndarray
    strict_at_x: np.ndarray | None = None
    strict_per_radius: np.ndarray | None = None
    exact_per_radius: np.ndarray | None = None

    def terms(self, rows=slice(None), scale=None) -> tuple:
        """`(E, F, slack)` for `margin_math` (lists of guard alternatives where there
        are two), for the example rows `rows`; `F` times `scale` if given."""
        pairs = [(self.at_x, self.per_radius)]
        if self.strict_at_x is not None:
            pairs.append((self.strict_at_x, self.strict_per_radius))
        out_e, out_f = [], []
        for e, f in pairs:
            f = f[rows]
            out_e.append(e[rows])
            out_f.append(f if scale is None else f[:, None, :] * scale)
        if len(pairs) == 1:
            return out_e[0], out_f[0], self.slack
        return out_e, out_f, self.slack


def norm_slack(input_size: int) -> float:
    """Relative error bound of float64 gradient norms of `input_size` entries: a sum of
    squares (or absolute values), its square root and a division."""
    return 4.0 * (int(input_size) + 16) * unit_roundoff("float64")


class Guard:
    """The rounding guard of one rigor (see the module docstring).

    Attributes:
        rigor: the `Rigor` it implements.
    """

    rigor: Rigor

    def twin(self, lin):
        """The `Linearized` a computation of this rigor runs on."""
        return lin.at_dtype("float64")

    def errors(self, twin, fwd, l1=None, memory_budget: int | None = None):
        """The `RoundingErrors` of the examples of `fwd` (a forward pass of
        `self.twin(...)`), or None for no guard.

        Args:
            twin: the twin.
            fwd: its `ForwardPass` on a batch.
            l1: optional `[b, N]` l1 norms of the neuron gradients (exact up to
                `norm_slack`); they tighten the growth term of the probabilistic guard.
            memory_budget: bytes per chunk of the noise pass.
        """
        raise NotImplementedError

    def pattern_tolerance(self, twin, fwd, memory_budget: int | None = None):
        """`([b, N] bound on the twin's own error of every neuron, [b] overflow flags)`:
        what decides the pattern of exact arithmetic (`count_regions`)."""
        raise NotImplementedError

    def evaluation(self, twin) -> str:
        """How the model evaluates itself, e.g. 'float32' or 'float16 (mixed precision)'."""
        return evaluation_precision(twin.program).describe()


class Float32Guard(Guard):
    """`Rigor.FLOAT32`: the twin's own dtype, no guard (the paper's exact-arithmetic radii)."""

    rigor = Rigor.FLOAT32

    def twin(self, lin):
        return lin

    def errors(self, twin, fwd, l1=None, memory_budget=None):
        return None

    def pattern_tolerance(self, twin, fwd, memory_budget=None):
        b, n = (int(d) for d in fwd.neurons.z.shape)
        return np.zeros((b, n)), np.zeros(b, bool)


class StrictGuard(Guard):
    """`Rigor.STRICT`: the worst-case bound (`keras_roll.rounding.worst_case`)."""

    rigor = Rigor.STRICT

    def errors(self, twin, fwd, l1=None, memory_budget=None):
        rb = rounding_bound(twin, fwd.trace)
        at_x, per_r = rb.at_x.numpy(), rb.per_radius.numpy()
        g_eval, g_exact = rb.g_eval.numpy(), rb.g_exact.numpy()
        # |error| <= (1 + g)(g m + a): the second-order term of relative and absolute errors.
        grow = (1.0 + g_eval + g_exact) * BOUND_SAFETY
        absolute = rb.abs_eval.numpy() + rb.abs_exact.numpy()
        e = ((g_eval + g_exact) * at_x + absolute) * grow
        f = (g_eval + g_exact) * per_r * grow
        # Magnitudes beyond float64 (inf, or inf * 0): the example overflows.
        bad = ~(np.all(np.isfinite(e), axis=1) & np.all(np.isfinite(f), axis=1))
        return RoundingErrors(_finite(e), _finite(f), _slack(fwd), rb.overflow.numpy() | bad,
                              _finite((g_exact * at_x + rb.abs_exact.numpy()) * grow))

    def pattern_tolerance(self, twin, fwd, memory_budget=None):
        err = self.errors(twin, fwd)
        return err.exact_at_x, err.overflow


class GuardAtX(NamedTuple):
    """The part of the default guard that needs no gradient: its terms at `x`.

    Attributes:
        noise: the noise pass's track 0 (`sigma_at_x`, `exact_at_x`, `overflow`).
        strict: the worst-case guard's `RoundingErrors` (at `x` and per radius).
    """

    noise: object
    strict: RoundingErrors

    def alternatives_at_x(self) -> list:
        """`[E_probabilistic, E_worst_case]`, `[b, N]` each."""
        nb = _finite_bound(self.noise)
        e = (NOISE_FACTOR * nb.sigma_at_x + 2.0 * nb.exact_at_x) * BOUND_SAFETY
        return [e, _finite(self.strict.at_x)]

    def smallest_at_x(self) -> np.ndarray:
        """`[b, N]`: a neuron closer than this to its breakpoint gets ratio 0 under every
        alternative (its margin is 0 whatever its gradient)."""
        return np.minimum(*self.alternatives_at_x())


def _finite(t):
    """A bound that overflowed allows nothing: inf (not NaN)."""
    return np.where(np.isfinite(t), t, np.inf)


def _finite_bound(nb):
    """A `NoiseBound` with its non-finite terms made inf (allowing nothing)."""
    return type(nb)(*(None if f is None else _finite(f) for f in nb[:4]), nb.overflow)


class Float64Guard(Guard):
    """`Rigor.FLOAT64`: the probabilistic guard of `keras_roll.rounding.noise` (`LAMBDA
    KAPPA` estimated standard deviations of the model's own rounding, plus a
    rigorous bound on the float64 twin's), with the worst-case bound as a second
    guard: a neuron is safe where either keeps it on its piece."""

    rigor = Rigor.FLOAT64

    def at_x(self, twin, fwd, memory_budget=None) -> GuardAtX:
        """The terms at `x` (before any gradient is known): `GuardAtX`."""
        nb = noise_bound(twin, fwd, memory_budget=memory_budget, tracks=(0,))
        return GuardAtX(nb, StrictGuard().errors(twin, fwd))

    def errors(self, twin, fwd, l1=None, memory_budget=None, at_x: GuardAtX | None = None):
        """See `Guard.errors`; with `at_x` (from `self.at_x`) only the growth terms
        run (the noise pass's track 1), `l1` are taken as upper bounds as given, and
        `exact_per_radius` also bounds gradients computed in reverse mode."""
        slack = _slack(fwd)
        if at_x is None:
            if l1 is not None:
                l1 = np.asarray(l1) * (1.0 + slack)
            nb = noise_bound(twin, fwd, l1=l1, memory_budget=memory_budget)
            strict = StrictGuard().errors(twin, fwd)
            nb0 = nb
        else:
            nb = noise_bound(twin, fwd, l1=l1, memory_budget=memory_budget, tracks=(1,),
                             reverse=True)
            nb0, strict = at_x.noise, at_x.strict
        # Terms the noise pass could not represent (even with float64 tangents): the
        # example is flagged as overflowing (NaN margins and a warning), never shrunk less.
        bad = nb0.nonfinite() | nb.nonfinite()
        nb0, nb = _finite_bound(nb0), _finite_bound(nb)
        exact_at_x = 2.0 * nb0.exact_at_x * BOUND_SAFETY
        # The worst-case bound as a second guard: the smaller one for small fan-ins and
        # under float16. Its magnitudes compound |W| and may overflow where the model's
        # do not: it then allows nothing (inf), and only the actual magnitudes flag
        # overflow. The twin's rigorous bounds are doubled for their second-order terms.
        return RoundingErrors(
            (NOISE_FACTOR * nb0.sigma_at_x + 2.0 * nb0.exact_at_x) * BOUND_SAFETY,
            (NOISE_FACTOR * nb.sigma_per_radius + 2.0 * nb.exact_per_radius) * BOUND_SAFETY,
            slack, nb0.overflow | bad, np.fmin(exact_at_x, strict.exact_at_x),
            _finite(strict.at_x), _finite(strict.per_radius), nb.exact_per_radius * BOUND_SAFETY)

    def pattern_tolerance(self, twin, fwd, memory_budget=None):
        nb = noise_bound(twin, fwd, memory_budget=memory_budget, samples=0, tracks=(0,))
        return 2.0 * _finite(nb.exact_at_x) * BOUND_SAFETY, nb.overflow | nb.nonfinite()


def _slack(fwd) -> float:
    return norm_slack(int(np.prod(fwd.trace.input.shape[1:])))


_GUARDS = {Rigor.FLOAT32: Float32Guard(), Rigor.FLOAT64: Float64Guard(),
           Rigor.STRICT: StrictGuard()}


def guard_for(rigor: Rigor | str) -> Guard:
    """The `Guard` of `rigor` (a `Rigor` or one of its strings).

    Example:

    ```python
    guard_for("strict").twin(lin).dtype          # 'float64'
    ```
    """
    return _GUARDS[Rigor.parse(rigor)]
