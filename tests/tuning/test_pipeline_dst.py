"""DST over pipelines: ``decide(..., pipeline=PipelineShape)`` anchors, cuts and raises on each rank's
1F1B makespan (what the simulator prices), not on rank totals."""

import numpy as np
import pytest

from sparsebalance.batching.pipeline import PipelineShape
from sparsebalance.batching.schedule import head_seconds, stage_layers
from sparsebalance.simulate.pipeline import one_f_one_b, split_forward_backward, stage_seconds
from sparsebalance.tuning import DSTConfig, DSTTuner, PipelineWorkload, PlanWorkload
from sparsebalance.tuning.records import CUT, KEPT, RAISED
from sparsebalance.workload import MicroBatch

from ..batching.fake_cost import FakeCost


class EightLayers(FakeCost):
    num_layers = 8

    def __init__(self):
        super().__init__(a=1e-5, b=1e-7, c0=1e-3)


def mb(*lengths, density=0.5):
    return MicroBatch(tuple(range(len(lengths))), tuple(lengths), tuple([density] * len(lengths)))


# Equal rank totals (both ranks hold 4 x 2000 tokens at one density), unequal pipelines: rank 0
# runs one 8000-token-sized micro-batch's worth of attention in one pack (the critical path).
PLAN = [
    [mb(2000, 2000, 2000, 2000), mb(10), mb(10), mb(10)],
    [mb(2000, 10), mb(2000, 10), mb(2000, 10), mb(2000, 10)],
]


def pipe(stages, split=(), ratio=2.0, scales=()):
    """The pricing of EightLayers as a pipeline of ``stages``."""
    return PipelineShape.of(8, stages, split, ratio, scales)


def tuner(mode="bidirectional"):
    return DSTTuner(DSTConfig(mode=mode, anchor="mean", p=0.5, budget_tokens=512), block_size=64)


def makespan_at(cost, mbs, knob, value, stages, split=()):
    n = max(len(m.lengths) for m in mbs)
    lengths = np.array([list(m.lengths) + [0] * (n - len(m.lengths)) for m in mbs])
    d0 = np.array([list(m.densities) + [1.0] * (n - len(m.densities)) for m in mbs])
    st = stage_seconds(cost, lengths, knob.density(lengths, d0, value), stages, split)
    return one_f_one_b(*split_forward_backward(st)).makespan


def test_workload_prices_each_rank_as_the_simulator_does():
    cost, t = EightLayers(), tuner()
    work = PipelineWorkload(PlanWorkload(PLAN, cost, t.knob), pipe(4))
    for value in (t.base, t.knob.lo, 2 * t.base):
        got = work.seconds(np.full(2, value))
        want = [makespan_at(cost, PLAN[r], t.knob, value, 4) for r in range(2)]
        assert got == pytest.approx(want, rel=1e-12)
    active = np.array([False, True])
    assert work.seconds(np.full(2, t.base), active)[0] == 0.0


def test_anchor_and_roles_read_makespans_not_totals():
    cost, t = EightLayers(), tuner()
    flat = t.decide(PLAN, cost)
    totals = PlanWorkload(PLAN, cost, t.knob).seconds(np.full(2, t.base))
    assert flat.targets.anchor_seconds == pytest.approx(totals.mean())
    piped = t.decide(PLAN, cost, pipeline=pipe(4), per_microbatch=False)  # the rank level alone
    spans = [makespan_at(cost, PLAN[r], t.knob, t.base, 4) for r in range(2)]
    assert spans[0] > 1.2 * spans[1]  # the case: one critical micro-batch on rank 0
    assert piped.targets.times_before == pytest.approx(spans)
    assert piped.targets.anchor_seconds == pytest.approx(np.mean(spans))
    assert piped.targets.roles == (CUT, RAISED)
    assert piped.ranks[0].budget < t.base < piped.ranks[1].budget
    # the cut pipeline lands at the anchor (coverage allows it here), the raised one up to it
    after = [makespan_at(cost, PLAN[r], t.knob, piped.ranks[r].budget, 4) for r in range(2)]
    assert after == pytest.approx([r.predicted_after for r in piped.ranks], rel=1e-12)
    assert max(after) <= piped.targets.anchor_seconds * (1 + 1e-6)
    assert max(after) < max(spans)


def test_one_stage_decides_exactly_as_before():
    cost, t = EightLayers(), tuner()
    assert t.decide(PLAN, cost, pipeline=None) == t.decide(PLAN, cost)


def test_off_keeps_the_base_with_pipelines():
    cost = EightLayers()
    dec = tuner("off").decide(PLAN, cost, pipeline=pipe(4))
    assert dec.targets.roles == (KEPT, KEPT)
    assert dec.budgets.tolist() == [tuner().base] * 2


def test_head_is_what_the_layers_do_not_explain():
    cost = EightLayers()
    lengths, dens = np.array([[100, 30], [50, 0]]), np.array([[0.5, 1.0], [0.2, 1.0]])
    total = cost.predict_many(lengths, dens)
    assert head_seconds(cost, lengths, dens, total) == pytest.approx([cost.c0, cost.c0])


def test_bad_pipelines_refused():
    with pytest.raises(ValueError, match="more pipeline stages than the model's 8 layers"):
        pipe(9)
    with pytest.raises(ValueError, match="--pp must be an integer >= 1"):
        pipe(0)
    assert stage_layers(8, 3).tolist() == [3, 3, 2]
    cost, t = EightLayers(), tuner()
    with pytest.raises(ValueError, match=r"a pipeline of stages \[3, 3, 3\] for a model of 8 layers"):
        PipelineWorkload(PlanWorkload(PLAN, cost, t.knob), PipelineShape.of(9, 3))


def test_workload_and_decide_price_the_given_split():
    """A split: the workload prices each rank as the simulator does with it, not the even one;
    ``decide`` builds it from the pipeline and refuses a workload of another."""
    cost, t = EightLayers(), tuner()
    split = (3, 2, 2, 1)
    work = PipelineWorkload(PlanWorkload(PLAN, cost, t.knob), pipe(4, split))
    even = PipelineWorkload(PlanWorkload(PLAN, cost, t.knob), pipe(4))
    assert work.shape.layers.tolist() == list(split) and even.shape.layers.tolist() == [2, 2, 2, 2]
    lengths = np.array([[2000, 2000, 2000, 2000]] + [[10, 0, 0, 0]] * 3)
    st = stage_seconds(cost, lengths, np.full(lengths.shape, 0.5), 4, split)
    assert st[0, :3] / np.array([3, 2, 2]) == pytest.approx(np.full(3, st[0, 0] / 3))
    got, base = work.seconds(np.full(2, t.base)), even.seconds(np.full(2, t.base))
    want = [makespan_at(cost, PLAN[r], t.knob, t.base, 4, split) for r in range(2)]
    assert got == pytest.approx(want, rel=1e-12)
    assert not np.allclose(got, base)  # the split changes the makespans DST reads
    flat = t.decide(PLAN, cost, pipeline=pipe(4, split), per_microbatch=False)
    assert [r.predicted_before for r in flat.ranks] == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="the workload prices another pipeline"):
        t.decide(PLAN, cost, even, pipeline=pipe(4, split))
    with pytest.raises(ValueError, match="summing to the model's 8 layers"):
        pipe(4, (3, 3, 3, 3))


def test_workload_and_decide_price_learned_stage_scales_and_ratio():
    """A run's measured stages (``stage_scales``, ``ratio``): each stage's share times its scale,
    split at the ratio; the identity decides exactly as the default."""
    cost, t = EightLayers(), tuner()
    scales = (1.0, 1.0, 1.0, 2.0)
    work = PipelineWorkload(PlanWorkload(PLAN, cost, t.knob), pipe(4, (), 3.0, scales))
    for r in range(2):
        n = max(len(m.lengths) for m in PLAN[r])
        lengths = np.array([list(m.lengths) + [0] * (n - len(m.lengths)) for m in PLAN[r]])
        d0 = np.array([list(m.densities) + [1.0] * (n - len(m.densities)) for m in PLAN[r]])
        st = stage_seconds(cost, lengths, t.knob.density(lengths, d0, t.base), 4) * np.asarray(scales)
        want = one_f_one_b(*split_forward_backward(st, 3.0)).makespan
        assert work.seconds(np.full(2, t.base))[r] == pytest.approx(want, rel=1e-12)
        assert want > 1.2 * makespan_at(cost, PLAN[r], t.knob, t.base, 4)
    learned = t.decide(PLAN, cost, pipeline=pipe(4, (), 3.0, scales))
    assert learned.targets.times_before == pytest.approx(work.seconds(np.full(2, t.base)).tolist(), rel=1e-12)
    same = t.decide(PLAN, cost, pipeline=pipe(4, (), 2.0, (1.0,) * 4))
    assert same == t.decide(PLAN, cost, pipeline=pipe(4))
    with pytest.raises(ValueError, match="need one scale per stage"):
        pipe(4, (), 2.0, (1.0, 2.0))
