"""absl flags from an example's config: the config is the one place of the defaults,
help texts, bounds and choices; the flags override it.

An example's `configs/default.py` holds a frozen dataclass whose fields are
declared with `option(default, help, lower_bound=..., upper_bound=...)`;
`define_config_flags` defines one absl flag per field, typed from the field's
annotation:

| annotation            | flag                                                       |
| --------------------- | ---------------------------------------------------------- |
| `bool`                | `DEFINE_bool` (`--name` / `--noname`)                      |
| `int`, `float`        | `DEFINE_integer` / `DEFINE_float` with the field's bounds  |
| `str`                 | `DEFINE_string`                                            |
| an `enum.Enum`        | `DEFINE_enum_class` (member names, any case)               |
| `tuple[float, ...]`   | comma-separated numbers, each within the field's bounds    |
| `tuple[str, ...]`     | `DEFINE_list`                                              |

(`X | None` allows the flag to stay unset.) absl checks every value while it
parses, so a bad one stops the example with one line, `FATAL Flags parsing
error: ...`, before any work.

`config_from_flags` builds the config of a run: it starts from the `--quick`
config (`configs/quick.py`) under `--quick`, else from the default one, and every
flag that is set (on the command line or in a flagfile) replaces its field. The
flagfiles of `examples/configs/` therefore set only what differs from the defaults,
so that `--flagfile=... --quick` runs the quick config of that experiment, and an
explicit `--epochs=3` wins over both.

Every example defines its flags with `define_example_flags` (`--quick`, `--out`,
one flag per config field, the check of `--data_dir`) and builds its config with
`example_config`.

Example:

```python
define_example_flags(fv, default.get_config, out="runs/mnist", data_dir=MNIST_PATH)
fv(["example", "--flagfile=examples/configs/mnist_roll.flags", "--quick"])
config = example_config(fv, default.get_config, quick.get_config)
```
"""

from __future__ import annotations

import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable

from absl import flags

from examples.common import app

__all__ = ["MNIST_PATH", "FloatListParser", "config_from_flags", "define_config_flags",
           "define_example_flags", "example_config", "option", "parse_flags", "parsed_by",
           "require_existing_path"]

# What the MNIST examples' --data_dir holds (the text of its check's error).
MNIST_PATH = "a Keras-layout mnist.npz or a folder holding it or the four IDX files"


def option(default, help: str, *, lower_bound=None, upper_bound=None,  # noqa: A002
           above=None):
    """A config field with its flag's help text and bounds (`above`: a strict lower
    bound, for values that must be positive).

    Example:

    ```python
    @dataclasses.dataclass(frozen=True)
    class Config:
        epochs: int = option(20, "Training epochs.", lower_bound=1)
    ```
    """
    return dataclasses.field(default=default, metadata={
        "help": help, "lower_bound": lower_bound, "upper_bound": upper_bound,
        "above": above})


class FloatListParser(flags.ListParser):
    """Comma-separated numbers, each in `[lower_bound, upper_bound]` (either optional).

    Example:

    ```python
    flags.DEFINE(FloatListParser(lower_bound=0), "lam", [2.0], "ROLL weights.",
                 serializer=flags.CsvListSerializer(","))
    ```
    """

    def __init__(self, lower_bound=None, upper_bound=None):
        super().__init__()
        self.lower_bound, self.upper_bound = lower_bound, upper_bound

    def parse(self, argument) -> list[float]:
        values = []
        for item in super().parse(argument):
            try:
                value = float(item)
            except (TypeError, ValueError):
                raise ValueError(f"takes comma-separated numbers, got {item!r}") from None
            if self.lower_bound is not None and value < self.lower_bound:
                raise ValueError(f"{value:g} is below the lower bound {self.lower_bound:g}")
            if self.upper_bound is not None and value > self.upper_bound:
                raise ValueError(f"{value:g} is above the upper bound {self.upper_bound:g}")
            values.append(value)
        return values

    def flag_type(self) -> str:
        return "comma separated list of numbers"


def define_config_flags(fv: flags.FlagValues, default) -> None:
    """Defines on `fv` one flag per field of the config dataclass `default`, with the
    field's value as the flag's default (see the module docstring for the types)."""
    hints = typing.get_type_hints(type(default))
    for field in dataclasses.fields(default):
        kind, optional = _unwrap_optional(hints[field.name])
        meta = field.metadata
        value = getattr(default, field.name)
        args = dict(flag_values=fv)
        bounds = dict(lower_bound=meta.get("lower_bound"), upper_bound=meta.get("upper_bound"))
        if kind is bool:
            flags.DEFINE_bool(field.name, value, meta["help"], **args)
        elif kind is int:
            flags.DEFINE_integer(field.name, value, meta["help"], **bounds, **args)
        elif kind is float:
            flags.DEFINE_float(field.name, value, meta["help"], **bounds, **args)
        elif kind is str:
            flags.DEFINE_string(field.name, value, meta["help"], **args)
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            flags.DEFINE_enum_class(field.name, value, kind, meta["help"],
                                    case_sensitive=False, **args)
        elif kind == tuple[float, ...]:
            flags.DEFINE(FloatListParser(**bounds), field.name, list(value), meta["help"],
                         serializer=flags.CsvListSerializer(","), **args)
        elif kind == tuple[str, ...]:
            flags.DEFINE_list(field.name, list(value), meta["help"], **args)
        else:
            raise TypeError(f"Config field {field.name!r} has type {kind!r}, which has no "
                            f"flag; use bool, int, float, str, an Enum or a tuple of float "
                            f"or str.")
        if meta.get("above") is not None:
            _register_above(fv, field.name, meta["above"])
        if value is None and not optional:
            raise TypeError(f"Config field {field.name!r} defaults to None; annotate it "
                            f"as '{kind.__name__} | None'.")


def define_example_flags(fv: flags.FlagValues, default: Callable[[], object], *, out: str,
                         data_dir: str | None = None) -> None:
    """Defines an example's common flags on `fv`: `--quick` and `--out` (default `out`;
    `app.define_run_flags`), one flag per field of the config `default()`
    (`define_config_flags`) and, with `data_dir`, the check that `--data_dir`, when
    set, exists (`data_dir` says what it holds, in the error).

    Example:

    ```python
    def define_flags(fv):
        define_example_flags(fv, default.get_config, out="runs/compare",
                             data_dir=MNIST_PATH)
        flags.register_validator("fixed", parsed_by(default.parse_fixed), flag_values=fv)
    ```
    """
    app.define_run_flags(fv, out=out)
    define_config_flags(fv, default())
    if data_dir is not None:
        require_existing_path(fv, "data_dir", data_dir)


def example_config(fv: flags.FlagValues, default: Callable[[], object],
                   quick: Callable[[], object]):
    """The config of a run of an example whose flags `define_example_flags` defined:
    `quick()` under `--quick`, else `default()`, overridden by the flags that are set.

    Example:

    ```python
    config = example_config(fv, default.get_config, quick.get_config)
    ```
    """
    return config_from_flags(fv, default(), quick() if fv.quick else None)


def config_from_flags(fv: flags.FlagValues, default, base=None):
    """The config of a run: `base` (the `--quick` config under `--quick`; None:
    `default`) with the value of every flag that is set (on the command line or in a
    flagfile) in its field's place."""
    base = default if base is None else base
    changes = {}
    for field in dataclasses.fields(default):
        if fv[field.name].present:
            value = fv[field.name].value
            changes[field.name] = tuple(value) if isinstance(value, list) else value
    return dataclasses.replace(base, **changes)


def parse_flags(define, argv=()) -> flags.FlagValues:
    """A fresh `FlagValues` with the flags of `define(fv)`, parsed from `argv` (flags
    only, no program name; `--flagfile=...` works). Raises `flags.Error` (for
    example `IllegalFlagValueError`) for a bad value, as the command line would.

    Example:

    ```python
    fv = parse_flags(main.define_flags, ["--quick", "--out=/tmp/toy"])
    ```
    """
    fv = flags.FlagValues()
    define(fv)
    fv(["example", *argv])
    return fv


def require_existing_path(fv: flags.FlagValues, name: str, what: str) -> None:
    """Registers a validator: `--name`, when set, must name an existing path (`what`
    says what it should hold).

    Example:

    ```python
    require_existing_path(fv, "data_dir", "a folder holding mnist.npz or the IDX files")
    ```
    """
    flags.register_validator(
        name, lambda path: path is None or os.path.exists(os.path.expanduser(path)),
        message=f"--{name} does not exist; pass {what}", flag_values=fv)


def _register_above(fv, name, above):
    def check(value):
        values = value if isinstance(value, (list, tuple)) else [value]
        return all(v is None or v > above for v in values)

    flags.register_validator(name, check, message=f"--{name} must be > {above:g}",
                             flag_values=fv)


def _unwrap_optional(hint):
    """`(type, optional)` of an annotation `X` or `X | None`."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return hint, False


def parsed_by(parse):
    """An absl validator that accepts a value `parse` accepts and raises `parse`'s
    ValueError as absl's ValidationError (its message is the flag's error line).

    Example:

    ```python
    flags.register_validator("normalize", parsed_by(parse_normalize), flag_values=fv)
    ```
    """
    def check(value):
        try:
            parse(value)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True
    return check
