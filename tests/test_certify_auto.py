"""`memory_budget="auto"` for certificates: the chunk size picked by a timed probe.

References: a certificate under every candidate budget equals the certificate
under one fixed budget (the chunking must not change it); the probe runs once per
model and shape, and only on a stream long enough to time, so that a first small
call does not fix the budget of the larger calls after it; the default
certificate times only the candidates that cut the batch into the fewest slices.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_roll
from keras_roll.certification import guarded_norms as gnorms
from keras_roll.compile import autotune, chunking
from keras_roll.rounding.tangent_error import SLICE_EXAMPLES

NORMS = (2, np.inf)


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((24,))
    h = keras.layers.Dense(16, activation="relu")(inp)
    h = keras.layers.Dense(16, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(3)(h))


@pytest.fixture
def probes(auto_probes, monkeypatch):
    """Small candidates (`auto_probes`), a low chunk threshold and the float32 pass on
    24 axes; returns the candidate lists of the probes run."""
    monkeypatch.setattr(autotune, "MIN_CHUNKS", 8)
    monkeypatch.setattr(gnorms, "MIN_AXES", 0)
    return auto_probes(autotune)


@pytest.mark.parametrize("rigor", ["float32", "float64"])
def test_a_short_first_call_leaves_the_choice_to_a_longer_one(probes, rigor):
    model = _mlp()
    lin = keras_roll.linearize(model)
    x = np.random.default_rng(0).uniform(-1, 1, (40, 24)).astype("float32")
    fixed = keras_roll.certify(keras_roll.linearize(model, memory_budget=2**30), x,
                               norms=NORMS, rigor=rigor, verbose=0)
    keras_roll.certify(lin, x[:1], norms=NORMS, rigor=rigor, verbose=0)
    assert probes == []  # one example, a few chunks: nothing timed
    assert not chunking._CHOICES.get(model)  # and nothing remembered
    got = keras_roll.certify(lin, x, norms=NORMS, rigor=rigor, verbose=0)
    assert len(probes) == 1 and probes[0]
    assert set(chunking._CHOICES[model].values()) <= set(probes[0])
    if rigor == "float64":  # only the candidates that cut x into the fewest slices
        layout = lin.layout(x.shape[1:])
        plans = chunking.auto_candidates(lambda b: chunking.plan_chunks(
            len(x), layout.input_size, layout.tangent_bytes(4), b, max_examples=SLICE_EXAMPLES))
        slices = {b: p.example_chunks for b, p in plans.items()}
        assert {slices[b] for b in probes[0]} == {min(slices.values())}
        assert len(set(slices.values())) > 1  # the narrowing had something to drop
    keras_roll.certify(lin, x, norms=NORMS, rigor=rigor, verbose=0)
    assert len(probes) == 1  # remembered for the model and shape
    for p in NORMS:
        np.testing.assert_array_equal(got.binding_index[p], fixed.binding_index[p])
        np.testing.assert_allclose(got.margins[p], fixed.margins[p], rtol=1e-12, atol=0)
