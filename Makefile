# keras_roll developer tasks.
#
#   make venv       create .venv (if missing) and install keras_roll[cpu,test] in editable mode
#   make test       the default test suite (skips tests marked `slow`; tf.functions run
#                   eagerly except in tests marked `graph`, see tests/conftest.py), on
#                   TEST_WORKERS processes (pytest-xdist, one test file per process at a time)
#   make test-all   the full test suite, every tf.function compiled as users run them
#   make lint       ruff
#   make demo       python -m examples.demo
#   make bench      benchmarks (certify throughput, ROLL step time, distortion search,
#                   ResNet-18 ROLL steps at 32x32; the full one: python -m benchmarks.resnet)
#   make clean      remove build outputs and caches (keeps .venv; `make distclean` drops it)
#
# Variables: PYTHON (interpreter used to create the venv), VENV, EXTRAS, PYTEST_ARGS,
# TEST_WORKERS (default 2, one per core of a 2-core machine; 0 runs the tests in this process).

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= cpu,test
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Keep TensorFlow's C++ logging quiet in tests, demos and benchmarks.
TF_CPP_MIN_LOG_LEVEL ?= 2
export TF_CPP_MIN_LOG_LEVEL

.DEFAULT_GOAL := test
.PHONY: venv test test-all lint demo bench clean distclean

venv: $(STAMP)

# Re-runs only when setup.py changes (or the stamp is missing).
$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	@# The editable install maps the top-level package only if keras_roll/__init__.py
	@# existed when it ran: leave the stamp unset until keras_roll imports from outside
	@# the checkout, so the next run installs again.
	@if (cd / && $(abspath $(PY)) -c 'import keras_roll') >/dev/null 2>&1; then \
		touch $@; \
	else \
		echo "note: keras_roll is not importable from outside the checkout yet;" \
			"'make venv' will reinstall on its next run"; \
	fi

# Test files are spread over TEST_WORKERS processes whole (--dist loadfile), so each
# module-scoped fixture is built once. One worker per core: more workers than cores
# only add switching (on 2 cores, 3 workers took 10 % longer than 2); each worker
# imports TensorFlow (about 1 GB), so raise it by hand on larger machines.
# --no-loadscope-reorder keeps tests/conftest.py's order (the longest files first):
# pytest-xdist otherwise hands out the files with the most tests first, which left
# long files of few tests to run alone at the end.
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder,)

# Every worker collects every test file: it imports TensorFlow (about 7 CPU s), rewrites
# the asserts of each test file and compiles keras_roll (about 7 CPU s more, on 2 cores
# under load). Python's bytecode caches (__pycache__, which pytest also keeps its
# rewritten files in) save the second part from the second run on: collection took 18.5
# CPU s a worker without them, 11 with them. So the tests write them even where
# PYTHONDONTWRITEBYTECODE is set (`make clean` removes them).
KEEP_PYC := PYTHONDONTWRITEBYTECODE=

test: venv
	$(KEEP_PYC) $(PY) -m pytest -q -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-all: venv
	$(KEEP_PYC) KERAS_ROLL_TEST_GRAPH=1 $(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check .

demo: venv
	$(PY) -m examples.demo

bench: venv
	$(PY) -m benchmarks.certify
	$(PY) -m benchmarks.step_time
	$(PY) -m benchmarks.distortion
	$(PY) -m benchmarks.resnet --quick

clean:
	rm -rf build dist .pytest_cache .ruff_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
