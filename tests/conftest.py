"""Suite-wide pytest settings: `--cpu-durations=N` reports the N tests that used the
most CPU time (their setup, call and teardown together).

Wall-clock durations (`--durations`) depend on whatever else runs on the machine;
the CPU time of the test process (all its threads) does much less, so it is the
figure to compare when the machine is shared. Run it without pytest-xdist's `-n`
(the workers' times do not reach the report).

    python -m pytest -q -m "not slow" --cpu-durations=30
"""

from __future__ import annotations

import time

import pytest

_CPU = pytest.StashKey[dict]()


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests that used the most CPU time (0: all).")


def pytest_configure(config):
    config.stash[_CPU] = {}


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
