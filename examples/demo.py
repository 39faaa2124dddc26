"""keras_roll demo: certify the linear regions of a ReLU RNN on Japanese Vowels.

Trains a small SimpleRNN(ReLU) classifier on the embedded UCI Japanese Vowels
data (variable-length sequences, Keras masking), then certifies, for test
sequences, the l1 / l2 / l_inf radius of the largest ball inside each input's
linear region, names the binding neurons and counts the distinct linear regions.

    python -m examples.demo [--epochs=15] [--units=32] [--num_test=200]
"""

from __future__ import annotations

import time

import keras
import numpy as np
from absl import app, flags

import keras_roll
from keras_roll.data import load_japanese_vowels

FLAGS = flags.FLAGS
flags.DEFINE_integer("epochs", 15, "Training epochs.")
flags.DEFINE_integer("units", 32, "SimpleRNN units.")
flags.DEFINE_integer("num_test", 200, "Test sequences to certify.")
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_string("data_dir", None, "Folder with the Japanese Vowels files (default: the "
                    "copy embedded in keras_roll).")


def build_model(steps: int, channels: int, units: int, classes: int) -> keras.Model:
    inp = keras.Input((steps, channels))
    h = keras.layers.Masking(0.0)(inp)
    h = keras.layers.SimpleRNN(units, activation="relu", name="rnn")(h)
    out = keras.layers.Dense(classes, activation="softmax", name="logits")(h)
    return keras.Model(inp, out, name="vowel_rnn")


def main(argv):
    del argv
    keras.utils.set_random_seed(FLAGS.seed)
    x_train, y_train, _ = load_japanese_vowels(FLAGS.data_dir, split="train")
    x_test, y_test, lengths = load_japanese_vowels(FLAGS.data_dir, split="test",
                                                   max_len=x_train.shape[1])
    model = build_model(x_train.shape[1], x_train.shape[2], FLAGS.units, 9)
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    print(f"Training {model.name} on {len(x_train)} sequences "
          f"(lengths up to {x_train.shape[1]}, {x_train.shape[2]} channels)...")
    model.fit(x_train, y_train, epochs=FLAGS.epochs, batch_size=32, verbose=2)
    _, acc = model.evaluate(x_test, y_test, verbose=0)
    print(f"Test accuracy: {acc:.3f}")

    x = x_test[: FLAGS.num_test]
    start = time.perf_counter()
    cert = keras_roll.certify(model, x)
    elapsed = time.perf_counter() - start
    print(f"\nCertified {len(x)} test sequences in {elapsed:.1f} s "
          f"({len(x) / elapsed:.0f} sequences/s).")
    cert.summary()
    binding = cert.binding[2]
    layers, counts = np.unique([b[0] for b in binding if b is not None], return_counts=True)
    print("Binding neurons of the l2 margin by layer:",
          ", ".join(f"{n}: {c}" for n, c in zip(layers, counts)))
    regions = keras_roll.count_regions(model, x)
    regions.summary()


if __name__ == "__main__":
    app.run(main)
