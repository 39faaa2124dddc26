"""Tables the examples write: Markdown for reading, JSON (strict: no inf / nan) for
programs, and the cell formats both use.

Example:

```python
md = write_table(out, "table1", "Table 1", [("acc", "ACC", percent)], [{"acc": 0.98}])
```
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

__all__ = ["fmt", "jsonable", "markdown_table", "percent", "write_json", "write_table"]


def fmt(value, digits: int = 3) -> str:
    """A table cell: numbers in 3 significant digits (scientific when small, no
    exponent from 1000 on), '-' for None, yes / no for booleans.

    Example:

    ```python
    fmt(0.001234), fmt(12345.6), fmt(None)   # '1.23e-03', '12,346', '-'
    ```
    """
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    v = float(value)
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v != 0 and abs(v) < 1e-2:
        return f"{v:.{digits - 1}e}"
    text = f"{v:.{digits}g}"
    return f"{v:,.0f}" if "e" in text else text


def percent(value) -> str:
    """An accuracy in [0, 1] as a percentage cell ('-' for None)."""
    return "-" if value is None else f"{100 * float(value):.2f} %"


def jsonable(value):
    """`value` with numpy scalars and arrays as Python values, tuples as lists and
    inf / nan as None (strict JSON has neither)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        v = float(value)
        return v if math.isfinite(v) else None
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "value") and hasattr(value, "name"):  # an Enum member
        return value.value
    return value


def markdown_table(columns, rows) -> str:
    """A Markdown table: `columns` is a list of `(key, header, formatter)`, `rows` a
    list of dicts (a missing key is formatted from None).

    Example:

    ```python
    markdown_table([("acc", "ACC", percent)], [{"acc": 0.98}])
    ```
    """
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join(f(row.get(k)) for k, _, f in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def write_table(out: Path, name: str, title: str, columns, rows, notes=()) -> str:
    """Writes `out/name.md` (Markdown) and `out/name.json` and returns the Markdown.

    The JSON holds `title`, `columns` (keys and headers), `rows` (every key of every
    row, raw values; inf / nan become null) and `notes`.

    Example:

    ```python
    md = write_table(out, "table1", "Table 1: MNIST", columns, rows, notes=["..."])
    ```
    """
    md = f"### {title}\n\n{markdown_table(columns, rows)}\n"
    if notes:
        md += "\n" + "\n".join(f"* {n}" for n in notes) + "\n"
    (out / f"{name}.md").write_text(md, encoding="utf-8")
    write_json(out / f"{name}.json", {
        "title": title, "columns": [{"key": k, "header": h} for k, h, _ in columns],
        "rows": rows, "notes": list(notes)})
    return md


def write_json(path: Path, data) -> None:
    """Writes `data` as strict JSON (see `jsonable`)."""
    Path(path).write_text(json.dumps(jsonable(data), indent=1) + "\n", encoding="utf-8")
