"""The Bazel BUILD file stays accurate: every module and test file is declared."""

import ast
import pathlib

from tests import build_file

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rules():
    """(kind, kwargs) for every call in BUILD, read with the Python parser."""
    tree = ast.parse((ROOT / "BUILD").read_text())
    rules = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            call = node.value
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords
                      if isinstance(kw.value, (ast.Constant, ast.List))}
            rules.append((getattr(call.func, "id", None), kwargs))
    return rules


def test_every_module_has_a_py_library():
    declared = {src for kind, kw in _rules() if kind == "py_library" for src in kw.get("srcs", [])}
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "keras_roll").rglob("*.py")}
    assert modules - declared == set(), "modules missing from BUILD"
    assert declared - modules - _other_sources() == set(), "BUILD names files that do not exist"


def _other_sources():
    return {str(p.relative_to(ROOT)) for d in ("examples", "benchmarks", "tests")
            for p in (ROOT / d).rglob("*.py")}


def test_every_test_file_has_a_sized_py_test():
    tests = {kw["srcs"][0]: kw for kind, kw in _rules() if kind == "py_test"}
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
    assert files - set(tests) == set(), "test files missing from BUILD"
    assert set(tests) - files == set(), "BUILD names test files that do not exist"
    for src, kw in tests.items():
        assert kw.get("size") in {"small", "medium", "large", "enormous"}, src


def test_generated_libraries_match_the_imports():
    """The keras_roll libraries are the ones `tests/build_file.py` derives from the imports."""
    section = build_file.current_section((ROOT / "BUILD").read_text())
    assert section is not None, "BUILD lost its generated section markers"
    assert section == build_file.libraries(), (
        "BUILD's keras_roll libraries are out of date: run `python -m tests.build_file --write`")
