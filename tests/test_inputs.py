"""The one input reader (`keras_roll.inputs`): every input kind gives the same
batches; labels, empty inputs and non-finite rows get the same errors from every
public function that reads inputs."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_roll
from keras_roll.inputs import (
    InputSpec,
    LabelSpec,
    check_labels,
    read_all,
    read_batches,
)

SPEC = InputSpec((3,), "float32", "tiny")
CLASSES = 10


def _data(n=7):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3) / 10.0
    y = np.arange(n) % CLASSES
    return x, y


class _Sequence(keras.utils.PyDataset):
    def __init__(self, x, y, size):
        super().__init__()
        self.x, self.y, self.size = x, y, size

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, i):
        sl = slice(i * self.size, (i + 1) * self.size)
        return self.x[sl], self.y[sl]


@pytest.fixture(scope="module")
def tiny():
    keras.utils.set_random_seed(0)
    inp = keras.Input((3,))
    h = keras.layers.Dense(6, activation="relu", bias_initializer="random_normal")(inp)
    return keras.Model(inp, keras.layers.Dense(CLASSES)(h), name="tiny")


def _joined(batches):
    """`(x, y, index starts)` of a reader's batches, joined."""
    batches = list(batches)
    x = np.concatenate([b.x.numpy() for b in batches])
    y = None if batches[0].y is None else np.concatenate([b.y for b in batches])
    return x, y, [b.index.start for b in batches]


# ---------------------------------------------------------------------- input kinds


def test_every_input_kind_gives_the_same_examples_and_labels():
    x, y = _data()
    kinds = {
        "array": x,
        "tensor": tf.constant(x),
        "list of rows": [list(map(float, row)) for row in x],
        "tf.data batched": tf.data.Dataset.from_tensor_slices((x, y)).batch(3),
        "tf.data single": tf.data.Dataset.from_tensor_slices((x, y)),
        "tf.data (x, y, w)": tf.data.Dataset.from_tensor_slices((x, y, np.ones(7))).batch(2),
        "generator": ((x[i:i + 2], y[i:i + 2]) for i in range(0, 7, 2)),
        "iterator of single examples": iter(list(zip(x, y))),
        "PyDataset": _Sequence(x, y, 4),
    }
    for kind, source in kinds.items():
        labelled = "tf.data" in kind or kind in ("generator", "iterator of single examples",
                                                  "PyDataset")
        got_x, got_y, starts = _joined(read_batches(
            source, SPEC, y=None if labelled else y, labels=LabelSpec(CLASSES), batch_size=3))
        np.testing.assert_array_equal(got_x, x, err_msg=kind)
        np.testing.assert_array_equal(got_y, y, err_msg=kind)
        assert starts[0] == 0 and starts == sorted(starts), kind
        one = read_all(source if not labelled else x, SPEC, y=y)
        np.testing.assert_array_equal(one.x.numpy(), x)


def test_unlabelled_streams_and_batch_positions():
    x, _ = _data()
    batches = list(read_batches(tf.data.Dataset.from_tensor_slices(x), SPEC, batch_size=3))
    assert [(b.index.start, b.index.stop) for b in batches] == [(0, 3), (3, 6), (6, 7)]
    assert all(b.y is None and b.directions is None for b in batches)
    split = list(read_batches(x, SPEC, batch_size=3, split=True))
    assert [b.index for b in split] == [b.index for b in batches]
    assert len(list(read_batches(x, SPEC, batch_size=3))) == 1  # an array: one batch


def test_y_replaces_a_streams_labels_and_must_fit_it():
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(3)
    _, got, _ = _joined(read_batches(ds, SPEC, y=9 - y, labels=LabelSpec(CLASSES)))
    np.testing.assert_array_equal(got, 9 - y)
    with pytest.raises(ValueError, match="y has 9 labels but the input stream yielded 7"):
        list(read_batches(ds, SPEC, y=np.arange(9)))
    with pytest.raises(ValueError, match="y has 5 labels but the input has more examples"):
        list(read_batches(ds, SPEC, y=np.arange(5)))
    mixed = iter([(x[:2], y[:2]), x[2:4]])
    with pytest.raises(ValueError, match="Some stream elements have labels and some do not"):
        list(read_batches(mixed, SPEC))


def test_directions_are_sliced_per_batch_and_shared_for_streams():
    x, _ = _data()
    per = np.random.default_rng(0).normal(size=(7, 2, 3))
    got = list(read_batches(x, SPEC, directions=per, batch_size=3, split=True))
    np.testing.assert_allclose(np.concatenate([b.directions for b in got]), per, rtol=1e-6)
    shared = list(read_batches(iter([x[:4], x[4:]]), SPEC, directions=per[0]))
    assert [b.directions.shape for b in shared] == [(4, 2, 3), (3, 2, 3)]
    with pytest.raises(ValueError, match="directions must be shared"):
        read_batches(iter([x]), SPEC, directions=per)


# ---------------------------------------------------------------------- labels


def test_check_labels_by_hand():
    spec = LabelSpec(4, model="m")
    np.testing.assert_array_equal(check_labels(2, 3, spec), [2, 2, 2])
    np.testing.assert_array_equal(check_labels(np.array([[1], [3]]), 2, spec), [1, 3])
    np.testing.assert_array_equal(check_labels(np.array([1.0, 0.0]), 2, spec), [1, 0])
    np.testing.assert_array_equal(check_labels(tf.constant([3, 0]), 2, spec), [3, 0])
    assert check_labels(None, 2, spec) is None
    hot = np.array([[0, 1, 1, 0], [1, 0, 0, 0]])
    np.testing.assert_array_equal(check_labels(hot, 2, spec._replace(hot=True)), hot)
    with pytest.raises(ValueError, match=r"np.argmax\(y, axis=-1\)"):
        check_labels(hot, 2, spec)  # hot targets where the function takes classes
    with pytest.raises(ValueError, match=r"rows without any target class at positions \[1\]"):
        check_labels(np.array([[0, 1, 0, 0], [0, 0, 0, 0]]), 2, spec._replace(hot=True))
    with pytest.raises(ValueError, match=r"integer class labels, got \[0.5\] at positions \[1\]"):
        check_labels(np.array([1.0, 0.5]), 2, spec)
    with pytest.raises(ValueError, match="dtype bool"):
        check_labels(np.array([True, False]), 2, spec)
    with pytest.raises(ValueError, match=r"shape \[B\] = \(2,\).*got shape \(3,\)"):
        check_labels(np.array([1, 2, 3]), 2, spec)
    binary = LabelSpec(1, sigmoid=True)
    np.testing.assert_array_equal(check_labels([0, 1], 2, binary), [0, 1])
    with pytest.raises(ValueError, match="y must be 0 or 1"):
        check_labels([0, 2], 2, binary)


def test_out_of_range_message_names_values_positions_range_and_fix():
    with pytest.raises(ValueError) as err:
        check_labels(np.array([0, 12, 3, -1]), 4, LabelSpec(10, model="m"), offset=100)
    text = str(err.value)
    assert "y must be in [0, 10) for model 'm', which has 10 classes" in text
    assert "got [12, -1] at positions [101, 103]" in text
    assert "counted from 0" in text and "np.argmax" in text


def _label_error(run) -> str:
    with pytest.raises(ValueError) as err:
        run()
    return str(err.value)


@pytest.mark.parametrize("bad", [12, np.array([1, 2, 3, 12, 0]), np.array([1, 2, 3, 4, 0.5])])
def test_bad_labels_are_refused_identically_everywhere(tiny, bad):
    x = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    kw = dict(verbose=False)
    runs = {
        "robust_radius": lambda: keras_roll.robust_radius(tiny, x, y=bad, **kw),
        "robust_radius stream": lambda: keras_roll.robust_radius(
            tiny, tf.data.Dataset.from_tensor_slices((x, np.broadcast_to(bad, (5,)))).batch(5),
            **kw),
        "saliency": lambda: keras_roll.saliency(tiny, x, bad),
        "integrated_gradients": lambda: keras_roll.integrated_gradients(tiny, x, bad, **kw),
        "smoothgrad": lambda: keras_roll.smoothgrad(tiny, x, bad, samples=2, **kw),
        "gradient_distortion": lambda: keras_roll.gradient_distortion(
            tiny, x, bad, samples=2, domain=None, **kw),
    }
    messages = {name: _label_error(run) for name, run in runs.items()}
    want = messages["saliency"]
    assert re.search(r"y must (be in \[0, 10\)|hold integer class labels)", want), want
    for name, message in messages.items():
        assert message == want, name


# ---------------------------------------------------------------------- empty inputs


def test_an_empty_input_is_an_error_everywhere(tiny):
    empty = np.zeros((0, 3), np.float32)
    kw = dict(verbose=False)
    runs = {
        "certify": lambda x: keras_roll.certify(tiny, x, **kw),
        "lp_margins": lambda x: keras_roll.lp_margins(tiny, x),
        "stability_bounds": lambda x: keras_roll.stability_bounds(tiny, x, **kw),
        "count_regions": lambda x: keras_roll.count_regions(tiny, x, **kw),
        "saliency": lambda x: keras_roll.saliency(tiny, x),
        "stable_radius": lambda x: keras_roll.stable_radius(tiny, x, **kw),
        "smoothgrad": lambda x: keras_roll.smoothgrad(tiny, x, samples=2, **kw),
        "integrated_gradients": lambda x: keras_roll.integrated_gradients(tiny, x, **kw),
        "faithfulness": lambda x: keras_roll.faithfulness(tiny, x, None, np.zeros((0, 3)),
                                                          **kw),
        "gradient_distortion": lambda x: keras_roll.gradient_distortion(tiny, x, samples=2,
                                                                        **kw),
        "robust_radius": lambda x: keras_roll.robust_radius(tiny, x, **kw),
    }
    for run in runs.values():
        for source in (empty, tf.data.Dataset.from_tensor_slices(empty).batch(4)):
            with pytest.raises(ValueError, match="no examples"):
                run(source)
    with pytest.raises(ValueError, match="empty"):
        keras_roll.MarginMonitor(empty)
    with pytest.raises(ValueError, match="empty"):
        keras_roll.MarginMonitor(iter([]))


# ---------------------------------------------------------------------- non-finite rows


def test_non_finite_rows_are_named(tiny):
    x = np.random.default_rng(2).normal(size=(50, 3)).astype(np.float32)
    rows = [3, 17, 42, 43, 44, 45, 47, 49]
    x[rows, 1] = np.nan
    x[45, 0] = np.inf
    want = "Rows 3, 17, 42, 43, 44 (and 3 more) of x hold non-finite values (NaN or inf)"
    for run in (lambda: keras_roll.certify(tiny, x, verbose=False),
                lambda: keras_roll.saliency(tiny, x),
                lambda: keras_roll.count_regions(tiny, x, verbose=False),
                lambda: list(read_batches(x, SPEC))):
        with pytest.raises(ValueError, match=re.escape(want)):
            run()
    clean = tf.data.Dataset.from_tensor_slices(np.zeros((10, 3), np.float32)).batch(10)
    stream = clean.concatenate(tf.data.Dataset.from_tensor_slices(x[10:]).batch(8))
    with pytest.raises(ValueError, match="Row 17 of x holds non-finite"):  # rows 10 to 17
        keras_roll.lp_margins(tiny, stream)
    one = np.zeros((2, 3), np.float32)
    one[1, 2] = np.inf
    with pytest.raises(ValueError, match="Row 1 of x holds non-finite"):
        keras_roll.integrated_gradients(tiny, one, verbose=False)
    with pytest.warns(UserWarning, match="non-finite"):
        rr = keras_roll.robust_radius(tiny, x[:5], norms=(2,), method="region", verbose=False)
    assert rr.nonfinite.tolist() == [False, False, False, True, False]  # NaN bounds there


def test_shape_errors_name_the_reshape():
    """Images for a flat model, one example without its batch axis: the error says the
    reshape, which then runs; sizes that do not match get no hint."""
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(3)])
    images = np.zeros((16, 28, 28), np.float32)
    with pytest.raises(ValueError, match=re.escape(
            "expects inputs of shape (batch, 784), got x of shape (16, 28, 28). Each example "
            "has 784 values, as the model expects: reshape with x.reshape(-1, 784).")):
        keras_roll.certify(model, images, verbose=False)
    x = images.reshape(-1, 784)                       # the advice, as printed
    assert keras_roll.certify(model, x, verbose=False).margins[2].shape == (16,)
    with pytest.raises(ValueError, match=re.escape(
            "add it with x[None] (x.reshape(-1, 784))")):
        keras_roll.certify(model, np.zeros(784, np.float32), verbose=False)
    with pytest.raises(ValueError, match=re.escape(
            "reshape with tf.reshape(x, (-1, 784))")):
        keras_roll.certify(model, tf.zeros((2, 28, 28)), verbose=False)
    with pytest.raises(ValueError, match=r"got x of shape \(16, 10\)\.$"):
        keras_roll.certify(model, np.zeros((16, 10), np.float32), verbose=False)
