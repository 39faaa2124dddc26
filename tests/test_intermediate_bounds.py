"""`IntermediateBounds`: CROWN at every layer, intervals then CROWN at the output, or the
automatic choice; the cost estimate against the pull-backs that actually run, the
choice against the memory, work and time budgets, and the bounds of each choice against
each other and against sampled points, in `lower_bounds` and in `robust_radius` (where
the choice is recorded on the result)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile.bounds import (
    BoundMethod,
    IntermediateBounds,
    capture,
    choose_intermediate,
    crown_cost,
    lower_bounds,
)
from keras_roll.compile.bounds import crown as crown_module
from keras_roll.compile.bounds.intermediate import SURE_SECONDS_PER_ELEMENT, probe_seconds
from keras_roll.compile.structure import structure_of
from keras_roll.compile.twin import linearize
from keras_roll.robust import RobustRadius
from keras_roll.robust.bounds import arithmetic_of

L = keras.layers
EPS = 0.05


def _setup():
    keras.utils.set_random_seed(2)
    inp = keras.Input((6, 6, 1))
    h = L.Conv2D(3, 3, activation="relu")(inp)
    h = L.Flatten()(h)
    h = L.Dense(8, activation="relu")(h)
    model = keras.Model(inp, L.Dense(3)(h))
    twin = linearize(model).at_dtype("float64")
    x = np.random.default_rng(0).uniform(0, 1, (2, 6, 6, 1))
    return twin, structure_of(twin.program), capture(twin.interpreter, tf.constant(x)), x


@pytest.mark.parametrize("budget", [2**40, 20_000])
def test_cost_counts_the_pull_backs_that_run(monkeypatch, budget):
    """`crown_cost`'s pull-backs are the layer pull-backs CROWN runs (counted) plus the
    output's; CROWN-IBP runs one."""
    twin, structure, values, _ = _setup()
    calls = []
    real = crown_module.relaxed_lower_bounds
    monkeypatch.setattr(crown_module, "relaxed_lower_bounds",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    rows = tf.constant(np.eye(3)[None] - np.eye(3)[None, :1])
    lower_bounds(structure, values, rows, tf.fill([2], EPS), np.inf, BoundMethod.RELAXATION,
                 arithmetic_of(twin, guard=False), budget, 2)
    crown, ibp = crown_cost(structure, values, 3, budget, 2)
    assert crown.pullbacks == len(calls) + 1
    assert ibp.pullbacks == 1
    assert crown.elements > ibp.elements > 0
    assert crown.chunk_bytes <= max(budget, ibp.chunk_bytes)


def test_auto_takes_crown_within_the_budget_and_intervals_beyond():
    """AUTO resolves to CROWN when its work fits `max_elements` and to intervals (with a
    reason naming what it gave up) when it does not; explicit choices are kept."""
    _, structure, values, _ = _setup()
    crown, _ = crown_cost(structure, values, 3)
    big = choose_intermediate("auto", structure, values, 3, max_elements=crown.elements,
                              max_seconds=None)
    assert big.bounds is IntermediateBounds.CROWN and big.method is BoundMethod.RELAXATION
    small = choose_intermediate(IntermediateBounds.AUTO, structure, values, 3,
                                max_elements=crown.elements - 1, max_seconds=None)
    assert small.bounds is IntermediateBounds.INTERVALS
    assert small.method is BoundMethod.CROWN_IBP
    assert "looser" in small.reason and "over the budget" in small.reason and small.gave_up
    assert choose_intermediate("crown", structure, values, 3,
                               max_elements=1).bounds is IntermediateBounds.CROWN
    with pytest.raises(ValueError, match="intermediate must be one of 'crown'"):
        choose_intermediate("ibp", structure, values, 3)
    with pytest.raises(ValueError, match="resolved by choose_intermediate"):
        _ = IntermediateBounds.AUTO.method


def test_each_choice_bounds_the_sampled_outputs_and_crown_is_tighter():
    """The bounds of both resolved choices contain the output differences at 300 points
    sampled in the box; CROWN's are at least CROWN-IBP's."""
    twin, structure, values, x = _setup()
    eye = np.eye(3)[None]
    rows = tf.constant(np.concatenate([eye, -eye], 1))
    low = {}
    for bounds in (IntermediateBounds.CROWN, IntermediateBounds.INTERVALS):
        low[bounds] = lower_bounds(structure, values, rows, tf.fill([2], EPS), np.inf,
                                   bounds.method, arithmetic_of(twin, guard=False)).numpy()
    u = np.random.default_rng(1).uniform(-1, 1, (300, *x.shape))
    d = (twin.primal((x[None] + EPS * u).reshape(-1, *x.shape[1:])).logits.numpy()
         .reshape(300, 2, 3) - twin.primal(x).logits.numpy()[None])
    for got in low.values():
        assert np.all(d >= got[None, :, :3] - 1e-12)
        assert np.all(d <= -got[None, :, 3:] + 1e-12)
    assert np.all(low[IntermediateBounds.CROWN] >= low[IntermediateBounds.INTERVALS] - 1e-12)


def test_auto_weighs_memory_and_time():
    """Memory: CROWN's smallest chunk over the budget gives intervals. Time: within the
    pessimistic rate no probe runs; beyond it the probe's (or the given) rate decides."""
    _, structure, values, _ = _setup()
    crown, _ = crown_cost(structure, values, 3, examples=2)
    tight = choose_intermediate("auto", structure, values, 3, budget=crown.chunk_bytes // 50,
                                examples=2)
    assert tight.bounds is IntermediateBounds.INTERVALS and "memory budget" in tight.reason

    def no_probe():
        raise AssertionError("probed although the pessimistic rate fits")

    work = crown.elements / 2
    sure = choose_intermediate("auto", structure, values, 3, examples=2,
                               max_seconds=work * SURE_SECONDS_PER_ELEMENT,
                               seconds_per_element=no_probe)
    assert sure.bounds is IntermediateBounds.CROWN
    rate = SURE_SECONDS_PER_ELEMENT / 10
    fits = choose_intermediate("auto", structure, values, 3, examples=2,
                               max_seconds=work * rate * 2, seconds_per_element=lambda: rate)
    assert fits.bounds is IntermediateBounds.CROWN and fits.seconds == pytest.approx(work * rate)
    over = choose_intermediate("auto", structure, values, 3, examples=2,
                               max_seconds=work * rate * 0.99, seconds_per_element=rate)
    assert over.bounds is IntermediateBounds.INTERVALS and "time budget" in over.reason
    rate = probe_seconds(structure, values, examples=2, repeats=1)
    assert 0 < rate < 1e-3


def _mlp():
    keras.utils.set_random_seed(4)
    inp = keras.Input((12,))
    h = L.Dense(16, activation="relu")(inp)
    h = L.Dense(16, activation="relu")(h)
    model = keras.Model(inp, L.Dense(4)(h))
    x = np.random.default_rng(3).uniform(0, 1, (6, 12)).astype(np.float32)
    return model, x


@pytest.fixture(scope="module")
def radii():
    model, x = _mlp()
    out = {}
    for choice in ("crown", "intervals"):
        out[choice] = keras_roll.robust_radius(model, x, norms=(np.inf,), method="relaxation",
                                               intermediate=choice, verbose=False)
    return model, x, out


def test_robust_radius_each_choice_is_sound_and_intervals_are_looser(radii):
    """Both choices: 400 points sampled in each certified l_inf ball (corners and uniform)
    keep the float32 model's prediction; the intervals' radius is at most CROWN's (up to
    the search's tolerance); each result records its choice."""
    model, x, out = radii
    pred = np.argmax(np.asarray(model(x)), -1)
    rng = np.random.default_rng(0)
    for choice, rr in out.items():
        (recorded,) = rr.intermediate
        assert recorded.bounds is IntermediateBounds(choice) and not recorded.auto
        r = rr.lower[np.inf]
        assert np.all(r > 0)
        u = np.concatenate([rng.choice([-1.0, 1.0], (200, *x.shape)),
                            rng.uniform(-1, 1, (200, *x.shape))])
        pts = (x[None] + 0.999 * r[None, :, None] * u).astype(np.float32)
        got = np.argmax(np.asarray(model(pts.reshape(-1, x.shape[1]))), -1)
        assert np.all(got.reshape(400, -1) == pred[None])
    crown, ibp = out["crown"].lower[np.inf], out["intervals"].lower[np.inf]
    assert np.all(ibp <= crown * (1 + 2e-3))
    assert np.mean(ibp < crown) > 0.5


def test_robust_radius_auto_records_its_choice_and_survives_concat(radii):
    """AUTO takes CROWN on the small MLP (the same radii as asked for); with a time budget
    no pass fits it takes intervals, warns what it gave up and says so in the summary;
    `concat` keeps both choices, once each."""
    model, x, out = radii
    auto = keras_roll.robust_radius(model, x[:3], norms=(np.inf,), method="relaxation",
                                    verbose=False)
    (choice,) = auto.intermediate
    assert choice.bounds is IntermediateBounds.CROWN and choice.auto and not choice.gave_up
    np.testing.assert_allclose(auto.lower[np.inf], out["crown"].lower[np.inf][:3])
    with pytest.warns(UserWarning, match="Given up: CROWN's tighter layer bounds"):
        cheap = keras_roll.robust_radius(model, x[3:], norms=(np.inf,), method="relaxation",
                                         pass_seconds=1e-12, verbose=False)
    (choice,) = cheap.intermediate
    assert choice.gave_up and "time budget" in choice.reason
    np.testing.assert_allclose(cheap.lower[np.inf], out["intervals"].lower[np.inf][3:])
    both = RobustRadius.concat([auto, cheap, auto])
    assert [c.bounds for c in both.intermediate] == [IntermediateBounds.CROWN,
                                                     IntermediateBounds.INTERVALS]
    assert both.n == 9
    text = str(both.summary())
    assert "Intermediate bounds of the relaxation: CROWN at every layer" in text
    assert "Pass intermediate='crown'" in text
    region = keras_roll.robust_radius(model, x[:2], norms=(np.inf,), method="region",
                                      verbose=False)
    assert region.intermediate == ()
    with pytest.raises(ValueError, match="intermediate must be one of"):
        keras_roll.robust_radius(model, x[:1], intermediate="ibp")
