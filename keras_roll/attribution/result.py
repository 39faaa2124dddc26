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

import numpy as np

from keras_roll.errors import UnsupportedModelError

__all__ = ["Attribution", "WithRadius", "deprecated_alias"]


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
