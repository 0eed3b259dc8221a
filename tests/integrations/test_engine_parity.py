"""Issue 37: one engine below every front end. The same documents through ``sparsebalance train``'s
own ``Trainer`` and through the plain-loop API (``balanced_loader``), one process, the same seed
and settings (``hf_worker.py`` says what "alike" means): the same plans (hashes) and the same
per-layer budgets, bit for bit, and the same losses within 1e-6 (the own loop's loss and the
model's HF loss are two implementations of the global token mean, in float64 and float32
summed in another order: measured 1.7e-7 apart)."""

from __future__ import annotations

import pytest
import torch

import sparsebalance
from sparsebalance.engine.runtime import Runtime
from sparsebalance.integrations import PlannerConfig, balanced_loader
from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.models.hf import build_model
from sparsebalance.train import Trainer
from tests.integrations.hf_worker import BLOCK, CAPACITY, DST, LR, WD, sb_config

pytestmark = [
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning"),
    pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning"),
]
STEPS, GLOBAL_BATCH, MICRO = 3, 6, 8


def _own(tmp_path, profile):
    """The own trainer's steps: (plan hash, DST's cut, predicted step, every micro-batch's
    per-layer budgets in plan order, global loss) per step."""
    from dataclasses import replace

    cfg = replace(sb_config(tmp_path, profile), global_batch=GLOBAL_BATCH, steps=STEPS)
    trainer = Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    steps = []
    for _ in range(STEPS):
        result = trainer.run_step()
        layers = [list(mb.budgets) for rec in result.records for mb in rec.microbatches]
        steps.append(
            (
                result.report.plan_hash,
                result.report.dst_budget_cut,
                result.report.predicted_max_s,
                layers,
                result.report.loss,
            )
        )
    return trainer, steps


def test_the_own_trainer_and_the_plain_loop_run_the_same_engine(tmp_path):
    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=BLOCK).save(profile)
    trainer, own = _own(tmp_path, profile)
    docs = [trainer.corpus.docs[i].tolist() for i in range(len(trainer.corpus.lengths()))]
    dataset = [{"input_ids": d} for d in docs]

    model = build_model("tiny", seed=0)
    runtime = sparsebalance.attach(model, block_size=BLOCK)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    config = PlannerConfig(GLOBAL_BATCH, MICRO, CAPACITY, dst=DST, block_size=BLOCK, deterministic=True)
    loop = balanced_loader(runtime, dataset, config, profile=profile)
    theirs = []
    for step in loop.steps(epoch=0, max_steps=STEPS):
        total = 0.0
        for batch in step:
            loss = model(**batch).loss
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        tickets = [t for t in step.work.tickets if not t.filler]
        layers = [[s.budget for s in t.attention.stats] for t in tickets]
        t = step.finish()
        theirs.append((t["plan_hash"], t["dst_budget_cut"], t["predicted_max_s"], layers, total))

    assert len({h for h, *_ in own}) == STEPS
    for mine, other in zip(own, theirs, strict=True):
        assert mine[:4] == other[:4]  # plan, DST's decision, every layer's budget: bit for bit
        assert len(mine[3]) > 1 and len(mine[3][0]) == 4  # several micro-batches, 4 layers each
        assert other[4] == pytest.approx(mine[4], rel=1e-6)
