"""The trainer under the paper's method: top-k budgets, DST's rule with the coverage bound, the
per-length-bin budget average as SAB's estimate (emulated ranks, one process)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparsebalance.batching import BudgetEMAEstimator
from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency import analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.tuning import DSTConfig

pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.ProfileMismatchWarning")


def _config(tmp_path, **dst) -> TrainConfig:
    profile = tmp_path / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(profile)
    return TrainConfig(
        num_builtin=48,
        min_len=200,
        max_len=1200,
        profile=str(profile),
        out=str(tmp_path / "r"),
        steps=3,
        global_batch=8,
        capacity=2400,
        block_size=32,
        emulate_ranks=4,
        strategy="sab",
        deterministic=True,
        warmup_steps=0,
        device="cpu",
        dst=DSTConfig(budget_tokens=96, **dst),  # k = 3 blocks of 32
    )


def test_topk_training_is_sparse_and_dst_moves_whole_k_per_layer(tmp_path):
    trainer = Trainer(_config(tmp_path), Runtime(0, 1, torch.device("cpu")))
    assert isinstance(trainer.estimator, BudgetEMAEstimator)
    results = [trainer.run_step() for _ in range(2)]
    for res in results:
        s = res.report
        assert s.budget_kind == "top-k" and 0 < s.mean_density < 0.9
        assert s.plan_s > 0 and s.dst_s > 0 and s.overhead_s >= s.plan_s + s.dst_s
        for rec in res.records:
            for mb in rec.microbatches:  # every layer ran a whole k
                assert all(float(k).is_integer() and k >= 0 for k in mb.budgets)
    # DST gave the ranks different budgets (cut and raised) in some step
    roles = {r.dst_role for res in results for r in res.records}
    assert {"cut", "raised"} <= roles
    spread = max(max(r.budget for r in res.records) - min(r.budget for r in res.records) for res in results)
    assert spread > 1.0
    # the estimator learned each length bin's final k
    assert trainer.estimator.num_observed > 0 and trainer.estimator.bins
    line = results[-1].records[0].to_json()  # a metrics.jsonl line
    assert "budget_mean" in line and "dst_layer_s" in line and "coverage_limited" in line


def test_p_zero_never_cuts_below_the_base_k(tmp_path):
    trainer = Trainer(_config(tmp_path, p=0.0), Runtime(0, 1, torch.device("cpu")))
    for _ in range(1):
        res = trainer.run_step()
        for rec in res.records:
            assert rec.budget >= 3
            for mb in rec.microbatches:
                assert min(mb.budgets) >= 3


@pytest.mark.parametrize("feedback", [False, True])
def test_layer_times_feed_the_layer_choices_only_when_asked(tmp_path, monkeypatch, feedback):
    """By default each layer's budget follows predicted times (a CPU forward time, x 3 for its
    backward, misled the closed loop); ``--layer-feedback`` feeds measured layer times back."""
    from sparsebalance.tuning.layer import LayerController

    calls = []
    real = LayerController.observe
    monkeypatch.setattr(LayerController, "observe", lambda self, *a: (calls.append(a), real(self, *a))[1])
    cfg = replace(_config(tmp_path, layer_feedback=feedback), deterministic=False)
    res = Trainer(cfg, Runtime(0, 1, torch.device("cpu"))).run_step()
    assert {"cut", "raised"} & {r.dst_role for r in res.records}
    assert bool(calls) == feedback
