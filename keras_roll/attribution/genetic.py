"""The genetic worst-case search of `gradient_distortion(mode="max")` (the paper's
Appendix J), with its populations stored and evolved in chunks.

A population of `P` points of `D` inputs takes `P * D` numbers per example (about
5 GB in float32 at 299x299x3 with the paper's `P = 4800`). The search keeps two
populations (the current one and the next) in a `PopulationStore`: in memory when
they fit the population budget, else in a temporary file, read and written row by
row in chunks of at most the evaluation chunk. Every step works on rows in the order
and with the arithmetic of the whole-array search, so the result is the same bit
for bit; only the memory differs. See docs/design.md, section "Gradient distortion".

Example:

```python
store = PopulationStore(groups=2, population=4800, d=268203, dtype="float32",
                        in_memory=False)
store.write(0, e, 0, rows)          # slot 0, example e, rows 0..len(rows)-1
store.read(0, e, np.array([5, 2]))  # rows 5 and 2
```
"""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np

__all__ = ["CROSSOVER", "RANK_BITS", "SURVIVORS", "PopulationStore", "genetic_search",
           "ranking_keys", "survivors"]

SURVIVORS = 0.25  # share of the population kept by each generation (Appendix J)
CROSSOVER = (-0.25, 1.25)  # range of the crossover weight a (Appendix J)


RANK_BITS = 16  # scores that agree to 16 bits of an example's largest rank as equal


def ranking_keys(score: np.ndarray) -> np.ndarray:
    """`score [G, N]` rounded to `RANK_BITS` bits below each row's largest magnitude
    (a power of two), the keys by which the search ranks its points.

    A point's float32 score changes in its last bits with the batch it is evaluated
    in: a kernel may sum a row in another order at another place in a batch (oneDNN's
    blocked matrix products do). Points of one linear region have the same gradient,
    so their scores tie but for that noise, and ranking by the raw scores would let
    the batch layout (one device, or a share on each replica) pick among them. On the
    rounded keys such ties keep their order (the earlier point first).
    """
    top = np.max(np.abs(score), axis=1, keepdims=True)
    step = np.exp2(np.floor(np.log2(np.where(top > 0, top, 1.0))) - RANK_BITS)
    return np.round(score / step)


def survivors(population: int) -> int:
    """Points kept by each generation: 25 % of the population, at least 1."""
    return max(1, int(math.floor(SURVIVORS * population + 0.5)))


class PopulationStore:
    """Two populations (slots 0 and 1) of `groups` examples, `[population, d]` each.

    Args:
        groups: examples.
        population: rows per example.
        d: numbers per row.
        dtype: the rows' dtype.
        in_memory: keep them in arrays; else in a temporary file, read and written
            with plain file I/O (the page cache holds what the machine can spare,
            the process only its chunks).
    """

    def __init__(self, groups: int, population: int, d: int, dtype, in_memory: bool):
        self.shape = (groups, population, d)
        self.dtype = np.dtype(dtype)
        self.row_bytes = d * self.dtype.itemsize
        if in_memory:
            self.arrays = [np.empty(self.shape, self.dtype) for _ in range(2)]
            self.files = None
        else:
            self.arrays = None
            self.files = [tempfile.TemporaryFile(prefix="keras_roll_population_")
                          for _ in range(2)]
            for f in self.files:
                f.truncate(groups * population * self.row_bytes)

    def _offset(self, e: int, row: int) -> int:
        return (e * self.shape[1] + row) * self.row_bytes

    def read(self, slot: int, e: int, rows) -> np.ndarray:
        """Rows `rows` (an index array, or a slice) of example `e`, as a new array."""
        if self.arrays is not None:
            return self.arrays[slot][e][rows]
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(self.shape[1]))
        out = np.empty((len(rows), self.shape[2]), self.dtype)
        f = self.files[slot]
        for k, r in enumerate(np.asarray(rows).tolist()):
            os.preadv(f.fileno(), [memoryview(out[k]).cast("B")], self._offset(e, r))
        return out

    def write(self, slot: int, e: int, start: int, values: np.ndarray) -> None:
        """Writes `values [m, d]` to rows `start .. start + m - 1` of example `e`."""
        if self.arrays is not None:
            self.arrays[slot][e, start:start + values.shape[0]] = values
            return
        data = np.ascontiguousarray(values, self.dtype)
        os.pwrite(self.files[slot].fileno(), memoryview(data).cast("B"),
                  self._offset(e, start))

    def close(self) -> None:
        if self.files is not None:
            for f in self.files:
                f.close()
        self.arrays = self.files = None


def genetic_search(run, x, index, sign, lo, hi, population, generations, keep, streams,
                   examples_per_group, in_memory):
    """The search over all examples, group by group (see `gradient_distortion`).

    Returns:
        `(distortion [B], changed_fraction [B], points [B, ...], changed [B])`.
    """
    b_total = x.shape[0]
    dist, frac = np.zeros(b_total), np.zeros(b_total)
    points, changed = np.empty_like(x), np.zeros(b_total, bool)
    for g0 in range(0, b_total, examples_per_group):
        ex = np.arange(g0, min(b_total, g0 + examples_per_group))
        ref = run.engine.reference(x[ex], index[ex], sign[ex])
        search = _GroupSearch(run, ex, ref, lo, hi, population, keep, streams, in_memory)
        try:
            search.initial()
            for _ in range(generations):
                search.generation()
            dist[ex], frac[ex], points[ex], changed[ex] = search.result(generations)
        finally:
            search.store.close()
    return dist, frac, points, changed


class _GroupSearch:
    """The search of one group of examples: scores in memory, rows in a store."""

    def __init__(self, run, ex, ref, lo, hi, population, keep, streams, in_memory):
        self.run, self.ex, self.ref = run, ex, ref
        self.g, self.ex_shape = ex.size, lo.shape[1:]
        self.d = int(np.prod(self.ex_shape))
        self.dtype = lo.dtype
        self.low = lo[ex].reshape(self.g, self.d)
        self.high = hi[ex].reshape(self.g, self.d)
        self.population, self.keep = population, keep
        self.children = population - keep
        self.streams = [streams[e] for e in ex]
        self.store = PopulationStore(self.g, population, self.d, self.dtype, in_memory)
        self.cur = 0  # the slot of the current population
        self.block = max(1, run.chunk)  # rows per evaluation, as the whole-array search
        # rows per breeding step: all of them in memory, evaluation chunks in a file
        self.breed_block = population if in_memory else self.block

    def _evaluate(self, slot: int, first_row: int, per_example: int):
        """Evaluates rows `first_row ..` of every example in `slot`, example-major, in
        the chunks of the whole-array search."""
        total = self.g * per_example
        score, flip = np.empty(total), np.empty(total, bool)
        for f0 in range(0, total, self.block):
            flat = np.arange(f0, min(total, f0 + self.block))
            owner = flat // per_example
            rows = [self.store.read(slot, e, slice(first_row + r[0], first_row + r[-1] + 1))
                    for e, r in _runs(owner, flat % per_example)]
            # one run of rows in memory is a view: no copy
            cands = (rows[0] if len(rows) == 1 else np.concatenate(rows)).reshape(
                -1, *self.ex_shape)
            score[flat], flip[flat] = self.run.evaluate(cands, owner, self.ref, self.ex)
        return score.reshape(self.g, per_example), flip.reshape(self.g, per_example)

    def initial(self):
        """A uniform population in the box of every example."""
        for e in range(self.g):
            l64 = self.low[e].astype(np.float64)
            width = self.high[e].astype(np.float64) - l64
            for r0 in range(0, self.population, self.block):
                m = min(self.block, self.population - r0)
                u = self.streams[e].random((m, self.d))
                rows = (l64 + u * width).astype(self.dtype)
                np.clip(rows, self.low[e], self.high[e], out=rows)
                self.store.write(self.cur, e, r0, rows)
        self.score, self.flip = self._evaluate(self.cur, 0, self.population)
        self.n_flip = self.flip.sum(axis=1).astype(np.float64)

    def generation(self):
        """Keeps the best 25 %, refills by crossover, projects, evaluates the children."""
        order = np.argsort(-ranking_keys(self.score), axis=1, kind="stable")[:, :self.keep]
        self.score = np.take_along_axis(self.score, order, axis=1)
        self.flip = np.take_along_axis(self.flip, order, axis=1)
        nxt = 1 - self.cur
        for e in range(self.g):
            rng = self.streams[e]
            i = rng.integers(0, self.keep, size=self.children)
            j = rng.integers(0, self.keep, size=self.children)
            a = rng.uniform(*CROSSOVER, size=(self.children, 1)).astype(self.dtype)
            self._breed(e, order[e], nxt, i, j, a)
        k_score, k_flip = self._evaluate(nxt, self.keep, self.children)
        self.n_flip += k_flip.sum(axis=1)
        self.cur = nxt
        self.score = np.concatenate([self.score, k_score], axis=1)
        self.flip = np.concatenate([self.flip, k_flip], axis=1)

    def _breed(self, e, order, nxt, i, j, a):
        """Survivors `order` of example `e` and their children, written to slot `nxt` in
        chunks of `breed_block` rows (elementwise: the chunking changes no number)."""
        block = self.breed_block
        for r0 in range(0, self.keep, block):
            self.store.write(nxt, e, r0, self.store.read(self.cur, e, order[r0:r0 + block]))
        for c0 in range(0, self.children, block):
            sl = slice(c0, c0 + block)
            other = self.store.read(nxt, e, j[sl])
            kids = self.store.read(nxt, e, i[sl])
            np.subtract(kids, other, out=kids)  # a c + (1 - a) c' = c' + a (c - c')
            kids *= a[sl]
            kids += other
            np.clip(kids, self.low[e], self.high[e], out=kids)  # projection onto the box
            self.store.write(nxt, e, self.keep + c0, kids)

    def result(self, generations):
        best = np.argmax(ranking_keys(self.score), axis=1)  # the first of equal maxima
        rows = np.arange(self.g)
        points = np.stack([self.store.read(self.cur, e, best[e:e + 1])[0] for e in rows])
        evaluations = self.population + generations * self.children
        return (self.score[rows, best], self.n_flip / evaluations,
                points.reshape(self.g, *self.ex_shape), self.flip[rows, best])


def _runs(owner: np.ndarray, rows: np.ndarray):
    """`(example, rows)` for each run of equal `owner` (rows consecutive within a run)."""
    cuts = np.flatnonzero(np.diff(owner)) + 1
    for o, r in zip(np.split(owner, cuts), np.split(rows, cuts)):
        yield int(o[0]), r
