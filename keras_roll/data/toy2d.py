"""Deterministic 2-D binary classification data sets for the toy experiment.

Small 2-D problems make the linear regions of a ReLU network visible (Lee,
Alvarez-Melis & Jaakkola, ICLR 2019, Fig. 1: a fully connected network on a 2-D
binary task, with and without the ROLL regularizer). This module imports only numpy.
"""

from __future__ import annotations

import numpy as np

KINDS = ("circles", "spirals", "xor")
_DEFAULT_NOISE = {"circles": 0.06, "spirals": 0.04, "xor": 0.0}


def make_toy2d(n=1000, seed=0, kind="circles", noise=None):
    """Makes a balanced 2-D binary classification data set.

    Kinds (all points lie roughly in ``[-1, 1]^2``):

    * ``"circles"``: class 0 on a ring of radius 0.4, class 1 on a ring of radius
      0.9, Gaussian radial noise ``noise``.
    * ``"spirals"``: two interleaved spirals (1.5 turns each), Gaussian noise
      ``noise`` on both coordinates.
    * ``"xor"``: uniform points in ``[-1, 1]^2``; the class is 1 where the two
      coordinates have the same sign. A gap of half-width ``noise`` around both axes is
      kept empty (``noise=0``: no gap).

    The result depends only on ``(n, seed, kind, noise)``: the same arguments give the
    same arrays on every platform (numpy's PCG64 generator).

    Args:
        n: number of points (``n // 2`` of class 0 and ``n - n // 2`` of class 1).
        seed: integer seed.
        kind: one of ``"circles"``, ``"spirals"``, ``"xor"``.
        noise: noise level (see above); ``None`` uses the kind's default (0.06 for
            circles, 0.04 for spirals, 0 for xor).

    Returns:
        A tuple ``(x, y)``: ``x`` float32 ``[n, 2]``, ``y`` int64 ``[n]`` in ``{0, 1}``,
        rows shuffled.

    Raises:
        ValueError: for an unknown ``kind``, ``n < 2`` or a negative ``noise``.

    Example:
        >>> from keras_roll.data import make_toy2d
        >>> x, y = make_toy2d(n=200, seed=0, kind="spirals")
        >>> x.shape, x.dtype, int(y.sum())
        ((200, 2), dtype('float32'), 100)
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if int(n) != n or n < 2:
        raise ValueError(f"n must be an integer >= 2, got {n!r}")
    n = int(n)
    noise = _DEFAULT_NOISE[kind] if noise is None else float(noise)
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    rng = np.random.default_rng(seed)
    n0 = n // 2
    y = np.concatenate([np.zeros(n0, np.int64), np.ones(n - n0, np.int64)])

    if kind == "circles":
        radius = np.where(y == 0, 0.4, 0.9) + noise * rng.standard_normal(n)
        angle = rng.uniform(0.0, 2.0 * np.pi, n)
        x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    elif kind == "spirals":
        t = np.sqrt(rng.uniform(0.0, 1.0, n))  # denser sampling away from the centre
        angle = 3.0 * np.pi * t + np.pi * y
        x = 0.9 * t[:, None] * np.stack([np.cos(angle), np.sin(angle)], axis=1)
        x = x + noise * rng.standard_normal((n, 2))
    else:  # xor
        if noise >= 1.0:
            raise ValueError(f"xor needs noise (the gap half-width) < 1, got {noise!r}")
        magnitude = rng.uniform(noise, 1.0, (n, 2))
        sign_a = rng.choice([-1.0, 1.0], n)
        # same signs for class 1, opposite signs for class 0
        sign_b = np.where(y == 1, sign_a, -sign_a)
        x = magnitude * np.stack([sign_a, sign_b], axis=1)

    order = rng.permutation(n)
    return x[order].astype(np.float32), y[order]
