"""The ```python examples in the docstrings of the public API run.

The public API is every object of `keras_roll.__all__`, the objects of the
submodules it names (`keras_roll.callbacks`, `models`, `plots`, ...) and their
classes' public methods and properties. Each example runs in a fresh namespace that
holds what an example may take as given:

* the names of the object's own module and of `keras_roll.__all__`, and `np`,
  `keras`, `tf`, `plt`, `keras_roll`;
* `model`: a small 8-6-3 ReLU classifier whose first layer is a
  `Rescaling(1 / 255, name="rescaling")`; `x`, `y` (and `x_val`, `x_test`, `xv`, ...
  the same): 4 inputs in [0, 1] and their labels; `xa`, `xb`: two halves of `x`;
* for the examples that continue another one (`cert.summary()` after `certify`),
  `SETUP` says what runs first.

The docstrings of the modules that hold the public API count too (`module
<name>[i]`). An example that cannot run on this fixture is listed in `NOT_RUN` with
the reason (a 2-D input for region maps, the torchvision weights file, a layer the
example leaves to the reader); one that fails as written is listed in `KNOWN_BROKEN`
and expected to fail until it is fixed; every other example runs, and
`test_every_docstring_example_is_run_or_listed` fails for a listed one that no
longer exists. The examples of
`SLOW` (certification, radii, attribution, training steps: half a second or more
each) run in the tests marked `slow`; the others in the default suite.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll

BLOCK = re.compile(r"```python\n(.*?)```", re.S)

# What runs before an example that continues another.
SETUP = {
    "Certificate.binding_direction[0]": "cert = keras_roll.certify(model, x, verbose=False)",
    "Certificate.boundary_point[0]": "cert = keras_roll.certify(model, x, verbose=False)",
    "RobustRadius.certified_accuracy[0]":
        'rr = keras_roll.robust_radius(model, x, y, method="region", verbose=False)',
    "Linearized.tangent_from_trace[0]":
        "lin = keras_roll.linearize(model)\nv = np.ones((4, 2, 8), 'float32')",
    "lp_margins[0]": "lin = keras_roll.linearize(model)",
    "MarginMonitor[0]": "wrapped = keras_roll.wrap(model, lam=1.0)\n"
                        "wrapped.compile('sgd', 'sparse_categorical_crossentropy')",
    "attribution.Faithfulness.summary[0]":
        "ig = keras_roll.integrated_gradients(model, x, y, verbose=False)",
    "attribution.faithfulness[0]": "sal = keras_roll.saliency(model, x, y)",
}

SETUP.update({
    "module keras_roll.callbacks[0]": "model.compile('sgd', 'sparse_categorical_crossentropy')",
    "module keras_roll.compile.units[0]": "margins = np.ones(4)",
    "module keras_roll.regularizers.ramps[0]":
        "wrapped = keras_roll.wrap(model, regularizer=keras_roll.IBPConfig(eps=0.0))\n"
        "wrapped.compile('adam', 'sparse_categorical_crossentropy')",
    "regularizers.evaluating[0]": "wrapped = keras_roll.wrap(model, lam=1.0)",
    "regularizers.labelled_step[0]":
        "wrapped = keras_roll.wrap(model, regularizer=keras_roll.MMRConfig(lam=1.0))\n"
        "model.loss = keras.losses.SparseCategoricalCrossentropy()",
})

# Examples that fail as written: the test expects them to fail (strict xfail), so a
# fix shows as an unexpected pass and the entry goes.
KNOWN_BROKEN: dict = {}

# Examples that do not run on the fixture, with the reason.
NOT_RUN = {
    "module keras_roll.certification.zero_radii[0]": "`cnn`: the reader's CNN with max pooling",
    "module keras_roll.compile.bounds.methods[0]":
        "a fragment of a bound pass: `rows`, `arithmetic` of the calling pass",
    "module keras_roll.plots[0]": "needs a model with a 2-D input (tests/test_plots.py)",
    "attribution.Score[0]": "a fragment: `maps` of an attribution of the reader's",
    "attribution.postprocess_saliency[0]": "a fragment: `grad` of the reader's image model",
    "attribution.integrated_gradients[0]": "plots maps of [B, H, W] images; the fixture is flat",
    "attribution.saliency[0]": "plots maps of images; the fixture's inputs are flat",
    "attribution.smoothgrad[0]": "plots maps of images; the fixture's inputs are flat",
    "stability_bounds[0]": "plots the bounds of an image; the fixture's inputs are flat",
    "plots.plot_stability_bounds[0]": "draws a [T, C] sequence; the fixture's inputs are flat",
    "plots.plot_attribution_grid[0]": "draws a grid of images; the fixture's inputs are flat",
    "plots.plot_faithfulness[0]": "`models`: a dict of the reader's trained models",
    "plots.plot_gradient_comparison[0]": "`m0`, `m1`: two of the reader's models",
    "plots.plot_margin_tradeoff[0]": "`certs`: the certificates of a sweep of models",
    "plots.plot_linear_regions[0]": "needs a model with a 2-D input (tests/test_plots.py)",
    "RegionMap[0]": "needs a model with a 2-D input (tests/test_region_map.py)",
    "region_map[0]": "needs a model with a 2-D input (tests/test_region_map.py)",
    "RollRegularizer.step_seed[0]": "`layer`: a RollRegularizer inside a training step",
    "RunOptions.of[0]": "an excerpt of a function that reads only `verbose` and `memory_budget`",
    "rules.Activation[0]": "a fragment of a rule's code: `layer` of the reader's",
    "rules.Linear[0]": "registers a rule for the reader's layer `MyScale` (guide, Custom rules)",
    "rules.Link[0]": "a fragment of a rule's code: `logits` of the reader's",
    "rules.MaxWindows[0]": "a fragment of a rule's code: `layer` of the reader's",
    "rules.OutputLink[0]": "a rule for the reader's layer `MySoftmax`",
    "rules.SimpleRNNOp[0]": "a rule for the reader's layer `MyRNN`",
    "testing.check_rule[0]": "checks the reader's layer `MyScale` (guide, Custom rules)",
    "models.fc[0]": "builds the paper's 784-input network; the fixture's inputs have 8 values",
    "models.load_torchvision_resnet18[0]": "needs the exported torchvision weights file",
    "models.resnet18[0]": "needs the exported torchvision weights file",
    "layers.ScoRNN[0]": "a sequence model; the fixture's inputs are flat",
}

# Examples of seconds each (certification, radii, attribution): the tests marked slow.
SLOW = {
    "Certificate[0]", "Certificate.summary[0]", "Distortion.summary[0]",
    "IntegratedGradients[0]", "Saliency[0]", "attribution.SmoothGrad[0]",
    "attribution.stable_radius[0]", "gradient_distortion[0]", "RollModel[0]",
    "RunOptions[0]", "RobustRadius[0]", "RobustRadius.summary[0]", "StabilityBounds[0]",
    "StabilityBounds.summary[0]", "certify[0]", "count_regions[0]", "robust_radius[0]",
    "RegionCount.summary[0]", "linearize[0]", "models.scornn_classifier[0]",
    "attribution.DistortionMode[0]", "attribution.Faithfulness.summary[0]",
    "attribution.faithfulness[0]",
    "Certificate.binding_direction[0]", "Certificate.boundary_point[0]",
    "RobustRadius.certified_accuracy[0]", "Certificate.concat[0]", "RobustRadius.concat[0]",
    "StabilityBounds.concat[0]", "MarginMonitor[0]", "lp_margins[0]",
    "module keras_roll.attribution[0]", "module keras_roll.attribution.faithfulness[0]",
    "module keras_roll.attribution.result[0]", "module keras_roll.attribution.smoothgrad[0]",
    "module keras_roll.certification.certificates[0]",
    "module keras_roll.certification.stability[0]", "module keras_roll.models[0]",
    "module keras_roll.options[0]", "module keras_roll.robust.api[0]",
    "module keras_roll.robust.result[0]", "module keras_roll.regularizers.ramps[0]", "wrap[0]",
    "module keras_roll.callbacks[0]",
    # half a second or more each (a fit, a bound pass, a distortion search)
    "module keras_roll.regularizers.wrap[0]", "Distortion.concat[0]",
    "module keras_roll.regularizers.certified[0]", "module keras_roll.regularizers.roll[0]",
    "testing.check_bounds[0]", "regularizers.regularizer_loss[0]", "l2_margins[0]",
}


class Example(NamedTuple):
    """One ```python block of a public object's docstring."""

    key: str  # "<qualified name>[<index>]"
    owner: object
    source: str


def _public_objects():
    """`(qualified name, object)` of the public API, each object once."""
    seen: set[int] = set()

    def visit(name, obj):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        yield name, obj
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if not attr.startswith("_"):
                    yield from visit(f"{name}.{attr}", value)

    for name in keras_roll.__all__:
        obj = getattr(keras_roll, name)
        if inspect.ismodule(obj):
            for sub in getattr(obj, "__all__", ()):
                yield from visit(f"{name}.{sub}", getattr(obj, sub))
        else:
            yield from visit(name, obj)


def _function(obj):
    if isinstance(obj, property):
        return obj.fget
    return getattr(obj, "__func__", obj)


def _public_modules() -> dict:
    """`{name: module}`: the submodules `keras_roll.__all__` names and the modules that
    define a public object (their docstrings show the module's use)."""
    modules = {}
    for name in keras_roll.__all__:
        obj = getattr(keras_roll, name)
        if inspect.ismodule(obj):
            modules[obj.__name__] = obj
    for _, obj in _public_objects():
        name = getattr(_function(obj), "__module__", None) or ""
        if name.startswith("keras_roll") and name in sys.modules:
            modules.setdefault(name, sys.modules[name])
    return dict(sorted(modules.items()))


def docstring_examples() -> list[Example]:
    """Every ```python block of the public API's docstrings (and of the docstrings of
    the modules that hold it, as `module <name>[i]`)."""
    examples = []
    for name, obj in _public_objects():
        f = _function(obj)
        if not (inspect.isfunction(f) or inspect.isclass(f)):
            continue
        doc = inspect.getdoc(f) or ""
        for i, source in enumerate(BLOCK.findall(doc)):
            examples.append(Example(f"{name}[{i}]", obj, source))
    for name, module in _public_modules().items():
        for i, source in enumerate(BLOCK.findall(inspect.getdoc(module) or "")):
            examples.append(Example(f"module {name}[{i}]", module, source))
    return examples


EXAMPLES = docstring_examples()


def namespace(example: Example) -> dict:
    """The fixture namespace of the module docstring."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)),
                              keras.layers.Rescaling(1 / 255, name="rescaling"),
                              keras.layers.Dense(6, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    rng = np.random.default_rng(0)
    x = rng.random((4, 8)).astype("float32")
    y = rng.integers(0, 3, 4)
    module = example.owner if inspect.ismodule(example.owner) else sys.modules.get(
        getattr(_function(example.owner), "__module__", "") or "")
    ns = dict(vars(module)) if module is not None else {}
    ns.update({name: getattr(keras_roll, name) for name in keras_roll.__all__})
    ns.update(np=np, keras=keras, tf=tf, plt=plt, keras_roll=keras_roll, model=model,
              x=x, y=y, x_val=x, y_val=y, x_test=x, y_test=y, x_train=x, y_train=y, xv=x,
              yv=y, xa=x[:2], xb=x[2:], ya=y[:2], yb=y[2:], x_batch=x,
              __name__="__docstring__")
    return ns


def run_example(example: Example, folder) -> None:
    """Runs the example in `folder` (what it writes lands there)."""
    import os

    ns = namespace(example)
    here = os.getcwd()
    os.chdir(folder)
    try:
        if example.key in SETUP:
            exec(compile(SETUP[example.key], "<setup>", "exec", dont_inherit=True), ns)
        # dont_inherit: the example compiles as pasted, without this file's future import
        exec(compile(example.source, f"<docstring of {example.key}>", "exec", dont_inherit=True),
             ns)
    except Exception as e:
        raise AssertionError(f"The docstring example of {example.key} fails: "
                             f"{type(e).__name__}: {e}\n{example.source}") from e
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")
        os.chdir(here)


def test_every_docstring_example_is_run_or_listed():
    keys = {e.key for e in EXAMPLES}
    assert len(keys) == len(EXAMPLES)
    assert len(EXAMPLES) > 50, "the extraction found too few examples"
    stale = sorted((set(NOT_RUN) | SLOW | set(SETUP) | set(KNOWN_BROKEN)) - keys)
    assert stale == [], f"listed examples that no longer exist: {stale}"
    assert not set(NOT_RUN) & SLOW and not set(KNOWN_BROKEN) & (set(NOT_RUN) | SLOW)
    assert all(reason.strip() for reason in NOT_RUN.values())


def _case(example: Example):
    if example.key in KNOWN_BROKEN:
        return pytest.param(example, marks=pytest.mark.xfail(
            reason=KNOWN_BROKEN[example.key], raises=AssertionError, strict=True))
    return example


@pytest.mark.parametrize("example", [_case(e) for e in EXAMPLES if e.key not in NOT_RUN
                                     and e.key not in SLOW], ids=lambda e: e.key)
def test_docstring_example_runs(example, tmp_path):
    run_example(example, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.key in SLOW],
                         ids=lambda e: e.key)
def test_slow_docstring_example_runs(example, tmp_path):
    run_example(example, tmp_path)


def test_a_failing_example_names_itself(tmp_path):
    example = Example("thing[0]", run_example, "undefined_name\n")
    with pytest.raises(AssertionError, match=r"example of thing\[0\] fails: NameError"):
        run_example(example, tmp_path)
