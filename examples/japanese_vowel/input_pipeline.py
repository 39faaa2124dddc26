"""The data of the Japanese Vowels example: the stratified validation split of the
training sequences, and batches of sequences of similar length.

Example:

```python
train, val, test = load_data(config)            # (x, y, lengths) triples
ds = sequence_dataset(*train, batch_size=32, seed=0)
```
"""

from __future__ import annotations

import warnings

import numpy as np

from examples.common.app import UsageError
from examples.common.training import without_autotune
from examples.japanese_vowel.configs.default import Config
from keras_roll.data import load_japanese_vowels

__all__ = ["BUCKETS", "WHERE_TO_GET", "load_data", "sequence_dataset"]

# Batches are drawn from buckets of similar length and padded to their own longest
# sequence (masked steps create no neurons, so each example's loss is unchanged): exact
# ROLL costs about the square of the padded length, so this is 4-6x faster than padding
# every batch to 26 frames.
BUCKETS = (11, 14, 17, 20, 23)
WHERE_TO_GET = (
    "The Japanese Vowels data ship with keras_roll (keras_roll/data/japanese_vowels/); "
    "leave --data_dir unset to use them. Otherwise pass --data_dir pointing at a folder "
    "with JapaneseVowels_TRAIN.ts / JapaneseVowels_TEST.ts (sktime/aeon format, "
    "https://timeseriesclassification.com/description.php?Dataset=JapaneseVowels) or the "
    "UCI files ae.train / ae.test (https://archive.ics.uci.edu/dataset/128/japanese+vowels)."
)


def load_data(config: Config):
    """`(train, val, test)` as `(x, y, lengths)` triples; validation is a stratified,
    seeded `--val_fraction` of the training sequences, the test set cut to
    `--test_size`.

    Raises:
        UsageError: no data where `--data_dir` points (the message says where to get
            it), or a validation split without a sequence.
    """
    try:
        x, y, lengths = load_japanese_vowels(config.data_dir, split="train")
        test = load_japanese_vowels(config.data_dir, split="test")
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"{e} {WHERE_TO_GET}") from e
    rng = np.random.default_rng(config.seed)
    held = []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        held.extend(idx[:int(round(config.val_fraction * len(idx)))])
    held = np.sort(np.asarray(held, np.int64))
    kept = np.setdiff1d(np.arange(len(y)), held)
    if len(held) == 0:
        raise UsageError(f"--val_fraction={config.val_fraction} holds out no sequence; the "
                         f"examples select on validation, use e.g. 0.2.")
    if config.test_size:
        test = tuple(a[:config.test_size] for a in test)
    return (x[kept], y[kept], lengths[kept]), (x[held], y[held], lengths[held]), test


def sequence_dataset(x, y, lengths, batch_size: int, seed=None):
    """Batches of sequences of similar length, each padded to its longest sequence
    (`tf.data` `bucket_by_sequence_length`); shuffled every epoch when `seed` is given.

    With a fixed prefetch and tf.data's autotuning off (`without_autotune`: with it on,
    `fit` idled at every epoch's end).

    Example:

    ```python
    train = sequence_dataset(x, y, lengths, 32, seed=0)
    model.fit(train, epochs=10)
    ```
    """
    import tensorflow as tf

    # Keras cannot know the number of bucketed batches in advance, and says so.
    warnings.filterwarnings("ignore", message=".*ran out of data.*")
    ds = tf.data.Dataset.from_tensor_slices((x, y, lengths))
    if seed is not None:
        ds = ds.shuffle(len(y), seed=seed, reshuffle_each_iteration=True)
    ds = ds.map(lambda a, b, n: (a[:n], b))
    ds = ds.bucket_by_sequence_length(lambda a, b: tf.shape(a)[0], list(BUCKETS),
                                      [batch_size] * (len(BUCKETS) + 1))
    return without_autotune(ds.prefetch(2))
