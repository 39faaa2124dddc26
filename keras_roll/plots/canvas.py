"""The drawing surface of every figure: matplotlib on the Agg canvas.

matplotlib is imported only when a figure is drawn (it is in the `test` and
`examples` extras); figures never touch pyplot's global state.

Example:

```python
fig = new_figure((6.4, 4.2))
fig.add_subplot().plot([0, 1], [0, 1])
finish(fig, "line.png")
```
"""

from __future__ import annotations

import os

DPI = 120


def matplotlib_modules():
    """`(Figure, FigureCanvasAgg, matplotlib)`, imported on first use; a clear error
    naming the install command without matplotlib."""
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "keras_roll.plots needs matplotlib, which is not installed: "
            "pip install matplotlib (or pip install 'keras_roll[examples]')."
        ) from e
    return Figure, FigureCanvasAgg, matplotlib


def new_figure(figsize):
    """A constrained-layout `Figure` of `figsize` inches on its own Agg canvas."""
    Figure, FigureCanvasAgg, _ = matplotlib_modules()
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)  # the Agg canvas: PNG output, no GUI, no global backend change
    return fig


def finish(fig, path):
    """Saves `fig` as a PNG at `path` (its folder created) when `path` is given;
    returns `fig`."""
    if path is not None:
        path = os.fspath(path)
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        fig.savefig(path, format="png", dpi=DPI)
    return fig
