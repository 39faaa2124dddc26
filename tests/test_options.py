"""Run options and their validators: `Rigor`, `RunOptions`, one validator per argument."""

import dataclasses
import io
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


class _Stream(io.StringIO):
    """A stream that says whether it is a terminal."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def _redraws(monkeypatch, tty: bool, steps: int = 100, dt: float = 0.05) -> list[str]:
    """The lines a bar writes for `steps` updates `dt` seconds apart (a fake clock)."""
    import tqdm.std

    clock = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    stream = _Stream(tty)
    with progress_bar(steps, True, "work", file=stream) as bar:
        for _ in range(steps):
            clock[0] += dt
            bar.update(1)
    return [line for line in stream.getvalue().replace("\n", "\r").split("\r") if line]


def test_progress_bar_redraws_once_a_second_when_not_on_a_terminal(monkeypatch):
    """100 updates over 5 s: a file gets at most one line a second (plus the first and
    the last), a terminal up to ten; every line ends with the same steady ETA."""
    to_file = _redraws(monkeypatch, tty=False)
    assert len(to_file) <= 5 + 2, to_file
    assert "100/100" in to_file[-1]
    to_terminal = _redraws(monkeypatch, tty=True)
    assert len(to_terminal) >= 4 * len(to_file) - 8, (len(to_terminal), len(to_file))
    etas = [line.split("ETA ")[1].split(",")[0] for line in to_file[1:-1] if "ETA " in line]
    rates = {line.rsplit(", ", 1)[1] for line in to_file[1:] if "ETA " in line}
    assert len(rates) == 1, rates                          # 20 ex/s from start to end
    assert etas == sorted(etas, reverse=True), etas


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
    with pytest.raises(ValueError, match="Unknown method='exact'.*'analytic'.*'bisect'"):
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


# --------------------------------------------------------------------------- options, once

@pytest.fixture(scope="module")
def planar():
    """A small 2-D-input classifier (region_map needs a 2-D input) and 6 points."""
    import keras
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(5, activation="relu"),
                              keras.layers.Dense(3)])
    x = np.random.default_rng(1).normal(size=(6, 2)).astype("float32")
    return model, x


def _calls(model, x):
    """Every public function, called with `**kw` (the arguments it needs besides)."""
    attr = np.ones_like(x)
    return {
        "certify": lambda **kw: keras_roll.certify(model, x, **kw),
        "lp_margins": lambda **kw: keras_roll.lp_margins(model, x, **kw),
        "l2_margins": lambda **kw: keras_roll.l2_margins(model, x, **kw),
        "stability_bounds": lambda **kw: keras_roll.stability_bounds(model, x, **kw),
        "count_regions": lambda **kw: keras_roll.count_regions(model, x, **kw),
        "region_map": lambda **kw: keras_roll.region_map(model, resolution=4, **kw),
        "saliency": lambda **kw: keras_roll.saliency(model, x, **kw),
        "stable_radius": lambda **kw: keras_roll.stable_radius(model, x, **kw),
        "smoothgrad": lambda **kw: keras_roll.smoothgrad(model, x, samples=2, seed=0, **kw),
        "integrated_gradients": lambda **kw: keras_roll.integrated_gradients(model, x, **kw),
        "faithfulness": lambda **kw: keras_roll.faithfulness(model, x, None, attr, samples=4,
                                                             seed=0, **kw),
        "gradient_distortion": lambda **kw: keras_roll.gradient_distortion(
            model, x, samples=4, seed=0, domain=None, **kw),
        "robust_radius": lambda **kw: keras_roll.robust_radius(model, x, norms=(2,),
                                                               method="region", **kw),
    }


UNUSED = [  # (function, an option it does not read)
    ("lp_margins", "verbose"), ("l2_margins", "verbose"),
    ("region_map", "rigor"), ("region_map", "memory_budget"), ("region_map", "verbose"),
    ("saliency", "rigor"), ("saliency", "batch_size"), ("saliency", "verbose"),
    ("smoothgrad", "rigor"), ("smoothgrad", "batch_size"),
    ("integrated_gradients", "rigor"), ("integrated_gradients", "batch_size"),
    ("faithfulness", "rigor"), ("faithfulness", "batch_size"),
    ("gradient_distortion", "rigor"), ("gradient_distortion", "batch_size"),
]
VALUES = {"rigor": "strict", "batch_size": 2, "verbose": False, "memory_budget": 2**20}


@pytest.mark.parametrize("fn, field", UNUSED)
def test_an_option_a_function_does_not_read_is_a_type_error_naming_it(planar, fn, field):
    model, x = planar
    with pytest.raises(TypeError, match=rf"{fn}\(\) does not use the run option\(s\) "
                                        rf"\['{field}'\]"):
        _calls(model, x)[fn](**{field: VALUES[field]})


def test_the_radius_is_what_reads_the_certificate_options(planar):
    model, x = planar
    with pytest.raises(TypeError, match="pass radius=True"):
        keras_roll.saliency(model, x, rigor="float32")
    sal = keras_roll.saliency(model, x, radius=True, rigor="float32", batch_size=2,
                              verbose=False)
    want = keras_roll.certify(model, x, norms=(2, np.inf), rigor="float32", verbose=False)
    np.testing.assert_array_equal(sal.radius[np.inf], want.margins[np.inf])
    # A shared RunOptions may carry fields a function does not read.
    opts = RunOptions(rigor="strict", batch_size=2, verbose=False)
    keras_roll.integrated_gradients(model, x, steps=2, options=opts)
    keras_roll.lp_margins(model, x, options=opts)


@pytest.mark.parametrize("fn, field", [("roll_loss", "lam"), ("roll_loss", "on_eval"),
                                       ("neuron_grad_sq", "lam"), ("memory_plan", "on_eval")])
def test_roll_loss_refuses_the_fields_of_wrap(planar, fn, field):
    from keras_roll.roll import loss
    model, x = planar
    value = {"lam": 1.0, "on_eval": True}[field]
    with pytest.raises(TypeError, match=rf"{fn}\(\) does not use \['{field}'\].*wrap"):
        getattr(loss, fn)(model, x, **{field: value})
    # In a RollConfig they are fine: one config serves wrap and roll_loss.
    config = keras_roll.RollConfig(**{field: value})
    np.testing.assert_allclose(keras_roll.roll_loss(model, x, config).numpy(),
                               keras_roll.roll_loss(model, x).numpy(), rtol=1e-6)


def test_none_means_the_default_everywhere(planar):
    model, x = planar
    assert RunOptions(rigor=None, verbose=None, batch_size=None, memory_budget=None) == \
        RunOptions()
    assert RunOptions.of(RunOptions(rigor="strict"), rigor=None).rigor is Rigor.FLOAT64
    default = keras_roll.certify(model, x, verbose=False)
    cert = keras_roll.certify(model, x, rigor=None, method=None, verbose=None)
    assert cert.rigor is Rigor.FLOAT64 and cert.method is Method.ANALYTIC
    np.testing.assert_array_equal(cert.margins[2], default.margins[2])
    ig = keras_roll.integrated_gradients(model, x, steps=3, rule=None, verbose=False)
    assert ig.rule == "right" and ig.method == "riemann"
    d = keras_roll.gradient_distortion(model, x, samples=4, seed=0, domain=None, mode=None,
                                       verbose=False)
    assert d.mode == "expected"
    f = keras_roll.faithfulness(model, x, None, np.ones_like(x), samples=4, seed=0,
                                score=None, verbose=False)
    assert f.score_kind == "model"
    config = keras_roll.RollConfig(lam=None, C=None, gamma=None, estimator=None,
                                   share_axes=None, fewest_directions=None)
    assert config == keras_roll.RollConfig()


@pytest.mark.slow  # "best" traces the attack's compiled loop (5 s on this tiny model)
def test_none_means_the_default_for_robust_radius(planar):
    model, x = planar
    # one point: the options resolve the same for any batch
    rr = keras_roll.robust_radius(model, x[:1], norms=(2,), method=None, rigor=None,
                                  verbose=False)
    assert rr.rigor is Rigor.FLOAT64 and rr.method == "best"


def test_robust_radius_takes_its_options_one_way(planar):
    import inspect
    params = inspect.signature(keras_roll.robust_radius).parameters
    assert not {"rigor", "batch_size", "memory_budget", "verbose"} & set(params)
    model, x = planar
    by_keywords = keras_roll.robust_radius(model, x, norms=(2,), method="region",
                                           rigor="float32", batch_size=4, verbose=False)
    by_options = keras_roll.robust_radius(model, x, norms=(2,), method="region",
                                          options=RunOptions(rigor="float32", batch_size=4,
                                                             verbose=False))
    assert by_keywords.rigor is Rigor.FLOAT32 and by_options.rigor is Rigor.FLOAT32
    np.testing.assert_array_equal(by_keywords.lower[2], by_options.lower[2])
    with pytest.raises(TypeError, match=r"\['rigour'\]"):
        keras_roll.robust_radius(model, x, rigour="strict")


def _enum_cases():
    from keras_roll.attribution import PathMethod, RiemannRule, Score
    from keras_roll.attribution.distortion import DistortionMode
    from keras_roll.robust import RobustMethod
    from keras_roll.roll.config import EstimatorKind, Strata
    return [
        (RobustMethod, "walk", RobustMethod.WALK),
        (DistortionMode, "max", DistortionMode.MAX),
        (RiemannRule, "midpoint", RiemannRule.MIDPOINT),
        (PathMethod, "exact", PathMethod.EXACT),
        (Score, "logit", Score.LOGIT),
        (EstimatorKind, "rademacher", EstimatorKind.RADEMACHER),
        (Strata, "channel", Strata.CHANNEL),
        (Method, "bisect", Method.BISECT),
        (Rigor, "strict", Rigor.STRICT),
    ]


def test_modes_are_enums_that_parse_their_strings():
    for cls, text, member in _enum_cases():
        assert cls.parse(text) is member and cls.parse(member) is member
        assert member == text and str(member) == text
        assert isinstance(member, keras_roll.options.Choice)
        with pytest.raises(ValueError) as info:
            cls.parse(text.upper())
        for choice in cls:  # the message lists every valid string
            assert repr(choice.value) in str(info.value)
        assert repr(text.upper()) in str(info.value)


@pytest.mark.parametrize("fn, kw, valid", [
    ("robust_radius", {"method": "closest"}, "'best', 'region', 'walk', 'relaxation', "
                                             "'interval'"),
    ("gradient_distortion", {"mode": "mean"}, "'expected', 'max'"),
    ("integrated_gradients", {"steps": 4, "rule": "simpson"},
     "'right', 'left', 'midpoint', 'trapezoid'"),
    ("faithfulness", {"score": "probability"}, "'model', 'logit'"),
    ("certify", {"method": "exact"}, "'analytic'.*'bisect'"),
])
def test_public_functions_reject_bad_mode_strings_with_the_valid_ones(planar, fn, kw, valid):
    model, x = planar
    kw = dict(kw)
    if fn == "robust_radius":  # the fixture's call fixes method="region"
        call = lambda **k: keras_roll.robust_radius(model, x, **k)  # noqa: E731
    else:
        call = _calls(model, x)[fn]
    bad = next(v for k, v in kw.items() if k != "steps")
    with pytest.raises(ValueError, match=rf"{bad!r}.*{valid}"):
        call(**kw)


def test_strings_and_enums_give_the_same_results(planar):
    from keras_roll.attribution.distortion import DistortionMode
    from keras_roll.robust import RobustMethod
    model, x = planar
    a = keras_roll.robust_radius(model, x, norms=(2,), method="region", verbose=False)
    b = keras_roll.robust_radius(model, x, norms=(2,), method=RobustMethod.REGION,
                                 verbose=False)
    assert a.method is RobustMethod.REGION and b.method is RobustMethod.REGION
    np.testing.assert_array_equal(a.lower[2], b.lower[2])
    d = keras_roll.gradient_distortion(model, x, samples=4, seed=0, domain=None,
                                       mode=DistortionMode.EXPECTED, verbose=False)
    e = keras_roll.gradient_distortion(model, x, samples=4, seed=0, domain=None,
                                       mode="expected", verbose=False)
    assert d.mode is DistortionMode.EXPECTED
    np.testing.assert_array_equal(d.distortion, e.distortion)
    config = keras_roll.RollConfig(samples=1, estimator="gaussian", seed=0)
    assert config.estimator is keras_roll.roll.config.EstimatorKind.GAUSSIAN
    np.testing.assert_array_equal(
        keras_roll.roll_loss(model, x, config).numpy(),
        keras_roll.roll_loss(model, x, samples=1, seed=0,
                             estimator=keras_roll.roll.config.EstimatorKind.GAUSSIAN).numpy())
    with pytest.raises(ValueError, match="Unknown estimator='normal'.*'axes', 'gaussian', "
                                         "'rademacher'"):
        keras_roll.RollConfig(estimator="normal")
    with pytest.raises(ValueError, match="Unknown strata='pixel'.*None.*'channel'"):
        keras_roll.RollConfig(samples=1, strata="pixel")


def test_roll_config_is_exported_and_saved_as_plain_strings(planar):
    from keras_roll.roll import config as config_module
    assert keras_roll.RollConfig is config_module.RollConfig
    model, _ = planar
    layer = keras_roll.RollRegularizer(model, samples=1, estimator="rademacher",
                                       strata=None)
    saved = layer.get_config()
    assert type(saved["estimator"]) is str and saved["estimator"] == "rademacher"


def test_the_roll_entry_is_resolved_once_per_call(planar, monkeypatch):
    """roll_loss and RollRegularizer compute where the tangents enter once: the loss,
    the estimators and the regularizer read it from the `RollPlan`."""
    from keras_roll.roll import entry
    model, x = planar
    calls = []
    real = entry.tangent_entry
    monkeypatch.setattr(entry, "tangent_entry",
                        lambda program, wrt: calls.append(wrt) or real(program, wrt))
    keras_roll.roll_loss(model, x, samples=1, seed=0)
    assert calls == [None]
    layer = keras_roll.RollRegularizer(model, samples=1, seed=0)
    assert len(calls) == 2 and layer.roll_plan.entry == 0
    layer(x, training=True)
    assert len(calls) == 2  # the call reads the plan


# --------------------------------------------------------------------------- results, once

def _summaries(model, x):
    y = np.zeros(len(x), np.int64)
    return {
        "Certificate": keras_roll.certify(model, x, verbose=False),
        "StabilityBounds": keras_roll.stability_bounds(model, x, verbose=False),
        "RegionCount": keras_roll.count_regions(model, x, verbose=False),
        "RobustRadius": keras_roll.robust_radius(model, x, y, norms=(2,), method="region",
                                                 verbose=False),
        "Distortion": keras_roll.gradient_distortion(model, x, samples=4, seed=0,
                                                     domain=None, verbose=False),
        "Faithfulness": keras_roll.faithfulness(model, x, None, np.ones_like(x), samples=4,
                                                seed=0, verbose=False),
    }


def test_summary_returns_the_table_and_shows_it_once(planar, capsys):
    from keras_roll.certification.tables import Summary
    model, x = planar
    for name, result in _summaries(model, x).items():
        capsys.readouterr()
        summary = result.summary()
        assert capsys.readouterr().out == "", f"{name}.summary() printed"
        assert isinstance(summary, Summary), name
        text = str(summary)
        assert text and text == summary.as_text() == repr(summary), name
        assert text.splitlines()[0] == summary.lines[0].splitlines()[0]
        print(summary)
        assert capsys.readouterr().out == text + "\n", name  # once, not "None" after it
        html = summary._repr_html_()
        assert html.startswith("<pre>") and html.endswith("</pre>")
        lines = []
        again = result.summary(print_fn=lines.append)  # a logger gets the text, once
        assert lines == [text] and str(again) == text


def test_summary_tables_hold_the_numbers(planar):
    model, x = planar
    cert = keras_roll.certify(model, x, verbose=False)
    row = next(line for line in str(cert.summary()).splitlines() if line.startswith("l2 ball"))
    assert f"{np.percentile(cert.margins[2], 50):.4g}" in row


def test_twin_summary_is_a_summary_that_prints_nothing_itself(planar, capsys):
    from keras_roll.certification.tables import Summary as Reexported
    from keras_roll.summary import Summary
    model, _ = planar
    lin = keras_roll.linearize(model)
    capsys.readouterr()
    summary = lin.summary()
    assert capsys.readouterr().out == "", "lin.summary() printed"
    assert isinstance(summary, Summary) and Reexported is Summary
    text = str(summary)
    assert text == repr(summary) == summary.as_text()
    rows = text.splitlines()
    assert rows[0].startswith(f"Linearized '{model.name}'")
    # one row per layer call, named as the model names its layers, in order
    assert [r.split()[0] for r in rows[1:]] == [layer.name for layer in model.layers]
    print(lin.summary())
    assert capsys.readouterr().out == text + "\n"  # once, not "None" after it
    lines = []
    again = lin.summary(print_fn=lines.append)  # a logger gets the text, once
    assert lines == [text] and str(again) == text and capsys.readouterr().out == ""


def test_robust_radius_concat_equals_one_run_over_the_concatenated_inputs(planar):
    model, x = planar
    y = np.array([0, 1, 2, 0, 1, 2])
    kw = dict(norms=(2, np.inf), method="region", verbose=False)
    whole = keras_roll.robust_radius(model, x, y, **kw)
    joined = keras_roll.RobustRadius.concat([keras_roll.robust_radius(model, x[:2], y[:2], **kw),
                                             keras_roll.robust_radius(model, x[2:], y[2:], **kw)])
    assert joined.n == whole.n == 6 and joined.norms == whole.norms
    for p in whole.norms:
        for name in ("lower", "upper", "adversarial", "exact", "runner_up", "lower_method",
                     "upper_method"):
            np.testing.assert_array_equal(getattr(joined, name)[p], getattr(whole, name)[p],
                                          err_msg=f"{name}[{p}]")
    np.testing.assert_array_equal(joined.predicted, whole.predicted)
    np.testing.assert_array_equal(joined.labels, y)
    np.testing.assert_array_equal(joined.nonfinite, whole.nonfinite)
    assert (joined.method, joined.rigor) == (whole.method, whole.rigor)
    assert joined.certified_accuracy(0.0) == whole.certified_accuracy(0.0)

    other = keras_roll.robust_radius(model, x[:2], y[:2], norms=(2, np.inf), method="region",
                                     rigor="float32", verbose=False)
    with pytest.raises(ValueError, match="cannot be concatenated.*rigor='float32'"):
        keras_roll.RobustRadius.concat([whole, other])
    unlabelled = keras_roll.robust_radius(model, x[:2], **kw)
    with pytest.raises(ValueError, match="labels"):
        keras_roll.RobustRadius.concat([whole, unlabelled])
    with pytest.raises(ValueError, match="at least one"):
        keras_roll.RobustRadius.concat([])


def test_attribution_results_share_one_shape_and_hold_no_model(planar):
    import keras

    from keras_roll.attribution import Attribution
    model, x = planar
    results = [keras_roll.saliency(model, x),
               keras_roll.smoothgrad(model, x, samples=2, seed=0, verbose=False),
               keras_roll.integrated_gradients(model, x, verbose=False)]
    for res in results:
        assert isinstance(res, Attribution)
        assert res.maps.shape == x.shape and res.labels.shape == (len(x),)
        for value in vars(res).values():  # numpy and plain values only
            assert not isinstance(value, (keras.Model, keras_roll.Linearized)), type(res)
            assert not callable(value) or isinstance(value, np.ndarray), type(value)
    sal = results[0]
    with pytest.raises(ValueError, match="radius=True.*stable_radius"):
        sal.radius  # noqa: B018


def test_the_old_names_of_the_maps_warn(planar):
    model, x = planar
    ig = keras_roll.integrated_gradients(model, x, verbose=False)
    with pytest.warns(DeprecationWarning, match=r"IntegratedGradients.attributions.*\.maps"):
        old = ig.attributions
    assert old is ig.maps
    sg = keras_roll.smoothgrad(model, x, samples=2, seed=0, verbose=False)
    with pytest.warns(DeprecationWarning, match=r"SmoothGrad.smoothgrad.*\.maps"):
        old = sg.smoothgrad
    assert old is sg.maps
    with pytest.warns(DeprecationWarning, match="region_map.chunk=. is deprecated"):
        old_chunk = keras_roll.region_map(model, resolution=4, chunk=5)
    np.testing.assert_array_equal(old_chunk.ids,
                                  keras_roll.region_map(model, resolution=4, batch_size=5).ids)


# --------------------------------------------------------------------------- the output link

def _classifier(activation):
    import keras
    keras.utils.set_random_seed(2)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="relu"),
                             keras.layers.Dense(3, activation=activation)])


@pytest.mark.parametrize("activation", ["softmax", "sigmoid", None])
def test_output_link_is_a_link_equal_to_its_string(activation):
    from keras_roll.compile.rules import Link
    model = _classifier(activation)
    lin = keras_roll.linearize(model)
    if activation is None:
        assert lin.output_link is None
    else:
        assert isinstance(lin.output_link, Link) and lin.output_link == activation
        assert lin.output_link is Link.parse(activation) and str(lin.output_link) == activation
        assert f"output link {activation}" in str(lin.summary()).splitlines()[0]
    # the link re-applied to the twin's logits gives the Keras model's own output
    x = np.random.default_rng(2).normal(size=(5, 3)).astype("float32")
    out = lin.apply_output_link(lin.forward(x).logits).numpy()
    np.testing.assert_allclose(out, model(x).numpy(), rtol=1e-5, atol=1e-6)


def test_a_tape_engine_reports_its_link_as_a_link():
    import keras

    from keras_roll.attribution.tape_gradients import TapeGradients, gradient_engine
    from keras_roll.compile.rules import Link
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(3, activation="sigmoid")])
    engine = gradient_engine(model)
    assert isinstance(engine, TapeGradients) and engine.output_link is Link.SIGMOID


def test_a_registered_rule_names_its_link_by_string_or_member():
    import keras

    from keras_roll.compile.rules import Link, OutputLink

    class Squash(keras.layers.Layer):  # a softmax under another class: needs a rule
        def call(self, x):
            return keras.ops.softmax(x, axis=-1)

    layer = Squash()
    assert OutputLink(layer, "softmax").link is Link.SOFTMAX
    assert OutputLink(layer, Link.SIGMOID).link is Link.SIGMOID
    with pytest.raises(ValueError, match=r"link='tanh'.*'softmax', 'sigmoid'"):
        OutputLink(layer, "tanh")
    keras_roll.register_rule(Squash, lambda layer: OutputLink(layer, "softmax"))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), Squash()])
    lin = keras_roll.linearize(model)
    assert lin.output_link is Link.SOFTMAX
    x = np.random.default_rng(3).normal(size=(4, 3)).astype("float32")
    np.testing.assert_allclose(lin.apply_output_link(lin.forward(x).logits).numpy(),
                               model(x).numpy(), rtol=1e-5, atol=1e-6)
