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
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_roll"
KERAS_BOUNDARY = "keras_roll/compile/keras_internals.py"
CHUNK_PLANNER = "keras_roll/compile/chunking.py"


@functools.cache
def _modules() -> tuple:
    """`(path relative to the root, ast)` of every module of the package, parsed once
    for all the checks (each would otherwise parse the package again)."""
    return tuple((str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path)))
                 for path in sorted(PACKAGE.rglob("*.py")))


@functools.cache
def _walk(tree: ast.AST) -> tuple:
    """`ast.walk(tree)`, listed once per tree: the checks walk the same trees often."""
    return tuple(ast.walk(tree))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.AST) -> set[str]:
    """Names a module defines: its functions and methods, and the attributes it
    assigns on `self` (a layer may use its own cell's private state)."""
    names = {node.name for node in _walk(tree)
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in _walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                      and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


def underscored_accesses(rel: str, tree: ast.AST) -> list[str]:
    """`file:line what` for every access to another module's private name."""
    own = _own_names(tree)
    found = []
    for node in _walk(tree):
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
    for node in _walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras.src"):
            found.append(f"{rel}:{node.lineno} from {node.module}")
        if isinstance(node, ast.Import):
            found += [f"{rel}:{node.lineno} import {a.name}" for a in node.names
                      if a.name.startswith("keras.src")]
    return found


def budget_divisions(rel: str, tree: ast.AST) -> list[str]:
    """Floor divisions of a name mentioning a budget (how chunk sizes are computed)."""
    found = []
    for node in _walk(tree):
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


# --------------------------------------------------------------------------- graph walks

COMPILER = "keras_roll/compile/"
WALKED = ("steps", "nodes")  # what a program's ops are listed under (Program, ProgramStructure)


def _walked_iterable(node: ast.AST) -> bool:
    """Whether a loop iterates over `<x>.steps` / `<x>.nodes`, possibly inside
    `enumerate`, `zip` or `reversed`."""
    if isinstance(node, ast.Attribute):
        return node.attr in WALKED
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("enumerate", "zip",
                                                                         "reversed"):
        return any(_walked_iterable(a) for a in node.args)
    return False


def _target_names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def graph_walks(rel: str, tree: ast.AST) -> list[str]:
    """`file:line` of every walk along a program's edges: a loop or comprehension over a
    program's steps or nodes (`_walked_iterable`) that reads its loop variable's `inputs`
    or assigns to a subscript keyed by its loop variable's `output` (an environment of
    values by key, as `interpreter.propagate` keeps)."""
    found = []
    loops = [(n, n.iter, n.target, n.body) for n in _walk(tree)
             if isinstance(n, (ast.For, ast.AsyncFor))]
    loops += [(n, g.iter, g.target, [n]) for n in _walk(tree)
              if isinstance(n, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp))
              for g in n.generators]
    for loop, iterable, target, body in loops:
        if not _walked_iterable(iterable):
            continue
        names = _target_names(target)
        for part in body:
            for node in ast.walk(part):
                edge = (isinstance(node, ast.Attribute) and node.attr == "inputs"
                        and isinstance(node.value, ast.Name) and node.value.id in names)
                keyed = (isinstance(node, (ast.Assign, ast.AugAssign)) and any(
                    isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Attribute)
                    and t.slice.attr == "output" and isinstance(t.slice.value, ast.Name)
                    and t.slice.value.id in names
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])))
                if edge or keyed:
                    found.append(f"{rel}:{loop.lineno} {ast.unparse(iterable)}")
                    break
            else:
                continue
            break
    return found


def test_graph_walks_live_in_the_compiler():
    """No module outside keras_roll/compile/ walks a program's edges itself: forward
    passes are `Transform`s for `interpreter.propagate`, bound passes and backward walks
    are in `compile/bounds/` (docs/design.md, "Architecture rules")."""
    found = [hit for rel, tree in _modules() if not rel.startswith(COMPILER)
             for hit in graph_walks(rel, tree)]
    assert found == [], "graph walks outside keras_roll/compile/:\n" + "\n".join(found)
    inside = [hit for rel, tree in _modules() if rel.startswith(COMPILER)
              for hit in graph_walks(rel, tree)]
    assert inside, "the detector finds none of the compiler's own walks"


def test_the_graph_walk_check_sees_violations():
    code = ast.parse(
        "env = {}\n"
        "for i, node in enumerate(structure.nodes):\n"
        "    env[node.output] = f([env[k] for k in node.inputs])\n"
        "for step in program.steps:\n"
        "    out = step.inputs\n"
        "readers = [i for i, s in enumerate(program.steps) if key in s.inputs]\n"
        "names = [s.name for s in program.steps]\n"
        "for step in trace.steps:\n"
        "    masks.append(step.mask)\n"
    )
    assert len(graph_walks("m.py", code)) == 3


# --------------------------------------------------------------------------- layering
# docs/design.md, "Module map" and "Architecture rules": every top-level unit of
# keras_roll (a subpackage or a top-level module) sits on a floor, and imports only
# units on a lower floor (its own modules aside). `models`, `layers` and `data` are
# plain Keras and numpy: they import only one another. Imports under
# `if TYPE_CHECKING:` are annotations, not dependencies.

FLOORS = {
    # 0: shared by every job, no dependency on the core
    "errors": 0, "options": 0, "summary": 0, "inputs": 0, "layers": 0, "data": 0,
    # 1: the lp geometry (dual norms, steepest directions, NormDict), on the options' norms;
    # the executor that spreads examples over a strategy's replicas
    "geometry": 1, "distribute": 1,
    # 2: the compiler (and the model builders, on top of `layers`)
    "compile": 2, "models": 2,
    # 3: the rounding guards, passes over the compiled program
    "rounding": 3,
    # 4: what a certificate says about one region
    "certification": 4,
    # 5: the uses of certificates and of the twin, independent of one another
    "roll": 5, "attribution": 5, "robust": 5,
    # 6: the regularizer family: ROLL's layer over roll, MMR, input gradient, IBP, wrap
    "regularizers": 6,
    # 7: drawing results, checking rules, the names kept for a release
    "plots": 7, "testing": 7, "callbacks": 7, "evaluate": 7,
    # 8: the package's public names
    "__init__": 8,
}
INDEPENDENT = {"models", "layers", "data"}


def _unit(dotted: str) -> str:
    """The top-level unit of `keras_roll.<unit>...` (`__init__` for the package)."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in _walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines |= {n.lineno for n in ast.walk(child) if hasattr(n, "lineno")}
    return lines


def unit_imports(rel: str, tree: ast.AST) -> list[tuple[int, str]]:
    """`(line, unit)` of every keras_roll unit that the module `rel` imports."""
    skip = _type_checking_lines(tree)
    found = []
    for node in _walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "keras_roll":
            if node.module == "keras_roll":
                found += [(node.lineno, alias.name) for alias in node.names]
            else:
                found.append((node.lineno, _unit(node.module)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, _unit(a.name)) for a in node.names
                      if a.name.split(".")[0] == "keras_roll"]
    return found


def layering_violations(rel: str, tree: ast.AST) -> list[str]:
    """`file:line` for every import against the floors (or of a unit without one)."""
    own = _unit(".".join(pathlib.PurePosixPath(rel).with_suffix("").parts))
    if own not in FLOORS:
        return [f"{rel}: unit {own!r} has no floor: add it to FLOORS and to docs/design.md"]
    found = []
    for line, unit in unit_imports(rel, tree):
        if unit == own:
            continue
        if unit not in FLOORS:
            found.append(f"{rel}:{line} imports {unit!r}, which has no floor")
        elif own in INDEPENDENT and unit not in INDEPENDENT:
            found.append(f"{rel}:{line} {own} (independent of the core) imports {unit}")
        elif FLOORS[unit] >= FLOORS[own]:
            found.append(f"{rel}:{line} {own} (floor {FLOORS[own]}) imports {unit} "
                         f"(floor {FLOORS[unit]})")
    return found


def test_every_unit_imports_only_from_lower_floors():
    found = [hit for rel, tree in _modules() for hit in layering_violations(rel, tree)]
    assert found == [], "imports against the layering of docs/design.md:\n" + "\n".join(found)


def test_the_layering_check_sees_violations():
    code = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "from keras_roll.compile.twin import linearize\n"        # down: fine
        "from keras_roll.roll.loss import roll_loss\n"           # a peer of floor 5
        "import keras_roll.plots\n"                               # up
        "from keras_roll import options\n"                        # down: fine
        "from keras_roll.attribution.saliency import saliency\n"  # its own unit: fine
        "if TYPE_CHECKING:\n"
        "    from keras_roll.plots import canvas\n"               # an annotation: fine
    )
    hits = layering_violations("keras_roll/attribution/m.py", code)
    assert len(hits) == 2 and "roll (floor 5)" in hits[0] and "plots" in hits[1], hits
    models = layering_violations("keras_roll/models/m.py",
                                 ast.parse("from keras_roll.options import RunOptions\n"))
    assert len(models) == 1 and "independent" in models[0]
    assert "no floor" in layering_violations("keras_roll/newjob/m.py", ast.parse(""))[0]
