"""Caltech-256: the generated tree, the paper's and the fraction split, the tf.data
pipeline, skipped files and error messages (keras_roll.data.caltech256)."""

import logging
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

from keras_roll.data import caltech256 as c256
from keras_roll.data import (
    caltech256_dataset,
    caltech256_splits,
    index_caltech256,
    load_caltech256,
    make_synthetic_caltech256,
)
from keras_roll.data.caltech256 import pipeline

FILE_NAME = re.compile(r"^(\d{3})_(\d{4})\.jpg$")


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """4 classes of 24 generated JPEGs (+ 257.clutter), the real folder layout."""
    parent = tmp_path_factory.mktemp("caltech")
    root = make_synthetic_caltech256(parent, classes=4, images_per_class=24, seed=0)
    assert root == parent / "256_ObjectCategories"
    return parent


def _copy(tree, tmp_path):
    shutil.copytree(tree, tmp_path / "copy")
    return tmp_path / "copy" / "256_ObjectCategories"


def _class_of(path):
    """The class number in the folder name NNN.name of an image path."""
    return int(path.split("/")[-2].split(".")[0])


def test_synthetic_tree_layout(tree):
    root = tree / "256_ObjectCategories"
    folders = sorted(p.name for p in root.iterdir())
    assert folders == ["001.ak47", "002.american-flag", "003.backpack", "004.baseball-bat",
                       "257.clutter"]
    grayscale = 0
    for folder in root.iterdir():
        number = folder.name.split(".")[0]
        files = sorted(folder.iterdir())
        assert len(files) == (2 if number == "257" else 24)
        for i, f in enumerate(files, start=1):
            m = FILE_NAME.match(f.name)
            assert m and m.group(1) == number and int(m.group(2)) == i, f.name
            image = tf.io.decode_jpeg(f.read_bytes())
            assert 32 <= image.shape[0] <= 64 and 32 <= image.shape[1] <= 64
            grayscale += image.shape[2] == 1
    assert grayscale == 4 * 3  # images 7, 14, 21 of every class
    with pytest.raises(FileExistsError, match="256_ObjectCategories"):
        make_synthetic_caltech256(tree)
    with pytest.raises(ValueError, match="classes.*0"):
        make_synthetic_caltech256(tree / "other", classes=0)
    with pytest.raises(ValueError, match="min_size=4"):
        make_synthetic_caltech256(tree / "other", min_size=4)


def test_paper_split_counts_labels_and_determinism(tree):
    index = index_caltech256(tree, seed=1)
    assert index.class_names == ["ak47", "american-flag", "backpack", "baseball-bat"]
    assert index.counts() == {"train": 16, "val": 20, "test": 60, "all": 96, "skipped": 0}
    for split, per_class in (("train", 4), ("val", 5), ("test", 15)):
        np.testing.assert_array_equal(np.bincount(index.labels[split]), [per_class] * 4)
        # labels are the folders' order; no clutter
        assert [_class_of(f) - 1 for f in index.files[split]] == list(index.labels[split])
    parts = [set(index.files[s]) for s in ("train", "val", "test")]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert parts[0] | parts[1] | parts[2] == set(index.files["all"])
    assert len(index.files["all"]) == 96 and not any("257.clutter" in f for f in index.files["all"])

    again = index_caltech256(tree / "256_ObjectCategories", seed=1, verify=False)
    assert again.files == index.files
    other = index_caltech256(tree, seed=2)
    assert set(other.files["val"]) != set(index.files["val"])
    assert set(other.files["all"]) == set(index.files["all"])
    small = index_caltech256(tree, val_per_class=1, test_per_class=2, max_per_class=10)
    assert small.counts() == {"train": 28, "val": 4, "test": 8, "all": 40, "skipped": 0}


def test_fraction_split_is_kept(tree):
    kwargs = dict(scheme="fraction", val_fraction=0.3, seed=5)
    index = index_caltech256(tree, **kwargs)
    np.testing.assert_array_equal(np.bincount(index.labels["val"]), [7] * 4)  # round(0.3 * 24)
    assert index.files["test"] == index.files["val"]
    assert not set(index.files["train"]) & set(index.files["val"])
    ds, names = load_caltech256(tree, image_size=8, split="test", **kwargs)  # alias of "val"
    assert len(list(ds)) == 28 and len(names) == 4
    default = index_caltech256(tree, scheme="fraction")  # val_fraction 0.2
    np.testing.assert_array_equal(np.bincount(default.labels["val"]), [5] * 4)  # round(4.8)


def test_pipeline_pixels_resize_and_normalisation(tmp_path):
    """Images already at the target size come through unresized: pixels == the decoder's."""
    rng = np.random.default_rng(0)
    files, expected = [], []
    for i, channels in enumerate((3, 1, 3)):
        image = rng.integers(0, 256, (12, 10, channels), dtype=np.uint8)
        data = tf.io.encode_jpeg(image).numpy()
        (tmp_path / f"{i}.jpg").write_bytes(data)
        files.append(tmp_path / f"{i}.jpg")
        decoded = tf.io.decode_jpeg(data).numpy().astype(np.float32)
        expected.append(np.repeat(decoded, 3, axis=-1) if channels == 1 else decoded)
    ds = caltech256_dataset(files, [0, 1, 2], image_size=(12, 10), cache=False)
    for (image, label), want, lab in zip(ds, expected, [0, 1, 2]):
        assert image.shape == (12, 10, 3) and image.dtype == tf.float32 and label == lab
        np.testing.assert_allclose(image.numpy(), want / 255.0, atol=1e-6)
    raw = caltech256_dataset(files, [0, 1, 2], image_size=(12, 10), normalize=False, cache=False)
    np.testing.assert_array_equal(next(iter(raw))[0].numpy(), expected[0])

    # Resizing: a constant image stays constant; the paper's default is 299 x 299.
    const = np.full((40, 30, 3), 77, np.uint8)
    (tmp_path / "c.jpg").write_bytes(tf.io.encode_png(const).numpy())  # lossless
    (image, _), = caltech256_dataset([tmp_path / "c.jpg"], [0], normalize=False, cache=False)
    assert image.shape == (299, 299, 3)
    np.testing.assert_array_equal(image.numpy(), 77.0)
    (image, _), = caltech256_dataset([tmp_path / "c.jpg"], [0], image_size=20, normalize=False,
                                     crop_to_aspect_ratio=True, cache=False)
    assert image.shape == (20, 20, 3)


@pytest.mark.parametrize("cache", ["memory", "file", False])
def test_pipeline_shuffle_batch_and_cache(tree, tmp_path, cache):
    index = index_caltech256(tree, val_per_class=1, test_per_class=1)
    files, labels = index.files["all"][:40], index.labels["all"][:40]
    cache_arg = str(tmp_path / "cache") if cache == "file" else cache
    ds = caltech256_dataset(files, labels, image_size=16, batch_size=8, shuffle=True, seed=3,
                            cache=cache_arg)

    def epoch():
        batches = [(x.numpy(), y.numpy()) for x, y in ds]
        assert [len(y) for _, y in batches] == [8] * 5
        x = np.concatenate([b[0] for b in batches])
        return x, np.concatenate([b[1] for b in batches])

    x1, y1 = epoch()
    x2, y2 = epoch()
    assert x1.shape == (40, 16, 16, 3) and 0.0 <= x1.min() and x1.max() <= 1.0
    assert not np.array_equal(y1, y2) or not np.array_equal(x1, x2)  # reshuffled
    # the same examples every epoch (pairs of image and label)
    key = lambda x, y: sorted(zip(y.tolist(), np.round(x.reshape(40, -1).sum(1), 3).tolist()))
    assert key(x1, y1) == key(x2, y2)
    assert sorted(y1.tolist()) == sorted(labels.tolist())
    if cache == "file":
        assert any(p.name.startswith("cache") for p in tmp_path.iterdir())
    # without shuffling, the order is the files' order
    plain = caltech256_dataset(files[:5], labels[:5], image_size=16, cache=cache_arg + "_2"
                               if cache == "file" else cache)
    assert [int(y) for _, y in plain] == labels[:5].tolist()


def test_cache_auto_fits_the_memory(tree, monkeypatch):
    gib = 2**30
    assert pipeline.cache_mode("auto", gib, available=4 * gib) == "memory"
    assert pipeline.cache_mode("auto", gib, available=int(1.5 * gib)) is None  # over half of it
    assert pipeline.cache_mode("auto", 1, available=None) is None  # unknown: do not cache
    assert pipeline.cache_mode(True, 10**15, available=0) == "memory"  # explicit: as asked
    assert pipeline.cache_mode(False, 1, available=gib) is None

    # caltech256_splits shares one budget: val, test, then train while it fits
    seen = {}
    real = pipeline.caltech256_dataset

    def spy(files, labels, **kwargs):
        seen["train" if kwargs["shuffle"] else len(files)] = kwargs["cache"]
        return real(files, labels, **kwargs)

    monkeypatch.setattr(pipeline, "caltech256_dataset", spy)
    per_image = 8 * 8 * 3
    # val: 20 images, test: 60, train: 16 -> 80 images fit, 96 do not
    monkeypatch.setattr(pipeline, "available_memory", lambda: 2 * 80 * per_image)
    data = caltech256_splits(tree, image_size=8, batch_size=4)
    assert seen == {20: "memory", 60: "memory", "train": False}
    assert [len(list(d)) for d in (data.train, data.val, data.test)] == [4, 5, 15]
    assert data.class_names == data.index.class_names and len(data.class_names) == 4


def test_splits_default_is_the_paper_setting(tree):
    data = caltech256_splits(tree, batch_size=16, cache=False)
    x, y = next(iter(data.val))
    assert x.shape == (16, 299, 299, 3) and y.dtype == tf.int64
    assert 0.0 <= float(tf.reduce_min(x)) and float(tf.reduce_max(x)) <= 1.0  # [0, 1] pixels
    assert data.index.counts()["val"] == 20 and data.index.counts()["test"] == 60


def test_undecodable_files_are_skipped_and_counted(tree, tmp_path, caplog):
    root = _copy(tree, tmp_path)
    good = (root / "001.ak47" / "001_0001.jpg").read_bytes()
    (root / "001.ak47" / "001_0100.jpg").write_bytes(good[: len(good) // 3])  # truncated
    (root / "002.american-flag" / "002_0100.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"x" * 99)
    (root / "002.american-flag" / "002_0101.jpg").write_bytes(b"")
    (root / "003.backpack" / "notes.txt").write_text("not an image")
    (root / "003.backpack" / "003_0100.jpg").write_bytes(b"<html>not found</html>")
    (root / "004.baseball-bat" / "greg").mkdir()

    with caplog.at_level(logging.WARNING, logger="keras_roll.data.caltech256"):
        index = index_caltech256(root.parent)
    reasons = {p.split("/")[-1]: r for p, r in index.skipped}
    assert reasons == {
        "001_0100.jpg": "cannot be decoded as an image",
        "002_0100.jpg": "cannot be decoded as an image",
        "002_0101.jpg": "empty file",
        "notes.txt": "not an image file (extension '.txt')",
        "003_0100.jpg": "not a JPEG / PNG / GIF / BMP image (starts with 3c 68 74 6d)",
        "greg": "a folder inside a class folder (not read)",
    }
    assert index.counts()["all"] == 96 and index.counts()["skipped"] == 6
    assert "skipped 6 of 102 files" in caplog.text and "001_0100.jpg" in caplog.text
    # Every usable image goes through the pipeline without an error.
    ds = caltech256_dataset(index.files["all"], index.labels["all"], image_size=8, batch_size=32)
    assert sum(len(y) for _, y in ds) == 96

    # verify=False only does the cheap checks: the truncated JPEG stays in.
    quick = index_caltech256(root.parent, verify=False)
    assert quick.counts()["skipped"] == 4 and quick.counts()["all"] == 98


def test_empty_or_broken_class_folders(tree, tmp_path):
    root = _copy(tree, tmp_path)
    for f in (root / "002.american-flag").iterdir():
        f.write_bytes(b"\xff\xd8\xff" + b"\x00" * 10)
    with pytest.raises(ValueError, match=r"002.american-flag.*all 24 of its files were skipped"):
        index_caltech256(root)
    shutil.rmtree(root / "002.american-flag")
    (root / "002.american-flag").mkdir()
    with pytest.raises(ValueError, match=r"002.american-flag.*it is empty"):
        index_caltech256(root)
    shutil.rmtree(root / "002.american-flag")
    for f in sorted((root / "003.backpack").iterdir())[:10]:
        f.unlink()
    with pytest.raises(ValueError, match=r"003.backpack.*14 usable images.*21.*scheme='fraction'"):
        index_caltech256(root)
    (root / "005.bear").mkdir()
    (root / "5.bear").mkdir()
    with pytest.raises(ValueError, match=r"\[5\].*more than one folder"):
        index_caltech256(root, scheme="fraction")


def test_quick_tree_check(tree, tmp_path):
    """check_tree reads no image: the class folders and their file names only."""
    assert c256.check_tree(tree) == tree / "256_ObjectCategories"
    assert c256.check_tree(tree / "256_ObjectCategories") == tree / "256_ObjectCategories"
    root = _copy(tree, tmp_path)
    for f in (root / "003.backpack").iterdir():
        f.unlink()
    (root / "003.backpack" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError, match=r"1 class folder\(s\) .* hold no image files: "
                                         r"003.backpack"):
        c256.check_tree(root)
    for folder in root.iterdir():
        shutil.rmtree(folder)
    (root / "not-a-class").mkdir()
    with pytest.raises(FileNotFoundError, match="No class folders"):
        c256.check_tree(root.parent)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        c256.check_tree(tmp_path / "nowhere")


def test_missing_data_says_where_to_get_it(tmp_path):
    for path in (tmp_path / "nowhere", tmp_path):
        with pytest.raises(FileNotFoundError) as info:
            caltech256_splits(path)
        message = str(info.value)
        for needle in (str(path), "data.caltech.edu", "256_ObjectCategories.tar", "--data_dir",
                       "256_ObjectCategories/NNN.name/NNN_XXXX.jpg", "--quick"):
            assert needle in message, needle
    (tmp_path / "256_ObjectCategories.tar").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is the archive: extract it first"):
        load_caltech256(tmp_path / "256_ObjectCategories.tar")


def test_bad_arguments(tree, tmp_path):
    with pytest.raises(ValueError, match="scheme.*'random'"):
        index_caltech256(tree, scheme="random")
    with pytest.raises(ValueError, match="val_fraction=0.1 applies to scheme='fraction'"):
        index_caltech256(tree, val_fraction=0.1)
    with pytest.raises(ValueError, match="val_fraction.*1.0"):
        index_caltech256(tree, scheme="fraction", val_fraction=1.0)
    with pytest.raises(ValueError, match="test_per_class.*-1"):
        index_caltech256(tree, test_per_class=-1)
    with pytest.raises(ValueError, match="max_per_class.*0"):
        index_caltech256(tree, max_per_class=0)
    with pytest.raises(ValueError, match="split must be.*'dev'"):
        load_caltech256(tree, split="dev")
    with pytest.raises(ValueError, match="'test' split is empty"):
        load_caltech256(tree, split="test", test_per_class=0)
    files = index_caltech256(tree, verify=False).files["val"]
    with pytest.raises(ValueError, match=r"image_size.*\(0, 3\)"):
        caltech256_dataset(files, [0] * len(files), image_size=(0, 3))
    with pytest.raises(ValueError, match="batch_size.*2.5"):
        caltech256_dataset(files, [0] * len(files), batch_size=2.5)
    with pytest.raises(ValueError, match="differ in length: 20 != 3"):
        caltech256_dataset(files, [0, 1, 2])
    with pytest.raises(ValueError, match="no_such_dir.*does not exist"):
        caltech256_dataset(files, [0] * len(files), cache=str(tmp_path / "no_such_dir" / "c"))
    with pytest.raises(ValueError, match="cache must be.*'disk'"):
        caltech256_dataset(files, [0] * len(files), cache="disk")
