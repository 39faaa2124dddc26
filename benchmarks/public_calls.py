"""Median times of the public calls on fixed models, for before / after comparisons.

Run it from the root of each tree to compare, alternating the trees (the numbers of
two processes compare only when they ran back to back on an otherwise idle machine):

    python -m benchmarks.public_calls        # prints `name seconds` per call

The calls: certify (default and float32 rigor) and robust_radius (region) on 200
inputs of a 784-300x4-10 MLP, robust_radius (relaxation) and exact integrated
gradients on 8 inputs of a 784-100x2-10 MLP, saliency, the expected gradient
distortion, and exact / sampled ROLL training steps on a batch of 64.
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.getcwd())
import keras
import numpy as np

import keras_roll


def mlp(widths=(300, 300, 300, 300), d=784, seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((d,))
    h = inp
    for w in widths:
        h = keras.layers.Dense(w, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))

model = mlp()
rng = np.random.default_rng(0)
x = rng.uniform(0, 1, (200, 784)).astype("float32")
y = np.argmax(model.predict(x, verbose=0), 1)
small = mlp((100, 100), seed=1)
ys = np.argmax(small.predict(x[:8], verbose=0), 1)

def t(name, fn, reps=3):
    fn()  # warm
    best = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best.append(time.perf_counter() - start)
    print(f"{name} {np.median(best):.4f}", flush=True)

t("certify_default_200", lambda: keras_roll.certify(model, x, verbose=False))
t("certify_float32_200",
  lambda: keras_roll.certify(model, x, rigor="float32", verbose=False))
t("robust_relaxation_8", lambda: keras_roll.robust_radius(
    small, x[:8], ys, method="relaxation", verbose=False), reps=2)
t("robust_region_200",
  lambda: keras_roll.robust_radius(model, x, y, method="region", verbose=False))
t("saliency_200", lambda: keras_roll.saliency(model, x, y))
t("ig_exact_8",
  lambda: keras_roll.integrated_gradients(small, x[:8], ys, verbose=False), reps=2)
t("distortion_expected_32", lambda: keras_roll.gradient_distortion(
    model, x[:32], y[:32], eps=0.03, mode="expected", samples=200, seed=0, verbose=False))
w = keras_roll.wrap(model, lam=2.0, C=1.0)
w.compile("sgd", "sparse_categorical_crossentropy")
xb, yb = x[:64], y[:64]
w.train_on_batch(xb, yb)
t("roll_exact_step_64", lambda: w.train_on_batch(xb, yb), reps=5)
ws = keras_roll.wrap(model, lam=2.0, C=1.0, samples=8)
ws.compile("sgd", "sparse_categorical_crossentropy")
ws.train_on_batch(xb, yb)
t("roll_sampled_step_64", lambda: ws.train_on_batch(xb, yb), reps=5)
