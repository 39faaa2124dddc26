"""Small typed records of tensors that travel through `tf.nest`.

The twin's forward pass leaves a *trace* (what every op recorded: masks,
slopes, argmax choices) that later passes read. It is passed through
`tf.function` boundaries, flattened for custom gradients and packed back, so
its records must be `tf.nest` structures. `Record` makes a frozen dataclass one:
its tensor fields are the leaves; its other fields (None, ints, strings) are
static metadata that `tf.nest.flatten` leaves out and `pack_sequence_as` puts
back.

Example:

```python
@dataclasses.dataclass(frozen=True, eq=False)
class ScaleRecord(Record):
    scale: tf.Tensor
    mask: tf.Tensor | None = None

tf.nest.flatten(ScaleRecord(tf.ones(3)))   # [<tf.Tensor ... ones(3)>]
```
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Record", "is_leaf_value"]


def is_leaf_value(value) -> bool:
    """Whether `value` is a `tf.nest` leaf of a record (not static metadata).

    Tensors, variables, numpy arrays and nested structures (lists, tuples,
    dicts, records) are data; None, Python scalars and strings are metadata.
    """
    return not (value is None or isinstance(value, (bool, int, float, str)))


@dataclasses.dataclass(frozen=True, eq=False)
class Record:
    """Base class of frozen dataclass records that `tf.nest` can flatten.

    It implements `tf.nest`'s custom nest protocol (`__tf_flatten__` /
    `__tf_unflatten__`, TensorFlow >= 2.13), which `tf.function` also uses for
    its arguments and results.

    Subclass it as `@dataclasses.dataclass(frozen=True, eq=False)`; `eq=False`
    keeps identity hashing (tensors are not hashable). Fields holding tensors
    (or nested structures of them) are leaves; fields holding None or Python
    scalars are static, so an optional tensor field can default to None.
    """

    def __tf_flatten__(self):
        names = tuple(f.name for f in dataclasses.fields(self))
        values = [getattr(self, n) for n in names]
        data = tuple(is_leaf_value(v) for v in values)
        static = tuple(None if d else v for d, v in zip(data, values))
        return (names, data, static), tuple(v for d, v in zip(data, values) if d)

    @classmethod
    def __tf_unflatten__(cls, metadata, components):
        names, data, static = metadata
        parts = iter(components)
        return cls(**{n: next(parts) if d else s for n, d, s in zip(names, data, static)})

    def as_dict(self) -> dict[str, Any]:
        """The fields that hold data, by name (None fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def replace(self, **changes) -> Record:
        """A copy with some fields replaced (`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

