"""Suite-wide pytest settings.

**Functions run eagerly unless a test is marked `graph`.** keras_roll compiles its
passes with `tf.function`; on the tiny models of the suite, tracing a function costs
several times more than running it (a float64 certificate of a small CNN: about 9 s
traced, under 2 s eagerly), so the default suite runs `tf.function`s eagerly
(`tf.config.run_functions_eagerly`): the same Python code and arithmetic, without
the graphs. Tests whose subject is the compiled graph (retracing, input signatures,
loops planned in the graph, training steps) or that run faster compiled carry
`@pytest.mark.graph` (or a module-level `pytestmark`); tests marked `slow` run
compiled too, and `KERAS_ROLL_TEST_GRAPH=1` (`make test-all`) compiles every
function, as users run them.

`--cpu-durations=N` reports the N tests that used the most CPU time (their setup,
call and teardown together).

Wall-clock durations (`--durations`) depend on whatever else runs on the machine;
the CPU time of the test process (all its threads) does much less, so it is the
figure to compare when the machine is shared. Run it without pytest-xdist's `-n`
(the workers' times do not reach the report).

    python -m pytest -q -m "not slow" --cpu-durations=30

**The longest files run first.** pytest-xdist (`make test`, `--dist loadfile`) hands
whole files to its workers in collection order; a long file handed out last would
run alone at the end. `LONGEST_FIRST` (the files with the most CPU time, longest
first) are collected before the others, in alphabetical order.
"""

from __future__ import annotations

import os
import time

import pytest

_CPU = pytest.StashKey[dict]()

LONGEST_FIRST = ("test_readme.py", "test_roll.py", "test_roll_exact.py", "test_errors.py",
                 "test_certified_training.py", "test_rule_conformance.py", "test_options.py",
                 "test_robust.py", "test_models.py", "test_scornn.py", "test_bounds.py",
                 "test_twin.py", "test_fast_paths.py", "test_soundness.py", "test_distribute.py",
                 "test_margins.py", "test_examples.py", "test_caltech256_example.py",
                 "test_robust_exact.py", "test_distortion.py")


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests that used the most CPU time (0: all).")


def pytest_configure(config):
    config.stash[_CPU] = {}


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps the rest


def _compiled(node) -> bool:
    """Whether `node` (a module or a test) runs its tf.functions as graphs."""
    return os.environ.get("KERAS_ROLL_TEST_GRAPH", "0") not in ("", "0") or any(
        node.get_closest_marker(m) is not None for m in ("graph", "slow"))


@pytest.fixture(scope="module", autouse=True)
def _module_function_mode(request):
    """The mode of a module's own fixtures (set up before any test's fixtures)."""
    import tensorflow as tf  # here, not at the top: pytest-xdist's controller never needs it

    tf.config.run_functions_eagerly(not _compiled(request.node))
    yield
    tf.config.run_functions_eagerly(False)


@pytest.fixture(autouse=True)
def _function_mode(request):
    import tensorflow as tf

    previous = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(not _compiled(request.node))
    yield
    tf.config.run_functions_eagerly(previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.process_time()
    yield
    item.config.stash[_CPU][item.nodeid] = time.process_time() - start


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    times = config.stash[_CPU]
    if n is None or not times:
        return
    ranked = sorted(times.items(), key=lambda kv: -kv[1])
    total = sum(times.values())
    terminalreporter.section(f"CPU time: {total:.1f} s in {len(times)} tests")
    per_file: dict[str, float] = {}
    for nodeid, seconds in times.items():
        per_file[nodeid.split("::")[0]] = per_file.get(nodeid.split("::")[0], 0.0) + seconds
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
    terminalreporter.write_line("")
    for nodeid, seconds in ranked[: n or None]:
        terminalreporter.write_line(f"{seconds:8.2f} s  {nodeid}")


@pytest.fixture
def auto_probes(monkeypatch):
    """`memory_budget="auto"` candidates of a few KB, so that a tiny model has several
    plans to time; returns `watch(module)`, which counts the probes that module's
    `choose_budget` runs (the list of their sorted candidate budgets)."""
    from keras_roll.compile import chunking

    monkeypatch.setattr(chunking, "AUTO_BUDGETS", (2**12, 2**14, 2**16))
    monkeypatch.setattr(chunking, "AUTO_CAP", 2**20)

    def watch(module):
        calls = []
        choose = module.choose_budget

        def counting(plans, seconds, **kwargs):
            calls.append(sorted(plans))
            return choose(plans, seconds, **kwargs)

        monkeypatch.setattr(module, "choose_budget", counting)
        return calls

    return watch
