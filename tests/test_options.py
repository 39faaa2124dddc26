"""Run options and their validators: `Rigor`, `RunOptions`, one validator per argument."""

import dataclasses
import math

import numpy as np
import pytest

import keras_roll
from keras_roll.options import (
    Method,
    Rigor,
    RunOptions,
    check_batch_size,
    check_memory_budget,
    check_verbose,
    fixed_budget,
    parse_norm,
    parse_norms,
    progress_bar,
)


@pytest.mark.parametrize("text, member", [("float64", Rigor.FLOAT64), ("strict", Rigor.STRICT),
                                          ("float32", Rigor.FLOAT32)])
def test_rigor_parses_its_strings_and_itself(text, member):
    assert Rigor.parse(text) is member
    assert Rigor.parse(member) is member
    assert member == text and str(member) == text and f"{member}" == text


@pytest.mark.parametrize("bad", ["Float64", "float16", "exact", None, 64, ""])
def test_rigor_refuses_anything_else_and_lists_the_choices(bad):
    with pytest.raises(ValueError, match="rigor=.*'float64'.*'strict'.*'float32'"):
        Rigor.parse(bad)


def test_rigor_says_which_twin_it_runs():
    assert Rigor.FLOAT64.guarded and Rigor.STRICT.guarded and not Rigor.FLOAT32.guarded
    assert Rigor.STRICT.twin_dtype("float32") == "float64"
    assert Rigor.FLOAT32.twin_dtype("float32") == "float32"
    assert Rigor.FLOAT32.twin_dtype("float64") == "float64"


def test_run_options_defaults_and_normalised_fields():
    opts = RunOptions()
    assert (opts.batch_size, opts.memory_budget, opts.verbose, opts.rigor) == \
        (None, None, "auto", Rigor.FLOAT64)
    opts = RunOptions(batch_size=np.int64(8), memory_budget=2.0**20, rigor="strict")
    assert type(opts.batch_size) is int and opts.batch_size == 8
    assert type(opts.memory_budget) is int and opts.memory_budget == 2**20
    assert opts.rigor is Rigor.STRICT
    assert RunOptions(memory_budget="auto").memory_budget == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.rigor = Rigor.FLOAT32


@pytest.mark.parametrize("field, bad, match", [
    ("batch_size", 0, "batch_size must be a positive integer"),
    ("batch_size", 2.5, "batch_size must be a positive integer"),
    ("batch_size", True, "batch_size must be a positive integer"),
    ("memory_budget", 0.5, "memory_budget must be a number of bytes >= 1"),
    ("memory_budget", "big", "memory_budget must be a number of bytes >= 1"),
    ("memory_budget", math.inf, "memory_budget must be a number of bytes >= 1"),
    ("memory_budget", False, "memory_budget must be a number of bytes >= 1"),
    ("verbose", "yes", "verbose must be 'auto', True or False"),
    ("verbose", 3, "verbose must be 'auto', True or False"),
    ("rigor", "exact", "Unknown rigor='exact'"),
])
def test_run_options_validate_every_field_on_construction(field, bad, match):
    with pytest.raises(ValueError, match=match):
        RunOptions(**{field: bad})
    with pytest.raises(ValueError, match=match):  # and when a field is overridden
        RunOptions.of(RunOptions(), **{field: bad})


def test_run_options_of_merges_keywords_over_options():
    base = RunOptions(batch_size=4, verbose=False)
    assert RunOptions.of(base) is base
    merged = RunOptions.of(base, rigor="float32")
    assert (merged.batch_size, merged.verbose, merged.rigor) == (4, False, Rigor.FLOAT32)
    assert RunOptions.of(None, batch_size=2) == RunOptions(batch_size=2)
    with pytest.raises(TypeError, match=r"\['batch'\].*batch_size.*memory_budget"):
        RunOptions.of(None, batch=3)
    with pytest.raises(TypeError, match="options must be a keras_roll.RunOptions"):
        RunOptions.of({"batch_size": 3})


def test_budgets_resolve_to_bytes():
    assert RunOptions().budget(1000) == 1000
    assert RunOptions(memory_budget="auto").budget(1000) == 1000
    assert RunOptions(memory_budget=77).budget(1000) == 77
    assert fixed_budget(None) is None and fixed_budget("auto") is None
    assert fixed_budget(12.0) == 12
    with pytest.raises(ValueError, match="memory_budget must be a number of bytes >= 1, got"):
        check_memory_budget(None, allow_default=False)


def test_linearize_takes_the_same_budgets():
    import keras
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="relu")])
    assert keras_roll.linearize(model, memory_budget="auto").memory_budget == \
        keras_roll.linearize(model).memory_budget
    assert keras_roll.linearize(model, memory_budget=2**20).memory_budget == 2**20
    with pytest.raises(ValueError, match="memory_budget must be"):
        keras_roll.linearize(model, memory_budget=0)


def test_single_validators():
    assert check_batch_size(None) is None and check_batch_size(3) == 3
    for ok in ("auto", True, False, 0, 1, 2):
        assert check_verbose(ok) == ok
    assert parse_norm("l2") == 2 and parse_norm(np.inf) == math.inf and parse_norm(1.0) == 1
    assert parse_norms((2.0, "inf", 2)) == (2, math.inf) and parse_norms(None) == ()
    with pytest.raises(ValueError, match="Unsupported norm 3"):
        parse_norm(3)


def test_one_progress_bar_for_every_verbosity(capsys):
    with progress_bar(3, False, "quiet") as bar:
        assert bar.disable
        bar.update(3)
    assert capsys.readouterr().err == ""
    with progress_bar(3, True, "shown", unit="grad") as bar:
        assert not bar.disable
        bar.update(3)
    err = capsys.readouterr().err
    assert "shown" in err and "3/3" in err and "grad" in err
    with RunOptions(verbose=False).progress(5, "quiet") as bar:
        assert bar.disable


def test_public_names():
    assert keras_roll.Rigor is Rigor and keras_roll.RunOptions is RunOptions


@pytest.fixture(scope="module")
def small_mlp():
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                              keras.layers.Dense(3)])
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    return model, x


def test_the_family_takes_options_or_keywords(small_mlp):
    model, x = small_mlp
    opts = RunOptions(batch_size=2, rigor="float32", verbose=False)
    by_options = keras_roll.certify(model, x, options=opts)
    by_keywords = keras_roll.certify(model, x, batch_size=2, rigor="float32", verbose=False)
    assert by_options.rigor is Rigor.FLOAT32 and by_options.method is Method.ANALYTIC
    for p in by_options.norms:
        np.testing.assert_array_equal(by_options.margins[p], by_keywords.margins[p])
    # A keyword replaces the field of the options.
    assert keras_roll.certify(model, x, options=opts, rigor="strict").rigor is Rigor.STRICT
    np.testing.assert_array_equal(keras_roll.lp_margins(model, x, 2, options=opts),
                                  by_options.margins[2])
    sb = keras_roll.stability_bounds(model, x, options=opts)
    assert sb.rigor is Rigor.FLOAT32 and sb.lower.shape == x.shape
    assert keras_roll.count_regions(model, x, options=opts).n == 5
    radius = keras_roll.stable_radius(model, x, norms=(2,), options=opts)
    np.testing.assert_array_equal(radius[2], by_options.margins[2])
    sal = keras_roll.saliency(model, x, options=opts, radius=True)
    np.testing.assert_array_equal(sal.radius[2], by_options.margins[2])


@pytest.mark.parametrize("fn", ["certify", "stability_bounds", "count_regions", "lp_margins",
                                "saliency", "integrated_gradients", "gradient_distortion",
                                "smoothgrad"])
def test_unknown_keywords_name_the_options(small_mlp, fn):
    model, x = small_mlp
    with pytest.raises(TypeError, match=r"\['batchsize'\].*batch_size"):
        getattr(keras_roll, fn)(model, x, batchsize=3)


def test_method_parses_its_strings():
    assert Method.parse("bisect") is Method.BISECT and Method.parse(Method.ANALYTIC) is \
        Method.ANALYTIC
    with pytest.raises(ValueError, match="Unknown method 'exact'.*'analytic'.*'bisect'"):
        Method.parse("exact")


def test_certificates_of_different_runs_do_not_concatenate(small_mlp):
    model, x = small_mlp
    a = keras_roll.certify(model, x[:2], verbose=False)
    b = keras_roll.certify(model, x[2:], verbose=False, rigor="float32")
    with pytest.raises(ValueError, match="cannot be concatenated"):
        keras_roll.Certificate.concat([a, b])
    with pytest.raises(ValueError, match="at least one"):
        keras_roll.Certificate.concat([])
    joined = keras_roll.Certificate.concat([a, keras_roll.certify(model, x[2:], verbose=False)])
    np.testing.assert_array_equal(joined.margins[2],
                                  keras_roll.certify(model, x, verbose=False).margins[2])
