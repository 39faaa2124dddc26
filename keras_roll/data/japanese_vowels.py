"""UCI Japanese Vowels: 9 speakers, 12-channel LPC cepstrum sequences of length 7-29.

The official split (270 train / 370 test sequences) ships with keras_roll in the
sktime/aeon ``.ts`` format (see ``keras_roll/data/japanese_vowels/README.md`` for the
provenance and the CC BY 4.0 license). The loader also reads the original UCI files
``ae.train`` / ``ae.test``.

This module imports only numpy.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

NUM_CHANNELS = 12
NUM_CLASSES = 9
MAX_LEN = 29  # longest sequence over both splits (train 26, test 29).

EMBEDDED_DIR = Path(__file__).resolve().parent / "japanese_vowels"
TS_FILES = {"train": "JapaneseVowels_TRAIN.ts", "test": "JapaneseVowels_TEST.ts"}
UCI_FILES = {"train": "ae.train", "test": "ae.test"}
UCI_SIZE_FILES = {"train": "size_ae.train", "test": "size_ae.test"}
# Blocks per speaker (speakers 1..9, in file order) of the original UCI files.
UCI_BLOCKS_PER_SPEAKER = {
    "train": (30, 30, 30, 30, 30, 30, 30, 30, 30),
    "test": (31, 35, 88, 44, 29, 24, 40, 50, 29),
}


def load_japanese_vowels(path=None, split="train", pad_value=0.0, max_len=None):
    """Loads the Japanese Vowels sequences as a padded array.

    Reference: M. Kudo, J. Toyama, M. Shimbo, "Multidimensional Curve Classification
    Using Passing-Through Regions", Pattern Recognition Letters 20 (1999); used for the
    scoRNN experiment of Lee, Alvarez-Melis & Jaakkola, ICLR 2019.

    Args:
        path: where to read from. ``None`` uses the copy embedded in keras_roll. A
            directory must hold ``JapaneseVowels_TRAIN.ts`` / ``JapaneseVowels_TEST.ts``
            (sktime/aeon format) or the UCI files ``ae.train`` / ``ae.test`` (with
            optional ``size_ae.train`` / ``size_ae.test`` giving the blocks per speaker).
            A file path is read directly: a ``.ts`` file carries its labels; for a UCI
            file the speaker of each block comes from its position, using the layout of
            ``ae.train`` or ``ae.test`` by file name, else by ``split``.
        split: ``"train"`` or ``"test"``.
        pad_value: value written after the end of each sequence (post-padding).
        max_len: time dimension of the result. ``None`` uses the longest sequence of
            the split (26 for train, 29 for test; pass ``max_len=MAX_LEN`` to get the
            same shape for both). Longer sequences are truncated and their length
            clipped to ``max_len``.

    Returns:
        A tuple ``(x, y, lengths)``: ``x`` float32 ``[n, T, 12]`` post-padded with
        ``pad_value``, ``y`` int64 ``[n]`` speaker index in ``0..8`` (file labels
        ``1..9``), ``lengths`` int64 ``[n]`` number of valid time steps of each row.

    Raises:
        ValueError: for a bad ``split`` or ``max_len``, or a malformed file.
        FileNotFoundError: when ``path`` or the expected files do not exist.

    Example:
        >>> from keras_roll.data import load_japanese_vowels
        >>> x, y, lengths = load_japanese_vowels(split="train")
        >>> x.shape, y.max(), lengths.min(), lengths.max()
        ((270, 26, 12), 8, 7, 26)
    """
    split = _check_split(split)
    if max_len is not None and (int(max_len) != max_len or max_len < 1):
        raise ValueError(f"max_len must be a positive integer or None, got {max_len!r}")
    file, kind = _resolve(path, split)
    if kind == "ts":
        seqs, y = _read_ts(file)
    else:
        seqs, y = _read_uci(file, _uci_counts(file, split))
    return _pad(seqs, y, pad_value, max_len)


def _check_split(split):
    if not isinstance(split, str) or split.lower() not in TS_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return split.lower()


def _resolve(path, split):
    """Returns ``(file, kind)`` with kind ``"ts"`` or ``"uci"``."""
    if path is None:
        file = EMBEDDED_DIR / TS_FILES[split]
        if not file.is_file():
            raise FileNotFoundError(
                f"The embedded Japanese Vowels file {str(file)!r} is missing; reinstall "
                "keras_roll or pass path= pointing at the data."
            )
        return file, "ts"
    p = Path(os.path.expanduser(os.fspath(path)))
    if p.is_file():
        return p, ("ts" if p.suffix.lower() == ".ts" else "uci")
    if p.is_dir():
        for name, kind in ((TS_FILES[split], "ts"), (UCI_FILES[split], "uci")):
            if (p / name).is_file():
                return p / name, kind
        raise FileNotFoundError(
            f"No Japanese Vowels {split} file in directory {str(p)!r}: expected "
            f"{TS_FILES[split]!r} (sktime/aeon .ts format) or {UCI_FILES[split]!r} "
            "(original UCI format)."
        )
    raise FileNotFoundError(
        f"Japanese Vowels path {str(p)!r} does not exist: pass a directory holding "
        f"{TS_FILES[split]!r} or {UCI_FILES[split]!r}, a file path, or path=None for the "
        "embedded copy."
    )


def _parse_float(token, file, lineno):
    token = token.strip()
    if token == "?":
        return float("nan")
    try:
        return float(token)
    except ValueError:
        raise ValueError(f"{file}:{lineno}: cannot parse {token!r} as a number") from None


def _read_ts(file):
    """Reads a multivariate sktime/aeon ``.ts`` file into (list of [T, C] arrays, labels)."""
    class_labels = None
    in_data = False
    seqs, raw_labels = [], []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            if not in_data:
                if line.startswith("#"):
                    continue
                if line.startswith("@"):
                    key, _, rest = line[1:].partition(" ")
                    key = key.lower()
                    if key == "data":
                        in_data = True
                    elif key == "classlabel":
                        fields = rest.split()
                        if fields and fields[0].lower() == "true":
                            class_labels = fields[1:]
                    continue
                raise ValueError(
                    f"{file}:{lineno}: expected a header line starting with '#' or '@' "
                    f"before '@data', got {line[:40]!r}"
                )
            fields = line.split(":")
            if len(fields) != NUM_CHANNELS + 1:
                raise ValueError(
                    f"{file}:{lineno}: expected {NUM_CHANNELS} channels and a class label "
                    f"separated by ':', got {len(fields)} fields"
                )
            channels = [
                [_parse_float(v, file, lineno) for v in ch.split(",")] for ch in fields[:-1]
            ]
            lengths = {len(ch) for ch in channels}
            if len(lengths) != 1:
                raise ValueError(
                    f"{file}:{lineno}: channels have different lengths {sorted(lengths)}"
                )
            seqs.append(np.asarray(channels, dtype=np.float32).T)  # [T, C]
            raw_labels.append(fields[-1].strip())
    if not in_data:
        raise ValueError(f"{file}: no '@data' line; is this a sktime/aeon .ts file?")
    if not seqs:
        raise ValueError(f"{file}: no data lines after '@data'")
    return seqs, _encode_labels(raw_labels, class_labels, file)


def _encode_labels(raw_labels, class_labels, file):
    if class_labels is None:
        uniq = set(raw_labels)
        try:
            class_labels = sorted(uniq, key=float)
        except ValueError:
            class_labels = sorted(uniq)
    index = {c: i for i, c in enumerate(class_labels)}
    unknown = sorted(set(raw_labels) - index.keys())
    if unknown:
        raise ValueError(
            f"{file}: class labels {unknown} are not among the declared labels {class_labels}"
        )
    return np.asarray([index[c] for c in raw_labels], dtype=np.int64)


def _uci_counts(file, split):
    """Blocks per speaker for a UCI file: size_ae.* next to it, else the known layout."""
    name = file.name.lower()
    which = "train" if name == "ae.train" else "test" if name == "ae.test" else split
    size_file = file.parent / UCI_SIZE_FILES[which]
    if size_file.is_file():
        tokens = size_file.read_text(encoding="utf-8").split()
        try:
            counts = tuple(int(t) for t in tokens)
        except ValueError:
            raise ValueError(
                f"{size_file}: expected whitespace-separated block counts, got "
                f"{' '.join(tokens)[:60]!r}"
            ) from None
        if not counts or min(counts) < 0:
            raise ValueError(f"{size_file}: bad block counts {counts}")
        return counts
    return UCI_BLOCKS_PER_SPEAKER[which]


def _read_uci(file, counts):
    """Reads an original UCI file: blocks of lines of 12 floats, separated by blank lines."""
    seqs, block = [], []
    with open(file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            tokens = line.split()
            if not tokens:
                if block:
                    seqs.append(np.asarray(block, dtype=np.float32))
                    block = []
                continue
            if len(tokens) != NUM_CHANNELS:
                raise ValueError(
                    f"{file}:{lineno}: expected {NUM_CHANNELS} numbers per line, got {len(tokens)}"
                )
            block.append([_parse_float(t, file, lineno) for t in tokens])
    if block:
        seqs.append(np.asarray(block, dtype=np.float32))
    if len(seqs) != sum(counts):
        raise ValueError(
            f"{file}: found {len(seqs)} blocks but the blocks per speaker {list(counts)} "
            f"add up to {sum(counts)}"
        )
    y = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    return seqs, y


def _pad(seqs, y, pad_value, max_len):
    lengths = np.asarray([len(s) for s in seqs], dtype=np.int64)
    t = int(lengths.max()) if max_len is None else int(max_len)
    x = np.full((len(seqs), t, NUM_CHANNELS), pad_value, dtype=np.float32)
    for i, s in enumerate(seqs):
        n = min(len(s), t)
        x[i, :n] = s[:n]
    return x, y, np.minimum(lengths, t)
