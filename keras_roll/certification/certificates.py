"""The results of `certify` and `stability_bounds` and their paper-style tables.

`Certificate` (lp and directional margins, binding neurons) and
`StabilityBounds` (per-coordinate intervals, the paper's Figure 3) hold numpy
arrays (analysis results are numpy; functions used inside training return
tensors: docs/design.md, section "Return types"); `summary()` prints
percentiles as in the tables of Lee et al. (ICLR 2019). Their dicts by norm
(`keras_roll.geometry.NormDict`) accept 1, 2, np.inf, 'l1', 'l2', 'linf' and 'inf' as keys. See
docs/design.md, section "Data flow of certify".

Example:

```python
cert = keras_roll.certify(model, x)
cert.summary()        # P25 / P50 / P75 / P100 of each margin, binding layers
```
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from keras_roll.certification.bisection import binding_directions
from keras_roll.certification.tables import rigor_line
from keras_roll.certification.zero_radii import no_causes, zero_lines
from keras_roll.compile.units import INPUT_UNITS, Units
from keras_roll.geometry import NORM_LABELS, NormDict
from keras_roll.options import Method, Rigor, parse_norm
from keras_roll.summary import Summary, format_table, percentiles_of

__all__ = ["Certificate", "StabilityBounds", "binding_layers_lines", "concat_padded",
           "first_part"]

INF = math.inf
PAPER = "Lee et al., ICLR 2019"


def first_part(parts: Sequence, cls: type):
    """The first of the results that `cls.concat` joins; a `ValueError` when there
    is none.

    Example:

    ```python
    first = first_part(parts, Certificate)   # parts[0], or "needs at least one"
    ```
    """
    if not parts:
        raise ValueError(f"{cls.__name__}.concat needs at least one {cls.__name__}.")
    return parts[0]


def concat_padded(arrays: list, fill) -> np.ndarray:
    """Concatenates along axis 0, padding trailing axes to the largest shape with `fill`
    (batches of a stream of variable-length sequences)."""
    arrays = [np.asarray(a) for a in arrays]
    if len({a.shape[1:] for a in arrays}) <= 1:
        return np.concatenate(arrays, axis=0)
    shape = tuple(max(a.shape[i] for a in arrays) for i in range(1, arrays[0].ndim))
    out = []
    for a in arrays:
        dtype = np.result_type(a.dtype, np.asarray(fill).dtype)
        padded = np.full((a.shape[0], *shape), fill, dtype)
        padded[tuple(slice(0, n) for n in a.shape)] = a
        out.append(padded)
    return np.concatenate(out, axis=0)


def binding_layers_lines(binding: NormDict, n: int) -> list[str]:
    """The summary's line on where the balls end: the (at most 3) layers whose neurons
    bind most often, with their shares of the `n` examples, for l2 (else the first
    norm); no line when no neuron binds.

    Example:

    ```python
    binding_layers_lines(NormDict({2: [("dense", 3), None]}), 2)
    # ['Binding layers (l2): dense (50%)']
    ```
    """
    if not n or not binding:
        return []
    p = 2 if 2 in binding else next(iter(binding))
    layers = [b[0] for b in binding[p] if b is not None]
    if not layers:
        return []
    names, counts = np.unique(layers, return_counts=True)
    share = ", ".join(f"{names[i]} ({100 * counts[i] / n:.0f}%)"
                      for i in np.argsort(-counts)[:3])
    return [f"Binding layers ({NORM_LABELS[p]}): {share}"]


@dataclasses.dataclass(repr=False)
class Certificate:
    """Certified margins of a batch: numpy arrays, float64 margins.

    Attributes:
        margins: `{p: [B]}` float64, radius of the largest lp ball (p in 1, 2,
            inf) around each example inside its linear region (Prop. 6), in
            `units`; NaN for `nonfinite` examples. Keys: 1, 2, np.inf or 'l1',
            'l2', 'linf' (a `NormDict`).
        binding: `{p: [B]}` list of the binding neuron `(layer name, unit index)`
            per example, None where no neuron binds (margin inf) or NaN.
        binding_index: `{p: [B] int64}`, the binding neuron's row in
            `lin.neuron_names_for(x)`, -1 where none binds.
        directional: `[B, K]` float64 margins along the given directions, in
            units of `t` of `x + t d` (not normalised by `||d||`; `d` in `units`),
            or None.
        directional_index: `[B, K]` int64 binding neuron rows, or None.
        logits: `[B, *output_shape]` outputs of the twin (before any folded
            softmax / sigmoid; float64 under rigor 'float64').
        method: `Method.ANALYTIC` or `Method.BISECT` (equal to "analytic" /
            "bisect").
        rigor: the rounding guard, a `Rigor` (equal to its string):
            "float64" (the default: radii shrunk by a probabilistic bound on
            the rounding of the model evaluated in `evaluation`,
            `keras_roll.rounding.noise`: each neuron of each point fails with
            probability below 1e-13), "strict" (a worst-case bound: sound
            always, often 0 on wide float32 networks) or "float32" (no
            rounding guard).
        evaluation: the precision the model evaluates itself in, which the
            certificate covers under rigor 'float64' and 'strict' ('float32',
            'float16 (mixed precision)', 'float32 (TensorFloat-32 ...)').
        mask: for models with a `Masking` layer, `[B, T]` bool, True at the
            unpadded steps: each ball is in those coordinates (padded steps
            held at the mask value); None otherwise.
        nonfinite: `[B]` bool, examples with a non-finite neuron or logit, or
            whose evaluation may overflow (their margins are NaN).
        zero_cause: `{p: [B]}` object arrays of `ZeroCause`: why each zero
            radius is zero (a tie in a max-pooling window, a neuron exactly at
            its breakpoint, or one within the rounding guard; `ZeroCause.NONE`
            for the other radii); `binding` names the neuron and its layer.
        units: the `Units` of the radii (`certify(wrt=...)`); the points of
            `binding_direction` / `boundary_point` are model inputs.

    Example:

    ```python
    cert = keras_roll.certify(model, x)
    cert.margins["l2"][0], cert.binding[2][0]    # 0.031, ('dense_1', 17)
    cert.boundary_point(2)[0]                    # where the ball meets its boundary
    cert.zero_cause[2][0]                        # ZeroCause.NONE
    ```
    """

    margins: dict
    binding: dict
    binding_index: dict
    directional: np.ndarray | None = None
    directional_index: np.ndarray | None = None
    logits: np.ndarray | None = None
    method: Method = Method.ANALYTIC
    rigor: Rigor = Rigor.FLOAT32
    evaluation: str = "float32"
    mask: np.ndarray | None = None
    nonfinite: np.ndarray | None = None
    zero_cause: dict | None = None
    units: Units = INPUT_UNITS
    _source: tuple | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        self.method, self.rigor = Method.parse(self.method), Rigor.parse(self.rigor)
        if self.zero_cause is None:
            self.zero_cause = {p: no_causes(np.shape(v)) for p, v in self.margins.items()}
        for name in ("margins", "binding", "binding_index", "zero_cause"):
            value = getattr(self, name)
            if not isinstance(value, NormDict):
                setattr(self, name, NormDict({parse_norm(k): v for k, v in value.items()}))
        if self.nonfinite is None:
            self.nonfinite = np.zeros(self.n, bool)

    @classmethod
    def concat(cls, parts: Sequence[Certificate]) -> Certificate:
        """One certificate of the examples of `parts` (e.g. a stream's batches) in order;
        they share norms, method, rigor and evaluation (`binding_direction`'s inputs go).

        Example:

        ```python
        cert = Certificate.concat([certify(model, xa), certify(model, xb)])
        ```
        """
        first = first_part(parts, cls)
        for part in parts[1:]:
            theirs, ours = ((q.norms, q.method, q.rigor, q.evaluation, q.units.describe())
                            for q in (part, first))
            if theirs != ours:
                raise ValueError(
                    f"Certificates of different runs cannot be concatenated: norms, method, "
                    f"rigor, evaluation and units {theirs} differ from {ours}.")

        def joined(name):
            return {p: np.concatenate([getattr(q, name)[p] for q in parts]) for p in first.norms}

        directional = directional_index = None
        if first.directional is not None:
            directional = np.concatenate([q.directional for q in parts])
            directional_index = np.concatenate([q.directional_index for q in parts])
        masks = [q.mask for q in parts]
        return cls(
            margins=joined("margins"), binding_index=joined("binding_index"),
            binding={p: [b for q in parts for b in q.binding[p]] for p in first.norms},
            directional=directional, directional_index=directional_index,
            logits=concat_padded([q.logits for q in parts], np.nan), method=first.method,
            rigor=first.rigor, evaluation=first.evaluation,
            mask=None if any(m is None for m in masks) else concat_padded(masks, False),
            nonfinite=np.concatenate([q.nonfinite for q in parts]),
            zero_cause=joined("zero_cause"), units=first.units)

    def __getstate__(self) -> dict:
        """Pickles the arrays without the twin kept for `binding_direction` (a
        certificate sent from another worker; see `concat`)."""
        return {**self.__dict__, "_source": None}

    def attach_source(self, twin, inputs: list | None) -> None:
        """Keeps the twin and the inputs (or None) that `binding_direction` recomputes from."""
        self._source = (twin, inputs)

    def binding_direction(self, p, x=None) -> np.ndarray:
        """Unit vectors along which each lp ball touches its binding hyperplane.

        The dual-norm maximiser of `g_j . u` over `||u||_p <= 1` for the binding
        neuron `j`, signed toward its nearest breakpoint: `g / ||g||_2` for l2,
        `sign(g)` for l_inf, `sign(g_i) e_i` with `i = argmax |g_i|` for l1. The
        gradient is recomputed by one reverse pass of the twin.

        Args:
            p: the norm (1, 2, np.inf, 'l1', 'l2', 'linf').
            x: the certified inputs; needed only when the certificate did not
                keep them (a stream of more than 512 MiB).

        Returns:
            `[B, *input_shape]` float64; NaN rows where no neuron binds.

        Example:

        ```python
        u = cert.binding_direction("linf")          # entries in {-1, 0, 1}
        ```
        """
        p = parse_norm(p)
        index = self.binding_index[p]
        twin, xs = self._inputs(x)
        return binding_directions(twin, xs, index, p).u

    def boundary_point(self, p, x=None) -> np.ndarray:
        """The point where each lp ball meets its region's boundary.

        `x + t u` with `u = binding_direction(p)` and `t = dist_j / ||g_j||_q`,
        on the binding hyperplane (computed in float64). `t` equals the margin
        under rigor 'float32' and exceeds it by the rounding bound (a relative
        ~1e-6 or less) under 'float64'. The activation pattern changes just
        beyond it.

        Returns:
            `[B, *input_shape]` float64; NaN rows where no neuron binds.

        Example:

        ```python
        x_adv = cert.boundary_point(2)        # nearest l2 point of another region
        ```
        """
        p = parse_norm(p)
        twin, xs = self._inputs(x)
        u, t = binding_directions(twin, xs, self.binding_index[p], p)
        base = np.concatenate([np.asarray(b, np.float64) for b in xs]) if xs else \
            np.zeros_like(u)
        return base + t.reshape((-1,) + (1,) * (u.ndim - 1)) * u

    def _inputs(self, x):
        if self._source is None:
            raise ValueError("This Certificate was not made by keras_roll.certify, so it "
                             "cannot recompute gradients.")
        twin, kept = self._source
        if x is not None:
            kept = [np.asarray(x)]
        if kept is None:
            raise ValueError("certify did not keep the inputs of this (large) stream; pass "
                             "them: cert.binding_direction(p, x=...).")
        if sum(int(np.shape(b)[0]) for b in kept) != self.n:
            raise ValueError(f"x has {sum(int(np.shape(b)[0]) for b in kept)} examples, the "
                             f"certificate {self.n}.")
        return twin, kept

    @property
    def n(self) -> int:
        """Number of certified examples."""
        for v in self.margins.values():
            return int(v.shape[0])
        return 0 if self.logits is None else int(self.logits.shape[0])

    @property
    def norms(self) -> tuple:
        return tuple(self.margins)

    def __repr__(self) -> str:
        parts = [f"n={self.n}", f"method='{self.method}'", f"rigor='{self.rigor}'"]
        for p, v in self.margins.items():
            med = percentiles_of(v, (50,))[0] if v.size else float("nan")
            parts.append(f"median_{NORM_LABELS[p]}={med:.4g}")
        if self.directional is not None:
            parts.append(f"directions={self.directional.shape[1]}")
        return f"Certificate({', '.join(parts)})"

    def summary(self, print_fn=None, percentiles=(25, 50, 75, 100)) -> Summary:
        """The paper-style table: percentiles of every certified margin.

        Returns a `Summary` (its `str` is the table; a notebook shows it); `print_fn`
        (a logger's function, say) also receives the text.

        Example:

        ```python
        keras_roll.certify(model, x_test).summary()
        ```
        """
        out = []
        rows = []
        for p, v in self.margins.items():
            rows.append((f"{NORM_LABELS[p]} ball", v))
        if self.directional is not None:
            k = self.directional.shape[1]
            rows.append((f"directional (K={k})", self.directional.reshape(-1)))
        head = (f"Certified margins ({self.units.describe()}): {self.n} examples, method "
                f"'{self.method}' ({PAPER})")
        out.append(format_table(head, rows, percentiles))
        out.append(rigor_line(self.rigor, self.evaluation))
        out += zero_lines(self.zero_cause, self.binding)
        if self.mask is not None:
            out.append("Masked sequences: each ball is in the unpadded coordinates (see .mask); "
                       "it holds while padded steps stay at the mask value.")
        if self.nonfinite is not None and self.nonfinite.any():
            out.append(f"{int(self.nonfinite.sum())} example(s) with non-finite neurons or "
                       f"logits: margins NaN.")
        out += binding_layers_lines(self.binding, self.n)
        return Summary.emit(out, print_fn)


@dataclasses.dataclass(repr=False)
class StabilityBounds:
    """Per-coordinate stability intervals (the paper's Figure 3).

    Coordinate k of example i can move anywhere in
    `[x_ik + lower_ik, x_ik + upper_ik]`, all other coordinates fixed, without
    leaving the linear region of `x_i`. All arrays are numpy.

    Attributes:
        lower: `[B, *input_shape]` float64, `-eps(x, -e_k)` (<= 0, -inf if
            unbounded, NaN for `nonfinite` examples).
        upper: `[B, *input_shape]` float64, `+eps(x, +e_k)` (>= 0, inf if unbounded).
        lower_index, upper_index: int64 binding neuron rows (-1 if none), same shape.
        method: `Method.ANALYTIC` or `Method.BISECT`.
        rigor: a `Rigor`: "float64" (shrunk by the probabilistic rounding
            guard), "strict" (by the worst-case bound) or "float32" (no guard).
        nonfinite: `[B]` bool, examples with non-finite neurons or logits.

    Example:

    ```python
    sb = keras_roll.stability_bounds(model, x[:1])
    width = sb.upper - sb.lower                # how far each pixel may move alone
    ```
    """

    lower: np.ndarray
    upper: np.ndarray
    lower_index: np.ndarray
    upper_index: np.ndarray
    method: Method = Method.ANALYTIC
    rigor: Rigor = Rigor.FLOAT32
    nonfinite: np.ndarray | None = None

    def __post_init__(self):
        self.method, self.rigor = Method.parse(self.method), Rigor.parse(self.rigor)
        if self.nonfinite is None:
            self.nonfinite = np.zeros(self.lower.shape[0], bool)

    @classmethod
    def concat(cls, parts: Sequence[StabilityBounds]) -> StabilityBounds:
        """The bounds of the examples of `parts`, in order (variable-length
        sequences padded: -inf / inf bounds and index -1 past their end).

        Example:

        ```python
        sb = StabilityBounds.concat([stability_bounds(model, xa), stability_bounds(model, xb)])
        ```
        """
        first = first_part(parts, cls)
        if any((q.method, q.rigor) != (first.method, first.rigor) for q in parts):
            raise ValueError("StabilityBounds of different methods or rigors cannot be "
                             "concatenated.")
        return cls(concat_padded([q.lower for q in parts], -INF),
                   concat_padded([q.upper for q in parts], INF),
                   concat_padded([q.lower_index for q in parts], -1),
                   concat_padded([q.upper_index for q in parts], -1), first.method,
                   first.rigor, np.concatenate([q.nonfinite for q in parts]))

    def __repr__(self) -> str:
        return (f"StabilityBounds(shape={self.lower.shape}, method='{self.method}', "
                f"median_width={self._median_width():.4g})")

    def _median_width(self) -> float:
        if self.lower.size == 0:
            return float("nan")
        return percentiles_of((self.upper - self.lower).reshape(-1), (50,))[0]

    def summary(self, print_fn=None, percentiles=(25, 50, 75, 100)) -> Summary:
        """The percentiles of the upper / lower bounds and the interval widths: a
        `Summary` (see `Certificate.summary`).

        Example:

        ```python
        print(keras_roll.stability_bounds(model, x[:1]).summary())
        ```
        """
        rows = [("upper  +eps(+e_k)", self.upper.reshape(-1)),
                ("lower  -eps(-e_k)", -self.lower.reshape(-1)),
                ("width", (self.upper - self.lower).reshape(-1))]
        n = self.lower.shape[0]
        head = (f"Per-coordinate stability bounds (input units): {n} examples x "
                f"{int(np.prod(self.lower.shape[1:]))} coordinates, method '{self.method}'")
        return Summary.emit([format_table(head, rows, percentiles)], print_fn)
