"""Issue 15's exactness: a step whose plan splits a document over a CP unit (the unmodified HF
model on striped shards, distributed selection, flat or hierarchical sparse ring) gives the same
loss and the same gradient of every parameter as one process running the whole documents with
the single-process op: float64, tiny model, 4 gloo processes, max relative difference <= 1e-9."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sparsebalance.batching import Unit
from sparsebalance.data import pack
from sparsebalance.engine.cp_unit import unit_batch
from sparsebalance.engine.loss import packed_loss
from sparsebalance.models.attention import PackedAttention
from sparsebalance.models.checkpointing import apply_activation_checkpointing
from sparsebalance.models.hf import build_model
from sparsebalance.ops import Budget

from ..parallel.spawn import run_workers

BLOCK = 16
# Document 0 (300 tokens: 19 blocks, not a multiple of 3 ranks or of the block size) is split;
# documents 1 and 2 are short and run whole on one rank.
LENGTHS = (300, 40, 57)
TOL = 1e-9


def _docs():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 4096, n) for n in LENGTHS]


def _plan(ring: str):
    """Units as a hybrid plan gives them: the split document first, the short ones after."""
    if ring == "flat":  # document 0 over ranks 0..2, the short documents on rank 3
        cp = Unit(0, (0, 1, 2), "striped", "flat", 3, (0,), (0,), (300,), (0.5,), 1.0)
    else:  # 2 x 2: document 0 over all four ranks; rank 3 runs the short ones afterwards
        cp = Unit(0, (0, 1, 2, 3), "striped", "hierarchical", 2, (0,), (0,), (300,), (0.5,), 1.0)
    solo = Unit(1, (3,), "whole", "none", 1, (1, 2), (0, 0), (40, 57), (0.5, 0.5), 1.0)
    return [cp, solo]


def _choose(gamma):
    if gamma == "per-layer":  # DST-like: a different budget in every layer
        return lambda layer, estimate: Budget(gamma=0.6 + 0.1 * layer)
    if gamma == "top-k per-layer":  # the paper's knob, a whole k per layer
        return lambda layer, estimate: Budget(top_k=1 + layer)
    return None


def _budget(gamma):
    if gamma == "top-k":
        return Budget(top_k=2)
    return Budget(gamma=1.0 if gamma in ("per-layer", "top-k per-layer") else gamma)


def _model(checkpointing: str):
    model = build_model("tiny", "cpu", torch.float64, seed=3)
    apply_activation_checkpointing(model, checkpointing)
    return model


def _reference(units, docs, gamma, checkpointing):
    """One process, whole documents, the single-process op: loss and gradients of the step."""
    model = _model(checkpointing)
    weight = sum(n - 1 for n in LENGTHS)
    total = 0.0
    for unit in units:
        batch = pack([docs[i] for i in unit.sample_ids], "cpu")
        ctx = PackedAttention(batch.cu_seqlens, _budget(gamma), BLOCK, "torch", choose_budget=_choose(gamma))
        loss = packed_loss(model, batch, ctx, "chunked")
        (loss / weight).backward()
        total += float(loss)
    return total / weight, {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank, world, cases):
    for case in cases:  # one spawn for every case: process start-up dominates on 2 cores
        _case(rank, world, *case)


def _case(rank, world, ring, gamma, checkpointing):
    docs, units = _docs(), _plan(ring)
    model = _model(checkpointing)
    weight = sum(n - 1 for n in LENGTHS)
    local = torch.zeros((), dtype=torch.float64)
    cp_density = torch.zeros(model.config.num_hidden_layers, dtype=torch.float64)
    for unit in units:  # in slot order
        if rank not in unit.ranks:
            continue
        if unit.degree > 1:
            batch, ring_ctx = unit_batch(unit, rank, docs, BLOCK, torch.device("cpu"))
        else:
            batch, ring_ctx = pack([docs[i] for i in unit.sample_ids], "cpu"), None
        ctx = PackedAttention(
            batch.cu_seqlens, _budget(gamma), BLOCK, "torch", choose_budget=_choose(gamma), ring=ring_ctx
        )
        loss = packed_loss(model, batch, ctx, "chunked")
        (loss / weight).backward()
        local += loss.detach()
        if ring_ctx is not None:
            cp_density = torch.tensor([s.density for s in ctx.stats], dtype=torch.float64)
    # the unit's layouts are global: the same density in every layer on each of its ranks
    gathered = [torch.empty_like(cp_density) for _ in range(world)]
    dist.all_gather(gathered, cp_density)
    assert all(torch.equal(gathered[r], gathered[0]) for r in units[0].ranks), gathered
    assert float(gathered[0].min()) > 0
    # the trainer's one gradient sync over all ranks (a sum here: no DDP average to undo)
    dist.all_reduce(local)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        grads[n] = g
    want_loss, want = _reference(units, docs, gamma, checkpointing)
    got_loss = float(local) / weight
    assert abs(got_loss - want_loss) <= TOL * abs(want_loss), (got_loss, want_loss)
    for n, g in grads.items():
        scale = float(want[n].abs().max())
        err = float((g - want[n]).abs().max()) / max(scale, 1e-300)
        assert err <= TOL, f"rank {rank} {ring} gamma={gamma}: {n} relative error {err:.2e}"


CASES = (
    ("flat", 1.0, "off"),  # dense
    ("flat", 0.9, "off"),
    ("hierarchical", 0.9, "off"),  # 2 x 2
    ("hierarchical", 1.0, "off"),
    ("flat", "per-layer", "full"),  # DST-like per-layer budgets, activation checkpointing
    ("flat", "top-k", "off"),  # top-k budgets through the ring
    ("hierarchical", "top-k per-layer", "full"),
)


@pytest.mark.slow  # default tier time (~10 min on 2 cores): its correctness is CI's slow tier
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_cp_step_equals_the_single_process_step(tmp_path):
    run_workers(_worker, 4, tmp_path, CASES)
