"""Typed records through tf.nest / tf.function, and NeuronLayout against brute-force naming."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.compile.layout import NeuronLayout
from keras_roll.compile.records import Record
from keras_roll.compile.rules import ActivationRecord, MaxRecord
from tests import model_zoo as zoo


@dataclasses.dataclass(frozen=True, eq=False)
class Pair(Record):
    a: tf.Tensor
    b: tf.Tensor | None = None
    label: str = "pair"


def test_records_flatten_to_their_tensors_only():
    r = Pair(tf.ones(2), None, "x")
    assert len(tf.nest.flatten(r)) == 1
    full = Pair(tf.ones(2), tf.zeros(3))
    assert [t.shape for t in tf.nest.flatten([r, full])] == [(2,), (2,), (3,)]
    back = tf.nest.pack_sequence_as(full, [tf.fill([2], 5.0), tf.fill([3], 7.0)])
    assert isinstance(back, Pair) and back.label == "pair"
    np.testing.assert_array_equal(back.b.numpy(), [7.0, 7.0, 7.0])
    doubled = tf.nest.map_structure(lambda t: 2 * t, r)
    assert doubled.b is None and doubled.label == "x"
    np.testing.assert_array_equal(doubled.a.numpy(), [2.0, 2.0])


def test_records_pass_through_tf_function_both_ways():
    @tf.function(autograph=False)
    def f(rec):
        extra = 0.0 if rec.b is None else tf.reduce_sum(rec.b)
        return Pair(rec.a + extra, None, rec.label + "!")

    out = f(Pair(tf.ones(2), tf.ones(3)))
    assert isinstance(out, Pair) and out.b is None and out.label == "pair!"
    np.testing.assert_array_equal(out.a.numpy(), [4.0, 4.0])
    assert f(Pair(tf.ones(2))).label == "pair!"


def test_record_dicts_name_their_data():
    z = tf.constant([[1.0, -1.0]])
    assert set(ActivationRecord(z, tf.cast(z > 0, tf.float32)).as_dict()) == {"z", "slope"}
    one_hot = tf.constant([[[0.0], [1.0]]])  # [B, w=2, C=1]: element 1 wins
    rec = MaxRecord(one_hot, one_hot, one_hot == 0, tf.constant([[1.0]]))
    assert rec.as_dict()["argmax"].numpy().tolist() == [[1]]


def _brute_names(units):
    names = []
    for name, shape in units:
        for idx in np.ndindex(*shape):
            names.append((name, idx[0] if len(idx) == 1 else tuple(int(i) for i in idx)))
    return names


def test_layout_names_rows_and_lookup_match_enumeration():
    units = [("relu", (3,)), ("pool", (2, 2, 4, 3)), ("scalar", ()), ("dense", (5,))]
    layout = NeuronLayout.from_units((7, 7, 3), units, tangent_size=99)
    brute = _brute_names(units)
    assert layout.names == brute and layout.num_neurons == len(brute) == 3 + 48 + 1 + 5
    for row in range(len(brute)):
        assert layout.name(row) == brute[row]
    assert layout.rows("dense").tolist() == [52, 53, 54, 55, 56]
    assert list(layout) == [("relu", 0, (3,)), ("pool", 3, (2, 2, 4, 3)),
                            ("scalar", 51, ()), ("dense", 52, (5,))]
    assert layout.tangent_bytes(4) == (99 + 57) * 4 and layout.input_size == 147
    with pytest.raises(IndexError, match="57 is out of range"):
        layout.name(57)
    with pytest.raises(KeyError, match="'nope'"):
        layout.rows("nope")


def test_twin_layout_agrees_with_its_forward_pass():
    x = np.random.default_rng(0).uniform(0, 4, size=(2, 8, 8, 2)).astype("float32")
    lin = keras_roll.linearize(zoo.cnn())
    layout = lin.layout(x.shape[1:])
    fwd = lin.forward(x)
    assert layout.num_neurons == fwd.neurons.z.shape[1]
    assert layout.tangent_size == int(fwd.tangent_size)
    assert [u.name for u in layout.units] == list(lin.units(fwd))
    assert lin.layout((8, 8, 2)) is layout  # one probe per input shape
