"""README.md and the guide's main examples run as written, and quietly.

Every ```python block of README.md runs, in order and in one namespace, exactly as
pasted: its first block loads MNIST with `keras_roll.data.mnist_splits()`, which
reads the Keras cache, and the test puts a small MNIST-layout `mnist.npz` there
(`$KERAS_HOME/datasets/mnist.npz`, as `keras.datasets.mnist.load_data()` would):
random 0..255 images, 4 of them left for training after the 5,000 validation ones,
and 3 test images.

From docs/guide.md the blocks of `GUIDE_SECTIONS` run the same way (the guide's
model is the README's), after a preamble that defines the data the guide leaves to
the reader: `x`, `y`, `x_train`, `y_train`, `x_val`, `y_val` as a few `[B, 784]`
images in raw 0..255 pixels. The guide's other blocks are fragments or need what a test
cannot have; `GUIDE_SKIPPED` names them with the reason and the test file that
covers them instead.

The default suite runs the slow calls with smaller budgets (`SHORTER`: fewer
epochs, a smaller genetic search, the robustness radius's region method, fewer
SmoothGrad samples); each substitution must match the text exactly once, so a change
of the snippet is noticed, and the tests marked `slow` run every block verbatim.

No documented call may print TensorFlow's "triggered tf.function retracing"
warning: the README's certificate and `fit` with `MarginMonitor`, and integrated
gradients of smooth (tanh) models, run compiled, as users run them, with
TensorFlow's log captured (the slow test runs the whole README compiled).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import re
from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll

ROOT = pathlib.Path(__file__).resolve().parents[1]

PREAMBLE = """
import numpy as np
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (6, 784)).astype("float32")          # raw 0..255 pixels
y = rng.integers(0, 10, 6)
x_train = rng.integers(0, 256, (16, 784)).astype("float32")
y_train = rng.integers(0, 10, 16)
x_val, y_val = x[:4], y[:4]
x_test, y_test = x, y
v = rng.normal(size=(2, 784)).astype("float32")               # directions for lin.jvp
"""

# Guide blocks that need more than the preamble: what they use, defined beforehand.
GUIDE_SETUP = {
    ("Training with ROLL", 2): """
import tensorflow as tf
train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(8)
""",
    ("Custom rules", 0): """
class MyScale(keras.layers.Layer):
    def __init__(self, factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor
""",
}

GUIDE_SECTIONS = ("Certificates", "Inputs and return types", "Training with ROLL",
                  "Units and `wrt=`", "Other regularizers", "Evaluation", "Robustness radius",
                  "Custom rules")

GUIDE_SKIPPED = {
    ("Certificates", 1): "zero radii of a trained CNN with max pooling (tests/test_zero_radii.py)",
    ("Distribution", 0): "needs a multi-worker cluster (tests/test_multiworker.py)",
    ("Distribution", 1): "needs several devices (tests/test_distribute_eval.py, two logical "
                         "CPUs)",
    ("Distribution", 2): "a recipe for several workers (tests/test_distribute_eval.py, "
                         "test_recipe_*)",
    ("Models", 0): "builds the paper's 299 x 299 ResNet-18 (tests/test_models.py)",
    ("Data", 0): "needs the Caltech-256 files (tests/test_caltech256.py)",
}

# (document, text, the same with a smaller budget) for the default suite.
SHORTER = (
    ("README.md", 'mode="max", seed=0)', 'mode="max", seed=0, population=24, generations=2)'),
    ("README.md", "epochs=10", "epochs=1"),
    ("README.md", "validation_data=(x_val, y_val)", "validation_data=(x_val[:4], y_val[:4])"),
    ("README.md", "MarginMonitor(x_val)", "MarginMonitor(x_val[:4])"),
    ("README.md", 'norms=(2, np.inf), wrt="rescale")',
     'norms=(2, np.inf), wrt="rescale", method="region")'),
    ("README.md", "samples=50, seed=0)", "samples=4, seed=0)"),
    ("docs/guide.md", 'mode="max", seed=0)', 'mode="max", seed=0, population=24, generations=2)'),
    ("docs/guide.md", "epochs=10", "epochs=2"),
    ("docs/guide.md", "norms=(2, np.inf))", 'norms=(2, np.inf), method="region")'),
    ("docs/guide.md", "ibp.fit(x, y, epochs=20", "ibp.fit(x, y, epochs=2"),
    ("docs/guide.md", "crown.fit(x, y, epochs=20", "crown.fit(x, y, epochs=2"),
)


class Block(NamedTuple):
    """A ```python block of a Markdown file."""

    section: str  # its `## ` heading
    index: int  # its place among the section's blocks
    line: int  # the line of its first statement
    source: str


def python_blocks(path: pathlib.Path) -> list[Block]:
    """Every ```python block of a Markdown file, with its `## ` section."""
    blocks, section, counts = [], "", {}
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        if lines[i].strip() == "```python":
            start = i + 1
            i = start
            while lines[i].strip() != "```":
                i += 1
            index = counts.get(section, 0)
            counts[section] = index + 1
            blocks.append(Block(section, index, start + 1, "\n".join(lines[start:i]) + "\n"))
        i += 1
    return blocks


def shortened(document: str, blocks: list[Block]) -> list[Block]:
    """The blocks with `SHORTER`'s substitutions for `document`, each found exactly once."""
    blocks = list(blocks)
    for doc, text, short in SHORTER:
        if doc != document:
            continue
        hits = [k for k, b in enumerate(blocks) if text in b.source]
        assert len(hits) == 1 and blocks[hits[0]].source.count(text) == 1, (
            f"{document}: {text!r} should occur once in the blocks that run; update SHORTER")
        b = blocks[hits[0]]
        blocks[hits[0]] = b._replace(source=b.source.replace(text, short))
    return blocks


def run_blocks(document: str, blocks: list[Block], setup: dict | None = None,
               namespace: dict | None = None, preamble: str = PREAMBLE) -> dict:
    """Runs the blocks in order in one namespace (`namespace`, filled) after
    `preamble`; a failure names the block's line in `document`."""
    namespace = {} if namespace is None else namespace
    namespace["__name__"] = "__readme__"
    exec(compile(preamble, "<preamble>", "exec"), namespace)
    for b in blocks:
        if setup and (b.section, b.index) in setup:
            exec(compile(setup[(b.section, b.index)], "<setup>", "exec"), namespace)
        # blank lines keep the traceback's line numbers those of the document
        # dont_inherit: the block runs as pasted into a script, without this file's
        # `from __future__ import annotations` (a dataclass block needs its own module)
        code = compile("\n" * (b.line - 1) + b.source, str(ROOT / document), "exec",
                       dont_inherit=True)
        try:
            exec(code, namespace)
        except Exception as e:
            raise AssertionError(f"{document}, the block at line {b.line} ({b.section}) "
                                 f"fails as written: {type(e).__name__}: {e}") from e
    return namespace


@contextlib.contextmanager
def tensorflow_log():
    """The messages TensorFlow logs (`tf.get_logger()`) inside the block."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(logging.DEBUG)
    logger = tf.get_logger()
    level = logger.level  # another test (or an example) may have quietened it
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def readme_blocks() -> list[Block]:
    return python_blocks(ROOT / "README.md")


README_TEST_IMAGES = 3  # `x_test[:10]` takes them all


@pytest.fixture
def mnist_in_keras_cache(tmp_path, monkeypatch):
    """A small MNIST-layout mnist.npz where `mnist_splits()` looks without a path:
    the Keras cache, `$KERAS_HOME/datasets/mnist.npz`."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "keras_home" / "datasets"
    folder.mkdir(parents=True)
    n_train = 5000 + 4  # the 5,000 validation images, and 4 to train on
    np.savez(folder / "mnist.npz",
             x_train=rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
             y_train=rng.integers(0, 10, n_train, dtype=np.uint8),
             x_test=rng.integers(0, 256, (README_TEST_IMAGES, 28, 28), dtype=np.uint8),
             y_test=rng.integers(0, 10, README_TEST_IMAGES, dtype=np.uint8))
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    return folder / "mnist.npz"


def run_readme(blocks: list[Block], namespace: dict | None = None) -> dict:
    """The README's blocks as pasted: no preamble (the first block loads the data)."""
    return run_blocks("README.md", blocks, namespace=namespace, preamble="")


def guide_blocks() -> list[Block]:
    blocks = python_blocks(ROOT / "docs" / "guide.md")
    return [b for b in blocks if b.section in GUIDE_SECTIONS
            and (b.section, b.index) not in GUIDE_SKIPPED]


def test_every_guide_block_is_run_or_skipped_for_a_reason():
    blocks = python_blocks(ROOT / "docs" / "guide.md")
    keys = {(b.section, b.index) for b in blocks}
    assert set(GUIDE_SKIPPED) <= keys, "GUIDE_SKIPPED names a block the guide no longer has"
    unaccounted = [(b.section, b.index, b.line) for b in blocks
                   if b.section not in GUIDE_SECTIONS and (b.section, b.index) not in GUIDE_SKIPPED]
    assert unaccounted == [], "guide blocks neither run nor skipped: add them to a list"


def test_the_readme_snippets_are_the_usage_section():
    blocks = readme_blocks()
    assert [b.section for b in blocks] == ["Usage"] * 5
    assert "mnist_splits(" in blocks[0].source.split("\n\n")[1].splitlines()[0]
    assert "keras_roll.certify(model, x)" in blocks[0].source
    assert "regularizer=keras_roll.IBPConfig(" in blocks[2].source
    assert "keras_roll.robust_radius(" in blocks[3].source


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) < 200


def test_readme_runs_as_written(mnist_in_keras_cache):
    ns = run_readme(shortened("README.md", readme_blocks()))
    # the snippets did what their comments say
    n = README_TEST_IMAGES
    assert ns["x_train"].shape == (4, 784) and ns["x_val"].shape == (5000, 784)
    assert float(ns["x"].max()) > 1.0                  # raw 0..255 pixels, as the model wants
    assert ns["cert"].margins[2].shape == (n,)
    assert ns["rr"].lower[2].shape == (n,)
    assert np.all(ns["rr"].lower[2] <= ns["rr"].upper[2])
    assert "ibp_loss" in ns["ibp"].history.history
    assert ns["res"].points.shape == (n, 784)
    assert np.all(ns["res"].points >= 0) and np.all(ns["res"].points <= 255)
    assert np.all(np.abs(ns["res"].points - ns["x"]) <= 8 * (1 + 1e-6))
    assert np.allclose(ns["ig"].delta, 0, atol=1e-3 * np.abs(ns["ig"].f_x).max())
    assert "margin_l2_p50" in ns["wrapped"].history.history


@pytest.mark.slow  # compiled fits; the default suite checks retracing in test_errors.py
@pytest.mark.graph
def test_documented_calls_print_no_retracing_warning(mnist_in_keras_cache):
    blocks = shortened("README.md", readme_blocks())[:2]  # certify, count_regions, fit
    with tensorflow_log() as messages:
        ns = run_readme(blocks)
        assert "margin_l2_p50" in ns["wrapped"].history.history
        x = np.random.default_rng(0).normal(size=(4, 12)).astype("float32")
        for seed in range(6):  # fresh models, as when comparing several
            keras.utils.set_random_seed(seed)
            smooth = keras.Sequential([keras.Input((12,)), keras.layers.Dense(8, activation="tanh"),
                                       keras.layers.Dense(3, activation="softmax")])
            ig = keras_roll.integrated_gradients(smooth, x, 0, steps=16, verbose=False)
            assert not ig.piecewise_linear
    retracing = [m for m in messages if "retracing" in m]
    assert retracing == [], retracing


@pytest.mark.slow  # about 25 s; the README's blocks run in the default suite
def test_guide_main_examples_run_as_written():
    ns: dict = {}
    try:
        run_blocks("docs/guide.md", shortened("docs/guide.md", guide_blocks()), GUIDE_SETUP, ns)
    finally:
        keras_roll.compile.rules.unregister_rule(ns.get("MyScale"))  # the guide registered it
    assert ns["rr"].lower[2].shape == (6,)
    assert ns["res"].domain == (0.0, 1.0)


def test_a_failing_block_names_its_line():
    block = Block("Usage", 0, 42, "undefined_name\n")
    with pytest.raises(AssertionError, match=r"README.md, the block at line 42 .*NameError"):
        run_blocks("README.md", [block])


def test_the_log_capture_sees_tensorflow_retracing_warnings():
    """The capture the README test relies on sees TensorFlow's own warning: a
    function made afresh in a loop, the case the warning is for."""
    was_eager = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(False)
    try:
        with tensorflow_log() as messages:
            for k in range(6):
                tf.function(lambda t: t * 2)(tf.zeros((k + 1,)))
    finally:
        tf.config.run_functions_eagerly(was_eager)
    assert any(re.search(r"triggered tf\.function retracing", m) for m in messages)


@pytest.mark.slow
def test_readme_runs_verbatim_and_quietly(mnist_in_keras_cache):
    with tensorflow_log() as messages:
        run_readme(readme_blocks())
    assert [m for m in messages if "retracing" in m] == []


@pytest.mark.slow
def test_guide_runs_verbatim():
    ns: dict = {}
    try:
        run_blocks("docs/guide.md", guide_blocks(), GUIDE_SETUP, ns)
    finally:
        keras_roll.compile.rules.unregister_rule(ns.get("MyScale"))
