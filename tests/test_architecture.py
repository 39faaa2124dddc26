"""The shape of the code, checked with `ast`: module boundaries that reviews enforce.

* No module calls another's underscored members: no `from keras_roll.x import _y`,
  no `obj._attr` on anything but `self` / `cls` unless the module itself defines
  `_attr` (a function, a method or a `self._attr` assignment; dunders aside).
  A module that needs another's helper gets a public name for it.
* Keras internals (private attributes, `keras.src`) are read only in
  `keras_roll/compile/keras_internals.py`.
* Chunk sizes are computed in one place: `keras_roll/compile/chunking.py` (no other
  module floor-divides a memory budget).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_roll"
KERAS_BOUNDARY = "keras_roll/compile/keras_internals.py"
CHUNK_PLANNER = "keras_roll/compile/chunking.py"
def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.AST) -> set[str]:
    """Names a module defines: its functions and methods, and the attributes it
    assigns on `self` (a layer may use its own cell's private state)."""
    names = {node.name for node in ast.walk(tree)
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                      and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


def underscored_accesses(rel: str, tree: ast.AST) -> list[str]:
    """`file:line what` for every access to another module's private name."""
    own = _own_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras"):
            found += [f"{rel}:{node.lineno} from {node.module} import {a.name}"
                      for a in node.names if _private(a.name)]
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
                continue
            if node.attr in own:  # e.g. a layer calling its cell's method, same module
                continue
            found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr",
                                                                              "hasattr"):
            if (len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value)
                    and not node.args[1].value.startswith("_keras_roll")):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return found


def keras_src_imports(rel: str, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras.src"):
            found.append(f"{rel}:{node.lineno} from {node.module}")
        if isinstance(node, ast.Import):
            found += [f"{rel}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.startswith("keras.src")]
    return found


def budget_divisions(rel: str, tree: ast.AST) -> list[str]:
    """Floor divisions of a name mentioning a budget (how chunk sizes are computed)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
            text = ast.unparse(node.left)
            if "budget" in text:
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_cross_module_underscored_access():
    found = [hit for rel, tree in _modules() if rel != KERAS_BOUNDARY
             for hit in underscored_accesses(rel, tree)]
    assert found == [], "private members used across modules:\n" + "\n".join(found)


def test_keras_src_is_imported_only_at_the_boundary():
    found = [hit for rel, tree in _modules() if rel != KERAS_BOUNDARY
             for hit in keras_src_imports(rel, tree)]
    assert found == [], "keras.src used outside keras_internals.py:\n" + "\n".join(found)


def test_chunk_sizes_are_computed_in_one_place():
    found = {rel for rel, tree in _modules() if budget_divisions(rel, tree)}
    assert CHUNK_PLANNER in found
    assert found == {CHUNK_PLANNER}, found


def test_the_checks_see_violations():
    """The detectors above flag the patterns they are meant to flag."""
    code = ast.parse(
        "from keras_roll.certification.margins import _progress\n"
        "lin._jvp(trace)\n"
        "getattr(layer, '_call_has_mask_arg', False)\n"
        "self._ok()\n"
        "x.__class__\n"
        "cell._own()\n"
        "def _own(): pass\n"
        "from keras.src.ops import numpy\n"
        "k = budget // per\n"
    )
    assert len(underscored_accesses("m.py", code)) == 3
    assert len(keras_src_imports("m.py", code)) == 1
    assert len(budget_divisions("m.py", code)) == 1
