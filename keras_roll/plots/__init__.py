"""Figures in the style of Lee, Alvarez-Melis & Jaakkola (ICLR 2019), Figures 1-6.

* `plot_linear_regions`: the linear regions of a model with a 2-D input, its
  prediction heat map and the certified l2 margin around training points (Fig. 1).
* `plot_margin_tradeoff`: margin percentiles against a hyperparameter, accuracy on
  a second axis (Fig. 2).
* `plot_stability_bounds`: per-coordinate stability bounds of a time series (Fig. 3).
* `plot_attribution_grid` / `plot_gradient_comparison`: image grids of the original,
  its gradient, the gradient at the worst-case point of the distortion search and
  integrated gradients, for two models side by side (Figs. 4-6).
* `plot_faithfulness`: Deletion and Insertion curves of several models or
  attributions (`keras_roll.faithfulness`).

The functions only draw: they take result objects computed by the caller
(`keras_roll.region_map`, `keras_roll.certify`,
`keras_roll.stability_bounds`, `keras_roll.saliency`,
`keras_roll.integrated_gradients`, ...) and never run an experiment themselves.
matplotlib is imported only when a figure is drawn (it is in the `test` and
`examples` extras). Figures are drawn on the Agg canvas without touching pyplot's
global state; every function returns the `matplotlib.figure.Figure` and saves a
PNG when given `path`.

One module per figure (`regions`, `tradeoff`, `stability`, `attribution`,
`faithfulness`) over the drawing surface of `canvas`; a new figure gets its own module
and an export here.

Example:

```python
grid = keras_roll.region_map(model, bounds=((-1, 1), (-1, 1)), resolution=200)
keras_roll.plots.plot_linear_regions(grid, x, y, keras_roll.certify(model, x),
                                     path="figure1.png")
```
"""

from keras_roll.plots.attribution import (
    GradientMaps,
    plot_attribution_grid,
    plot_gradient_comparison,
)
from keras_roll.plots.faithfulness import plot_faithfulness
from keras_roll.plots.regions import plot_linear_regions
from keras_roll.plots.stability import plot_stability_bounds
from keras_roll.plots.tradeoff import plot_margin_tradeoff

__all__ = [
    "GradientMaps",
    "plot_attribution_grid",
    "plot_faithfulness",
    "plot_gradient_comparison",
    "plot_linear_regions",
    "plot_margin_tradeoff",
    "plot_stability_bounds",
]
