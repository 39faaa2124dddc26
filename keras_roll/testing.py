"""Test a linearization rule against `tf.GradientTape`: `check_rule`, `tape_jacobian`.

In the manner of Keras' `run_layer_test`: one call builds a small model around a
layer (or takes a model), linearizes it and compares the twin with references
that do not use the twin's tangent rules:

* the twin's output equals the Keras model's (`model(x, training=False)`);
* the output Jacobian equals the tape's (`tape_jacobian`: `tf.GradientTape`,
  one reverse pass per block of outputs) of the model's logits (before a folded
  softmax / sigmoid);
* the neuron Jacobians of the tangent pass equal the tape's Jacobian of the
  neurons' values computed by the forward pass (reverse mode through the primal
  rules against forward mode through the tangent rules);
* the pre-activations of every ReLU / LeakyReLU / PReLU / Activation layer, and
  their Jacobians, equal the tape's on the Keras model cut at that layer;
* all of the above again for the float64 twin (`lin.at_dtype("float64")`);
* the rounding guards of `rigor="strict"` and `rigor="float64"` are finite,
  not vacuous, and cover the observed error of the float32 neurons;
* each op's `training_dependent` flag says whether its layer computes something
  else with `training=True` (the layer's state is restored afterwards);
* where every op has a bound rule (`keras_roll.compile.bounds`): the intervals of
  every value and the linear relaxation's bounds of the output over a box around
  each input contain the values at points sampled in the box (and at its corners),
  and the interval of every affine op's output is exact: `J c +- |J| r` with the
  op's Jacobian `J` taken by `tf.GradientTape` (`keras_roll.testing.check_bounds`).

`RuleCheck.passes` says which passes accept each layer call: the twin (its
tangent pass), the rounding guards, the interval bounds and the linear relaxation.

A failure raises one `AssertionError` that lists every check that failed and
names the first layer whose own output Jacobian differs from the tape's.
docs/design.md, section "Rules"; docs/guide.md, section "Custom rules".
"""

from __future__ import annotations

from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from keras_roll.certification.margins import rounding_errors
from keras_roll.compile.bounds import (
    BoundMethod,
    BoundPass,
    bound_rule,
    capture,
    ibp,
    logit_margins,
    lower_bounds,
)
from keras_roll.compile.bounds import supported_passes as bound_passes
from keras_roll.compile.twin import Linearized, linearize
from keras_roll.robust.bounds import arithmetic_of

__all__ = ["PassSupport", "RuleCheck", "check_bounds", "check_rule", "tape_jacobian"]

BOUND_SAMPLES = 64  # points sampled in the box around each input (besides two corners)
MAX_TIGHTNESS_SIZE = 2**16  # Jacobian entries of an op checked for exact intervals at most


class PassSupport(NamedTuple):
    """Which passes accept one layer call.

    Attributes:
        twin: the twin's forward and tangent passes (checked against the tape).
        rounding: the rounding guards (`rigor="strict"` and `"float64"`) were checked.
        intervals: its ops have bound rules for interval bounds.
        relaxation: its ops have bound rules for the linear relaxation.
    """

    twin: bool
    rounding: bool
    intervals: bool
    relaxation: bool

_VISIBLE_ACTIVATIONS = (keras.layers.ReLU, keras.layers.LeakyReLU, keras.layers.PReLU,
                        keras.layers.Activation)
_MERGES = (keras.layers.Add, keras.layers.Subtract, keras.layers.Average,
           keras.layers.Concatenate, keras.layers.Multiply, keras.layers.Maximum,
           keras.layers.Minimum, keras.layers.Dot)
_RIGORS = ("strict", "float64")


class RuleCheck(NamedTuple):
    """What `check_rule` measured.

    Attributes:
        model: the model that was checked (built around the layer if one was given).
        x: the float32 inputs it was checked on.
        errors: per check, the largest deviation relative to the reference's
            largest magnitude; for the rounding guards, the largest excess of
            the observed error over the bound, as a fraction of the bound.
        training_flags: per layer call, `(step name, the ops' flag, what the
            layer does)`, whether it computes something else with `training=True`.
        inference_equals_training: what the twin says of the whole model.
        passes: per layer call (step name), the `PassSupport` of its ops.
    """

    model: keras.Model
    x: np.ndarray
    errors: dict[str, float]
    training_flags: list[tuple[str, bool, bool]]
    inference_equals_training: bool
    passes: dict[str, PassSupport]

    def failures(self, rtol: float) -> list[str]:
        """One line per check that failed with tolerance `rtol`."""
        lines = [f"{name}: off by {err:.2e}, relative to the reference (tolerance {rtol:.0e})"
                 for name, err in self.errors.items() if not err <= rtol]
        lines += [f"'{name}': its ops say training_dependent={flag}, but the layer "
                  f"{'does' if actual else 'does not'} compute something else with "
                  f"training=True" for name, flag, actual in self.training_flags
                  if flag != actual]
        if self.inference_equals_training and any(a for _, _, a in self.training_flags):
            lines.append("the twin says inference equals training, but a layer computes "
                         "something else with training=True")
        return lines


def check_rule(layer_or_model, input_shape=None, input_data=None, *, batch_size: int = 3,
               rtol: float = 1e-5, rounding: bool = True, seed: int = 0) -> RuleCheck:
    """Checks the linearization rules of a layer (or of every layer of a model).

    A layer is built into `Input(input_shape) -> layer -> ReLU -> Flatten ->
    Dense(3)`, so that its output feeds neurons; pass a model instead for a layer
    that needs several inputs, a mask or other layers around it (the model must be
    one keras_roll can linearize). The checks are listed in the module docstring.

    Args:
        layer_or_model: a `keras.layers.Layer` instance whose class has a rule
            (`keras_roll.register_rule`), or a `keras.Model`.
        input_shape: per-example input shape, without the batch axis. Needed for
            a layer unless `input_data` is given; a model's own shape by default.
        input_data: the inputs to check on, with a batch axis; by default
            `batch_size` standard-normal examples drawn with `seed`.
        batch_size: examples drawn when `input_data` is None.
        rtol: tolerance of every check, relative to the reference's largest
            magnitude (float32 arithmetic).
        rounding: also check the rounding guards (`rigor="strict"` and
            `"float64"`); False for a rule used only with `rigor="float32"`.
        seed: seed of the drawn inputs and of the weights of the added layers.

    Returns:
        A `RuleCheck` with every measured deviation.

    Raises:
        AssertionError: when a check fails; the message names the layer and
            lists what differed.
        keras_roll.UnsupportedModelError: when the model cannot be linearized
            (a layer without a rule).

    Example:

    ```python
    keras_roll.testing.check_rule(MyScale(2.0), input_shape=(4,))
    ```
    """
    if not (isinstance(rtol, (int, float)) and rtol > 0):
        raise ValueError(f"`rtol` must be a positive number, got {rtol!r}.")
    model = _model_for(layer_or_model, input_shape, input_data, seed)
    x = _inputs_for(model, input_data, batch_size, seed)
    lin = linearize(model)
    passes = {step.name: PassSupport(True, bool(rounding), *(
        all(p in bound_passes(op) for op in step.ops) for p in BoundPass))
        for step in lin.program.steps if step.ops}
    bounded = all(s.intervals and s.relaxation for s in passes.values())
    # The checks share the model's outputs and the float32 and float64 forward passes.
    out, fwd32, fwd64 = (model(x, training=False).numpy(), lin.forward(x),
                         lin.at_dtype("float64").forward(x))
    errors = {**_float32_errors(model, x, lin, out, fwd32),
              **_float64_errors(x, lin, out, fwd64),
              **(_guard_errors(lin, fwd32, fwd64) if rounding else {}),
              **(check_bounds(lin, x, seed=seed) if bounded else {})}
    flags = _training_flags(model, x, lin)
    result = RuleCheck(model, x, errors, flags, lin.inference_equals_training, passes)
    failed = result.failures(rtol)
    if failed:
        culprit = _first_deviating_layer(model, x, rtol)
        where = f"; first layer whose output Jacobian differs: {culprit}" if culprit else ""
        raise AssertionError(
            f"check_rule: the rules of model '{model.name}' ({_describe(layer_or_model)}) "
            f"disagree with the references{where}:\n  " + "\n  ".join(failed))
    return result


def _describe(layer_or_model) -> str:
    kind = type(layer_or_model).__name__
    return f"layer '{layer_or_model.name}' of class {kind}" if not isinstance(
        layer_or_model, keras.Model) else f"{kind} model"


def _model_for(layer_or_model, input_shape, input_data, seed) -> keras.Model:
    if isinstance(layer_or_model, keras.Model):
        return layer_or_model
    if not isinstance(layer_or_model, keras.layers.Layer):
        raise TypeError(f"check_rule takes a keras.layers.Layer or a keras.Model, got "
                        f"{type(layer_or_model).__name__}.")
    if input_shape is None and input_data is None:
        raise ValueError(f"check_rule needs `input_shape` (or `input_data`) to build a model "
                         f"around layer '{layer_or_model.name}', e.g. input_shape=(4,).")
    shape = tuple(input_shape) if input_shape is not None else np.shape(input_data)[1:]
    keras.utils.set_random_seed(seed)
    inp = keras.Input(shape)
    h = layer_or_model(inp)
    h = keras.layers.ReLU(name="check_rule_relu")(h)
    h = keras.layers.Flatten(name="check_rule_flatten")(h)
    out = keras.layers.Dense(3, name="check_rule_logits")(h)
    return keras.Model(inp, out, name=f"check_rule_{layer_or_model.name}")


def _inputs_for(model, input_data, batch_size, seed) -> np.ndarray:
    if input_data is not None:
        return np.asarray(input_data, dtype="float32")
    shape = tuple(model.inputs[0].shape[1:])
    if None in shape:
        raise ValueError(f"Model '{model.name}' has an input of unknown size {shape}: "
                         f"pass `input_data` to check_rule.")
    return np.random.default_rng(seed).normal(size=(batch_size, *shape)).astype("float32")


def _relative(actual, expected) -> float:
    """Max |actual - expected| relative to max |expected| (0 when both vanish)."""
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-12)
    return float(np.max(np.abs(np.asarray(actual) - expected), initial=0.0)) / scale


def tape_jacobian(fn, x, rows_per_pass: int = 2048, per_output: bool = False):
    """Values and input Jacobians of `fn(x)` by back-propagation (`tf.GradientTape`).

    The reference of `check_rule`, independent of the twin. Row `j` of every
    example's Jacobian is the gradient of output `j`: the batch is tiled, copy `i`
    differentiates output `j0 + i`, and one reverse pass gives a block of rows
    (`rows_per_pass` rows of the tiled batch at most). On small models this is
    much cheaper than `tape.batch_jacobian`, which loops or traces a vectorized
    graph per call; `fn` must treat the examples of a batch independently, as a
    model in inference does.

    Args:
        fn: `fn(x) -> tensor or nested tensors` `[B, ...]` each; they are
            flattened per example and concatenated.
        x: `[B, *input_shape]` numpy array.
        rows_per_pass: the largest tiled batch of one reverse pass.
        per_output: return one block per tensor of `fn(x)` instead of their
            concatenation.

    Returns:
        `(values [B, n], jacobian [B, n, D])` numpy, `D` the flattened input size;
        with `per_output=True`, `(values, jacobians)` lists, one `[B, n_i]` and one
        `[B, n_i, D]` per tensor of `fn(x)`.

    Example:

    ```python
    values, jac = tape_jacobian(lambda t: model(t, training=False), x)
    ```
    """

    def flat(t):
        outs = [tf.reshape(o, (t.shape[0], -1)) for o in tf.nest.flatten(fn(t))]
        return tf.concat(outs, axis=1), [int(o.shape[1]) for o in outs]

    x = np.asarray(x)
    b, d = x.shape[0], int(np.prod(x.shape[1:]))
    values, sizes = flat(tf.constant(x))
    values = values.numpy()
    n = values.shape[1]
    jac = np.zeros((b, n, d), values.dtype)
    per = max(1, rows_per_pass // max(b, 1))
    for j0 in range(0, n, per):
        k = min(per, n - j0)
        xt = tf.constant(np.tile(x, (k,) + (1,) * (x.ndim - 1)))  # copy i: rows i*b .. i*b+b-1
        with tf.GradientTape() as tape:
            tape.watch(xt)
            out = tf.reshape(flat(xt)[0][:, j0:j0 + k], (k, b, k))
            total = tf.reduce_sum(tf.linalg.diag_part(tf.transpose(out, (1, 0, 2))))
        grad = tape.gradient(total, xt)
        grad = np.zeros((k * b, d), values.dtype) if grad is None else grad.numpy()
        jac[:, j0:j0 + k] = grad.reshape(k, b, d).transpose(1, 0, 2)
    if not per_output:
        return values, jac
    ends = np.cumsum([0] + sizes)
    return ([values[:, a:e] for a, e in zip(ends[:-1], ends[1:])],
            [jac[:, a:e] for a, e in zip(ends[:-1], ends[1:])])


def _logits_tensor(model: keras.Model, lin: Linearized):
    if lin.output_link is None:
        return model.outputs[0]
    return model.layers[-1].input  # before the folded link


def _float32_errors(model, x, lin, out, fwd) -> dict[str, float]:
    errors = {"output": _relative(
        lin.apply_output_link(fwd.logits).numpy().reshape(out.shape), out)}
    layout = lin.layout(x.shape[1:])
    units = {u.name for u in layout.units}
    visible = [layer for layer in model.layers
               if isinstance(layer, _VISIBLE_ACTIVATIONS) and layer.name in units]
    # One tape: the logits and every visible pre-activation (the model cut there),
    # then the neurons of the twin's forward pass.
    cut = keras.Model(model.inputs[0], [_logits_tensor(model, lin)]
                      + [layer.input for layer in visible])
    values, refs = tape_jacobian(
        lambda t: [*tf.nest.flatten(cut(t, training=False)), lin.primal(t).neurons.z], x,
        per_output=True)
    errors["output jacobian"] = _relative(lin.output_jacobian(x), refs[0])
    jac = lin.jacobian(x)
    errors["neuron jacobians"] = _relative(jac, refs[-1])
    z = fwd.neurons.z.numpy()
    for layer, value, ref in zip(visible, values[1:-1], refs[1:-1]):
        rows = layout.rows(layer.name)
        errors[f"'{layer.name}' pre-activations"] = _relative(z[:, rows], value)
        errors[f"'{layer.name}' jacobian"] = _relative(jac[:, rows], ref)
    return errors


def _float64_errors(x, lin, out, fwd64) -> dict[str, float]:
    twin = lin.at_dtype("float64")
    out = out.astype(np.float64)
    _, ref = tape_jacobian(lambda t: twin.primal(t).neurons.z, x.astype(np.float64))
    logits = fwd64.logits
    return {
        "float64 output": _relative(twin.apply_output_link(logits).numpy().reshape(out.shape),
                                    out),
        "float64 neuron jacobians": _relative(twin.jacobian(x), ref),
    }


def _guard_errors(lin, fwd32, fwd) -> dict[str, float]:
    """The guards certificates subtract against the float32 neurons' observed error.

    Each guard bounds `|z32 - z64|` (the model's float32 evaluation against the
    float64 twin) per neuron at `x`. Reported: by how much the observed error
    exceeds the bound, as a fraction of the bound (0 when the bound holds; inf
    where a bound of 0 is exceeded); a bound that is not finite or vanishes
    everywhere counts as inf too.
    """
    twin = lin.at_dtype("float64")
    z64 = fwd.neurons.z.numpy()
    valid = fwd.neurons.valid.numpy()
    observed = np.where(valid, np.abs(fwd32.neurons.z.numpy() - z64), 0.0)
    errors = {}
    for rigor in _RIGORS:
        bound = rounding_errors(twin, fwd, rigor).at_x
        usable = bool(np.all(np.isfinite(bound[valid]))) and (
            not valid.any() or bool(np.any(bound[valid] > 0)))
        with np.errstate(divide="ignore", invalid="ignore"):
            excess = np.where(observed > bound, observed / bound - 1.0, 0.0)
        errors[f"rounding guard of rigor '{rigor}'"] = (
            float(np.max(excess, initial=0.0)) if usable else float("inf"))
    return errors


def _training_flags(model, x, lin) -> list[tuple[str, bool, bool]]:
    steps = [step for step in lin.program.steps
             if step.ops and isinstance(step.layer, keras.layers.Layer)]
    inputs = _layer_inputs(model, x, [step.layer for step in steps])
    return [(step.name, any(op.training_dependent for op in step.ops),
             _changes_in_training(step.layer, value))
            for step, value in zip(steps, inputs) if value is not None]


def _layer_inputs(model, x, layers) -> list:
    """Each layer's input at `x`, the model in inference (None where it is not a tensor
    of the model: a shared layer, a layer of a nested model): one cut of the model at
    every layer's input, or one cut per layer where that fails."""

    def cut(some):  # a model of one output returns it alone, not in a list
        try:
            outputs = [la.input for la in some] if len(some) > 1 else some[0].input
            values = keras.Model(model.inputs[0], outputs)(x, training=False)
        except (AttributeError, ValueError):
            return None
        return list(values) if len(some) > 1 else [values]

    every = cut(layers) if layers else []
    return every if every is not None else [(cut([la]) or [None])[0] for la in layers]


def _changes_in_training(layer, inputs) -> bool:
    """Whether `layer` computes something else with training=True on `inputs`. Its
    variables are restored."""
    if isinstance(inputs, (list, tuple)) and not isinstance(layer, _MERGES):
        inputs = inputs[0]  # a recurrent layer's input also lists its mask
    saved = [v.numpy() for v in layer.variables]
    try:
        train = keras.ops.convert_to_numpy(layer(inputs, training=True))
        infer = keras.ops.convert_to_numpy(layer(inputs, training=False))
    finally:
        for v, value in zip(layer.variables, saved):
            v.assign(value)
    return not np.allclose(train, infer)


def _first_deviating_layer(model, x, rtol) -> str | None:
    """The first layer, in model order, whose output's Jacobian (the model cut at
    that layer, linearized) differs from the tape's."""
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        try:
            cut = keras.Model(model.inputs[0], layer.output)
            lin = linearize(cut)
        except (AttributeError, ValueError):
            continue  # a shared layer, or a cut keras_roll refuses
        if lin.output_link is not None:
            continue
        _, ref = tape_jacobian(lambda t, m=cut: m(t, training=False), x)
        if not _relative(lin.output_jacobian(x), ref) <= rtol:
            return f"'{layer.name}' ({type(layer).__name__})"
    return None


def check_bounds(model, x, eps: float = 0.1, seed: int = 0) -> dict[str, float]:
    """The bound passes of a model against sampled points and the tape, in float64.

    Over the box `|x' - x| <= eps` around every input: the largest excess of a value
    at a sampled point (`BOUND_SAMPLES` uniform points and the two corners `x +- eps`)
    over its interval (every op's output) and over the linear relaxation's bounds of
    the output, relative to the interval's width; and, for every affine op with at
    most `MAX_TIGHTNESS_SIZE` Jacobian entries, how far its interval is from the exact
    `J c +- |J| r` (relative to `|J| r`), `J` the tape's Jacobian of its forward pass
    (every op whose bound rule says it is linear).

    Args:
        model: a Keras model or its `Linearized`; every op needs a bound rule.
        x: `[B, *input_shape]` inputs.
        eps: the half width of the box.
        seed: seed of the sampled points.

    Returns:
        `{check name: relative error}` (0 where the bounds hold and are exact).

    Example:

    ```python
    errors = keras_roll.testing.check_bounds(model, x[:2])
    ```
    """
    twin = linearize(model).at_dtype("float64")
    x = np.asarray(x, np.float64)
    b = x.shape[0]
    lm = logit_margins(twin.interpreter, tf.constant(x))
    structure, values = lm.structure, lm.values
    arithmetic = arithmetic_of(twin, guard=False)
    boxes = ibp.interval_pass(structure, values, tf.fill([b], eps), arithmetic).boxes
    rng = np.random.default_rng(seed)
    u = rng.uniform(-1.0, 1.0, (BOUND_SAMPLES + 2, *x.shape))
    u[0], u[1] = 1.0, -1.0
    points = capture(twin.interpreter, tf.constant((x[None] + eps * u).reshape(-1, *x.shape[1:])))

    def excess(key, lo, hi):
        d = points.value(structure, key).numpy().reshape(len(u), b, -1) - \
            values.value(structure, key).numpy().reshape(1, b, -1)
        lo, hi = lo.reshape(1, b, -1), hi.reshape(1, b, -1)
        width = max(float(np.max(hi - lo, initial=0.0)), 1e-12)
        return float(np.max(np.maximum(d - hi, lo - d), initial=0.0).clip(0.0)) / width

    errors = {"intervals at sampled points": max(
        excess(n.output, boxes[n.output].lo.numpy(), boxes[n.output].hi.numpy())
        for n in structure.nodes)}
    n_out = int(lm.logits.shape[-1])
    eye = np.eye(n_out)[None]
    low = lower_bounds(structure, values, tf.constant(np.concatenate([eye, -eye], 1)),
                       tf.fill([b], eps), np.inf, BoundMethod.RELAXATION, arithmetic).numpy()
    errors["relaxation at sampled points"] = excess(structure.output_key, low[:, :n_out],
                                                   -low[:, n_out:])
    errors["intervals of affine ops (exact)"] = max(
        [_affine_gap(n, values.inputs[i], boxes) for i, n in enumerate(structure.nodes)
         if bound_passes(n.op) and bound_rule(n.op).linear] + [0.0])
    return errors


def _affine_gap(node, inputs, boxes) -> float:
    """How far the interval of an affine op's output is from `J c +- |J| r` (example 0)."""
    ins = [tf.constant(v[:1]) for v in inputs]
    if sum(int(np.prod(v.shape)) for v in ins) * int(np.prod(
            boxes[node.output].lo.shape[1:])) > MAX_TIGHTNESS_SIZE:
        return 0.0
    centre = radius = 0.0
    for i, key in enumerate(node.inputs):

        def fn(t, i=i):
            args = [t if j == i else tf.repeat(v, tf.shape(t)[0], 0) for j, v in enumerate(ins)]
            return node.op.forward(args, None)[0]

        _, jac = tape_jacobian(fn, inputs[i][:1].numpy())
        box = boxes[key]
        lo, hi = box.lo.numpy()[:1].reshape(-1), box.hi.numpy()[:1].reshape(-1)
        centre = centre + jac[0] @ ((lo + hi) / 2.0)
        radius = radius + np.abs(jac[0]) @ ((hi - lo) / 2.0)
    out = boxes[node.output]
    got_lo, got_hi = out.lo.numpy()[:1].reshape(-1), out.hi.numpy()[:1].reshape(-1)
    scale = max(float(np.max(radius, initial=0.0)), 1e-12)
    return float(max(np.max(np.abs(got_lo - (centre - radius)), initial=0.0),
                     np.max(np.abs(got_hi - (centre + radius)), initial=0.0))) / scale
