"""Tests of the data loaders in keras_roll.data, on real files and generated fixtures."""

import gzip
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_roll.data import japanese_vowels as jv_module
from keras_roll.data import load_japanese_vowels, load_mnist, make_toy2d, mnist_splits
from keras_roll.data.mnist import load_idx

REPO = Path(__file__).resolve().parents[1]
# The real data files, where the checkout has them beside it or $KERAS_ROLL_TEST_DATA says.
SHARED_DATA = Path(os.environ.get("KERAS_ROLL_TEST_DATA", REPO.parent / "shared" / "data"))


# --------------------------------------------------------------------------- lazy imports


def test_numpy_only_modules_do_not_import_tensorflow():
    """The numpy loaders (and the caltech256 package until called) must not import
    TensorFlow. keras_roll's own __init__ imports the core (and TensorFlow), so the
    packages above the loaders are stand-ins pointing at the real folders."""
    code = (
        "import sys, types\n"
        f"for name, path in (('keras_roll', {str(REPO / 'keras_roll')!r}),\n"
        f"                   ('keras_roll.data', {str(REPO / 'keras_roll' / 'data')!r})):\n"
        "    package = types.ModuleType(name)\n"
        "    package.__path__ = [path]\n"
        "    sys.modules[name] = package\n"
        "import importlib\n"
        "for name in ('japanese_vowels', 'mnist', 'toy2d', 'caltech256'):\n"
        "    importlib.import_module('keras_roll.data.' + name)\n"
        "assert importlib.import_module('keras_roll.data.caltech256').check_tree\n"
        "bad = sorted(m for m in ('tensorflow', 'keras') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------- Japanese vowels


def _first_data_line(file):
    with open(file, encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.startswith(("#", "@")):
                return line.strip()
    raise AssertionError(f"no data line in {file}")


def test_japanese_vowels_embedded_train():
    x, y, lengths = load_japanese_vowels(split="train")
    assert x.dtype == np.float32 and x.shape == (270, 26, 12)
    assert y.dtype == np.int64 and y.shape == (270,)
    assert lengths.shape == (270,) and lengths.min() == 7 and lengths.max() == 26
    np.testing.assert_array_equal(np.bincount(y), [30] * 9)

    # The first data line parsed by hand: channels split by ':', label last.
    fields = _first_data_line(jv_module.EMBEDDED_DIR / "JapaneseVowels_TRAIN.ts").split(":")
    channels = [[float(v) for v in f.split(",")] for f in fields[:-1]]
    assert len(channels) == 12
    assert y[0] == int(fields[-1]) - 1
    assert lengths[0] == len(channels[0])
    assert x[0, 0, 0] == np.float32(1.860936)  # first value of the file
    for c in range(12):
        np.testing.assert_array_equal(x[0, : lengths[0], c], np.float32(channels[c]))
    assert np.all(x[0, lengths[0] :] == 0.0)  # post-padding with zeros
    # every row is zero beyond its length
    steps = np.arange(x.shape[1])[None, :, None]
    assert np.all(np.where(steps >= lengths[:, None, None], x, 0.0) == 0.0)


def test_japanese_vowels_embedded_test():
    x, y, lengths = load_japanese_vowels(split="test")
    assert x.shape == (370, 29, 12)
    assert lengths.min() == 7 and lengths.max() == 29
    assert set(np.unique(y)) == set(range(9))
    np.testing.assert_array_equal(np.bincount(y), [31, 35, 88, 44, 29, 24, 40, 50, 29])


def test_japanese_vowels_pad_value_and_max_len():
    x, _, lengths = load_japanese_vowels(split="train", pad_value=-1.0, max_len=29)
    assert x.shape == (270, 29, 12)
    i = int(np.argmin(lengths))
    assert np.all(x[i, lengths[i] :] == -1.0)
    assert np.all(x[i, : lengths[i]] != -1.0)

    full, _, _ = load_japanese_vowels(split="train")
    short, _, short_len = load_japanese_vowels(split="train", max_len=10)
    assert short.shape == (270, 10, 12) and short_len.max() == 10
    np.testing.assert_array_equal(short, full[:, :10])


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared data folder not present")
def test_japanese_vowels_directory_and_file_paths():
    x0, y0, l0 = load_japanese_vowels(split="test")
    x1, y1, l1 = load_japanese_vowels(SHARED_DATA, split="test")
    x2, y2, l2 = load_japanese_vowels(str(SHARED_DATA / "JapaneseVowels_TEST.ts"))
    for x, y, lengths in ((x1, y1, l1), (x2, y2, l2)):
        np.testing.assert_array_equal(x, x0)
        np.testing.assert_array_equal(y, y0)
        np.testing.assert_array_equal(lengths, l0)


def _write_uci(directory, name, counts, rng, size_file=None):
    """Writes a UCI-format file: blocks of lines of 12 floats, blank-line separated."""
    blocks = []
    for _speaker, count in enumerate(counts):
        for _ in range(count):
            blocks.append(rng.normal(size=(int(rng.integers(2, 6)), 12)).round(6))
    text = "".join(
        "".join(" ".join(f"{v:.6f}" for v in row) + " \n" for row in block) + "\n"
        for block in blocks
    )
    (directory / name).write_text(text)
    if size_file:
        (directory / size_file).write_text(" ".join(str(c) for c in counts) + "\n")
    return blocks


def test_japanese_vowels_uci_format(tmp_path):
    rng = np.random.default_rng(0)
    train = _write_uci(tmp_path, "ae.train", [30] * 9, rng)
    test = _write_uci(tmp_path, "ae.test", [31, 35, 88, 44, 29, 24, 40, 50, 29], rng)

    x, y, lengths = load_japanese_vowels(tmp_path, split="train")
    assert x.shape == (270, max(len(b) for b in train), 12)
    np.testing.assert_array_equal(y, np.repeat(np.arange(9), 30))
    np.testing.assert_array_equal(lengths, [len(b) for b in train])
    np.testing.assert_allclose(x[5, : lengths[5]], train[5], rtol=1e-6)
    assert np.all(x[5, lengths[5] :] == 0)

    x, y, lengths = load_japanese_vowels(tmp_path / "ae.test")  # layout from the name
    assert len(x) == 370
    np.testing.assert_array_equal(np.bincount(y), [31, 35, 88, 44, 29, 24, 40, 50, 29])
    np.testing.assert_allclose(x[-1, : lengths[-1]], test[-1], rtol=1e-6)


def test_japanese_vowels_uci_size_files(tmp_path):
    rng = np.random.default_rng(1)
    blocks = _write_uci(tmp_path, "ae.train", [2, 1, 3], rng, size_file="size_ae.train")
    x, y, lengths = load_japanese_vowels(tmp_path, split="train")
    np.testing.assert_array_equal(y, [0, 0, 1, 2, 2, 2])
    np.testing.assert_array_equal(lengths, [len(b) for b in blocks])


def test_japanese_vowels_errors(tmp_path):
    with pytest.raises(ValueError, match="'valid'"):
        load_japanese_vowels(split="valid")
    with pytest.raises(ValueError, match="max_len"):
        load_japanese_vowels(max_len=0)
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_japanese_vowels(missing)
    with pytest.raises(FileNotFoundError, match="JapaneseVowels_TRAIN.ts.*ae.train"):
        load_japanese_vowels(tmp_path)
    # UCI file whose block count does not match the speaker layout
    _write_uci(tmp_path, "ae.train", [3], np.random.default_rng(2))
    with pytest.raises(ValueError, match="found 3 blocks"):
        load_japanese_vowels(tmp_path)
    # malformed .ts lines
    bad = tmp_path / "bad.ts"
    bad.write_text("@problemName x\n@data\n1,2:3,4:1\n")
    with pytest.raises(ValueError, match="expected 12 channels"):
        load_japanese_vowels(bad)
    bad.write_text("@data\n" + ":".join(["1,2"] * 11 + ["1,x"]) + ":1\n")
    with pytest.raises(ValueError, match="'x'"):
        load_japanese_vowels(bad)
    bad.write_text(":".join(["1,2"] * 12) + ":1\n")
    with pytest.raises(ValueError, match="header"):
        load_japanese_vowels(bad)


# --------------------------------------------------------------------------------- MNIST


def _write_mnist(file, n_train=12, n_test=5):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, n_train).astype(np.uint8),
        "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, n_test).astype(np.uint8),
    }
    np.savez(file, **arrays)
    return arrays


def test_mnist_npz_file_and_directory(tmp_path):
    arrays = _write_mnist(tmp_path / "mnist.npz")
    x, y = load_mnist(tmp_path / "mnist.npz")
    assert x.dtype == np.float32 and x.shape == (12, 28, 28)
    assert y.dtype == np.int64
    np.testing.assert_array_equal(x, arrays["x_train"].astype(np.float32))  # raw 0..255
    np.testing.assert_array_equal(y, arrays["y_train"])

    x, y = load_mnist(str(tmp_path), split="test", flatten=True, normalize=True)
    assert x.shape == (5, 784)
    np.testing.assert_allclose(x, arrays["x_test"].reshape(5, -1) / 255.0, rtol=1e-6)
    assert 0.0 <= x.min() and x.max() <= 1.0
    np.testing.assert_array_equal(y, arrays["y_test"])


def test_mnist_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="'validation'"):
        load_mnist(tmp_path, split="validation")
    with pytest.raises(FileNotFoundError, match="mnist.npz"):
        load_mnist(tmp_path)  # directory without mnist.npz
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_mnist(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", images=np.zeros((2, 28, 28)))
    with pytest.raises(ValueError, match="x_train"):
        load_mnist(tmp_path / "other.npz")
    (tmp_path / "text.npz").write_text("not an archive")
    with pytest.raises(ValueError, match="text.npz"):
        load_mnist(tmp_path / "text.npz")

    # path=None with no Keras cache and no tensorflow-datasets: a clear hint.
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import -> ImportError
    with pytest.raises(FileNotFoundError, match="path="):
        load_mnist()


def test_mnist_keras_cache(tmp_path, monkeypatch):
    (tmp_path / "datasets").mkdir()
    arrays = _write_mnist(tmp_path / "datasets" / "mnist.npz")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    x, y = load_mnist(split="test")
    np.testing.assert_array_equal(x, arrays["x_test"])
    np.testing.assert_array_equal(y, arrays["y_test"])


def _write_idx(file, array, dtype_code=0x08, compress=True):
    """Writes an IDX file by the format's definition (independent of keras_roll)."""
    header = bytes([0, 0, dtype_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array).astype(array.dtype.newbyteorder(">")).tobytes()
    if compress:
        with gzip.open(file, "wb") as f:
            f.write(payload)
    else:
        file.write_bytes(payload)


def _write_mnist_idx(directory, arrays, compress=True):
    suffix = ".gz" if compress else ""
    for split, prefix in (("train", "train"), ("test", "t10k")):
        _write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", arrays[f"x_{split}"],
                   compress=compress)
        _write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", arrays[f"y_{split}"],
                   compress=compress)


@pytest.mark.parametrize("compress", [True, False])
def test_mnist_idx_files(tmp_path, compress):
    arrays = _write_mnist(tmp_path / "reference.npz")
    (tmp_path / "reference.npz").unlink()
    _write_mnist_idx(tmp_path, arrays, compress)
    for split in ("train", "test"):
        x, y = load_mnist(tmp_path, split=split)
        assert x.dtype == np.float32 and y.dtype == np.int64
        np.testing.assert_array_equal(x, arrays[f"x_{split}"])
        np.testing.assert_array_equal(y, arrays[f"y_{split}"])
    # one of the four files as the path: read all four from its folder
    name = "t10k-labels-idx1-ubyte" + (".gz" if compress else "")
    x, y = load_mnist(tmp_path / name, split="test", flatten=True, normalize=True)
    np.testing.assert_allclose(x, arrays["x_test"].reshape(5, -1) / 255.0, rtol=1e-6)


def test_idx_reader_dtypes_and_errors(tmp_path):
    values = np.arange(-6, 6, dtype=np.int32).reshape(3, 4)
    _write_idx(tmp_path / "ints.idx", values, dtype_code=0x0C, compress=False)
    out = load_idx(tmp_path / "ints.idx")
    np.testing.assert_array_equal(out, values)
    assert out.dtype.isnative
    floats = np.linspace(0, 1, 5).astype(np.float64)
    _write_idx(tmp_path / "f.idx.gz", floats, dtype_code=0x0E)
    np.testing.assert_array_equal(load_idx(tmp_path / "f.idx.gz"), floats)

    (tmp_path / "bad.idx").write_bytes(b"\x08\x03\x00\x01abcd")
    with pytest.raises(ValueError, match="not an IDX file.*08 03 00 01"):
        load_idx(tmp_path / "bad.idx")
    whole = (tmp_path / "ints.idx").read_bytes()
    (tmp_path / "short.idx").write_bytes(whole[:-3])
    with pytest.raises(ValueError, match=r"shape \(3, 4\).*truncated"):
        load_idx(tmp_path / "short.idx")
    (tmp_path / "notgz.idx.gz").write_bytes(whole)
    with pytest.raises(ValueError, match="notgz.idx.gz.*cannot be read"):
        load_idx(tmp_path / "notgz.idx.gz")

    # images and labels of different lengths
    rng = np.random.default_rng(0)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 255, (4, 28, 28),
                                                                       dtype=np.uint8))
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match=r"\(4, 28, 28\).*\(3,\)"):
        load_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte.gz.*--data_dir"):
        load_mnist(tmp_path, split="test")  # only the training files are there


def test_mnist_splits(tmp_path):
    arrays = _write_mnist(tmp_path / "mnist.npz", n_train=40, n_test=7)
    train, val, test = mnist_splits(tmp_path, seed=3, val=10)
    assert train[0].shape == (30, 784) and val[0].shape == (10, 784) and test[0].shape == (7, 784)
    assert 0.0 <= train[0].min() and train[0].max() <= 1.0
    # every training image lands in exactly one part, with its own label
    flat = arrays["x_train"].reshape(40, -1) / 255.0
    parts = np.concatenate([train[0], val[0]])
    labels = np.concatenate([train[1], val[1]])
    match = np.array([np.flatnonzero(np.all(np.isclose(flat, row), axis=1)) for row in parts])
    assert match.shape == (40, 1) and sorted(match[:, 0]) == list(range(40))
    np.testing.assert_array_equal(labels, arrays["y_train"][match[:, 0]])
    np.testing.assert_allclose(test[0], arrays["x_test"].reshape(7, -1) / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(test[1], arrays["y_test"])
    # deterministic in the seed, different across seeds
    again = mnist_splits(tmp_path, seed=3, val=10)
    np.testing.assert_array_equal(again.val[0], val[0])
    other = mnist_splits(tmp_path, seed=4, val=10)
    assert not np.array_equal(other.val[0], val[0])
    raw = mnist_splits(tmp_path, val=0, flatten=False, normalize=False)
    assert raw.train[0].shape == (40, 28, 28) and raw.train[0].max() > 1.0 and len(raw.val[0]) == 0
    with pytest.raises(ValueError, match="val=40 leaves no training images"):
        mnist_splits(tmp_path, val=40)
    with pytest.raises(ValueError, match="val must be.*-1"):
        mnist_splits(tmp_path, val=-1)
    with pytest.raises(ValueError, match="seed must be.*'a'"):
        mnist_splits(tmp_path, seed="a")


def test_mnist_missing_data_message(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(FileNotFoundError) as info:
        mnist_splits()
    message = str(info.value)
    for needle in ("mnist.npz", "train-images-idx3-ubyte.gz", "--data_dir", "https://"):
        assert needle in message, needle
    with pytest.raises(FileNotFoundError, match="nowhere.*--data_dir"):
        load_mnist(tmp_path / "nowhere")


@pytest.mark.skipif(not (SHARED_DATA / "mnist.npz").is_file(), reason="real mnist.npz not present")
def test_mnist_real_file():
    x, y = load_mnist(SHARED_DATA, split="train")
    assert x.shape == (60000, 28, 28) and y.shape == (60000,)
    assert x.min() == 0.0 and x.max() == 255.0
    np.testing.assert_array_equal(
        np.bincount(y), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    )
    x, y = load_mnist(SHARED_DATA / "mnist.npz", split="test")
    assert x.shape == (10000, 28, 28)
    np.testing.assert_array_equal(y[:3], [7, 2, 1])



@pytest.mark.skipif(not (SHARED_DATA / "mnist.npz").is_file(), reason="real mnist.npz not present")
def test_mnist_real_splits_and_idx_round_trip(tmp_path):
    train, val, test = mnist_splits(SHARED_DATA, seed=0)
    assert (len(train[0]), len(val[0]), len(test[0])) == (55000, 5000, 10000)
    assert train[0].shape[1] == 784 and train[0].max() == 1.0
    counts = np.bincount(train[1], minlength=10) + np.bincount(val[1], minlength=10)
    np.testing.assert_array_equal(counts, [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851,
                                           5949])
    # the real test images written as IDX files read back identically
    x, y = load_mnist(SHARED_DATA, split="test")
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", x.astype(np.uint8))
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", y.astype(np.uint8))
    x2, y2 = load_mnist(tmp_path, split="test")
    np.testing.assert_array_equal(x2, x)
    np.testing.assert_array_equal(y2, y)


# ------------------------------------------------------------------------------- toy 2-D


@pytest.mark.parametrize("kind", ["circles", "spirals", "xor"])
def test_toy2d_shapes_and_determinism(kind):
    x, y = make_toy2d(n=301, seed=3, kind=kind)
    assert x.shape == (301, 2) and x.dtype == np.float32
    assert y.shape == (301,) and y.dtype == np.int64
    assert set(np.unique(y)) == {0, 1}
    np.testing.assert_array_equal(np.bincount(y), [150, 151])
    assert np.abs(x).max() < 1.5
    x2, y2 = make_toy2d(n=301, seed=3, kind=kind)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    x3, _ = make_toy2d(n=301, seed=4, kind=kind)
    assert not np.array_equal(x, x3)


def test_toy2d_classes_are_separable_by_construction():
    x, y = make_toy2d(n=400, kind="xor")
    np.testing.assert_array_equal(y, (x[:, 0] * x[:, 1] > 0).astype(np.int64))
    x, y = make_toy2d(n=400, kind="circles", noise=0.0)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), np.where(y == 0, 0.4, 0.9), rtol=1e-5)
    x, _ = make_toy2d(n=400, kind="xor", noise=0.2)
    assert np.abs(x).min() >= 0.2


def test_toy2d_errors():
    with pytest.raises(ValueError, match="'moons'"):
        make_toy2d(kind="moons")
    with pytest.raises(ValueError, match="n must be"):
        make_toy2d(n=1)
    with pytest.raises(ValueError, match="noise"):
        make_toy2d(noise=-0.1)


def test_data_files_are_packaged():
    """setup.py must ship the embedded Japanese Vowels files."""
    text = (REPO / "setup.py").read_text()
    assert "japanese_vowels/*.ts" in text
    for name in ("JapaneseVowels_TRAIN.ts", "JapaneseVowels_TEST.ts", "README.md"):
        assert (jv_module.EMBEDDED_DIR / name).is_file(), name
    assert os.path.getsize(jv_module.EMBEDDED_DIR / "JapaneseVowels_TEST.ts") > 500_000
