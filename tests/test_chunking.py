"""keras_roll.compile.chunking against brute force: budgets respected, chunks balanced,
covering."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf

from keras_roll.compile.chunking import (
    auto_candidates,
    balanced_split,
    choose_budget,
    plan_chunks,
    plan_directions,
    remembered_budget,
)

CASES = list(itertools.product(
    [1, 3, 64, 1000],          # examples
    [1, 6, 32, 784, 30001],     # directions
    [1, 40, 6040, 8_000_000],  # bytes per item
    [1, 10_000, 64 * 2**20],   # budget
))


def _covered(plan):
    """The direction indices the plan's chunks visit, in order (brute force)."""
    return [i for s in plan.direction_starts()
            for i in range(s, min(s + plan.per_chunk, plan.directions))]


@pytest.mark.parametrize("examples,directions,per,budget", CASES)
def test_plan_respects_budget_and_covers_everything(examples, directions, per, budget):
    plan = plan_chunks(examples, directions, per, budget)
    b, k = plan.examples_per_chunk, plan.per_chunk
    assert 1 <= b <= examples and 1 <= k <= directions
    assert plan.fits == (b * per <= budget)
    if plan.fits:
        assert b * k * per <= budget
    else:  # nothing fits: one example and one direction at a time
        assert (b, k) == (1, 1)
    assert _covered(plan) == list(range(directions))
    rows = [i for sl in plan.example_slices() for i in range(sl.start, sl.stop)]
    assert rows == list(range(examples))
    assert plan.chunks == plan.example_chunks * plan.direction_chunks
    assert plan.direction_chunks == len(plan.direction_starts())


@pytest.mark.parametrize("examples,directions,per,budget", CASES)
def test_direction_chunks_are_as_few_and_as_even_as_possible(examples, directions, per,
                                                             budget):
    plan = plan_chunks(examples, directions, per, budget)
    fit = max(1, min(budget // (plan.examples_per_chunk * per), directions))
    n = plan.direction_chunks
    assert n == -(-directions // fit)  # no fewer chunks can hold the directions
    sizes = [min(s + plan.per_chunk, directions) - s for s in plan.direction_starts()]
    assert max(sizes) - min(sizes) < n  # the last chunk is not almost empty


def test_examples_default_to_64_and_shrink_to_keep_32_directions():
    assert plan_chunks(1000, 784, 4, 2**30).examples_per_chunk == 64
    assert plan_chunks(1000, 784, 4, 2**30, batch_size=10).examples_per_chunk == 10
    assert plan_chunks(1000, 1, 4, 2**30, max_examples=None).examples_per_chunk == 1000
    plan = plan_chunks(1000, 784, 1000, 64 * 32 * 1000 // 2)  # 64 examples: 16 directions
    assert plan.examples_per_chunk == 32 and plan.per_chunk >= 32
    fixed = plan_chunks(1000, 784, 1000, 64 * 32 * 1000 // 2, batch_size=64)
    assert fixed.examples_per_chunk == 64 and fixed.per_chunk == 16


def test_plan_chunks_respects_the_budget_for_large_inputs():
    d = 299 * 299 * 3
    per = 4 * 2_000_000  # bytes per direction per example of a big conv net
    plan = plan_chunks(32, d, per, 256 * 2**20, None)
    b, k = plan.examples_per_chunk, plan.per_chunk
    assert b * k * per <= 256 * 2**20 and k >= 1 and b >= 1


def test_the_paper_setting_gives_the_benchmark_chunks():
    # 784-300x4-10 MLP: tangent size 2410 + 1200 neurons, float32, 64 MiB
    plan = plan_chunks(1000, 784, (2410 + 1200) * 4, 64 * 2**20)
    assert (plan.examples_per_chunk, plan.per_chunk, plan.direction_chunks) == (64, 72, 11)


@pytest.mark.parametrize("total,per,budget", [(784, 924160, 64 * 2**20), (5, 7, 20),
                                              (10, 3, 100), (7, 10, 5), (1, 1, 1)])
def test_tensor_plan_equals_python_plan(total, per, budget):
    k, n, fits = plan_directions(total, per, budget)
    kt, nt, fitst = plan_directions(tf.constant(total), tf.constant(per), budget)
    assert (int(kt), int(nt), bool(fitst)) == (k, n, fits)
    assert fits == (budget // per >= 1)


def test_balanced_split_by_hand():
    assert balanced_split(10, 4) == (4, 3)      # 4 + 4 + 2
    assert balanced_split(784, 72) == (72, 11)
    assert balanced_split(100, 99) == (50, 2)   # not 99 + 1
    for total in range(1, 60):
        for fit in range(1, total + 1):
            k, n = balanced_split(total, fit)
            assert n == math.ceil(total / fit) and k <= fit and (n - 1) * k < total <= n * k


def test_random_plans_never_exceed_the_budget():
    rng = np.random.default_rng(0)
    for _ in range(500):
        b, d, per = (int(v) for v in rng.integers(1, [500, 5000, 10**6]))
        budget = int(rng.integers(1, 10**9))
        plan = plan_chunks(b, d, per, budget)
        if plan.fits:
            assert plan.examples_per_chunk * plan.per_chunk * per <= budget


# --------------------------------------------------------------------------- memory_budget="auto"


def _plan_for(examples=64, directions=784, per=4 * 1510):
    return lambda budget: plan_chunks(examples, directions, per, budget)


def test_auto_candidates_are_the_distinct_plans_within_the_cap():
    plans = auto_candidates(_plan_for())
    whole = 64 * 784 * 4 * 1510  # every direction of 64 examples: 289 MiB
    assert sorted(plans) == [16 * 2**20, 64 * 2**20, 256 * 2**20, whole]
    assert plans[whole].direction_chunks == 1
    assert all(p.fits for p in plans.values())
    small = auto_candidates(_plan_for(examples=4, directions=10))  # 241 KB in all
    assert len(small) == 1 and next(iter(small.values())).chunks == 1
    capped = auto_candidates(_plan_for(), cap=64 * 2**20)
    assert sorted(capped) == [16 * 2**20, 64 * 2**20]


def test_choose_budget_picks_the_fastest_and_skips_needless_probes():
    plans = auto_candidates(_plan_for())
    cost = {b: 1.0 + abs(b - 64 * 2**20) / 2**30 for b in plans}  # 64 MiB is fastest
    calls = []

    def seconds(budget, plan):
        calls.append(budget)
        assert plan is plans[budget]
        return cost[budget]

    assert choose_budget(plans, seconds, repeats=2) == min(cost, key=cost.get)
    assert sorted(calls) == sorted(list(plans) * 3)  # one untimed call, then 2 rounds
    calls.clear()
    one = {2**20: plans[16 * 2**20]}
    assert choose_budget(one, seconds) == 2**20 and not calls
    assert choose_budget(plans, seconds, min_chunks=10**6) == min(plans) and not calls


def test_remembered_budget_is_kept_per_owner_and_key():
    class Owner:
        pass

    first, second = Owner(), Owner()
    calls = []

    def choose(value):
        calls.append(value)
        return value

    assert remembered_budget(first, ("roll", (3,)), lambda: choose(5)) == 5
    assert remembered_budget(first, ("roll", (3,)), lambda: choose(7)) == 5
    assert remembered_budget(first, ("roll", (4,)), lambda: choose(7)) == 7
    assert remembered_budget(second, ("roll", (3,)), lambda: choose(9)) == 9
    assert calls == [5, 7, 9]
