"""The compiled train steps that `benchmarks/step_time.py` and `python -m examples.mnist --timing`
time: the paper's MNIST setting (784-300x4-10 ReLU, SGD), cross-entropy + lam * ROLL.

No flags are defined here, so the examples can import it.

* `vanilla_step`: cross-entropy only;
* `roll_step`: exact ROLL through the perturbation (forward-mode) pass of
  `keras_roll.roll.loss`, or sampled ROLL (`samples=k` axes per example, `share_axes`);
* `autodiff_step`: the same exact loss through `tf.GradientTape.batch_jacobian`
  (reverse mode per neuron, vectorized by pfor): the paper's "back-propagation";
* `make_steps`: every variant `benchmarks/step_time.py` times.

Example:

```python
model = build()
step = compile_step(roll_step(model, keras_roll.linearize(model), samples=3), 64)
step(x, y)   # one SGD update, returns the loss
```
"""

from __future__ import annotations

import keras
import tensorflow as tf

import keras_roll
from keras_roll.compile.twin import DEFAULT_MEMORY_BUDGET
from keras_roll.roll import loss as roll

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


def exact_step_flops(b: int) -> dict[str, float]:
    """Matmul FLOPs of one exact ROLL step (see `benchmarks/step_time.py`)."""
    fwd = 2 * b * (D * H + (DEPTH - 1) * H * H + H * L)
    tangent = 2 * D * D * H + (DEPTH - 1) * 2 * b * D * H * H + 2 * b * D * H * L
    tangent_bwd = (DEPTH - 1) * 2 * (2 * b * D * H * H) + 2 * D * D * H
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


def roll_step(model: keras.Model, lin, samples=None, share_axes=False):
    """Cross-entropy + LAM * ROLL (exact by perturbation, or `samples` axes) + SGD."""
    variables = model.trainable_variables

    def step(x, y):
        with tf.GradientTape() as tape:
            reg, logits = roll.roll_loss(lin, x, C=C, samples=samples, share_axes=share_axes,
                                         return_logits=True)
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


def make_steps(model: keras.Model, b: int, samples: int):
    """`(fast, slow, lins)`: the compiled steps of `benchmarks/step_time.py` by name, and
    the twins by memory budget in MiB."""
    default = DEFAULT_MEMORY_BUDGET // 2**20
    lins = {mib: keras_roll.linearize(model, memory_budget=mib * 2**20)
            for mib in (1024, default, 16)}
    fast = {"vanilla": compile_step(vanilla_step(model), b),
            f"sampled ROLL, {samples} axes": compile_step(
                roll_step(model, lins[default], samples), b),
            f"sampled ROLL, {samples} shared axes": compile_step(
                roll_step(model, lins[default], samples, share_axes=True), b)}
    slow = {f"exact ROLL, perturbation ({mib} MiB)": compile_step(roll_step(model, lin), b)
            for mib, lin in lins.items()}
    slow["exact ROLL, autodiff batch_jacobian"] = compile_step(autodiff_step(model), b)
    return fast, slow, lins
