"""The results of `certify` and `stability_bounds` and their paper-style tables.

`Certificate` (lp and directional margins, binding neurons) and
`StabilityBounds` (per-coordinate intervals, the paper's Figure 3) hold numpy
arrays; `summary()` prints percentiles as in the tables of Lee et al. (ICLR
2019). See docs/design.md, section "Data flow of certify".

Example:

```python
cert = keras_roll.certify(model, x)
cert.summary()        # P25 / P50 / P75 / P100 of each margin, binding layers
```
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["Certificate", "StabilityBounds", "format_table", "percentiles_of"]

INF = math.inf
NORM_LABELS = {1: "l1", 2: "l2", INF: "linf"}
PAPER = "Lee et al., ICLR 2019"


@dataclasses.dataclass(repr=False)
class Certificate:
    """Certified margins of a batch (all arrays numpy, float64 margins).

    Attributes:
        margins: `{p: [B]}`, radius of the largest lp ball (p in 1, 2, inf)
            around each example inside its linear region (Prop. 6).
        binding: `{p: [B]}` list of the binding neuron `(layer name, unit index)`
            per example, None where no neuron binds (margin inf).
        binding_index: `{p: [B] int}`, the binding neuron's row in
            `lin.neuron_names_for(x)`, -1 where none binds.
        directional: `[B, K]` margins along the given directions, or None.
        directional_index: `[B, K]` binding neuron rows, or None.
        logits: `[B, *output_shape]` model outputs before any folded link.
        method: "analytic" or "bisect".

    Example:

    ```python
    cert = keras_roll.certify(model, x)
    cert.margins[2][0], cert.binding[2][0]     # 0.031, ('dense_1', 17)
    ```
    """

    margins: dict
    binding: dict
    binding_index: dict
    directional: np.ndarray | None = None
    directional_index: np.ndarray | None = None
    logits: np.ndarray | None = None
    method: str = "analytic"

    @property
    def n(self) -> int:
        """Number of certified examples."""
        for v in self.margins.values():
            return int(v.shape[0])
        return 0 if self.logits is None else int(self.logits.shape[0])

    @property
    def norms(self) -> tuple:
        return tuple(self.margins)

    def __repr__(self) -> str:
        parts = [f"n={self.n}", f"method={self.method!r}"]
        for p, v in self.margins.items():
            med = percentiles_of(v, (50,))[0] if v.size else float("nan")
            parts.append(f"median_{NORM_LABELS[p]}={med:.4g}")
        if self.directional is not None:
            parts.append(f"directions={self.directional.shape[1]}")
        return f"Certificate({', '.join(parts)})"

    def summary(self, print_fn=print, percentiles=(25, 50, 75, 100)) -> None:
        """Prints the paper-style table: percentiles of every certified margin.

        Example:

        ```python
        keras_roll.certify(model, x_test).summary()
        ```
        """
        rows = []
        for p, v in self.margins.items():
            rows.append((f"{NORM_LABELS[p]} ball", v, self.binding_index[p]))
        if self.directional is not None:
            k = self.directional.shape[1]
            rows.append((f"directional (K={k})", self.directional.reshape(-1),
                         self.directional_index.reshape(-1)))
        head = f"Certified margins: {self.n} examples, method '{self.method}' ({PAPER})"
        print_fn(format_table(head, rows, percentiles))
        if self.n and self.margins:
            p = 2 if 2 in self.margins else next(iter(self.margins))
            layers = [b[0] for b in self.binding[p] if b is not None]
            if layers:
                names, counts = np.unique(layers, return_counts=True)
                order = np.argsort(-counts)[:3]
                share = ", ".join(f"{names[i]} ({100 * counts[i] / self.n:.0f}%)"
                                  for i in order)
                print_fn(f"Binding layers ({NORM_LABELS[p]}): {share}")


@dataclasses.dataclass(repr=False)
class StabilityBounds:
    """Per-coordinate stability intervals (the paper's Figure 3).

    Coordinate k of example i can move anywhere in
    `[x_ik + lower_ik, x_ik + upper_ik]`, all other coordinates fixed, without
    leaving the linear region of `x_i`.

    Attributes:
        lower: `[B, *input_shape]`, `-eps(x, -e_k)` (<= 0, -inf if unbounded).
        upper: `[B, *input_shape]`, `+eps(x, +e_k)` (>= 0, inf if unbounded).
        lower_index, upper_index: binding neuron rows (-1 if none), same shape.
        method: "analytic" or "bisect".

    Example:

    ```python
    sb = keras_roll.stability_bounds(model, x[:1])
    width = sb.upper - sb.lower                # how far each pixel may move alone
    ```
    """

    lower: np.ndarray
    upper: np.ndarray
    lower_index: np.ndarray
    upper_index: np.ndarray
    method: str = "analytic"

    def __repr__(self) -> str:
        return (f"StabilityBounds(shape={self.lower.shape}, method={self.method!r}, "
                f"median_width={self._median_width():.4g})")

    def _median_width(self) -> float:
        if self.lower.size == 0:
            return float("nan")
        return percentiles_of((self.upper - self.lower).reshape(-1), (50,))[0]

    def summary(self, print_fn=print, percentiles=(25, 50, 75, 100)) -> None:
        """Prints percentiles of the upper / lower bounds and the interval widths."""
        rows = [("upper  +eps(+e_k)", self.upper.reshape(-1), None),
                ("lower  -eps(-e_k)", -self.lower.reshape(-1), None),
                ("width", (self.upper - self.lower).reshape(-1), None)]
        n = self.lower.shape[0]
        head = (f"Per-coordinate stability bounds: {n} examples x "
                f"{int(np.prod(self.lower.shape[1:]))} coordinates, method '{self.method}'")
        print_fn(format_table(head, rows, percentiles))


def percentiles_of(v, qs) -> list[float]:
    """Percentiles `qs` of `v` (inf where interpolating infinities gives NaN)."""
    v = np.asarray(v, np.float64)
    if v.size == 0:
        return [float("nan")] * len(qs)
    with np.errstate(invalid="ignore"):
        out = np.percentile(v, qs)
    out = np.where(np.isnan(out), INF, out)  # inf - inf when interpolating infinities
    return [float(o) for o in out]


def format_table(head: str, rows, qs) -> str:
    """A paper-style table: one row of percentiles (and a count of zeros) per `(label, v, _)`."""
    cols = [f"P{q:g}" for q in qs]
    width = 22 + 12 * len(cols) + 10
    lines = [head, "_" * width,
             f"{'Margin':<22}" + "".join(f"{c:>12}" for c in cols) + f"{'zero':>10}",
             "=" * width]
    for label, v, _ in rows:
        vals = percentiles_of(v, qs)
        zero = int(np.sum(np.asarray(v) == 0))
        lines.append(f"{label:<22}" + "".join(f"{x:>12.4g}" for x in vals) + f"{zero:>10d}")
    lines.append("_" * width)
    return "\n".join(lines)
