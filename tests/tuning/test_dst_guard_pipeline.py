"""DST's skew guard on pipelines (:class:`~sparsebalance.tuning.skew.PipelineSkew`), with the
latency model as the clock (no wall time): SAB's pipeline plans of the project's own mixes, DST's
budgets per pipeline and per micro-batch, and a true machine whose attention costs ``s`` times
what the profile says. DST's true step makespan (the slowest pipeline) is never above SAB's alone
(the base budget everywhere) for ``s`` = 0.5 and 2, on 1F1B, ZB-H1 and interleaved pipelines.

Before the guard, pipelines trusted the model (what ``--skew-margin 1`` still does): the same
cases made DST up to ~1.2 % slower than SAB (PP2 interleaved, bimodal), and
:func:`test_a_skew_margin_of_one_overshoots_on_pipelines` shows it.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.simulate.distributions import LengthDistribution
from sparsebalance.tuning import DSTConfig, DSTTuner, PipelineWorkload, PlanWorkload
from sparsebalance.tuning.microbatch_dst import MicroBatchPrices
from sparsebalance.tuning.records import CUT, RAISED
from sparsebalance.workload import Sample

from .test_dst_guard import MIXES, _model

# (data-parallel ranks, stages, schedule, virtual chunks): the tiny model has 4 layers, so the
# interleaved schedule runs at PP2 with 2 chunks (PP4 x 2 would need 8 layers)
PIPELINES = {
    "DP2-PP2-1f1b": (2, 2, "1f1b", 1),
    "DP2-PP4-1f1b": (2, 4, "1f1b", 1),
    "DP4-PP4-1f1b": (4, 4, "1f1b", 1),
    "DP2-PP2-zb-h1": (2, 2, "zb-h1", 1),
    "DP2-PP4-zb-h1": (2, 4, "zb-h1", 1),
    "DP2-PP2-V2": (2, 2, "1f1b", 2),
    "DP4-PP2-V2": (4, 2, "1f1b", 2),
}
SEEDS = range(6)
SKEWS = (0.5, 2.0)
"""The true machine's attention, as a factor of the profile's (DSTConfig.skew_margin's range)."""


@cache
def _plan(pipeline: str, mix: str, seed: int):
    """SAB's pipeline plan of 32 documents (capacity 4,096, top-k 512 at block 64), priced by the
    profile as measured: the plan, its pipeline shape and the model (one per case: DST does not
    change them)."""
    dp, pp, schedule, virtual = PIPELINES[pipeline]
    lengths, _ = LengthDistribution(name=mix, min_len=128, max_len=4096).sample(np.random.default_rng(seed), 32)
    samples = [Sample(id=i, num_tokens=int(n)) for i, n in enumerate(lengths)]
    nominal = _model()
    knob = DSTConfig(budget="top-k", budget_tokens=512).knob(64)
    dens = knob.density(np.asarray(lengths), 1.0, float(knob.base))
    cfg = PlanConfig(
        world_size=dp,
        capacity=4096,
        strategy="sab",
        pipeline_stages=pp,
        pipeline_schedule=schedule,
        pipeline_virtual=virtual,
    )
    plan = plan_batch(samples, nominal, cfg, densities=dens)
    return plan, cfg.pipeline(nominal.num_layers), nominal


def _step(pipeline: str, mix: str, seed: int, config: DSTConfig, per_microbatch: bool = True):
    """:func:`_plan` and DST's decision on it: the plan, its pipeline shape, the tuner and the
    decision."""
    plan, shape, nominal = _plan(pipeline, mix, seed)
    tuner = DSTTuner(config, block_size=64)
    decision = tuner.decide(plan.ranks, nominal, pipeline=shape, per_microbatch=per_microbatch)
    return plan, shape, tuner, decision


def _true_makespans(plan, shape, tuner, decision, attention: float) -> tuple[np.ndarray, np.ndarray]:
    """``(R,)`` each pipeline's makespan on a machine whose attention is ``attention`` x the
    profile's: at the base budget (SAB alone) and at DST's budgets per micro-batch (or its one
    budget per pipeline)."""
    truth = _model(attention, 1.0)
    prices = MicroBatchPrices(PipelineWorkload(PlanWorkload(plan.ranks, truth, tuner.knob), shape))
    per_mb = []
    for g in prices.groups:
        for r in g.ranks.tolist():
            mine = decision.ranks[r].microbatch_budgets
            per_mb.append(np.full(g.lengths.shape[1], decision.ranks[r].budget) if mine is None else np.asarray(mine))
    dst = np.concatenate([np.zeros(0), *per_mb])
    base = np.full(prices.size, float(tuner.knob.base))
    return prices.makespans(prices.seconds(base)), prices.makespans(prices.seconds(dst))


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_dst_never_slows_a_pipeline_step_under_a_skew(pipeline):
    config = DSTConfig(budget="top-k", budget_tokens=512)
    gains = []
    for mix in MIXES:
        for seed in SEEDS:
            plan, shape, tuner, decision = _step(pipeline, mix, seed, config)
            for s in SKEWS:
                sab, dst = _true_makespans(plan, shape, tuner, decision, s)
                assert dst.max() <= sab.max() * (1 + 1e-9), (
                    f"{mix} seed {seed}, attention x{s}: DST {dst.max():.5f} s > SAB {sab.max():.5f} s"
                )
            sab, dst = _true_makespans(plan, shape, tuner, decision, 1.0)
            assert dst.max() <= sab.max() * (1 + 1e-9)
            gains.append(sab.max() / dst.max())
    # the profile right: DST still lowers the slowest pipeline on most steps, never raises it
    assert np.mean(gains) > 1.005, f"mean gain {np.mean(gains):.4f}"


def test_a_skew_margin_of_one_overshoots_on_pipelines():
    """``--skew-margin 1`` (the pipelines' rule before the guard: raises by the nominal model
    alone, per pipeline and per micro-batch) makes DST slower than SAB on some step once attention
    costs 2x more, or less, than profiled; the default margin keeps those same steps at or below
    SAB (:func:`test_dst_never_slows_a_pipeline_step_under_a_skew`)."""
    trusting = DSTConfig(budget="top-k", budget_tokens=512, skew_margin=1.0)
    worst = 1.0
    for pipeline in ("DP2-PP4-1f1b", "DP2-PP2-zb-h1", "DP2-PP2-V2"):
        for mix in MIXES:
            for seed in SEEDS:
                plan, shape, tuner, decision = _step(pipeline, mix, seed, trusting)
                for s in SKEWS:
                    sab, dst = _true_makespans(plan, shape, tuner, decision, s)
                    worst = max(worst, dst.max() / sab.max())
    assert worst > 1.002, f"the trusting rule's worst step is {worst:.5f}x SAB's"


@pytest.mark.parametrize("pipeline", ["DP2-PP4-1f1b", "DP2-PP2-zb-h1", "DP2-PP2-V2"])
def test_the_guard_holds_between_the_checked_skews(pipeline):
    """A makespan is convex in the skew, not linear: the guard checks ``1/m``, 1 and ``m`` and
    bounds the reference below in between, so no skew inside the range (here a grid of 9) makes
    a raised pipeline slower than SAB's slowest."""
    config = DSTConfig(budget="top-k", budget_tokens=512)
    for mix in MIXES:
        for seed in SEEDS[:3]:
            plan, shape, tuner, decision = _step(pipeline, mix, seed, config)
            for s in np.geomspace(0.5, 2.0, 9):
                sab, dst = _true_makespans(plan, shape, tuner, decision, float(s))
                assert dst.max() <= sab.max() * (1 + 1e-9), f"{mix} seed {seed}, attention x{s:.3f}"


def test_the_rank_level_guard_keeps_cuts_and_lowers_raises_only():
    """One budget per pipeline: against margin 1 the default margin changes no cut and raises no
    pipeline further, and it keeps every pipeline at or above the base where it was raised."""
    lowered = 0
    for pipeline in ("DP2-PP4-1f1b", "DP4-PP4-1f1b", "DP2-PP2-zb-h1"):
        for mix in MIXES:
            for seed in SEEDS:
                trusting = _step(
                    pipeline, mix, seed, DSTConfig(budget="top-k", budget_tokens=512, skew_margin=1.0), False
                )[3]
                _, _, tuner, guarded = _step(pipeline, mix, seed, DSTConfig(budget="top-k", budget_tokens=512), False)
                roles = np.asarray(guarded.targets.roles)
                assert guarded.targets == trusting.targets
                assert np.array_equal(guarded.budgets[roles == CUT], trusting.budgets[roles == CUT])
                assert np.all(guarded.budgets <= trusting.budgets + 1e-12)
                assert np.all(guarded.budgets[roles == RAISED] >= tuner.base)
                lowered += int(np.sum(guarded.budgets < trusting.budgets - 1e-9))
    assert lowered > 0  # the guard had something to do
