"""The job packages meet only through one another's public names, checked with `ast`.

`certification`, `robust`, `attribution`, `roll` and `regularizers` are the jobs of
keras_roll (docs/design.md, "Module map"). A job that uses another imports the names
that package's `__init__.py` lists in `__all__`:

    from keras_roll.certification import certify                  # fine
    from keras_roll.certification.margin_math import dual_norm    # not from another job

so a package can reorganise its modules without breaking its peers. Shared helpers
(lp geometry, tables) live in the low units every job may import (`keras_roll.geometry`,
`keras_roll.summary`). A job package that does not exist (yet) is skipped as an
importer and reported when another job imports it.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "keras_roll"
JOBS = ("certification", "robust", "attribution", "roll", "regularizers")


def public_names(job: str, package: pathlib.Path = PACKAGE) -> set[str] | None:
    """The names in `keras_roll/<job>/__init__.py`'s `__all__` (else its top-level
    names without a leading underscore); None where the package does not exist."""
    init = package / job / "__init__.py"
    if not init.exists():
        return None
    tree = ast.parse(init.read_text(), str(init))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def _absolute(module: str | None, level: int, rel: str) -> str:
    """The dotted name of an import, relative imports resolved against the file `rel`."""
    if level == 0:
        return module or ""
    parts = list(pathlib.PurePosixPath(rel).with_suffix("").parts)
    base = parts[:len(parts) - level]
    return ".".join(base + ([module] if module else []))


def _job_of(dotted: str) -> tuple[str | None, str]:
    """`(job, rest)` of `keras_roll.<job>.<rest>` (job None for other modules)."""
    parts = dotted.split(".")
    if len(parts) >= 2 and parts[0] == "keras_roll" and parts[1] in JOBS:
        return parts[1], ".".join(parts[2:])
    return None, ""


def cross_job_imports(rel: str, tree: ast.AST, publics=public_names) -> list[str]:
    """`file:line what` for every import by the job module `rel` of another job's
    modules, or of a name that job does not make public."""
    own = pathlib.PurePosixPath(rel).parts[1]
    found = []
    aliases = {}  # local names bound to another job's package
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _absolute(node.module, node.level, rel)
            job, rest = _job_of(target)
            if target == "keras_roll":  # from keras_roll import certification
                for a in node.names:
                    if a.name in JOBS and a.name != own:
                        aliases[a.asname or a.name] = a.name
                continue
            if job is None or job == own:
                continue
            if rest:
                found.append(f"{rel}:{node.lineno} from {target} import "
                             f"{', '.join(a.name for a in node.names)}: import them from "
                             f"keras_roll.{job}")
                continue
            names = publics(job)
            if names is None:
                found.append(f"{rel}:{node.lineno} imports keras_roll.{job}, which does not "
                             f"exist")
                continue
            found += [f"{rel}:{node.lineno} from keras_roll.{job} import {a.name}: not in "
                      f"keras_roll.{job}.__all__" for a in node.names if a.name not in names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                job, rest = _job_of(a.name)
                if job is not None and job != own and rest:
                    found.append(f"{rel}:{node.lineno} import {a.name}: import the names of "
                                 f"keras_roll.{job} instead")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in aliases:
            job = aliases[node.value.id]
            names = publics(job)
            if names is not None and node.attr not in names:
                found.append(f"{rel}:{node.lineno} {node.value.id}.{node.attr}: not in "
                             f"keras_roll.{job}.__all__")
    return found


def _job_modules():
    for job in JOBS:
        folder = PACKAGE / job
        if not folder.is_dir():
            continue  # a job package that does not exist yet
        for path in sorted(folder.rglob("*.py")):
            yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))


def test_jobs_import_one_another_only_through_public_names():
    found = [hit for rel, tree in _job_modules() for hit in cross_job_imports(rel, tree)]
    assert found == [], ("job packages reaching into one another's modules "
                         "(tests/test_package_imports.py):\n" + "\n".join(found))


def test_the_import_check_sees_violations():
    code = ast.parse(
        "from keras_roll.certification import certify\n"                 # public: fine
        "from keras_roll.certification.margin_math import dual_norm\n"   # a module: no
        "from keras_roll.certification import margins_from_norms\n"      # not public: no
        "import keras_roll.certification.bisection\n"                    # a module: no
        "from keras_roll import certification\n"
        "certification.certify(m, x)\n"                                  # public: fine
        "certification.neuron_arrays(f)\n"                               # not public: no
        "from keras_roll.robust.region import decision_terms\n"          # its own job: fine
        "from keras_roll.geometry import dual_norm\n"                    # a low unit: fine
        "from keras_roll.regularizers import register_regularizer\n"     # missing: no
        "from ..certification.margins import certify\n"                  # relative: no
    )

    def publics(job):
        return {"certification": {"certify"}}.get(job)

    hits = cross_job_imports("keras_roll/robust/m.py", code, publics)
    assert len(hits) == 6, hits
    assert "margin_math" in hits[0] and "margins_from_norms" in hits[1]
    assert "does not exist" in " ".join(hits)
    assert any("neuron_arrays" in h for h in hits)
    assert any("keras_roll.certification.margins" in h for h in hits)


def test_public_names_reads_all_and_missing_packages(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "__init__.py").write_text(
        "from keras_roll.job.a import f, _g\n__all__ = ['f']\n")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "__init__.py").write_text("from keras_roll.bare.a import f, _g\n")
    assert public_names("job", tmp_path) == {"f"}
    assert public_names("bare", tmp_path) == {"f"}
    assert public_names("none", tmp_path) is None
