"""The closed forms of the margins: pure functions of distances and gradients.

For a piecewise-linear network every neuron is affine in the input on the
linear region of `x`: `z_j(x') = z_j(x) + g_j . (x' - x)`. The region is where
every neuron stays between its breakpoints, so (Lee, Alvarez-Melis & Jaakkola,
ICLR 2019, Prop. 6 in its dual-norm form)

    eps_p(x) = min_j dist_j / ||g_j||_q,     1/p + 1/q = 1,

with `dist_j = min(below_j, above_j)`, and along a direction `d`

    eps(x, d) = min over j of  above_j / (g_j . d)   if g_j . d > 0,
                               below_j / |g_j . d|  if g_j . d < 0.

Conventions: only valid neurons count; a neuron on a breakpoint with
`g_j != 0` gives 0; a neuron with `g_j = 0` never binds (`0 / 0 = inf`). See
docs/design.md, section "The maths". All functions are `keras.ops` code and
accept numpy arrays or tensors; `keras_roll.certification.margins` re-exports them. The
dual norms themselves are `keras_roll.geometry.dual_norm`.

With rounding error bounds (`err_at_x`, `err_per_radius`, from
`keras_roll.rounding.worst_case`), the same functions give the *sound* radii of
docs/design.md, section "The rounding bound":

    eps_p(x) = min_j max(0, dist_j - E_j) / (||g_j||_q (1 + slack) + F_j)

where `E_j` bounds the rounding error of neuron `j` at `x` and `F_j` its
growth per unit of `||x' - x||_inf` (and the error of `g_j`). Several guards
of the same error (rigor "float64" passes its probabilistic and its worst-case
bound) are given as lists: each neuron's radius is then the largest they
allow (`guard_alternatives`).

Example:

```python
eps, j = margins_from_norms(neuron_distances(n.below, n.above), dual_norm(g, 2), n.valid)
```
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
from keras import ops

from keras_roll.inputs import Array

__all__ = [
    "Margin",
    "NeuronArrays",
    "SliceMargins",
    "directional_margins",
    "exact_zeros",
    "guard_alternatives",
    "margins_from_norms",
    "min_and_index",
    "neuron_arrays",
    "neuron_distances",
]

INF = math.inf


class Margin(NamedTuple):
    """A margin and the neuron that binds it (`min_and_index`).

    Attributes:
        eps: `[...]` the margin (inf where no neuron binds).
        index: `[...]` int64 row of the binding neuron, -1 where none binds.
    """

    eps: Any
    index: Any


class SliceMargins(NamedTuple):
    """The margins of one slice of examples, as `certify` collects them.

    Attributes:
        margins: `{p: Margin([b], [b])}` per norm.
        directional: `Margin([b, K], [b, K])` along the given directions, or None.
        exact_zero: `{p: [b] int64}`, per norm, the first valid neuron exactly
            at its breakpoint with a nonzero gradient (-1 where none is): why
            a radius is 0 in exact arithmetic (`keras_roll.certification.zero_radii`).
    """

    margins: dict
    directional: Margin | None
    exact_zero: dict


def neuron_distances(below: Array, above: Array, valid: Array | None = None):
    """Distance of every neuron to its nearest breakpoint, `min(below, above)`
    (docs/design.md, "The maths": `dist_j`), inf where `valid` is False.

    Args:
        below: `[..., N]` distances `z - lo` to the breakpoint below (inf if none).
        above: `[..., N]` distances `hi - z` to the breakpoint above (inf if none).
        valid: optional `[..., N]` bool: neurons that exist for the example
            (the others get inf: no breakpoint to reach).

    Returns:
        `[..., N]`: a numpy array for numpy inputs, else a tensor.

    Example:

    ```python
    below, above, valid, _ = neuron_arrays(lin.forward(x))
    dist = neuron_distances(below, above, valid)     # [B, N] numpy
    ```
    """
    if not (ops.is_tensor(below) or ops.is_tensor(above) or ops.is_tensor(valid)):
        dist = np.minimum(np.asarray(below), np.asarray(above))
        return dist if valid is None else np.where(valid, dist, np.inf)
    dist = ops.minimum(_tensor(below), _tensor(above))
    if valid is None:
        return dist
    return ops.where(_tensor(valid), dist, ops.full_like(dist, np.inf))


def margins_from_norms(dist: Array, gnorm: Array, valid: Array | None = None,
                       err_at_x: Array | None = None, err_per_radius: Array | None = None,
                       slack: float = 0.0):
    """lp margins from distances and dual gradient norms (Prop. 6, dual-norm form).

    `eps = min_j dist_j / gnorm_j` over valid neurons; a neuron with
    `gnorm_j == 0` never binds (0/0 is defined as inf), one with `dist_j == 0`
    and `gnorm_j > 0` gives 0.

    With rounding bounds, `eps = min_j max(0, dist_j - err_at_x_j) /
    (gnorm_j (1 + slack) + err_per_radius_j)`: the radius within which no
    neuron can reach its breakpoint even with rounding (docs/design.md,
    section "The rounding bound").

    Args:
        dist: `[..., N]` distances to the nearest breakpoint (`neuron_distances`).
        gnorm: `[..., N]` dual norms `||g_j||_q` (`keras_roll.geometry.dual_norm`).
        valid: optional `[..., N]` bool, False for neurons that do not exist.
        err_at_x: optional `[..., N]` bound on the rounding error of every neuron at
            `x`, or a list of such bounds (alternatives: `guard_alternatives`).
        err_per_radius: optional `[..., N]` growth of that bound per unit of
            `||x' - x||_inf`, plus the error bound of `gnorm` (a list with a
            list `err_at_x`).
        slack: relative error bound of the computed `gnorm`.

    Returns:
        `Margin(eps [...], index [...])`: the margin and the binding neuron (-1
        when no neuron binds and `eps` is inf).

    Example:

    ```python
    eps, j = margins_from_norms([[0.5, 2.0]], [[1.0, 1.0]])   # eps=[0.5], j=[0]
    ```
    """
    dist = _tensor(dist)
    gnorm = ops.cast(_tensor(gnorm), dist.dtype)
    if err_at_x is None:
        return min_and_index(_ratio(dist, gnorm, valid))
    ratio = None
    for e, f in guard_alternatives(err_at_x, err_per_radius):
        d = ops.maximum(dist - ops.cast(_tensor(e), dist.dtype), 0.0)
        g = gnorm * (1.0 + slack) + ops.cast(_tensor(f), dist.dtype)
        r = _ratio(d, g, valid)
        ratio = r if ratio is None else ops.maximum(ratio, r)
    return min_and_index(ratio)


def _ratio(dist, gnorm, valid):
    """`dist / gnorm` per neuron, inf where `gnorm == 0` or the neuron is not valid."""
    ok = gnorm > 0
    if valid is not None:
        ok = ops.logical_and(ok, ops.cast(_tensor(valid), "bool"))
    safe = ops.where(ok, gnorm, ops.ones_like(gnorm))
    return ops.where(ok, dist / safe, ops.full_like(dist, INF))


def guard_alternatives(err_at_x, err_per_radius) -> list[tuple]:
    """`[(E, F), ...]`: one rounding guard, or several given as lists (or tuples).

    Every alternative bounds the same error (e.g. the probabilistic and the
    worst-case bound of rigor "float64"); a neuron is safe at radius `r` if
    `dist - E(r) > ||g|| r` for *any* of them, so its limit is the largest of
    the radii they give.

    Example:

    ```python
    guard_alternatives([e_prob, e_strict], [f_prob, f_strict])   # two (E, F) pairs
    ```
    """
    if isinstance(err_at_x, (list, tuple)):
        if not isinstance(err_per_radius, (list, tuple)) or len(err_per_radius) != len(err_at_x):
            raise ValueError("err_at_x and err_per_radius must be given as lists of the same "
                             "length (one entry per guard alternative).")
        return list(zip(err_at_x, err_per_radius))
    return [(err_at_x, err_per_radius)]


def directional_margins(rates: Array, below: Array, above: Array, valid: Array | None = None,
                        err_at_x: Array | None = None, err_per_radius: Array | None = None,
                        slack: float = 0.0):
    """Margins along directions: how far `x + t d` stays in the region of `x`.

    For neuron j moving at rate `r_j = g_j . d`, the segment leaves its piece
    at `above_j / r_j` if `r_j > 0` and at `below_j / |r_j|` if `r_j < 0`
    (never if `r_j = 0`); the margin is the minimum over valid neurons. The
    margin is in units of `t`: along an unnormalised `d` the point reached is
    `x + t d`, at distance `t ||d||` (divide by `||d||` for a length).

    With rounding bounds (docs/design.md, section "The rounding bound"),
    each side `s` of a neuron (distance `dist_s`, approached at rate `rho_s`)
    is crossed no sooner than `max(0, dist_s - err_at_x) / (rho_s + |rho_s|
    slack + err_per_radius)` when that denominator is positive: the error of
    the model's evaluation grows along the segment, so even a neuron moving
    away from a breakpoint may bind, far away.

    Args:
        rates: `[..., K, N]` directional derivatives (`Linearized.jvp(...).neurons`).
        below, above: `[..., N]` distances to the breakpoints below / above.
        valid: optional `[..., N]` bool.
        err_at_x: optional `[..., N]` rounding error bound of every neuron at `x`
            (or a list of alternatives, see `guard_alternatives`).
        err_per_radius: optional, broadcastable to `rates`: the growth of that
            bound per unit of `t` (`F_j ||d_k||_inf`; a list with a list `err_at_x`).
        slack: relative error bound of the computed rates.

    Returns:
        `Margin(eps [..., K], index [..., K])`, index -1 where no neuron binds.

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
    if err_at_x is not None:
        t = None
        for e, f in guard_alternatives(err_at_x, err_per_radius):
            err = ops.cast(_tensor(e), rates.dtype)
            grow = ops.abs(rates) * slack + ops.cast(_tensor(f), rates.dtype)
            t_up = _crossing(ops.expand_dims(ops.maximum(above - err, 0.0), -2), rates + grow)
            t_down = _crossing(ops.expand_dims(ops.maximum(below - err, 0.0), -2), grow - rates)
            t_a = ops.minimum(t_up, t_down)
            t = t_a if t is None else ops.maximum(t, t_a)
        return min_and_index(t)
    num = ops.where(rates > 0, ops.expand_dims(above, -2), ops.expand_dims(below, -2))
    speed = ops.abs(rates)
    t = ops.where(speed > 0, num / ops.where(speed > 0, speed, ops.ones_like(speed)),
                  ops.full_like(speed, INF))
    return min_and_index(t)


def _crossing(dist, speed):
    """`dist / speed` where `speed > 0`, inf elsewhere (an inf distance stays inf)."""
    moving = speed > 0
    return ops.where(moving, dist / ops.where(moving, speed, ops.ones_like(speed)),
                     ops.full_like(speed, INF))


def min_and_index(t) -> Margin:
    """Minimum over the last axis and its index (-1 where the minimum is inf).

    Example:

    ```python
    min_and_index(np.array([[3.0, 1.0], [np.inf, np.inf]]))   # ([1, inf], [1, -1])
    ```
    """
    if t.shape[-1] == 0:  # no neuron: nothing binds
        lead = ops.shape(t)[:-1]
        return Margin(ops.full(lead, INF, dtype=t.dtype), ops.full(lead, -1, dtype="int64"))
    idx = ops.cast(ops.argmin(t, axis=-1), "int64")
    eps = ops.take_along_axis(t, ops.expand_dims(idx, -1), axis=-1)[..., 0]
    idx = ops.where(ops.isinf(eps), ops.full_like(idx, -1), idx)
    return Margin(eps, idx)


class NeuronArrays(NamedTuple):
    """The neurons of a forward pass as numpy arrays (distances in float64)."""

    below: np.ndarray
    above: np.ndarray
    valid: np.ndarray
    piece: np.ndarray


def exact_zeros(dist: np.ndarray, gnorm: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """`[b]` the first valid neuron exactly at its breakpoint with a nonzero
    gradient (its radius is 0 in exact arithmetic), -1 where there is none.

    Example:

    ```python
    exact_zeros(np.array([[0.5, 0.0]]), np.array([[1.0, 2.0]]), np.ones((1, 2), bool))  # [1]
    ```
    """
    hit = np.asarray(valid, bool) & (np.asarray(dist) == 0) & (np.asarray(gnorm) > 0)
    return np.where(hit.any(axis=-1), np.argmax(hit, axis=-1), -1).astype(np.int64)


def neuron_arrays(fwd) -> NeuronArrays:
    """`(below, above, valid, piece)` of a `ForwardPass` as numpy, distances in float64."""
    n = fwd.neurons
    below = np.asarray(n.below.numpy(), np.float64)
    above = np.asarray(n.above.numpy(), np.float64)
    return NeuronArrays(below, above, n.valid.numpy(), n.piece.numpy())


def _tensor(x):
    """A tensor of `x`, keeping numpy / Python float64 precision."""
    return x if ops.is_tensor(x) else ops.convert_to_tensor(np.asarray(x))
