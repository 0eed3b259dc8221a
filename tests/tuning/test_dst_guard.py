"""DST's guard (issue 56), with the latency model as the clock (no wall time): on the project's own
mixes and 8 ranks, the budgets DST chooses never make the slowest rank slower than SAB alone, nor
the balance worse, even when the true machine differs from the profile by a constant factor or by
a 2x skew between attention and the rest; and they lower it when the profile is right.

Before the skew margin (d182e21: raises to the anchor by the nominal model alone) the 2x attention
skew made DST up to 7.6 % slower than SAB on the heavy mix (balance -0.074): the cases below fail
there."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.latency import LatencyModel, load_profile
from sparsebalance.simulate.distributions import LengthDistribution
from sparsebalance.tuning import DSTConfig, DSTTuner
from sparsebalance.tuning.plan_workload import PlanWorkload
from sparsebalance.workload import Sample

PROFILE = Path(__file__).parents[1] / "fixtures" / "profile-tiny-cpu-2026-12-02.json"
"""A latency profile measured on the 2-core CPU (tiny model, block 64, top-k, up to 4,096 tokens)."""

TRUTHS = {  # (attention, rest) factors of the true machine against the profile
    "as profiled": (1.0, 1.0),
    "2x faster": (0.5, 0.5),
    "2.5x slower": (2.5, 2.5),
    "attention 2x dearer": (2.0, 1.0),
    "attention 2x cheaper": (0.5, 1.0),
}
MIXES = ("heavy", "uniform", "bimodal")
SEEDS = range(8)


def _model(att: float = 1.0, rest: float = 1.0) -> LatencyModel:
    p = load_profile(PROFILE)
    p = copy.deepcopy(p)
    p.scales = [p.scales[0] * att, p.scales[1] * rest, p.scales[2] * rest]
    return LatencyModel(p)


def _step(mix: str, seed: int, config: DSTConfig):
    """SAB's plan of 32 documents over 8 ranks (capacity 4,096) and DST's budgets, both priced by
    the profile as measured; returns the plan, the tuner and the per-rank budgets."""
    lengths, _ = LengthDistribution(name=mix, min_len=128, max_len=4096).sample(np.random.default_rng(seed), 32)
    samples = [Sample(id=i, num_tokens=int(n)) for i, n in enumerate(lengths)]
    nominal = _model()
    tuner = DSTTuner(config, block_size=64)
    dens = tuner.knob.density(np.asarray(lengths), 1.0, float(tuner.knob.base))
    plan = plan_batch(samples, nominal, PlanConfig(world_size=8, capacity=4096, strategy="sab"), densities=dens)
    decision = tuner.decide(plan.ranks, nominal)
    return plan, tuner, np.array([r.budget for r in decision.ranks])


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("truth", list(TRUTHS))
def test_dst_never_slows_sab_down_nor_unbalances_it(mix, truth):
    config = DSTConfig(budget="top-k", budget_tokens=512)
    clock = _model(*TRUTHS[truth])
    gains = []
    for seed in SEEDS:
        plan, tuner, budgets = _step(mix, seed, config)
        work = PlanWorkload(plan.ranks, clock, tuner.knob)
        sab = work.seconds(np.full(8, float(tuner.knob.base)))
        dst = work.seconds(budgets)
        assert dst.max() <= sab.max() * (1 + 1e-9), f"seed {seed}: DST {dst.max():.4f} s > SAB {sab.max():.4f} s"
        balance_sab, balance_dst = sab.mean() / sab.max(), dst.mean() / dst.max()
        assert balance_dst >= balance_sab - 1e-9, f"seed {seed}: balance {balance_sab:.4f} -> {balance_dst:.4f}"
        gains.append(sab.max() / dst.max())
    if truth == "as profiled":  # the profile is right: DST lowers the slowest rank's time
        assert min(gains) > 1.0 and np.mean(gains) > 1.005


def test_a_skew_margin_of_one_trusts_the_model():
    """``--skew-margin 1`` raises to the anchor by the nominal model alone (the rule before the
    margin): with attention 2x dearer than profiled it overshoots on some step of the heavy mix,
    which is what the default margin prevents."""
    clock = _model(2.0, 1.0)
    worst = []
    for seed in SEEDS:
        plan, tuner, budgets = _step("heavy", seed, DSTConfig(budget="top-k", budget_tokens=512, skew_margin=1.0))
        work = PlanWorkload(plan.ranks, clock, tuner.knob)
        worst.append(work.seconds(np.full(8, float(tuner.knob.base))).max() / work.seconds(budgets).max())
    assert min(worst) < 0.97


def test_the_margin_keeps_cuts_and_lowers_raises_only():
    """Against margin 1, the default margin changes no cut and raises no worker further."""
    for seed in SEEDS:
        _, _, trusting = _step("heavy", seed, DSTConfig(budget="top-k", budget_tokens=512, skew_margin=1.0))
        _, tuner, guarded = _step("heavy", seed, DSTConfig(budget="top-k", budget_tokens=512))
        base = float(tuner.knob.base)
        cut = trusting < base
        assert np.array_equal(guarded[cut], trusting[cut])
        assert np.all(guarded <= trusting + 1e-12) and np.all(guarded[~cut] >= base)


def test_skew_margin_is_validated():
    with pytest.raises(ValueError, match="skew"):
        DSTConfig(skew_margin=0.5)


@pytest.mark.parametrize("mix", [pytest.param("tasks", marks=pytest.mark.slow), "heavy"])
def test_the_layers_realise_the_step_decision(tmp_path, mix):
    """The real trainer (8 emulated ranks, deterministic, the CPU profile as the clock): each
    rank's realised attention, the per-layer budgets its controllers actually ran priced by the
    model, is within 2 % of the step-level decision (a rank whose cuts the coverage bound stopped
    may stay above it, never above its time at the base budget), and the slowest rank's realised
    time is below SAB's for the same plan."""
    import torch

    from sparsebalance.engine.runtime import Runtime
    from sparsebalance.train import TrainConfig, Trainer

    data = None
    if mix == "heavy":  # a jsonl of heavy-tailed lengths (one repeated word per token, roughly)
        rng = np.random.default_rng(3)
        lengths, _ = LengthDistribution(name="heavy", min_len=128, max_len=2048).sample(rng, 64)
        data = tmp_path / "heavy.jsonl"
        data.write_text("".join('{"text": "' + " ".join(["x y"] * int(n // 2)) + '"}\n' for n in lengths))
    cfg = TrainConfig(
        data=None if data is None else str(data),
        num_builtin=64,
        min_len=128,
        max_len=2048,
        profile=str(PROFILE),
        out=str(tmp_path / "run"),
        steps=1,
        global_batch=32,
        capacity=2048,
        block_size=64,
        emulate_ranks=8,
        strategy="sab",
        deterministic=True,
        device="cpu",
        dst=DSTConfig(budget="top-k", budget_tokens=512),
    )
    trainer = Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    model = trainer.latency
    result = trainer.run_step()
    realised = []
    for rec in result.records:
        seconds = sum(model.predict(list(mb.lengths), np.asarray(mb.layer_densities)) for mb in rec.microbatches)
        realised.append(seconds)
        if rec.coverage_limited == 0:
            assert seconds == pytest.approx(rec.predicted_s, rel=0.02), f"rank {rec.rank} ({rec.dst_role})"
        else:
            assert seconds <= rec.predicted_before_s * 1.02, f"rank {rec.rank}: above its base-budget time"
    before = max(rec.predicted_before_s for rec in result.records)
    assert max(realised) < before, f"realised slowest {max(realised):.4f} s, SAB's {before:.4f} s"


def test_each_steps_layer_controller_prices_with_the_recalibrated_model():
    """The per-layer decisions cache costs within a step only: the next step's controller prices
    with the latency model as recalibrated by the measured step before (issue 56's question)."""
    from sparsebalance.tuning import LayerController
    from sparsebalance.workload import MicroBatch

    model = _model()
    config = DSTConfig(budget="top-k", budget_tokens=512)
    knob = config.knob(64)
    mb = MicroBatch((0, 1), (2048, 700), (0.5, 0.5))
    dens = knob.density(np.array(mb.lengths), 1.0, float(knob.base))

    def planned() -> float:
        return float(LayerController([mb], model, config, 1.0, knob=knob, device="cpu").planned.sum())

    before = planned()
    assert before == pytest.approx(model.predict(list(mb.lengths), dens), rel=1e-9)
    for _ in range(16):  # a step of micro-batches measured 2x slower than predicted
        model.update(list(mb.lengths), dens, 2.0 * before)
    assert planned() == pytest.approx(model.predict(list(mb.lengths), dens), rel=1e-9)
    assert planned() > 1.7 * before


@pytest.mark.parametrize("truth", list(TRUTHS))
def test_with_timing_noise_dst_still_lowers_the_expected_slowest_rank(truth):
    """A measured step waits for the slowest of 8 noisy ranks: raising the light ranks up to the
    anchor puts more of them near the top, where noise decides the maximum. With each rank's time
    off by 4 % (a normal draw per rank and step, fixed seed: about what the 2-core CPU shows,
    2026-12-02-dst-gain-median-*), the expected slowest rank under DST's budgets stays below
    SAB's on every mix and seed with the profile right, and is never 0.1 % above it with the profile
    off (in the model: at least 1.0003x faster on every truth today)."""
    noise = 1 + 0.04 * np.random.default_rng(56).standard_normal((2000, 8))
    clock = _model(*TRUTHS[truth])
    config = DSTConfig(budget="top-k", budget_tokens=512)
    for mix in MIXES:
        for seed in SEEDS:
            plan, tuner, budgets = _step(mix, seed, config)
            work = PlanWorkload(plan.ranks, clock, tuner.knob)
            sab = (work.seconds(np.full(8, float(tuner.knob.base))) * noise).max(axis=1).mean()
            dst = (work.seconds(budgets) * noise).max(axis=1).mean()
            # strictly faster with the profile right; within 0.1 % with it off (the worst case today
            # is 1.0003x faster: a small change to DST must not flip a test about noise)
            slack = 0.0 if truth == "as profiled" else 1e-3
            assert dst < sab * (1 + slack), f"{mix} seed {seed}: expected slowest rank {dst:.4f} s, SAB's {sab:.4f} s"
