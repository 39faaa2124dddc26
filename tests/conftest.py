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

`--cpu-durations=N` reports the CPU time and the wall time of every file, and the
N tests that used the most CPU time (their setup, call and teardown together; 0: all),
then the tests whose test thread sat blocked longest (see below).

Wall-clock durations depend on whatever else runs on the machine; the CPU time
(all the threads of the test process, and the subprocesses it waited for) does
much less, so it is the figure to compare when the machine is shared. It works
under pytest-xdist too (each report carries its CPU time to the controller). A
test whose wall time is far above its CPU time waits, either for a core (the other
worker, other jobs) or blocked: on a subprocess, on threads it started (tf.data's,
a thread pool's), on a lock or a disk. Linux's scheduler statistics tell the two
apart: "blocked" is the test thread's wall time neither running nor waiting for a
core (`/proc/self/task/<id>/schedstat`; 0 where that file is missing).

    python -m pytest -q -m "not slow" -n 2 --dist loadfile --cpu-durations=30

**The longest files run first.** pytest-xdist (`make test`, `--dist loadfile
--no-loadscope-reorder`) hands whole files to its workers in collection order; a
long file handed out last would run alone at the end. `LONGEST_FIRST` (the files
with the most CPU time, subprocesses included, longest first) are collected before
the others. Without `--no-loadscope-reorder`, pytest-xdist would instead hand out
the files with the most tests first, whatever their length. The list holds every file
of about 0.5 % of the suite's CPU time or more (1 CPU s of the 181 of the last profile):
a simulation of pytest-xdist's hand-out on measured per-test times (about 500 CPU s a
worker, on a slower machine) left the two workers 11 s apart with the 32 longest files
listed, under 1 s apart with every file of 2 s (0.4 %) or more.
"""

from __future__ import annotations

import os
import resource
import threading
import time

import pytest

# Before numpy loads (in this process, pytest-xdist's workers and the tests' children,
# which inherit the environment): one OpenBLAS thread. OpenBLAS otherwise starts one
# per core, and its threads spin while they wait for work: on the small float64
# matrices of the tests' numpy references, with every core running a test already,
# that doubled their CPU time (the brute force of test_robust_exact: 2.2-2.8 CPU s
# with a thread per core, 0.5 s with one). A value set by the caller stays.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

_START = pytest.StashKey[tuple]()
_TIMES: dict[str, list[float]] = {}  # nodeid: [CPU seconds, wall seconds, blocked seconds]

LONGEST_FIRST = ("test_roll.py", "test_roll_exact.py", "test_models.py", "test_robust.py",
                 "test_attacks.py", "test_certified_training.py", "test_branch_and_bound.py",
                 "test_errors.py", "test_bounds.py", "test_rule_conformance.py",
                 "test_robust_guard.py", "test_robust_search.py", "test_fast_paths.py",
                 "test_robust_exact.py", "test_distribute.py", "test_examples.py",
                 "test_alpha_crown.py", "test_caltech256_example.py", "test_chunked_passes.py",
                 "test_scornn.py", "test_twin.py", "test_distortion.py", "test_soundness.py",
                 "test_regularizers.py", "test_margins.py", "test_roll_wrt.py", "test_caches.py",
                 "test_plots.py", "test_distribute_eval.py", "test_attacks_polish.py",
                 "test_intermediate_bounds.py", "test_trace_counts.py", "test_attack_budget.py",
                 "test_architecture.py", "test_options.py", "test_caltech256.py",
                 "test_attack_starts.py", "test_docstrings.py", "test_attribution.py",
                 "test_conv_windows.py", "test_attack_scouts.py", "test_mmr_chunked.py",
                 "test_windows_residual.py", "test_chunked_jacobian.py",
                 "test_crown_stable_units.py", "test_branch_layer_bounds.py",
                 "test_float32_tangents.py", "test_ties.py", "test_attribution_inputs.py",
                 "test_readme.py", "test_faithfulness.py")


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests that used the most CPU time (0: all).")


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


def _cpu() -> float:
    """CPU seconds of this process (all its threads) and of its finished subprocesses."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _scheduled() -> float:
    """Seconds the calling thread has run or waited for a core (0 off Linux)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            ran, waited = f.read().split()[:2]
    except OSError:
        return 0.0
    return (int(ran) + int(waited)) * 1e-9


def _marks() -> tuple:
    return _cpu(), _scheduled(), time.perf_counter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach each phase's CPU and blocked time to its report (pytest-xdist sends them to
    the controller)."""
    outcome = yield
    start = item.stash.get(_START, None)
    if start is not None:  # the report shares the item's list: name the phase
        cpu, scheduled, wall = (b - a for a, b in zip(start, _marks()))
        blocked = max(0.0, wall - scheduled) if scheduled else 0.0
        outcome.get_result().user_properties.extend(
            [(f"cpu_s_{call.when}", cpu), (f"blocked_s_{call.when}", blocked)])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_START] = _marks()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    item.stash[_START] = _marks()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    item.stash[_START] = _marks()
    yield


def pytest_runtest_logreport(report):
    """Sum each test's CPU and wall time over its phases (here or in the xdist controller)."""
    times = _TIMES.setdefault(report.nodeid, [0.0, 0.0, 0.0])
    times[0] += sum(v for k, v in report.user_properties if k == f"cpu_s_{report.when}")
    times[1] += report.duration
    times[2] += sum(v for k, v in report.user_properties if k == f"blocked_s_{report.when}")


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if n is None or not _TIMES:
        return
    cpu = {nodeid: t[0] for nodeid, t in _TIMES.items()}
    wall = {nodeid: t[1] for nodeid, t in _TIMES.items()}
    terminalreporter.section(f"CPU time: {sum(cpu.values()):.1f} s in {len(cpu)} tests "
                             f"(wall {sum(wall.values()):.1f} s)")
    per_file: dict[str, list[float]] = {}
    for nodeid in cpu:
        entry = per_file.setdefault(nodeid.split("::")[0], [0.0, 0.0])
        entry[0] += cpu[nodeid]
        entry[1] += wall[nodeid]
    terminalreporter.write_line("     cpu       wall")
    for path, (c, w) in sorted(per_file.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"{c:8.1f} s {w:8.1f} s  {path}")
    terminalreporter.write_line("")
    for nodeid in sorted(cpu, key=lambda k: -cpu[k])[: n or None]:
        terminalreporter.write_line(f"{cpu[nodeid]:8.2f} s {wall[nodeid]:8.2f} s  {nodeid}")
    blocked = {nodeid: t[2] for nodeid, t in _TIMES.items() if t[2] >= 1.0}
    terminalreporter.write_line(f"\nblocked 1 s or more (test thread neither running nor "
                                f"waiting for a core): {len(blocked)} tests")
    terminalreporter.write_line(" blocked        cpu       wall")
    for nodeid in sorted(blocked, key=lambda k: -blocked[k])[: n or None]:
        terminalreporter.write_line(f"{blocked[nodeid]:8.2f} s {cpu[nodeid]:8.2f} s "
                                    f"{wall[nodeid]:8.2f} s  {nodeid}")


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
