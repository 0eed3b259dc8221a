"""A closed loop with the latency model as the clock (issue 56): SAB + DST step after step on 8
emulated ranks, each micro-batch "measured" by a TRUE model (the planner's profile with its
attention part scaled by ``s``) and fed back through the real path (:meth:`StepEngine.feedback`
-> :func:`~sparsebalance.engine.feedback.apply_feedback` -> the latency model's calibration),
so the next step's plan and budgets are priced with what the previous steps taught.

Per step: the slowest rank's TRUE seconds of SAB's plan at the base budget and at DST's budgets
(the same plan: what DST did to it), and the calibration's attention / rest ratio. Optional
timing noise is a fixed pattern per (step, rank, micro-batch): deterministic.

    PYTHONPATH=src .venv/bin/python -m tests.tuning.skew_loop      # the table of today's behaviour
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sparsebalance.batching import PlanConfig
from sparsebalance.engine.engine import StepEngine
from sparsebalance.engine.kernel import Kernel
from sparsebalance.engine.records import MicroBatchResult, RankRecord
from sparsebalance.latency import LatencyModel, load_profile
from sparsebalance.latency.calibration import ScaleFilter
from sparsebalance.simulate.distributions import LengthDistribution
from sparsebalance.tuning import DSTConfig
from sparsebalance.tuning.plan_workload import PlanWorkload
from sparsebalance.workload import Sample

PROFILE = Path(__file__).parents[1] / "fixtures" / "profile-tiny-cpu-2026-12-02.json"
"""A latency profile measured on the 2-core CPU (tiny model, block 64, top-k, up to 4,096 tokens)."""

RANKS, DOCS, CAPACITY, BLOCK, BUDGET_TOKENS = 8, 32, 4096, 64, 512
MIXES = ("heavy", "uniform", "bimodal")
SKEWS = (0.25, 0.5, 2.0, 4.0)


def latency_model(attention: float = 1.0) -> LatencyModel:
    """The profile's model with its attention part x ``attention`` (a fresh calibration)."""
    p = copy.deepcopy(load_profile(PROFILE))
    p.scales = [p.scales[0] * attention, p.scales[1], p.scales[2]]
    return LatencyModel(p)


@dataclass(frozen=True)
class LoopStep:
    """One step of the loop, priced by the true model."""

    sab_s: float
    """The slowest rank of SAB's plan at the base budget."""
    dst_s: float
    """The slowest rank of the same plan at DST's budgets."""
    ratio: float
    """The calibration's attention / rest factor ratio after the step's feedback."""

    @property
    def gain(self) -> float:
        return self.sab_s / self.dst_s


def run_loop(
    mix: str,
    skew: float,
    steps: int = 6,
    seed: int = 0,
    noise: float = 0.0,
    config: DSTConfig | None = None,
    split_std: float | None = None,
) -> list[LoopStep]:
    """``steps`` steps of SAB + DST on ``mix`` (32 documents of 128-4,096 tokens per step) with a
    machine whose attention costs ``skew`` x what the profile says; ``noise``: each micro-batch's
    measured time off by a fixed normal draw of this relative size; ``split_std``: the
    calibration's prior on its split, when not the default (with the level's prior of that
    filter, 0.5: the filter before issue 56's second round, with 0.15)."""
    config = config or DSTConfig(budget="top-k", budget_tokens=BUDGET_TOKENS)
    truth, nominal = latency_model(skew), latency_model()
    if split_std is not None:
        noise_std = nominal.calibration.noise_var**0.5
        nominal.calibration = ScaleFilter(noise_std=noise_std, level_std=0.5, split_std=split_std)
    samples: dict[int, Sample] = {}
    kernel = Kernel(torch.device("cpu"), BLOCK, "torch", "fp32", "expand")
    engine = StepEngine(
        PlanConfig(world_size=RANKS, capacity=CAPACITY, strategy="sab"),
        nominal,
        config,
        samples.__getitem__,
        kernel=kernel,
        world_size=RANKS,
    )
    knob = engine.knob
    rng = np.random.default_rng(seed)
    jitter = np.random.default_rng(10_000 + seed)
    dist = LengthDistribution(name=mix, min_len=128, max_len=CAPACITY)
    out = []
    for step in range(steps):
        lengths, _ = dist.sample(rng, DOCS)
        batch = [Sample(id=step * DOCS + i, num_tokens=int(n)) for i, n in enumerate(lengths)]
        samples.update({s.id: s for s in batch})
        tuned = engine.begin(batch)
        plan = tuned.planned.plan
        records = []
        for rank, decision in enumerate(tuned.decision.ranks):
            results = []
            for mb in plan.ranks[rank]:
                dens = knob.density(np.asarray(mb.lengths), 1.0, decision.budget)
                seconds = truth.predict(list(mb.lengths), dens) * (1.0 + noise * jitter.standard_normal())
                layers = truth.num_layers
                results.append(
                    MicroBatchResult(
                        seconds=float(seconds),
                        lengths=tuple(mb.lengths),
                        sample_ids=tuple(mb.sample_ids),
                        layer_densities=(tuple(float(d) for d in dens),) * layers,
                        budgets=(float(decision.budget),) * layers,
                        loss_sum=0.0,
                        weight_sum=1.0,
                    )
                )
            records.append(RankRecord.from_results(decision, results))
        work = PlanWorkload(plan.ranks, truth, knob)
        sab = work.seconds(np.full(RANKS, float(knob.base)))
        dst = work.seconds(np.array([r.budget for r in tuned.decision.ranks]))
        engine.feedback(records)
        theta = nominal.calibration.theta
        out.append(LoopStep(float(sab.max()), float(dst.max()), float(theta[0] / theta[1])))
    return out


def _table(steps: int = 6, noise: float = 0.0, seeds=(0, 1)) -> None:
    for skew in (*SKEWS, 1.0):
        for mix in MIXES:
            for seed in seeds:
                loop = run_loop(mix, skew, steps, seed, noise)
                gains = " ".join(f"{s.gain:.3f}" for s in loop)
                ratios = " ".join(f"{s.ratio:.2f}" for s in loop)
                print(f"s={skew:<4} {mix:8} seed {seed}: DST gain {gains} | att/rest {ratios}")


if __name__ == "__main__":
    import sys

    _table(noise=float(sys.argv[1]) if len(sys.argv) > 1 else 0.0)
