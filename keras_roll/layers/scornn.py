"""scoRNN: a recurrent layer whose recurrent matrix is exactly orthogonal.

K. Helfrich, D. Willmott, Q. Ye, *Orthogonal Recurrent Neural Networks with
Scaled Cayley Transform*, ICML 2018. The recurrent matrix is the scaled Cayley
transform

    W = (I + A)^-1 (I - A) D

of a trainable skew-symmetric `A` (`A^T = -A`), with `D` a fixed diagonal of
+1 and -1 entries. `W` is orthogonal for every `A`, so training moves it on the
orthogonal group without any projection; `D` (the paper's `rho` = number of -1
entries, here `num_negative_ones`) reaches orthogonal matrices with eigenvalue
-1, which the plain Cayley transform cannot represent.

`A` is stored as its `n (n - 1) / 2` strictly-upper-triangular entries (the
variable `skew`), so it is skew-symmetric by construction and the layer has the
paper's parameter count. Gradients reach `skew` by automatic differentiation
through the linear solve; for the upper triangle they equal the paper's
closed-form update `V^T - V`, `V = (I + A)^-T (dL/dW) (D + W^T)`.

Like Keras's `SimpleRNN` (and the reference scoRNN code), the state is a row
vector: `h_t = act(x_t K + h_{t-1} W + b)`.

With a ReLU-family activation the layer is piecewise linear, and keras_roll
linearizes it with the same frozen-pattern twin as `SimpleRNN`
(`keras_roll/compile/rules/scornn.py`).
"""

from __future__ import annotations

import contextlib
import math
import numbers

import keras
import numpy as np
from keras import ops

_PACKAGE = "keras_roll"


def _num_units(num_entries: int) -> int:
    """`n` such that `n (n - 1) / 2 == num_entries`, or a ValueError."""
    n = (1 + math.isqrt(1 + 8 * num_entries)) // 2
    if n * (n - 1) // 2 != num_entries:
        raise ValueError(
            f"A skew-symmetric n x n matrix has n (n - 1) / 2 free entries; "
            f"{num_entries} is not of that form. Initialise the `skew` weight of a "
            f"ScoRNNCell (shape (units * (units - 1) // 2,))."
        )
    return n


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CayleyInitializer(keras.initializers.Initializer):
    """The scoRNN paper's initialisation of the skew-symmetric matrix `A`.

    `A` is block diagonal with 2 x 2 blocks `[[0, s_j], [-s_j, 0]]`,
    `s_j = -tan(theta_j / 2) = -sqrt((1 - cos theta_j) / (1 + cos theta_j))`,
    `theta_j ~ U[0, pi / 2]` (Helfrich et al., 2018, section 4). The Cayley
    transform of such an `A` has eigenvalues `exp(+-i theta_j)`: rotations by
    angles spread uniformly over `[0, pi / 2]` (plus a 1 for odd sizes).

    Called with the shape `(n (n - 1) / 2,)` of a `ScoRNNCell`'s `skew`
    weight, it returns the strictly-upper-triangular entries of `A` in row-major
    order (`numpy.triu_indices(n, 1)`).

    Args:
        seed: int, `keras.random.SeedGenerator` or None, as for Keras's random
            initialisers.

    Example:

    ```python
    init = keras_roll.layers.CayleyInitializer(seed=1)
    upper = init((28,))      # A for 8 units: 4 rotation blocks
    ```
    """

    def __init__(self, seed=None):
        if seed is not None and not isinstance(seed, (int, keras.random.SeedGenerator)):
            raise ValueError(
                f"CayleyInitializer seed must be an int, a keras.random.SeedGenerator or "
                f"None; got {seed!r}."
            )
        self.seed = seed

    def __call__(self, shape, dtype=None):
        shape = tuple(shape)
        if len(shape) != 1:
            raise ValueError(
                f"CayleyInitializer fills the vector of strictly-upper-triangular entries "
                f"of a skew-symmetric matrix, shape (n (n - 1) / 2,); got shape {shape}."
            )
        n = _num_units(int(shape[0]))
        dtype = dtype or keras.backend.floatx()
        blocks = n // 2
        # Position of A[i, i + 1], i = 2j, in the row-major upper-triangular vector:
        # row i starts at i * n - i * (i + 1) / 2.
        i = 2 * np.arange(blocks)
        positions = (i * n - i * (i + 1) // 2).astype("int32")
        theta = keras.random.uniform((blocks,), 0.0, math.pi / 2, seed=self.seed,
                                     dtype="float32")
        s = -ops.tan(theta / 2.0)
        out = ops.scatter(positions[:, None], s, shape)
        return ops.cast(out, dtype)

    def get_config(self):
        return {"seed": self.seed if isinstance(self.seed, int) else None}


def _check_int(name, value, low, high=None, what=""):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low or (
            high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}{what}; got {value!r}.")
    return int(value)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ScoRNNCell(keras.layers.Layer):
    """One step of a scoRNN: `h_t = act(x_t K + h_{t-1} W + b)`, `W` orthogonal.

    `W = (I + A)^-1 (I - A) D` with `A` skew-symmetric (trainable, stored as its
    upper triangle `skew`) and `D` a fixed diagonal whose last `num_negative_ones`
    entries are -1 (the paper's `rho`), the others +1.

    Use it through `ScoRNN`, which computes `W` once per call instead of once
    per time step (and which keras_roll knows how to linearize).

    Args:
        units: positive int, size of the state.
        activation: activation function (default `keras.activations.leaky_relu`,
            slope 0.2). Any Keras activation runs; keras_roll linearizes only
            ReLU-family ones (relu, leaky_relu, relu6).
        num_negative_ones: number of -1 entries of `D` (the paper's `rho`),
            an int in `[0, units]`. `det(W) = (-1) ** num_negative_ones`.
        use_bias: whether to add a bias `b`.
        kernel_initializer: initialiser of the input kernel `K` (default
            uniform in [-0.01, 0.01], as in the scoRNN reference code).
        skew_initializer: "cayley" (default, `CayleyInitializer`: the paper's
            scheme) or any Keras initialiser for the `units * (units - 1) / 2`
            upper-triangular entries of `A` ("zeros" gives `W = D`).
        bias_initializer: initialiser of `b` (default zeros).
        kernel_regularizer, skew_regularizer, bias_regularizer: optional
            regularisers (`skew_regularizer` acts on the entries of `A`).
        kernel_constraint, bias_constraint: optional constraints.
        seed: seed of the default Cayley initialiser.

    Attributes:
        kernel: the `[input_dim, units]` input kernel `K`.
        recurrent_kernel: the current `W` (a tensor recomputed from `skew` and
            `D` each time it is read, so gradients reach `A`).
        bias: the bias vector, or None.
        skew: the trainable upper-triangular entries of `A`.
        diagonal: the non-trainable `[units]` diagonal of `D` (+1 / -1).

    Example:

    ```python
    cell = keras_roll.layers.ScoRNNCell(8, num_negative_ones=2)
    rnn = keras.layers.RNN(cell)         # W recomputed every step: prefer ScoRNN
    y = rnn(np.zeros((2, 5, 3), "float32"))
    W = cell.recurrent_matrix()          # W^T W = I
    ```
    """

    def __init__(self, units, activation=keras.activations.leaky_relu, num_negative_ones=0,
                 use_bias=True, kernel_initializer=None, skew_initializer="cayley",
                 bias_initializer="zeros", kernel_regularizer=None, skew_regularizer=None,
                 bias_regularizer=None, kernel_constraint=None, bias_constraint=None,
                 seed=None, **kwargs):
        units = _check_int("ScoRNNCell units", units, 1)
        num_negative_ones = _check_int(
            "num_negative_ones", num_negative_ones, 0, units,
            f" (the number of -1 entries of the {units} x {units} diagonal D)")
        super().__init__(**kwargs)
        self.units = units
        self.num_negative_ones = num_negative_ones
        self.activation = keras.activations.get(activation)
        self.use_bias = bool(use_bias)
        self.seed = seed
        if kernel_initializer is None:
            kernel_initializer = keras.initializers.RandomUniform(-0.01, 0.01, seed=seed)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        if isinstance(skew_initializer, str) and skew_initializer.lower() == "cayley":
            skew_initializer = CayleyInitializer(seed=seed)
        self.skew_initializer = keras.initializers.get(skew_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.skew_regularizer = keras.regularizers.get(skew_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.state_size = units
        self.output_size = units
        self._upper = np.stack(np.triu_indices(units, 1), axis=1).astype("int32")
        self._step_kernel = None  # W while ScoRNN runs its time loop

    def build(self, input_shape):
        n = self.units
        self.kernel = self.add_weight(
            shape=(input_shape[-1], n), name="kernel", initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer, constraint=self.kernel_constraint)
        # A and D stay in the variable dtype (float32 under mixed precision):
        # W is computed in full precision and cast where it is used.
        self.skew = self.add_weight(
            shape=(n * (n - 1) // 2,), name="skew", initializer=self.skew_initializer,
            regularizer=self.skew_regularizer, autocast=False)
        signs = self.diagonal_values()
        self.diagonal = self.add_weight(
            shape=(n,), name="diagonal", trainable=False, autocast=False,
            initializer=lambda shape, dtype=None: ops.convert_to_tensor(signs, dtype))
        if self.use_bias:
            self.bias = self.add_weight(
                shape=(n,), name="bias", initializer=self.bias_initializer,
                regularizer=self.bias_regularizer, constraint=self.bias_constraint)
        else:
            self.bias = None

    def diagonal_values(self) -> np.ndarray:
        """The diagonal of `D` as numpy: `units - num_negative_ones` ones, then -1s."""
        n, rho = self.units, self.num_negative_ones
        return np.concatenate([np.ones(n - rho), -np.ones(rho)]).astype("float32")

    def skew_matrix(self):
        """The current skew-symmetric `A` (`[units, units]` tensor)."""
        n = self.units
        upper = ops.scatter(self._upper, ops.convert_to_tensor(self.skew), (n, n))
        return upper - ops.transpose(upper)

    def recurrent_matrix(self):
        """The current orthogonal `W = (I + A)^-1 (I - A) D` (`[units, units]` tensor).

        Computed from the variables at every call (a linear solve, not an
        explicit inverse), in the variables' dtype.
        """
        a = self.skew_matrix()
        eye = ops.eye(self.units, dtype=a.dtype)
        cayley = ops.solve(eye + a, eye - a)
        return cayley * ops.cast(ops.convert_to_tensor(self.diagonal), a.dtype)[None, :]

    @contextlib.contextmanager
    def kernel_for_loop(self):
        """Computes `W` once for the duration of a time loop (one linear solve per call)."""
        self._step_kernel = self.recurrent_matrix()
        try:
            yield
        finally:
            self._step_kernel = None

    @property
    def recurrent_kernel(self):
        """`W`, recomputed from `skew` and `D` each time it is read."""
        return self.recurrent_matrix()

    def call(self, sequence, states):
        prev = states[0] if isinstance(states, (list, tuple)) else states
        w = self._step_kernel if self._step_kernel is not None else self.recurrent_matrix()
        h = ops.matmul(sequence, self.kernel)
        if self.bias is not None:
            h = ops.add(h, self.bias)
        z = h + ops.matmul(prev, ops.cast(w, prev.dtype))
        output = self.activation(z) if self.activation is not None else z
        new_state = [output] if isinstance(states, (list, tuple)) else output
        return output, new_state

    def get_initial_state(self, batch_size=None):
        return [ops.zeros((batch_size, self.state_size), dtype=self.compute_dtype)]

    def get_config(self):
        ser = keras.saving.serialize_keras_object
        config = {
            "units": self.units,
            "activation": keras.activations.serialize(self.activation),
            "num_negative_ones": self.num_negative_ones,
            "use_bias": self.use_bias,
            "kernel_initializer": ser(self.kernel_initializer),
            "skew_initializer": ser(self.skew_initializer),
            "bias_initializer": ser(self.bias_initializer),
            "kernel_regularizer": ser(self.kernel_regularizer),
            "skew_regularizer": ser(self.skew_regularizer),
            "bias_regularizer": ser(self.bias_regularizer),
            "kernel_constraint": ser(self.kernel_constraint),
            "bias_constraint": ser(self.bias_constraint),
            "seed": self.seed if isinstance(self.seed, int) else None,
        }
        return {**super().get_config(), **config}


def _cell_property(name: str) -> property:
    """A read-only property that reads the cell's attribute `name`."""
    return property(lambda self: getattr(self.cell, name),
                    doc=f"The cell's `{name}` (`ScoRNNCell`).")


@keras.saving.register_keras_serializable(package=_PACKAGE)
class ScoRNN(keras.layers.RNN):
    """The scoRNN layer (Helfrich, Willmott & Ye, ICML 2018) as a Keras RNN.

    A fully-connected recurrent layer, like `keras.layers.SimpleRNN`, whose
    recurrent matrix `W = (I + A)^-1 (I - A) D` is exactly orthogonal: `A` is
    skew-symmetric and trainable, `D` a fixed diagonal with `num_negative_ones`
    entries -1 (the paper's `rho`). Masking, `return_sequences`,
    `go_backwards`, `zero_output_for_mask` and `unroll` behave as in
    `SimpleRNN` (it is a `keras.layers.RNN`). `W` is computed once per call.

    With a ReLU-family activation (the default leaky_relu, relu, relu6) the
    layer is piecewise linear and keras_roll certifies it and trains it with
    ROLL; other activations run but are refused by `keras_roll.linearize`.

    Args:
        units: positive int, size of the state.
        activation: default `keras.activations.leaky_relu` (slope 0.2).
        num_negative_ones: number of -1 entries of `D`, in `[0, units]`.
        use_bias, kernel_initializer, skew_initializer, bias_initializer,
        kernel_regularizer, skew_regularizer, bias_regularizer,
        kernel_constraint, bias_constraint, seed: as for `ScoRNNCell`.
        return_sequences, return_state, go_backwards, stateful, unroll,
        zero_output_for_mask: as for `keras.layers.RNN`.

    Example:

    ```python
    inp = keras.Input((None, 12))
    h = keras.layers.Masking(0.0)(inp)
    h = keras_roll.layers.ScoRNN(64, num_negative_ones=6, name="scornn")(h)
    model = keras.Model(inp, keras.layers.Dense(9, activation="softmax")(h))
    W = model.get_layer("scornn").recurrent_matrix()   # orthogonal, det = (-1) ** 6
    keras_roll.certify(model, x)
    ```
    """

    def __init__(self, units, activation=keras.activations.leaky_relu, num_negative_ones=0,
                 use_bias=True, kernel_initializer=None, skew_initializer="cayley",
                 bias_initializer="zeros", kernel_regularizer=None, skew_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None, kernel_constraint=None,
                 bias_constraint=None, return_sequences=False, return_state=False,
                 go_backwards=False, stateful=False, unroll=False, seed=None, **kwargs):
        cell = ScoRNNCell(
            units, activation=activation, num_negative_ones=num_negative_ones,
            use_bias=use_bias, kernel_initializer=kernel_initializer,
            skew_initializer=skew_initializer, bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer, skew_regularizer=skew_regularizer,
            bias_regularizer=bias_regularizer, kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint, seed=seed, dtype=kwargs.get("dtype"),
            trainable=kwargs.get("trainable", True), name="scornn_cell")
        super().__init__(cell, return_sequences=return_sequences, return_state=return_state,
                         go_backwards=go_backwards, stateful=stateful, unroll=unroll,
                         activity_regularizer=activity_regularizer, **kwargs)
        self.input_spec = [keras.layers.InputSpec(ndim=3)]

    def inner_loop(self, sequences, initial_state, mask, training=False):
        with self.cell.kernel_for_loop():
            return super().inner_loop(sequences, initial_state, mask, training=training)

    def call(self, sequences, initial_state=None, mask=None, training=False):
        return super().call(sequences, mask=mask, training=training,
                            initial_state=initial_state)

    def recurrent_matrix(self):
        """The current orthogonal recurrent matrix `W` (`[units, units]` tensor)."""
        return self.cell.recurrent_matrix()

    units = _cell_property("units")
    activation = _cell_property("activation")
    num_negative_ones = _cell_property("num_negative_ones")
    use_bias = _cell_property("use_bias")

    def get_config(self):
        config = self.cell.get_config()
        for key in ("name", "trainable", "dtype"):
            config.pop(key, None)
        config["activity_regularizer"] = keras.saving.serialize_keras_object(
            self.activity_regularizer)
        base = super().get_config()
        del base["cell"]
        return {**base, **config}

    @classmethod
    def from_config(cls, config):
        return cls(**config)
