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
    from dataclasses import replace

    cfg = replace(sb_config(tmp_path, profile), global_batch=GLOBAL_BATCH, steps=STEPS)
    trainer = Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    out = trainer.run()
    return trainer, out, out["summaries"]


def test_the_own_trainer_and_the_plain_loop_run_the_same_engine(tmp_path):
    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=BLOCK).save(profile)
    trainer, out, summaries = _own(tmp_path, profile)
    docs = [trainer.corpus.docs[i].tolist() for i in range(len(trainer.corpus.lengths()))]
    dataset = [{"input_ids": d} for d in docs]

    model = build_model("tiny", seed=0)
    runtime = sparsebalance.attach(model, block_size=BLOCK)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    config = PlannerConfig(GLOBAL_BATCH, MICRO, CAPACITY, dst=DST, block_size=BLOCK,
                           deterministic=True)  # fmt: skip
    loop = balanced_loader(runtime, dataset, config, profile=profile)
    losses, telemetry = [], []
    for step in loop.steps(epoch=0, max_steps=STEPS):
        total = 0.0
        for batch in step:
            loss = model(**batch).loss
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        telemetry.append(step.finish())
        losses.append(total)

    assert [t["plan_hash"] for t in telemetry] == [s["plan_hash"] for s in summaries]
    assert len({s["plan_hash"] for s in summaries}) == STEPS
    for t, s in zip(telemetry, summaries, strict=True):  # DST's decisions, bit for bit
        assert t["dst_budget_cut"] == s["dst_budget_cut"]
        assert t["predicted_step_s"] == s["predicted_max_s"]
    own_layers = [r.budget_mean for r in _rank_records(tmp_path)]
    assert [t["budget_mean"] for t in telemetry] == own_layers  # per-layer budgets, mean
    assert losses == pytest.approx(out["losses"], rel=1e-6)


def _rank_records(tmp_path):
    import json
    from types import SimpleNamespace

    lines = [json.loads(x) for x in (tmp_path / "sb" / "metrics.jsonl").read_text().splitlines()]
    return [SimpleNamespace(**x) for x in lines if x.get("rank") != "all"]
