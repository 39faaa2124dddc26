"""The one shape of attribution results: `Attribution`, the base of `Saliency`,
`SmoothGrad` and `IntegratedGradients`.

Every attribution result names its map `maps` (`[B, *input_shape]`, or the
post-processed `[B, H, W]` of a saliency map), the differentiated class
`labels`, the logit weights `targets`, and whether the model was piecewise
linear (`piecewise_linear`, `note`). Results hold numpy arrays only, never a
model: the certified radius of `Saliency` / `SmoothGrad` is computed when the
call asks for it (`radius=True`), or afterwards by `keras_roll.stable_radius`.
docs/design.md, section "Options and results".

Example:

```python
sal = keras_roll.saliency(model, x, y, radius=True)
ig = keras_roll.integrated_gradients(model, x, y)
for result in (sal, ig):
    result.maps.shape          # [B, *input_shape]
sal.radius[2]                  # computed with the maps
```
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from keras_roll.errors import UnsupportedModelError

__all__ = ["Attribution", "WithRadius", "deprecated_alias", "join_examples"]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.shape(a) == np.shape(b) and bool(np.all(np.asarray(a) == np.asarray(b)))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b


def join_examples(cls: type, parts: Sequence, per_example: Sequence[str],
                  differ: dict | None = None):
    """One result of dataclass `cls` for the examples of `parts`, in order: the
    fields in `per_example` (arrays with a leading example axis, dicts of them, or
    None in every part) are concatenated; every other field must be equal in all
    parts (the settings of the run), except those in `differ`, which take the
    given value where the parts differ.

    Raises:
        ValueError: no parts, a part of another type, a per-example field that is
            None in some parts only, or a setting that differs between parts.

    Example:

    ```python
    join_examples(Saliency, [sal_a, sal_b], ("maps", "labels", "gradient", ...))
    ```
    """
    parts = list(parts)
    name = cls.__name__
    if not parts:
        raise ValueError(f"{name}.concat needs at least one {name}.")
    for i, q in enumerate(parts):
        if not isinstance(q, cls):
            raise ValueError(f"{name}.concat joins {name}s; part {i} is a "
                             f"{type(q).__name__}.")
    differ = differ or {}
    values = {}
    for field in dataclasses.fields(cls):
        got = [getattr(q, field.name) for q in parts]
        if field.name in per_example:
            if all(v is None for v in got):
                values[field.name] = None
            elif any(v is None for v in got):
                raise ValueError(f"{name}.concat: {field.name} is None in part "
                                 f"{[v is None for v in got].index(True)} but not in all "
                                 f"parts; compute every part with the same options.")
            elif isinstance(got[0], dict):
                values[field.name] = type(got[0])(
                    {k: np.concatenate([v[k] for v in got]) for k in got[0]})
            else:
                values[field.name] = np.concatenate([np.asarray(v) for v in got])
            continue
        for i, v in enumerate(got[1:], 1):
            if not _same(v, got[0]):
                if field.name in differ:
                    values[field.name] = differ[field.name]
                    break
                raise ValueError(f"{name}s of different runs cannot be concatenated: part {i} "
                                 f"has {field.name}={v!r}, part 0 has {got[0]!r}.")
        else:
            values[field.name] = got[0]
    return cls(**values)


@dataclasses.dataclass(kw_only=True, repr=False)
class Attribution:
    """The fields every attribution result has.

    Attributes:
        maps: `[B, *input_shape]` float attributions (a saliency map may be
            post-processed to `[B, H, W]`).
        labels: `[B]` the class whose logit was differentiated (-1 for a target
            of several classes).
        targets: `[B, L]` the weights of the differentiated logits.
        piecewise_linear: False for a model that is not piecewise linear
            (gradients from `tf.GradientTape`: no radius, no regions).
        note: why, in words, for such a model.

    Example:

    ```python
    isinstance(keras_roll.saliency(model, x), Attribution)     # True
    ```
    """

    maps: np.ndarray
    labels: np.ndarray
    targets: np.ndarray | None = None
    piecewise_linear: bool = True
    note: str | None = None

    EXAMPLE_FIELDS: ClassVar[tuple] = ("maps", "labels", "targets")
    """The fields with one entry per example (the others are the run's settings)."""

    @classmethod
    def concat(cls, parts: Sequence[Attribution]) -> Attribution:
        """The result of the examples of `parts`, in order: the result of one call
        over the concatenated inputs (each example's attribution depends on it
        alone).

        Raises:
            ValueError: no parts, or parts of runs with different settings.

        Example:

        ```python
        sal = Saliency.concat([keras_roll.saliency(model, xa), keras_roll.saliency(model, xb)])
        ```
        """
        return join_examples(cls, parts, cls.EXAMPLE_FIELDS)

    @property
    def n(self) -> int:
        """The number of examples."""
        return int(self.maps.shape[0])


@dataclasses.dataclass(kw_only=True, repr=False)
class WithRadius(Attribution):
    """An attribution result of gradients at `x` that may carry the certified radius.

    Attributes:
        radius: `{p: [B]}` certified l2 and l_inf radii of the examples' linear
            regions, within which the gradient at `x` is unchanged: computed by
            the call with `radius=True` (`keras_roll.stable_radius`).

    Example:

    ```python
    keras_roll.saliency(model, x, radius=True).radius[np.inf]    # [B]
    ```
    """

    _radius: dict | None = dataclasses.field(default=None, repr=False)

    EXAMPLE_FIELDS: ClassVar[tuple] = (*Attribution.EXAMPLE_FIELDS, "_radius")

    @property
    def radius(self) -> dict:
        """`{p: [B]}` the certified radii computed with the maps (`radius=True`).

        Raises:
            UnsupportedModelError: the model is not piecewise linear (no region).
            ValueError: the call did not compute them; the message says how.
        """
        if not self.piecewise_linear:
            raise UnsupportedModelError(f"No certified radius for these maps: {self.note}.")
        if self._radius is None:
            name = type(self).__name__
            raise ValueError(f"This {name} has no certified radius: pass radius=True to the "
                             f"call that made it (e.g. keras_roll.saliency(model, x, "
                             f"radius=True)), or compute it with "
                             f"keras_roll.stable_radius(model, x).")
        return self._radius


def deprecated_alias(new: str, old: str) -> property:
    """A read-only property `old` that returns the attribute `new` with a
    `DeprecationWarning` (the old name of a field, kept for a release).

    Example:

    ```python
    class IntegratedGradients(Attribution):
        attributions = deprecated_alias("maps", "attributions")
    ```
    """

    def get(self):
        warnings.warn(f"{type(self).__name__}.{old} is deprecated and will be removed in the "
                      f"next release; use .{new} (the same array).", DeprecationWarning,
                      stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated name of `{new}`.")
