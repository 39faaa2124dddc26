"""The modes of the public functions: `Choice` enums, parsed once at the boundary.

A mode is a `Choice`, a `str` enum whose members equal their strings: `Rigor` (the
rounding guard of certificates) and `Method` (how margins are computed) here, the
others next to the functions they steer. `AUTO` is the string of every "auto"
setting. `keras_roll.options` re-exports all of them.

Example:

```python
Rigor.parse("strict") is Rigor.STRICT       # True
Rigor.FLOAT64 == "float64"                  # True: a member is its string
```
"""

from __future__ import annotations

import enum

__all__ = ["AUTO", "Choice", "Method", "Rigor"]

AUTO = "auto"
"""The string of every "auto" setting: `memory_budget="auto"` (the chunk size is chosen
for the twin, today its own budget), `verbose="auto"` (a bar only for runs over a second)."""


class Choice(str, enum.Enum):
    """A mode of a public function: a `str` enum whose members equal their strings.

    The public functions accept a member or its string and parse it once at the
    boundary (`parse`); inside the library members are compared with `is`.
    docs/design.md, section "Options and results".

    Example:

    ```python
    class Color(Choice):
        RED = "red"

    Color.parse("red") is Color.RED           # True
    Color.parse("blue")         # ValueError: Unknown color='blue': color must be one of 'red' ...
    ```
    """

    def __str__(self) -> str:
        return self.value

    @classmethod
    def hints(cls) -> dict[str, str]:
        """What each string means, for the error message of `parse` (default: nothing)."""
        return {}

    @classmethod
    def parse(cls, value, name: str | None = None, default=None):
        """The member named by `value` (a member or its string).

        Args:
            value: the member, its string, or None (then `default`, if given).
            name: the argument's name in the error message (default: the class
                name in lower case).
            default: the member None stands for; None: None is refused.

        Raises:
            ValueError: anything else; the message echoes the value and lists the
                valid strings (with what each does, where `hints` says).
        """
        if value is None and default is not None:
            return cls(default)
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        name = name or cls.__name__.lower()
        hints = cls.hints()
        choices = ", ".join(repr(m.value) + (f" ({hints[m.value]})" if m.value in hints else "")
                            for m in cls)
        raise ValueError(f"Unknown {name}={value!r}: {name} must be one of {choices} (or a "
                         f"{cls.__name__}).")


class Rigor(Choice):
    """The rounding guard of a certificate (docs/design.md, "The rounding bound").

    * `FLOAT64` ("float64", the default): neurons and gradients in float64 from
      the model's weights, radii shrunk by a probabilistic bound on the rounding
      of the model's own evaluation (and a rigorous one on the float64 twin's).
    * `STRICT` ("strict"): the same with a worst-case bound: sound whatever the
      rounding errors, often 0 on wide float32 networks.
    * `FLOAT32` ("float32"): the twin's own dtype and no guard: the paper's
      exact-arithmetic radii.

    A `Rigor` is also its string (`Rigor.FLOAT64 == "float64"`); compare with
    `is` inside the library.

    Example:

    ```python
    Rigor.parse("strict")          # Rigor.STRICT
    Rigor.parse(Rigor.FLOAT32)     # Rigor.FLOAT32
    ```
    """

    FLOAT64 = "float64"
    STRICT = "strict"
    FLOAT32 = "float32"

    @classmethod
    def hints(cls) -> dict[str, str]:
        return {
            "float64": "the default: neurons and gradients in float64, radii shrunk by a "
                       "probabilistic bound on the rounding of the model's own evaluation",
            "strict": "the same with a worst-case bound: sound always, often 0 on wide "
                      "float32 networks",
            "float32": "the twin's own dtype, no rounding guard"}

    @property
    def guarded(self) -> bool:
        """Whether radii are shrunk by a rounding guard (computed by a float64 twin)."""
        return self is not Rigor.FLOAT32

    def twin_dtype(self, own: str) -> str:
        """The dtype the twin computes in under this rigor: float64 for a guarded
        rigor, else `own` (the twin's own dtype)."""
        return "float64" if self.guarded else own


class Method(Choice):
    """How `certify` and `stability_bounds` compute margins.

    * `ANALYTIC` ("analytic", the default): the closed forms, exact for
      piecewise-linear networks, from streamed gradient norms.
    * `BISECT` ("bisect"): the paper's binary search on pattern feasibility,
      evaluated on the twin's forward pass: a slow cross-check.

    Example:

    ```python
    keras_roll.certify(model, x, method="bisect").method is Method.BISECT   # a cross-check
    ```
    """

    ANALYTIC = "analytic"
    BISECT = "bisect"

    @classmethod
    def hints(cls) -> dict[str, str]:
        return {"analytic": "exact, streamed",
                "bisect": "binary search on the real network, a slow cross-check"}
