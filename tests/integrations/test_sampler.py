"""The balanced sampler, collator and plain-loop position (one process, no model forward)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from sparsebalance.integrations import (
    BalancedBatchSampler,
    PlannerConfig,
    StepPlanner,
)
from sparsebalance.integrations.sampler import IGNORE
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.tuning import DSTConfig

RNG = np.random.default_rng(3)
LENGTHS = np.clip(RNG.lognormal(4.5, 1.0, 24).astype(int), 40, 700)  # inside the profile
DATA = [{"input_ids": RNG.integers(3, 900, n).tolist()} for n in LENGTHS]


def planner(rank=0, world=1, **over) -> StepPlanner:
    cfg = dict(
        global_batch=8,
        micro_batches=4,
        capacity=512,
        block_size=32,
        dst=DSTConfig(budget="gamma", gamma0=0.9),
        deterministic=True,
    )
    cfg.update(over)
    latency = LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=32))
    # every rank plans alone here: all_gather returns this rank's hash for every rank
    return StepPlanner(
        LENGTHS, PlannerConfig(**cfg), latency, rank, world, all_gather=lambda obj: [obj] * world, device="cpu"
    )


def collect(sampler: BalancedBatchSampler, data=DATA):
    return list(sampler.dataloader(data))


def test_every_rank_gets_micro_batches_of_its_plan_and_fillers():
    batches = [collect(BalancedBatchSampler(planner(rank, 2))) for rank in (0, 1)]
    steps = len(DATA) // 8
    assert len(batches[0]) == len(batches[1]) == steps * 4  # the same count on every rank
    for step in range(steps):
        seen = []
        for rank in (0, 1):
            for b in batches[rank][4 * step : 4 * step + 4]:
                ticket = b["sb_attention"]
                assert ticket.step == step
                if not ticket.filler:
                    seen += list(ticket.key.sample_ids)
                else:  # two tokens, no target
                    assert b["input_ids"].shape == (1, 2) and (b["shift_labels"] == IGNORE).all()
        # every document of the global batch once (chunks of split ones share the id)
        planned = sorted(set(seen))
        assert len(planned) == 8
        total = sum(
            int((b["shift_labels"] != IGNORE).sum()) for rank in (0, 1) for b in batches[rank][4 * step : 4 * step + 4]
        )
        assert int(batches[0][4 * step]["num_items_in_batch"]) == total


def test_labels_shift_inside_documents_only():
    (batch, *_) = collect(BalancedBatchSampler(planner()))
    ids, labels, shift = batch["input_ids"][0], batch["labels"][0], batch["shift_labels"][0]
    cu = batch["cu_seq_lens_q"].tolist()
    for a, b in itertools.pairwise(cu):
        assert torch.equal(shift[a : b - 1], ids[a + 1 : b]) and shift[b - 1] == IGNORE
        assert labels[a] == IGNORE and torch.equal(labels[a + 1 : b], ids[a + 1 : b])
        assert batch["position_ids"][0, a:b].tolist() == list(range(b - a))
    assert torch.equal(labels[1:], shift[:-1])  # HF's own shift of labels gives shift_labels


def test_completion_mask_removes_prompt_targets():
    data = [
        {
            **d,
            "completion_mask": [0] * (len(d["input_ids"]) // 2)
            + [1] * (len(d["input_ids"]) - len(d["input_ids"]) // 2),
        }
        for d in DATA
    ]
    plain = collect(BalancedBatchSampler(planner()))
    masked = collect(BalancedBatchSampler(planner()), data)
    n_plain = sum(int((b["shift_labels"] != IGNORE).sum()) for b in plain[:4])
    n_masked = sum(int((b["shift_labels"] != IGNORE).sum()) for b in masked[:4])
    assert 0 < n_masked < n_plain
    assert int(masked[0]["num_items_in_batch"]) == n_masked


def test_state_dict_resumes_at_the_next_step():
    sampler = BalancedBatchSampler(planner())
    loader = sampler.dataloader(DATA)
    it = iter(loader)
    for _ in range(4):  # step 0
        next(it)
    sampler.planner.finish(sampler.planner.current)  # its feedback (estimator learns)
    state = sampler.state_dict()
    assert state["step"] == 1
    rest = [b["sb_attention"].key for b in it]
    resumed = BalancedBatchSampler(planner())
    resumed.load_state_dict(state)
    again = [b["sb_attention"].key for b in resumed.dataloader(DATA)]
    assert [(s.step, s.sample_ids, s.lengths) for s in again] == [(s.step, s.sample_ids, s.lengths) for s in rest]


@pytest.mark.filterwarnings("ignore::UserWarning")  # short chunks lie below the profiled lengths
def test_too_few_micro_batches_is_refused_naming_the_setting():
    sampler = BalancedBatchSampler(planner(micro_batches=1, capacity=64))
    with pytest.raises(ValueError, match="gradient_accumulation_steps is 1"):
        collect(sampler)


def test_config_refusals():
    with pytest.raises(ValueError, match="sab-cp"):
        PlannerConfig(global_batch=8, micro_batches=2, strategy="sab-cp")
    with pytest.raises(ValueError, match="micro_batches must be >= 1"):
        PlannerConfig(global_batch=8, micro_batches=0)
    with pytest.raises(ValueError, match="global_batch 99 exceeds"):
        planner(global_batch=99)
