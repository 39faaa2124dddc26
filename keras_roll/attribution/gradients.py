"""Input gradients of one logit per example, by reverse mode, compiled and chunked.

Saliency maps, integrated gradients and gradient distortion all need the input
gradient of a single logit (the label's) at many points. Examples are independent,
so one `tf.GradientTape` backward pass over a batch of points, on the sum of their
selected logits, gives every point's gradient at once: the cheap way (forward mode
would need one pass per input axis). The logits are those of the frozen-pattern
twin (`keras_roll.linearize`): a final softmax / sigmoid is folded, and the same
pass reports each point's activation pattern, so that two points in the same
linear region are known to have *exactly* the same gradient.

Points are pushed through in chunks sized from the twin's activation sizes so that
a chunk's live tensors stay under a memory budget. This module also holds the
argument checks shared by `keras_roll.attribution` and `keras_roll.attribution.distortion`.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_roll.attribution.targets import class_labels
from keras_roll.compile.caches import cached
from keras_roll.compile.chunking import plan_directions
from keras_roll.compile.twin import Linearized, linearize

__all__ = [
    "LogitGradients",
    "Reference",
    "check_count",
    "chunked_gradients",
    "chunked_logits",
    "check_inputs",
    "check_labels",
    "predictions",
    "predictions_np",
    "same_pattern",
]

# Elements per point kept live by a compiled chunk: the activations kept for the
# backward pass and their gradients (about 2 N pre-activations and activations, and
# the logits, twice), the pattern records (piece, valid) and a few copies of the
# input (the point, its gradient, the reference gradient it is compared to).
_ACTIVATION_COPIES = 2
_NEURON_COPIES = 2
_INPUT_COPIES = 4
# Reverse mode keeps one set of activations per point, not K tangents. Chunks of about
# 32 MiB of live tensors (half the twin's default tangent budget) measured fastest on a
# 2-core CPU for both an MLP and a CNN (larger chunks spill the caches): the default.
BUDGET_FACTOR = 0.5
# Distances below this fraction of ||g(x)||_1 are round-off candidates: their pattern
# is compared with the reference's, and an equal pattern gives an exact 0.
SNAP = 1e-3

_UNBOUNDED = 2**62  # "as many points as fit"


class Reference(NamedTuple):
    """What a candidate is compared to: the reference point's gradient and pattern.

    Attributes:
        grad: `[G, D]` input gradient of the selected logit at each reference point.
        grad_l1: `[G]` float64 numpy, `||grad||_1`.
        piece: `[G, N]` int32 activation pattern at each reference point.
        valid: `[G, N]` bool, which neurons exist at each reference point.
        pred: `[G]` int64 prediction at each reference point.
        index: `[G]` int32 selected (flattened) logit.
        sign: `[G]` +1 or -1 applied to the selected logit.
    """

    grad: tf.Tensor
    grad_l1: np.ndarray
    piece: tf.Tensor
    valid: tf.Tensor
    pred: tf.Tensor
    index: tf.Tensor
    sign: tf.Tensor


class LogitGradients:
    """Compiled, chunked input gradients of one logit per point.

    Use `LogitGradients.of(model)`: engines are cached per linearized model, so
    their compiled functions are traced once.

    Args:
        lin: a `Linearized` model.

    Example:

    ```python
    engine = LogitGradients.of(model)
    grad, logits = engine.gradients(x, index=y, sign=np.ones(len(y)))
    ```
    """

    piecewise_linear = True
    note = None
    affine_prefix = None  # set from the twin (`keras_roll.compile.prefix`)

    def __init__(self, lin: Linearized):
        self.lin = lin
        self.dtype = lin.dtype
        self.input_shape = lin.input_shape
        self.output_link = lin.output_link
        self._wgrad_fn = tf.function(self.objective_gradient, reduce_retracing=True,
                                     autograph=False)
        self._logits_fn = tf.function(lambda x: self._primal(x).logits, reduce_retracing=True,
                                      autograph=False)
        self._grad_fn = tf.function(self._grad_impl, reduce_retracing=True, autograph=False)
        self._dist_fn = tf.function(self._dist_impl, reduce_retracing=True, autograph=False)
        self._same_fn = tf.function(self._same_impl, reduce_retracing=True, autograph=False)
        self._sizes: dict = {}
        self.affine_prefix = lin.affine_prefix
        # The twin's forward pass traced into the caller's graph (`Linearized.primal`)
        # lets TensorFlow prune the records a gradient does not need; a nested
        # compiled `forward` would compute and keep them all for the backward pass.
        self._primal = getattr(lin, "primal", lin.forward)

    @classmethod
    def of(cls, model) -> LogitGradients:
        """The (cached) engine of a Keras model or `Linearized`."""
        lin = model if isinstance(model, Linearized) else linearize(model)
        return cached(lin, ("engine", cls), lambda: cls(lin))

    # ------------------------------------------------------------------ sizes

    def sizes(self, example_shape) -> tuple[int, int]:
        """`(L, N)`: flattened logits and neurons per example of this shape (from one
        batch-1 forward pass, cached)."""
        shape = tuple(int(d) for d in example_shape)
        if shape not in self._sizes:
            with tf.init_scope():
                fwd = self.lin.forward(np.zeros((1, *shape), self.dtype))
            self._sizes[shape] = (int(np.prod(fwd.logits.shape[1:])),
                                  int(fwd.neurons.z.shape[-1]))
        return self._sizes[shape]

    def num_logits(self, example_shape) -> int:
        """L, the number of (flattened) logits for inputs of this per-example shape."""
        return self.sizes(example_shape)[0]

    def chunk_size(self, example_shape, memory_budget: int | None = None,
                   total: int | None = None, scale: float = 1.0) -> int:
        """Points per compiled call so that one call's live tensors fit the budget.

        Per point: the activations kept for the backward pass and their gradients
        (about 2 N pre-activations and activations, and the logits), the pattern
        records, and a few copies of the input; `scale` multiplies that estimate.
        With `total` points to process, the chunks are balanced
        (`keras_roll.compile.chunking.plan_directions`).
        """
        d = int(np.prod(example_shape))
        n_logits, n_neurons = self.sizes(example_shape)
        elements = (_ACTIVATION_COPIES * (2 * n_neurons + n_logits)
                    + _NEURON_COPIES * n_neurons + _INPUT_COPIES * d)
        per_point = int(max(1, scale * elements) * np.dtype(self.dtype).itemsize)
        budget = int(memory_budget or BUDGET_FACTOR * self.lin.memory_budget)
        total = _UNBOUNDED if total is None else max(1, int(total))
        return int(max(1, plan_directions(total, per_point, budget)[0]))

    # ------------------------------------------------------------------ compiled

    def select(self, x, index, sign, trace: bool = False):
        """Traceable core: `(grad, logits [n, L], neurons)` of `sign * logits[:, index]`,
        and the forward pass's `Trace` with `trace=True`.

        For use inside a `tf.function` (the other methods are compiled already).
        """
        with tf.GradientTape() as tape:
            tape.watch(x)
            fwd = self._primal(x)
            logits = tf.reshape(fwd.logits, tf.stack([tf.shape(x)[0], -1]))
            picked = tf.gather(logits, index, axis=1, batch_dims=1)
            total = tf.reduce_sum(picked * sign)
        grad = tape.gradient(total, x)
        if grad is None:  # the selected logit does not depend on the input
            grad = tf.zeros_like(x)
        if trace:
            return grad, logits, fwd.neurons, fwd.trace
        return grad, logits, fwd.neurons

    def objective_gradient(self, x, weights, neurons: bool = False, entry=None):
        """Traceable: `(grad, logits [n, L])` of `sum(logits * weights)` (`weights [n, L]`:
        a one-hot row selects one logit, a multi-hot row sums several), and the
        points' `Neurons` with `neurons=True`. With `entry` (the twin's
        `affine_prefix`), `x` are points of the prefix's output and `grad` is
        with respect to them."""
        with tf.GradientTape() as tape:
            tape.watch(x)
            fwd = self._primal(x) if entry is None else self.lin.primal(x, entry)
            logits = tf.reshape(fwd.logits, tf.stack([tf.shape(x)[0], -1]))
            total = tf.reduce_sum(logits * tf.cast(weights, logits.dtype))
        grad = tape.gradient(total, x)
        grad = tf.zeros_like(x) if grad is None else grad
        return (grad, logits, fwd.neurons) if neurons else (grad, logits)

    def weighted_gradients(self, x, weights, memory_budget: int | None = None):
        """`(grad [n, *input_shape], logits [n, L])` numpy of `sum(logits * weights)`,
        in compiled chunks."""
        return chunked_gradients(self._wgrad_fn, self, x, weights, memory_budget)

    def logits(self, x, memory_budget: int | None = None) -> np.ndarray:
        """`[n, L]` flattened logits (numpy, model dtype), in compiled chunks."""
        return chunked_logits(self._logits_fn, self, x, memory_budget)

    def check(self, x, name: str = "x") -> np.ndarray:
        """`check_inputs` for this model."""
        return check_inputs(self.lin, x, name)

    def _grad_impl(self, x, index, sign):
        grad, logits, neurons = self.select(x, index, sign)
        return grad, logits, neurons.piece, neurons.valid

    def _dist_impl(self, x, owner, ref_grad, ref_pred, ref_index, ref_sign):
        index = tf.gather(ref_index, owner)
        sign = tf.gather(ref_sign, owner)
        grad, logits, _ = self.select(x, index, sign)
        flat = tf.reshape(grad, tf.stack([tf.shape(x)[0], -1]))
        l1 = tf.reduce_sum(tf.abs(flat - tf.gather(ref_grad, owner)), axis=1)
        changed = tf.not_equal(predictions(logits), tf.gather(ref_pred, owner))
        return l1, changed

    def _same_impl(self, x, owner, ref_piece, ref_valid):
        """Whether each point has the activation pattern of its reference point."""
        return same_pattern(self._primal(x).neurons, owner, ref_piece, ref_valid)

    # ------------------------------------------------------------------ public

    def gradients(self, x, index, sign, memory_budget: int | None = None, pattern=False):
        """Input gradients of `sign * logits[:, index]` at every point, chunked.

        Args:
            x: `[n, *input_shape]` points (already checked).
            index: `[n]` int, the flattened logit selected for each point.
            sign: `[n]` +1 / -1 factors.
            memory_budget: bytes per compiled call (default half the twin's budget).
            pattern: also return the activation pattern (`piece`, `valid`).

        Returns:
            `(grad [n, *input_shape], logits [n, L])` numpy arrays of the model
            dtype, plus `(piece [n, N], valid [n, N])` with `pattern=True`.
        """
        x = np.asarray(x, self.dtype)
        n = x.shape[0]
        step = self.chunk_size(x.shape[1:], memory_budget, total=n)
        index = np.asarray(index, np.int32)
        sign = np.asarray(sign, self.dtype)
        parts = []
        for i in range(0, max(n, 1), step):
            out = self._grad_fn(tf.constant(x[i:i + step]), tf.constant(index[i:i + step]),
                                tf.constant(sign[i:i + step]))
            parts.append([t.numpy() for t in out])
        grad, logits, piece, valid = (np.concatenate(p, axis=0) for p in zip(*parts))
        if pattern:
            return grad, logits, piece, valid
        return grad, logits

    def reference(self, x, index, sign) -> Reference:
        """Gradients, patterns and predictions at reference points, for `distortion`."""
        grad, logits, piece, valid = self.gradients(x, index, sign, pattern=True)
        flat = grad.reshape(grad.shape[0], int(np.prod(grad.shape[1:])))
        return Reference(
            grad=tf.constant(flat), grad_l1=np.abs(flat.astype(np.float64)).sum(axis=1),
            piece=tf.constant(piece), valid=tf.constant(valid),
            pred=tf.constant(predictions_np(logits)),
            index=tf.constant(np.asarray(index, np.int32)),
            sign=tf.constant(np.asarray(sign, self.dtype)),
        )

    def distortion(self, x, owner, ref: Reference):
        """l1 gradient distortion of points against their reference points.

        Runs in one compiled call (chunk `x` with `chunk_size` first): the
        gradients never leave the graph; only the distances come back. Two
        points with the same activation pattern have the very same gradient, but
        two backward passes over differently composed batches round differently:
        distances below `SNAP * ||g(x)||_1` are checked by a forward pass, and
        those of points with the reference pattern are reported as an exact 0.

        Args:
            x: `[n, *input_shape]` candidate points.
            owner: `[n]` int, the reference point (row of `ref`) of each candidate.
            ref: a `Reference` from `reference`.

        Returns:
            `(l1 [n] float64, changed [n] bool)`: `||g(x') - g(x)||_1` of the
            selected logit (exactly 0 when `x'` has the activation pattern of its
            reference point) and whether the prediction differs from the
            reference point's.
        """
        x = tf.constant(np.asarray(x, self.dtype))
        owner = np.asarray(owner, np.int32)
        l1, changed = self._dist_fn(x, tf.constant(owner), ref.grad, ref.pred, ref.index,
                                    ref.sign)
        l1 = l1.numpy().astype(np.float64)
        small = np.flatnonzero(l1 <= SNAP * ref.grad_l1[owner])
        if small.size:
            rows = tf.constant(small.astype(np.int32))
            same = self._same_fn(tf.gather(x, rows), tf.constant(owner[small]), ref.piece,
                                 ref.valid).numpy()
            l1[small[same]] = 0.0
        return l1, changed.numpy()


def same_pattern(neurons, owner, ref_piece, ref_valid):
    """Traceable: whether each point (`neurons [P, N]`) has the activation pattern of its
    reference point (row `owner [P]` of `ref_piece`, `ref_valid [G, N]`)."""
    ref_valid = tf.gather(ref_valid, owner)
    same_piece = tf.equal(neurons.piece, tf.gather(ref_piece, owner))
    return tf.reduce_all(same_piece | ~ref_valid, axis=1) & tf.reduce_all(
        tf.equal(neurons.valid, ref_valid), axis=1)


def chunked_gradients(fn, engine, x, weights, memory_budget):
    """Runs a compiled `fn(x, weights) -> (grad, logits)` over chunks of `x` sized by
    `engine.chunk_size`; numpy results."""
    x = np.asarray(x, engine.dtype)
    n = x.shape[0]
    step = engine.chunk_size(x.shape[1:], memory_budget, total=n)
    weights = np.asarray(weights, engine.dtype)
    grads, logits = [], []
    for i in range(0, max(n, 1), step):
        g, z = fn(tf.constant(x[i:i + step]), tf.constant(weights[i:i + step]))
        grads.append(g.numpy())
        logits.append(z.numpy())
    return np.concatenate(grads), np.concatenate(logits)


def chunked_logits(fn, engine, x, memory_budget) -> np.ndarray:
    """Runs a compiled `fn(x) -> logits` over chunks of `x`; `[n, L]` numpy."""
    x = np.asarray(x, engine.dtype)
    n = x.shape[0]
    step = engine.chunk_size(x.shape[1:], memory_budget, total=n)
    parts = [fn(tf.constant(x[i:i + step])).numpy() for i in range(0, max(n, 1), step)]
    return np.concatenate(parts).reshape(n, -1)


def predictions(logits):
    """Predicted class of flattened logits `[n, L]` (a single logit: `logit > 0`)."""
    if logits.shape[-1] == 1:
        return tf.cast(logits[:, 0] > 0, tf.int64)
    return tf.argmax(logits, axis=-1, output_type=tf.int64)


def predictions_np(logits: np.ndarray) -> np.ndarray:
    """`predictions` for numpy logits."""
    logits = np.asarray(logits)
    if logits.shape[-1] == 1:
        return (logits[:, 0] > 0).astype(np.int64)
    return np.argmax(logits, axis=-1).astype(np.int64)


# ---------------------------------------------------------------------- checks


def check_inputs(lin: Linearized, x, name: str = "x") -> np.ndarray:
    """A checked, private float copy of `x` in the model dtype.

    Raises:
        ValueError: naming `name`, for a wrong shape or non-finite values.
    """
    try:
        arr = np.array(x.numpy() if tf.is_tensor(x) else x, copy=True)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"{name} could not be read as an array: {e}") from None
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number)
                                   or arr.dtype == bool):
        raise ValueError(f"{name} must be a numeric array of shape [B, "
                         f"{', '.join(map(str, lin.input_shape))}], got dtype {arr.dtype}.")
    want = lin.input_shape
    if arr.ndim != len(want) + 1 or any(w is not None and s != w
                                         for s, w in zip(arr.shape[1:], want)):
        raise ValueError(
            f"{name} must have shape [B, {', '.join(str(w) for w in want)}] for model "
            f"'{lin.model.name}', got shape {arr.shape}."
        )
    arr = arr.astype(lin.dtype)
    bad = ~np.isfinite(arr)
    if bad.any():
        raise ValueError(f"{name} contains {int(bad.sum())} non-finite values (NaN or inf); "
                         f"gradients are undefined there. Clean the data first.")
    return arr


def check_labels(y, n: int, num_logits: int, output_link: str | None,
                 default_logits=None) -> tuple[np.ndarray, np.ndarray]:
    """Validates labels; returns the selected logit index and sign per example.

    `y[i]` selects logit `y[i]` of the flattened output. A model with a single
    sigmoid logit takes labels 0 / 1: class 1 is the logit, class 0 its negative
    (the log-odds of class 0). `y=None` selects the predicted class
    (`default_logits`, `[n, L]`).

    Raises:
        ValueError: naming `y`, for a wrong shape, non-integer values or labels
            out of range.
    """
    binary = num_logits == 1 and output_link == "sigmoid"
    if y is None:
        if default_logits is None:
            raise ValueError("y is required here: pass integer class labels of shape [B].")
        logits = np.asarray(default_logits)
        pred = predictions_np(logits.reshape(n, int(np.prod(logits.shape[1:]))))
        y = pred if binary or num_logits > 1 else np.zeros(n, np.int64)
    arr = np.asarray(y.numpy() if tf.is_tensor(y) else y)
    if arr.dtype == object or arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"y must be integer class labels, got dtype {arr.dtype}.")
    if arr.shape != (n,):
        hint = (" (one-hot labels: pass y.argmax(-1))" if arr.ndim == 2 and arr.shape[0] == n
                and arr.shape[1] > 1 else " (pass y.reshape(-1))" if arr.size == n else "")
        raise ValueError(f"y must have shape [B] = ({n},), one integer label per example, "
                         f"got shape {arr.shape}{hint}.")
    arr = class_labels(arr, num_logits, binary)
    if binary:
        return np.zeros(n, np.int32), np.where(arr == 1, 1.0, -1.0)
    return arr.astype(np.int32), np.ones(n)


def check_count(value, name: str, minimum: int = 1) -> int:
    """A positive (or >= minimum) integer argument."""
    if (not isinstance(value, numbers.Integral) or isinstance(value, bool)
            or value < minimum):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)
