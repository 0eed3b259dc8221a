"""The closed loop per pipeline stage (:mod:`sparsebalance.engine.stage_calibration`): the
identity at the start, what it learns from synthetic stage records (a stage 2x slower, a
backward 3x the forward), its clamp against an outlier step, and its state in the engine's."""

from __future__ import annotations

import numpy as np
import pytest

from sparsebalance.batching.schedule import BACKWARD_RATIO, resolve_layers
from sparsebalance.batching.zero_bubble import WEIGHT_SHARE
from sparsebalance.engine.records import MicroBatchResult
from sparsebalance.engine.stage_calibration import (
    RATIO_BOUNDS,
    SCALE_BOUNDS,
    SMOOTHING,
    StageCalibration,
    predicted_stage_seconds,
)

from ..batching.fake_cost import FakeCost


class FourLayers(FakeCost):
    num_layers = 4

    def __init__(self):
        super().__init__(a=1e-5, b=1e-7, c0=1e-3)


COST = FourLayers()
LAYERS = resolve_layers(4, 2, (3, 1))  # the tiny model's split: 3 layers, then 1 beside the head


def _microbatches(slow=(1.0, 1.0), ratio=BACKWARD_RATIO, seed=0) -> list[MicroBatchResult]:
    """Micro-batches whose measured stage seconds are the pricing's times ``slow`` per stage,
    split into forward and backward at ``ratio``."""
    rng = np.random.default_rng(seed)
    plain = []
    for i in range(6):
        lengths = tuple(int(n) for n in rng.integers(64, 4000, int(rng.integers(1, 4))))
        dens = tuple(tuple(float(d) for d in rng.uniform(0.1, 1.0, len(lengths))) for _ in range(4))
        plain.append(MicroBatchResult(0.0, lengths, tuple(range(i, i + len(lengths))), dens, (0.9,) * 4, 0.0, 0.0))
    stages = predicted_stage_seconds(COST, plain, LAYERS) * np.asarray(slow)  # (M, P)
    out = []
    for mb, st in zip(plain, stages, strict=True):
        pairs = tuple((float(s / (1 + ratio)), float(s * ratio / (1 + ratio))) for s in st)
        out.append(MicroBatchResult(float(st.sum()), *_fields(mb), stage_seconds=pairs))
    return out


def _fields(mb: MicroBatchResult) -> tuple:
    return mb.lengths, mb.sample_ids, mb.layer_densities, mb.budgets, mb.loss_sum, mb.weight_sum


def test_it_starts_at_the_identity():
    cal = StageCalibration(2)
    assert cal.pricing() == {"backward_ratio": BACKWARD_RATIO, "stage_scales": (1.0, 1.0), "weight_share": WEIGHT_SHARE}
    assert cal.state_dict() == {"ratio": 2.0, "scales": [1.0, 1.0], "weight_share": WEIGHT_SHARE, "steps": 0}
    # records without stages (no pipeline) teach nothing
    plain = [MicroBatchResult(1.0, (100,), (0,), ((0.5,),) * 4, (0.9,) * 4, 0.0, 0.0)]
    assert not cal.observe(plain, COST, LAYERS)
    assert cal.steps == 0 and cal.pricing()["stage_scales"] == (1.0, 1.0)


def test_pricing_as_measured_learns_nothing():
    cal = StageCalibration(2)
    for seed in range(3):
        assert cal.observe(_microbatches(seed=seed), COST, LAYERS)
    assert cal.ratio == pytest.approx(BACKWARD_RATIO, rel=1e-12)
    assert cal.scales == pytest.approx([1.0, 1.0], rel=1e-12)
    assert cal.steps == 3


def test_it_learns_a_stage_2x_slower_and_a_backward_3x_the_forward():
    cal = StageCalibration(2)
    for seed in range(40):
        cal.observe(_microbatches(slow=(1.0, 2.0), ratio=3.0, seed=seed), COST, LAYERS)
    assert cal.ratio == pytest.approx(3.0, rel=1e-5)
    assert cal.scales[1] / cal.scales[0] == pytest.approx(2.0, rel=1e-5)
    # the scales move the split, not the total (the latency model owns that): priced with them,
    # each stage's share of a step is its measured share
    mbs = _microbatches(slow=(1.0, 2.0), ratio=3.0, seed=99)
    predicted = predicted_stage_seconds(COST, mbs, LAYERS).sum(axis=0)
    measured = np.asarray([mb.stage_seconds for mb in mbs]).sum(axis=(0, 2))
    priced = predicted * cal.scales
    assert priced / priced.sum() == pytest.approx(measured / measured.sum(), rel=1e-5)
    assert priced.sum() == pytest.approx(predicted.sum(), rel=1e-2)  # about: averaged over other steps' shares


def test_it_moves_smoothly_towards_a_step():
    cal = StageCalibration(2)
    cal.observe(_microbatches(slow=(1.0, 2.0), ratio=3.0), COST, LAYERS)
    assert cal.ratio == pytest.approx(2.0 ** (1 - SMOOTHING) * 3.0**SMOOTHING, rel=1e-12)
    assert 1.0 < cal.scales[1] / cal.scales[0] < 2.0


def test_an_outlier_step_is_clamped():
    cal = StageCalibration(2)
    # stage 0 measured at ~nothing, the backward at 1000x the forward: one step moves the scales
    # and the ratio only from the bounds' values, by the smoothing weight; the scales are then
    # renormalised so the step's predicted total is kept (they move the split only)
    mbs = _microbatches(slow=(1e-9, 1.0), ratio=1000.0)
    cal.observe(mbs, COST, LAYERS)
    predicted = predicted_stage_seconds(COST, mbs, LAYERS).sum(axis=0)
    share = predicted / predicted.sum()
    raw = np.array([SCALE_BOUNDS[0], min(SCALE_BOUNDS[1], 1.0 / share[1])]) ** SMOOTHING
    assert cal.scales == pytest.approx(raw / (share @ raw), rel=1e-6)
    assert share @ cal.scales == pytest.approx(1.0, rel=1e-12)
    assert cal.ratio == pytest.approx(2.0 ** (1 - SMOOTHING) * RATIO_BOUNDS[1] ** SMOOTHING, rel=1e-12)
    # a step with a stage at 0 s (nothing measured there) is left out
    before = cal.state_dict()
    assert not cal.observe(_microbatches(slow=(0.0, 1.0)), COST, LAYERS)
    assert not cal.observe(_microbatches(slow=(np.inf, 1.0)), COST, LAYERS)  # nor one not finite
    assert cal.state_dict() == before


def test_state_round_trip_and_older_states():
    cal = StageCalibration(2)
    for seed in range(3):
        cal.observe(_microbatches(slow=(1.0, 1.5), ratio=2.5, seed=seed), COST, LAYERS)
    again = StageCalibration(2)
    again.load_state_dict(cal.state_dict())
    assert again.state_dict() == cal.state_dict() and again.pricing() == cal.pricing()
    # the next step learns the same on both (exact resume: the same plans)
    for c in (cal, again):
        c.observe(_microbatches(slow=(1.0, 1.5), ratio=2.5, seed=7), COST, LAYERS)
    assert again.pricing() == cal.pricing()
    again.load_state_dict(None)  # a checkpoint from before this loop
    assert again.state_dict() == StageCalibration(2).state_dict()
    with pytest.raises(ValueError, match="has 2 stages, this run 4"):
        StageCalibration(4).load_state_dict(cal.state_dict())


LENGTHS = (8000, 2000, 2000, 2000)


def _engine(deterministic: bool = False):
    from sparsebalance.engine import DSTConfig, PlanConfig, StepEngine, resolve_kernel
    from sparsebalance.latency import LatencyModel, analytic_profile
    from sparsebalance.models import load_shapes
    from sparsebalance.workload import Sample

    kernel = resolve_kernel("cpu", 32, "torch")
    latency = LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=kernel.block_size))
    plan = PlanConfig(world_size=1, micro_batches=4, pipeline_stages=2, stage_layers=(3, 1))
    sample = lambda i: Sample(i, 1000, "")  # noqa: E731
    dst = DSTConfig(budget_tokens=128)
    return StepEngine(plan, latency, dst, sample, kernel=kernel, world_size=1, deterministic=deterministic)


def _records(mbs: list[MicroBatchResult]) -> list:
    from types import SimpleNamespace

    return [SimpleNamespace(microbatches=tuple(mbs))]  # what StepFeedback reads of a RankRecord


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning")
def test_the_engine_learns_from_its_feedback_unless_deterministic():
    engine, fixed = _engine(), _engine(deterministic=True)
    identity = engine.planning_config()
    assert (identity.stage_scales, identity.backward_ratio) == ((1.0, 1.0), BACKWARD_RATIO)
    for e in (engine, fixed):
        e.feedback(_records(_microbatches(slow=(1.0, 2.0), ratio=3.0)))
    assert engine.stage_calibration.steps == 1 and engine.planning_config().backward_ratio > BACKWARD_RATIO
    assert engine.planning_config().stage_scales == tuple(engine.stage_calibration.scales.tolist())
    assert fixed.stage_calibration.state_dict() == StageCalibration(2).state_dict()  # no timing enters


@pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning")
def test_the_engine_plans_and_tunes_with_a_learned_slow_last_stage():
    from sparsebalance.workload import Sample

    samples = [Sample(i, n, "") for i, n in enumerate(LENGTHS)]
    before = _engine().begin(samples)
    slow = _engine()
    slow.load_state_dict({**slow.state_dict(), "stage_calibration": {"ratio": 2.0, "scales": [1.0, 2.0], "steps": 1}})
    after = slow.begin(samples)
    # every stage at least as slow, the last one 2x: both the plan's and DST's makespans grow
    assert after.planned.plan.metrics.makespan > 1.1 * before.planned.plan.metrics.makespan
    assert after.decision.ranks[0].predicted_before > 1.1 * before.decision.ranks[0].predicted_before


def test_the_engines_state_holds_it_and_older_states_load_the_identity():
    engine = _engine()
    state = engine.state_dict()
    assert state["stage_calibration"] == {"ratio": 2.0, "scales": [1.0, 1.0], "weight_share": WEIGHT_SHARE, "steps": 0}
    engine.stage_calibration.observe(_microbatches(slow=(1.0, 2.0), ratio=3.0), COST, LAYERS)
    learned = engine.state_dict()
    assert learned["stage_calibration"]["steps"] == 1
    engine.load_state_dict({k: v for k, v in learned.items() if k != "stage_calibration"})  # an older one
    assert engine.state_dict()["stage_calibration"] == state["stage_calibration"]
    engine.load_state_dict(learned)
    assert engine.state_dict() == learned


def test_zero_bubble_stages_teach_ws_share():
    """Stage seconds (forward, B + W, W) teach W's share of the backward, averaged in; (forward,
    backward) pairs leave it; records mixing both teach nothing; the share is in the state."""
    cal = StageCalibration(2)
    pairs = _microbatches()
    assert cal.observe(pairs, COST, LAYERS) and cal.weight_share == WEIGHT_SHARE
    triples = [
        MicroBatchResult(mb.seconds, *_fields(mb), stage_seconds=tuple((f, b, 0.8 * b) for f, b in mb.stage_seconds))
        for mb in pairs
    ]
    assert cal.observe(triples, COST, LAYERS)
    want = np.exp((1 - SMOOTHING) * np.log(WEIGHT_SHARE) + SMOOTHING * np.log(0.8))
    assert cal.weight_share == pytest.approx(want)
    assert not cal.observe(pairs[:1] + triples[1:], COST, LAYERS)
    again = StageCalibration(2)
    again.load_state_dict(cal.state_dict())
    assert again.pricing() == cal.pricing()
    old = {k: v for k, v in cal.state_dict().items() if k != "weight_share"}  # a checkpoint from before
    again.load_state_dict(old)
    assert again.weight_share == WEIGHT_SHARE
