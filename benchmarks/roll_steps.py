"""The compiled train steps that `benchmarks/step_time.py` and `python -m examples.mnist --timing`
time: the paper's MNIST setting (784-300x4-10 ReLU, SGD), cross-entropy + lam * ROLL.

No flags are defined here, so the examples can import it.

* `vanilla_step`: cross-entropy only;
* `roll_step`: exact ROLL through the perturbation (forward-mode) pass of
  `keras_roll.roll.loss` as `fit` runs it (each chunk differentiated in the
  forward pass), along per-example factors of the Gram matrix of the first
  layer's active units (the batch's most active units, about 160 of 300 here:
  the default) or along the 784 input axes (`fewest_directions=False`); or
  sampled ROLL (`samples=k` axes per example, `share_axes`);
* `h1_factor_step`: exact ROLL along the 300 rows of a factor of the first
  layer's whole Gram matrix (the default before the active units);
* `autodiff_step`: the same exact loss through `tf.GradientTape.batch_jacobian`
  (reverse mode per neuron, vectorized by pfor): the paper's "back-propagation";
* `make_steps`: every variant `benchmarks/step_time.py` times;
* `vowels_batch` and `sequence_steps`: the paper's Japanese Vowels scoRNN(512)
  exact ROLL step (AMSGrad replaced by SGD), along every input axis and along the
  valid (unpadded) axes only.

Example:

```python
model = build()
step = compile_step(roll_step(model, keras_roll.linearize(model), samples=3), 64)
step(x, y)   # one SGD update, returns the loss
```
"""

from __future__ import annotations

from unittest import mock

import keras
import numpy as np
import tensorflow as tf

import keras_roll
from keras_roll.compile.rules import recurrent
from keras_roll.compile.twin import DEFAULT_MEMORY_BUDGET
from keras_roll.roll import exact as exact_paths
from keras_roll.roll import loss as roll
from keras_roll.roll.config import RollConfig

D, H, DEPTH, L = 784, 300, 4, 10
LAM, C, LR = 1.0, 1.0, 0.01


def build() -> keras.Model:
    """784-300x4-10 with separate ReLU layers (the baseline needs the pre-activations)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((D,))
    h = inp
    for i in range(DEPTH):
        h = keras.layers.Dense(H, name=f"fc{i}")(h)
        h = keras.layers.ReLU(name=f"relu{i}")(h)
    return keras.Model(inp, keras.layers.Dense(L, name="logits")(h), name="mnist_fc")


def weight_reset(model: keras.Model):
    """A function that puts back the weights `model` has now.

    Every step here is an SGD update of the one shared model: timed again and again, the
    steps would train it (on one batch, towards every first-layer unit active), and later
    repetitions would time another network. Pass it as `interleaved_medians(setup=...)`.

    Example:

    ```python
    times = interleaved_medians(steps, repeats=9, setup=weight_reset(model))
    ```
    """
    initial = [v.numpy() for v in model.weights]

    def reset():
        for v, w in zip(model.weights, initial):
            v.assign(w)

    return reset


def exact_step_flops(b: int, directions: int = D) -> dict[str, float]:
    """Matmul FLOPs of one exact ROLL step (see `benchmarks/step_time.py`) along
    `directions` directions per example: the D input axes, or fewer (the H rows of the
    first layer's Gram factor, or the batch's most active first-layer units), which
    start after the first layer."""
    fwd = 2 * b * (D * H + (DEPTH - 1) * H * H + H * L)
    k = directions
    factored = k < D
    first = 2 * D * H * H if factored else 2 * D * D * H  # W^T W, or one-hot rows
    tangent = first + (DEPTH - 1) * 2 * b * k * H * H + 2 * b * k * H * L
    first_bwd = 2 * (2 * D * H * H) if factored else 2 * D * D * H  # L^-1 W^T and Q dR
    tangent_bwd = (DEPTH - 1) * 2 * (2 * b * k * H * H) + first_bwd
    return {"forward+backward": 3 * fwd - 2 * b * D * H, "tangent": tangent,
            "tangent backward": tangent_bwd}


def _sgd(tape, loss, variables):
    grads = tape.gradient(loss, variables)
    for v, g in zip(variables, grads):
        if g is not None:
            v.assign_sub(LR * g)


def _ce(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


def compile_step(fn, b: int):
    """`tf.function` of a step `fn(x, y)` for `[b, 784]` inputs and `[b]` int labels."""
    spec = [tf.TensorSpec([b, D]), tf.TensorSpec([b], tf.int32)]
    return tf.function(fn, input_signature=spec, autograph=False)


def vanilla_step(model: keras.Model):
    """Cross-entropy + SGD."""
    variables = model.trainable_variables

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _ce(y, model(x, training=True))
        _sgd(tape, loss, variables)
        return loss

    return step


def roll_step(model: keras.Model, lin, samples=None, share_axes=False,
              fewest_directions=True):
    """Cross-entropy + LAM * ROLL (exact by perturbation, or `samples` axes) + SGD, as
    `wrap(model).fit` computes it (`precompute_gradient=True`)."""
    config = RollConfig(C=C, samples=samples, share_axes=share_axes,
                        fewest_directions=fewest_directions)
    return _config_step(lin, config, model.trainable_variables)


def _config_step(lin, config: RollConfig, variables):
    """One SGD step on cross-entropy + LAM * the ROLL loss of `config`."""

    def step(x, y):
        with tf.GradientTape() as tape:
            reg, logits = roll.loss_from_config(lin, x, config, return_logits=True,
                                                precompute_gradient=True)
            loss = _ce(y, logits) + LAM * tf.reduce_mean(reg)
        _sgd(tape, loss, variables)
        return loss

    return step


def autodiff_step(model: keras.Model):
    """The exact loss by `tf.GradientTape.batch_jacobian` of the pre-activations."""
    variables = model.trainable_variables
    pre = keras.Model(model.inputs, [model.get_layer(f"fc{i}").output for i in range(DEPTH)])

    def step(x, y):
        with tf.GradientTape() as tape:
            with tf.GradientTape(persistent=True) as inner:
                inner.watch(x)
                z = tf.concat(pre(x), axis=1)  # [B, N] pre-activations
            jac = inner.batch_jacobian(z, x)  # [B, N, D]
            reg = tf.reduce_mean(tf.reduce_sum(jac**2, -1) + C * tf.nn.relu(1.0 - tf.abs(z)), 1)
            loss = _ce(y, model(x, training=True)) + LAM * tf.reduce_mean(reg)
        _sgd(tape, loss, variables)
        return loss

    return step


EXACT_BUDGETS_MIB = (16, DEFAULT_MEMORY_BUDGET // 2**20, 256, 1024)  # 1 GiB: one chunk


def make_steps(model: keras.Model, b: int, samples: int, budgets=EXACT_BUDGETS_MIB):
    """`(fast, exact, slow, lins)`: the compiled steps of `benchmarks/step_time.py` by name
    (exact ROLL along the active units' factors (the default) and along the input axes
    at each budget in `budgets`, along the active units and along the H1 rows of the
    first layer's Gram factor with `memory_budget="auto"`), and the twins by memory
    budget in MiB ("auto" too)."""
    default = DEFAULT_MEMORY_BUDGET // 2**20
    lins = {mib: keras_roll.linearize(model, memory_budget=mib * 2**20)
            for mib in sorted({*budgets, default})}
    fast = {"vanilla": compile_step(vanilla_step(model), b),
            f"sampled ROLL, {samples} axes": compile_step(
                roll_step(model, lins[default], samples), b),
            f"sampled ROLL, {samples} shared axes": compile_step(
                roll_step(model, lins[default], samples, share_axes=True), b)}
    exact = {}
    for mib in budgets:
        exact[exact_name(True, mib)] = compile_step(roll_step(model, lins[mib]), b)
        exact[exact_name(False, mib)] = compile_step(
            roll_step(model, lins[mib], fewest_directions=False), b)
    lins["auto"] = keras_roll.linearize(model)  # the default: chunks sized by a probe
    exact[exact_name(True, "auto")] = compile_step(roll_step(model, lins["auto"]), b)
    exact[H1_FACTOR] = h1_factor_step(model, b)
    slow = {"exact ROLL, autodiff batch_jacobian": compile_step(autodiff_step(model), b)}
    return fast, exact, slow, lins


H1_FACTOR = "exact ROLL, H1 factor rows (auto)"


def h1_factor_step(model: keras.Model, b: int):
    """The exact step along the H1 rows of the first layer's Gram factor (the default
    before the active units' factors), `memory_budget="auto"`: compiled with the ReLU
    after the first layer not recognised, on a twin of a copy of `model` (so that its
    chunk probe is its own)."""
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    step = compile_step(roll_step(twin, keras_roll.linearize(twin)), b)
    with mock.patch.object(exact_paths, "first_activation", lambda program, index: None):
        step.get_concrete_function()  # traced (and tuned) without the active units
    return step


def exact_name(fewest: bool, mib: int | str) -> str:
    """The name of an exact ROLL step variant in `make_steps` (`mib="auto"` too): along
    the fewest directions (the active units' factors) or the input axes."""
    size = "auto" if mib == "auto" else f"{mib} MiB"
    return f"exact ROLL, {'active units' if fewest else 'input axes'} ({size})"


def vowels_batch(batch: int = 32, bucketed: bool = False, seed: int = 0):
    """`(x, y)`: `batch` Japanese Vowels training sequences (the embedded copy), padded
    to the split's longest (26 steps), or (`bucketed`) `batch` sequences of similar
    length padded to their longest, as `examples/japanese_vowel.py` batches them."""
    from keras_roll.data import load_japanese_vowels

    x, y, lengths = load_japanese_vowels(split="train")
    rng = np.random.default_rng(seed)
    if bucketed:
        order = np.argsort(lengths + rng.uniform(0, 0.5, len(lengths)))
        start = rng.integers(0, len(order) - batch)
        idx = order[start:start + batch]
        x = x[:, :int(lengths[idx].max())]
    else:
        idx = rng.choice(len(y), batch, replace=False)
    return tf.constant(x[idx]), tf.constant(y[idx].astype("int32"))


def sequence_steps(units: int = 512, shape=(26, 12), batch: int = 32):
    """`{name: compiled step}`: exact ROLL on the scoRNN(units) classifier along every
    input axis (the default), the same with the recurrence run over every step for
    every chunk of directions (the step before the loop started at a chunk's first
    step), and along the valid axes only (`skip_padded_steps=True`, `PackedAxes`),
    for `[batch, *shape]`. Each variant has its own model (same weights), so that
    `memory_budget="auto"` tunes each."""
    spec = [tf.TensorSpec([batch, *shape]), tf.TensorSpec([batch], tf.int32)]

    def step_fn(valid_only):
        keras.utils.set_random_seed(0)
        model = keras_roll.models.scornn_classifier(units=units)
        lin = keras_roll.linearize(model)
        step = _config_step(lin, RollConfig(C=C, skip_padded_steps=valid_only),
                            model.trainable_variables)
        return tf.function(step, input_signature=spec, autograph=False)

    every_step = step_fn(False)
    with mock.patch.object(recurrent, "first_nonzero_step",
                           lambda t, axis=0: tf.constant(0, tf.int64)):
        every_step.get_concrete_function()  # traced (and tuned) with the loop from step 0
    return {"exact ROLL, every input axis": step_fn(False),
            "exact ROLL, every axis and step (before)": every_step,
            "exact ROLL, valid axes only": step_fn(True)}
