"""Where every neuron lives: the rows of the `[B, N]` neuron tensors, by unit.

The twin concatenates the neurons of its units (activations, max windows,
recurrent layers) in program order. `NeuronLayout` describes that order for one
per-example input shape: which rows belong to which unit, each unit's
per-example shape (so a row index maps back to `(layer name, unit index)`), the
number of neurons N and the tangent size (elements of every op output per
example and direction, what chunk plans are sized by). `Linearized.layout`
builds it from one cached batch-1 probe per input shape.

Example:

```python
layout = lin.layout((28, 28, 1))
layout.num_neurons, layout.tangent_size
layout.name(1234)                 # ('conv2d', (3, 7, 2))
layout.rows("dense")              # the rows of the neurons of 'dense'
```
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator

import numpy as np

__all__ = ["NeuronLayout", "UnitLayout"]


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """The neurons of one unit: rows `start .. start + size - 1`.

    Attributes:
        name: the name the unit's neurons are reported under.
        start: its first row.
        shape: its per-example neuron shape (numpy order).
        max_window: whether its neurons compare the elements of max windows
            (max pooling: a neuron at 0 is a tie).
    """

    name: str
    start: int
    shape: tuple[int, ...]
    max_window: bool = False

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def stop(self) -> int:
        return self.start + self.size

    def index(self, row: int) -> int | tuple[int, ...]:
        """The unit index of one of its rows: an int for 1-D units, else a tuple."""
        idx = tuple(int(i) for i in np.unravel_index(row - self.start, self.shape))
        return idx[0] if len(idx) == 1 else idx


@dataclasses.dataclass(frozen=True)
class NeuronLayout:
    """The neuron rows and tangent size of a twin for one per-example input shape.

    Attributes:
        example_shape: the per-example input shape it describes.
        units: one `UnitLayout` per neuron-owning op, in program (row) order.
        tangent_size: tangent elements per example and direction (the outputs
            of every op), the memory unit of every chunk plan.

    Iterating gives `(name, start, shape)` per unit (`Linearized.neuron_layout`).
    """

    example_shape: tuple[int, ...]
    units: tuple[UnitLayout, ...]
    tangent_size: int

    @classmethod
    def from_units(cls, example_shape, units, tangent_size: int) -> NeuronLayout:
        """Lays out `[(name, per-example shape[, max_window]), ...]` one unit after
        the other."""
        laid, start = [], 0
        for name, shape, *kind in units:
            unit = UnitLayout(name, start, tuple(int(d) for d in shape), bool(kind and kind[0]))
            laid.append(unit)
            start = unit.stop
        return cls(tuple(int(d) for d in example_shape), tuple(laid), int(tangent_size))

    @property
    def num_neurons(self) -> int:
        """N, the number of neuron rows."""
        return self.units[-1].stop if self.units else 0

    @property
    def input_size(self) -> int:
        """D, the flattened per-example input size."""
        return int(np.prod(self.example_shape, dtype=np.int64))

    @functools.cached_property
    def max_window_rows(self) -> np.ndarray:
        """`[N]` bool: the rows that compare the elements of a max window."""
        rows = np.zeros(self.num_neurons, bool)
        for u in self.units:
            rows[u.start:u.stop] = u.max_window
        return rows

    def tangent_bytes(self, itemsize: int) -> int:
        """Bytes of the tangents and neuron tangents of one example and direction."""
        return (self.tangent_size + self.num_neurons) * int(itemsize)

    def __iter__(self) -> Iterator[tuple[str, int, tuple[int, ...]]]:
        return iter([(u.name, u.start, u.shape) for u in self.units])

    def __len__(self) -> int:
        return len(self.units)

    @functools.cached_property
    def _starts(self) -> np.ndarray:
        return np.array([u.start for u in self.units], np.int64)

    def unit_of(self, row: int) -> UnitLayout:
        """The unit that owns neuron row `row`."""
        if not 0 <= row < self.num_neurons:
            raise IndexError(f"Neuron index {row} is out of range for inputs of shape "
                             f"{self.example_shape} ({self.num_neurons} neurons).")
        return self.units[int(np.searchsorted(self._starts, row, side="right")) - 1]

    def name(self, row: int) -> tuple[str, int | tuple[int, ...]]:
        """`(layer name, unit index)` of neuron row `row`, without listing them all."""
        unit = self.unit_of(int(row))
        return unit.name, unit.index(int(row))

    @functools.cached_property
    def names(self) -> list[tuple[str, int | tuple[int, ...]]]:
        """`(layer name, unit index)` of every row (a list of N tuples)."""
        return [(u.name, idx[0] if len(idx) == 1 else idx)
                for u in self.units for idx in np.ndindex(*u.shape)]

    def rows(self, name: str) -> np.ndarray:
        """The rows of the neurons reported under `name`."""
        for u in self.units:
            if u.name == name:
                return np.arange(u.start, u.stop)
        raise KeyError(f"No unit named {name!r}; units: {[u.name for u in self.units]}.")

