"""The linear regions of a model with a 2-D input, sampled on a grid.

`region_map` evaluates the model's frozen-pattern twin on a `resolution x
resolution` grid and numbers the distinct activation patterns it meets; the
result, a `RegionMap`, is what `keras_roll.plots.plot_linear_regions` draws
(the paper's Figure 1). Two grid points with the same pattern lie in the same
linear region (docs/design.md, section "The maths", Lemma 7); a cell whose
pattern differs from a neighbour's has a region boundary between them.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

from keras_roll.compile.rules.activations import Link
from keras_roll.compile.twin import linearize
from keras_roll.options import RunOptions

__all__ = ["RegionMap", "region_map"]


class RegionMap(NamedTuple):
    """Activation patterns and outputs of a 2-D-input model on a grid.

    Attributes:
        xs: `[W]` grid coordinates along the first input.
        ys: `[H]` grid coordinates along the second input.
        ids: `[H, W]` int64, one id per distinct activation pattern.
        logits: `[H, W, K]` float64 outputs of the twin (before any folded
            softmax / sigmoid).
        output_link: the folded output `Link` (equal to "softmax", "sigmoid") or None.
        model_name: the model's name (for titles).

    Example:

    ```python
    grid = region_map(model, bounds=((-1, 1), (-1, 1)), resolution=200)
    grid.regions, grid.boundaries().mean()   # regions met, share of boundary cells
    ```
    """

    xs: np.ndarray
    ys: np.ndarray
    ids: np.ndarray
    logits: np.ndarray
    output_link: Link | None
    model_name: str

    @property
    def regions(self) -> int:
        """Number of distinct activation patterns on the grid."""
        return int(len(np.unique(self.ids)))

    @property
    def bounds(self) -> tuple:
        """`((x_min, x_max), (y_min, y_max))` of the grid."""
        return ((float(self.xs[0]), float(self.xs[-1])), (float(self.ys[0]), float(self.ys[-1])))

    def boundaries(self) -> np.ndarray:
        """`[H, W]` bool: cells whose pattern differs from the cell left of or below them."""
        edge = np.zeros(self.ids.shape, bool)
        edge[:, 1:] |= self.ids[:, 1:] != self.ids[:, :-1]
        edge[1:, :] |= self.ids[1:, :] != self.ids[:-1, :]
        return edge


GRID_BATCH = 4096
"""Grid points per forward pass of `region_map` (`batch_size=None`)."""


def region_map(model, bounds=None, resolution: int = 400, around=None, chunk=None,
               options: RunOptions | None = None, **overrides) -> RegionMap:
    """Samples the linear regions of a model with input shape `(2,)` on a grid.

    Args:
        model: a Keras model or `Linearized` with input shape `(2,)`.
        bounds: `((x_min, x_max), (y_min, y_max))`; default: the range of
            `around` padded by 10 %, or [-1, 1]^2 without it.
        resolution: grid points per axis, an integer >= 2.
        around: optional `[n, 2]` points the default bounds must cover.
        chunk: deprecated name of `batch_size`.
        options: a `keras_roll.RunOptions`, or None.
        **overrides: its field `batch_size`: grid points per forward pass
            (default 4096); any other field is a `TypeError`.

    Returns:
        A `RegionMap`.

    Raises:
        ValueError: for a model whose input is not 2-D, bad bounds or resolution.

    Example:

    ```python
    grid = keras_roll.region_map(model, resolution=200)
    keras_roll.plots.plot_linear_regions(grid, path="regions.png")
    ```
    """
    if chunk is not None:
        warnings.warn("region_map(chunk=) is deprecated; pass batch_size= (grid points per "
                      "forward pass).", DeprecationWarning, stacklevel=2)
        overrides.setdefault("batch_size", chunk)
    opts = RunOptions.of(options, uses=("batch_size",), caller="region_map", **overrides)
    chunk = opts.batch_size or GRID_BATCH
    lin = linearize(model)
    if tuple(lin.input_shape) != (2,):
        raise ValueError(f"region_map needs a model with a 2-D input, got input shape "
                         f"{lin.input_shape}; pass a model built on keras.Input((2,)).")
    if isinstance(resolution, bool) or not (isinstance(resolution, int) and resolution >= 2):
        raise ValueError(f"resolution must be an integer >= 2, got {resolution!r}.")
    (x0, x1), (y0, y1) = _bounds(bounds, around)
    xs, ys = np.linspace(x0, x1, resolution), np.linspace(y0, y1, resolution)
    grid = np.stack(np.meshgrid(xs, ys), axis=-1).reshape(-1, 2).astype(lin.dtype)
    ids, logits = _pattern_ids(lin, grid, chunk)
    return RegionMap(xs, ys, ids.reshape(resolution, resolution),
                     logits.reshape(resolution, resolution, -1), lin.output_link,
                     lin.model.name)


def _bounds(bounds, around):
    if bounds is not None:
        try:
            (x0, x1), (y0, y1) = bounds
            x0, x1, y0, y1 = (float(v) for v in (x0, x1, y0, y1))
        except (TypeError, ValueError):
            raise ValueError(f"bounds must be ((x_min, x_max), (y_min, y_max)), got "
                             f"{bounds!r}.") from None
        if not (x0 < x1 and y0 < y1):
            raise ValueError(f"bounds must have min < max on both axes, got {bounds!r}.")
        return (x0, x1), (y0, y1)
    pts = None if around is None else np.asarray(around, np.float64).reshape(-1, 2)
    if pts is None or pts.shape[0] == 0:
        return (-1.0, 1.0), (-1.0, 1.0)
    lo, hi = pts.min(axis=0), pts.max(axis=0)
    pad = np.maximum(0.1 * (hi - lo), 1e-3)
    return (lo[0] - pad[0], hi[0] + pad[0]), (lo[1] - pad[1], hi[1] + pad[1])


def _pattern_ids(lin, grid, chunk):
    """An integer id per distinct activation pattern on the grid, and the logits."""
    ids = np.empty(grid.shape[0], np.int64)
    table: dict = {}
    logits = []
    for i in range(0, grid.shape[0], chunk):
        fwd = lin.forward(grid[i:i + chunk])
        n = fwd.neurons
        key = np.where(n.valid.numpy(), n.piece.numpy(), -1).astype(np.int32)
        key = np.ascontiguousarray(key)
        rows = key.view(np.dtype((np.void, key.dtype.itemsize * key.shape[1]))).ravel()
        uniq, inverse = np.unique(rows, return_inverse=True)
        local = np.array([table.setdefault(u.tobytes(), len(table)) for u in uniq], np.int64)
        ids[i:i + chunk] = local[inverse.reshape(-1)]
        logits.append(fwd.logits.numpy().reshape(key.shape[0], -1))
    return ids, np.concatenate(logits).astype(np.float64)
