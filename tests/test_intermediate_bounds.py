"""`IntermediateBounds`: CROWN at every layer, intervals then CROWN at the output, or the
automatic choice; the cost estimate against the pull-backs that actually run, the
choice against the budget, and the bounds of each choice against each other and
against sampled points."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_roll.compile.bounds import (
    BoundMethod,
    IntermediateBounds,
    capture,
    choose_intermediate,
    crown_cost,
    lower_bounds,
)
from keras_roll.compile.bounds import crown as crown_module
from keras_roll.compile.structure import structure_of
from keras_roll.compile.twin import linearize
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
    big = choose_intermediate("auto", structure, values, 3, max_elements=crown.elements)
    assert big.bounds is IntermediateBounds.CROWN and big.method is BoundMethod.RELAXATION
    small = choose_intermediate(IntermediateBounds.AUTO, structure, values, 3,
                                max_elements=crown.elements - 1)
    assert small.bounds is IntermediateBounds.INTERVALS
    assert small.method is BoundMethod.CROWN_IBP
    assert "looser" in small.reason and "over the budget" in small.reason
    assert choose_intermediate("crown", structure, values, 3,
                               max_elements=1).bounds is IntermediateBounds.CROWN
    with pytest.raises(ValueError, match="'crown', 'intervals', 'auto'"):
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
