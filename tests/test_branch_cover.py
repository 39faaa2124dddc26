"""A certified ball's leaves start the search over a larger ball (`BallVerdict.cover`).

* The cover partitions the input space: every sampled point (of a ball twice as large
  as the one certified) satisfies the splits of at least one leaf (exactly one, the
  points on a unit's breakpoint aside), read off the network layer by layer in numpy
  (`test_robust_exact.pre_activations`).
* Started from it, the search stays sound and complete against the MILP (scipy
  HiGHS): a ball just inside the MILP's radius is certified, one 1 % outside yields a
  point that the float32 Keras model classifies as another class.
* The radius search hands each probe the cover of the last certified one (an oracle
  ball, as `test_branch_schedule`).
"""

import numpy as np
import pytest

from keras_roll.compile.twin import linearize
from keras_roll.robust import BranchOptions
from keras_roll.robust.adversarial import predict_classes
from keras_roll.robust.subdomains import BallVerdict, Cover, LeafPasses, verify_ball
from tests.test_branch_and_bound import _small
from tests.test_branch_schedule import _Oracle, _run
from tests.test_robust_exact import EXACT_RTOL, exact_milp, pre_activations

pytestmark = pytest.mark.graph  # many small calls of the same passes: faster compiled


def test_a_cover_partitions_the_space_and_grows_to_the_milp_radius():
    model, stages, x = _small()
    twin = linearize(model).at_dtype("float64")
    passes = LeafPasses(twin, np.inf, True, twin.memory_budget, 32, layer_steps=0)
    flat = x.reshape(len(x), -1).astype(np.float64)[0]
    pred = int(predict_classes(model, x[:1])[0])
    raw, polished = exact_milp(stages, flat, pred, np.inf, 0.5, 3)
    radius = min(raw, polished)
    small = verify_ball(passes, model, flat, pred, 0.9 * radius, 0.0, BranchOptions(),
                        deadline=np.inf)
    assert small.status == "certified"
    assert small.cover is not None
    cover = small.cover.splits
    assert cover.dtype == np.int8
    assert cover.shape == (len(cover), passes.layout.size) and len(cover) > 1
    params = small.cover.params  # float32 multipliers (>= 0) and slopes per leaf
    assert params.dtype == np.float32 and params.shape == (len(cover), passes.rows,
                                                           2 * passes.layout.size)
    assert np.all(params[..., :passes.layout.size] >= 0)
    rng = np.random.default_rng(0)
    pts = flat + rng.uniform(-2 * radius, 2 * radius, size=(20000, flat.size))
    pre = np.concatenate(pre_activations(stages, pts)[0], axis=1)  # [P, size]
    inside = np.all((cover[None] == 0) | (cover[None] * pre[:, None] >= 0), axis=2)
    counts = inside.sum(axis=1)
    assert counts.min() >= 1
    assert np.mean(counts == 1) > 0.999
    near = verify_ball(passes, model, flat, pred, radius * (1 - EXACT_RTOL / 4), 0.0,
                       BranchOptions(), deadline=np.inf, cover=small.cover)
    assert near.status == "certified"
    for options in (BranchOptions(), BranchOptions(refine=False)):  # the ball's boxes
        far = verify_ball(passes, model, flat, pred, radius * 1.01, 0.0, options,
                          deadline=np.inf, cover=small.cover._replace(params=None))
        assert far.status == "adversarial"
        assert predict_classes(model, far.point[None].astype(np.float32))[0] != pred
    near = verify_ball(passes, model, flat, pred, radius * (1 - EXACT_RTOL / 4), 0.0,
                       BranchOptions(refine=False), deadline=np.inf, cover=small.cover)
    assert near.status == "certified"


class _Covering(_Oracle):
    """The oracle, handing out its radius as the cover of a certified ball and
    recording the cover each probe was given and each verdict."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.covers, self.statuses = [], []

    def verify(self, passes, model, x, pred, eps, gap, options, deadline, cover=None):
        self.covers.append(None if cover is None else float(cover.splits[0, 0]))
        verdict = super().verify(passes, model, x, pred, eps, gap, options, deadline)
        self.statuses.append(verdict.status)
        if verdict.status == "certified":
            return verdict._replace(cover=Cover(np.full((1, 1), eps, np.float64)))
        return verdict


def test_each_probe_starts_from_the_last_certified_ball(monkeypatch):
    oracle = _Covering(r=1.0, hard=0.2, decide_seconds=6.0)
    lo, hi, _, _ = _run(monkeypatch, oracle, 0.4, 1.0)
    assert lo <= 1.0 <= hi and hi - lo <= 1e-3 * hi
    last = None
    for eps, cover, status in zip(oracle.probes, oracle.covers, oracle.statuses):
        assert cover == last
        assert cover is None or cover < eps  # a cover only ever grows
        last = eps if status == "certified" else last
    assert oracle.statuses.count("certified") >= 3


def test_a_verdict_without_a_cover_is_the_default():
    assert BallVerdict("unknown", None, 1, -1.0).cover is None
