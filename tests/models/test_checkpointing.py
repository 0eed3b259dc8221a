"""Activation checkpointing: identical loss and gradients, and the recomputation chooses nothing."""

from __future__ import annotations

import pytest
import torch

import sparsebalance.models.attention as attention
from sparsebalance.data import pack
from sparsebalance.models.attention import PackedAttention
from sparsebalance.models.checkpointing import (
    MODES,
    apply_activation_checkpointing,
    decoder_layers,
)
from sparsebalance.models.hf import build_model
from sparsebalance.ops import Budget

LENGTHS = (97, 200, 33)  # not multiples of the block size, three documents in one pack


def _batch():
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 4096, (n,), generator=g).numpy() for n in LENGTHS]
    return pack(docs, "cpu", per_doc_weighting=True)


class Recorder:
    """A stand-in for DST's layer controller: counts every choose and observe per layer."""

    def __init__(self):
        self.chosen: list[int] = []
        self.observed: list[int] = []

    def choose(self, layer, estimate):
        self.chosen.append(layer)
        return Budget(gamma=0.5 + 0.1 * layer)  # gamma < 1: the layouts matter

    def observe(self, layer):
        self.observed.append(layer)


def _run(mode: str, monkeypatch):
    model = build_model("tiny", "cpu", torch.float64, seed=3)
    wrapped = apply_activation_checkpointing(model, mode)
    calls = {"estimate": 0}
    real_estimate = attention.estimate_block_mass

    def counting_estimate(*args, **kwargs):
        calls["estimate"] += 1
        return real_estimate(*args, **kwargs)

    monkeypatch.setattr(attention, "estimate_block_mass", counting_estimate)
    batch = _batch()
    rec = Recorder()
    ctx = PackedAttention(
        batch.cu_seqlens,
        Budget(gamma=1.0),
        block_size=32,
        backend="torch",
        choose_budget=rec.choose,
        on_layer_end=rec.observe,
    )
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, sb_attention=ctx, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[0], batch.labels[0], ignore_index=-100, reduction="none")
    loss = (loss * batch.loss_weights[0].double()).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, rec, calls["estimate"], ctx, wrapped


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_equals_plain_and_chooses_once(mode, monkeypatch):
    loss0, grads0, rec0, est0, _, _ = _run("off", monkeypatch)
    loss1, grads1, rec1, est1, ctx1, wrapped = _run(mode, monkeypatch)
    assert wrapped == 4  # the tiny model's 4 decoder layers (or their MLPs)
    torch.testing.assert_close(loss1, loss0, rtol=1e-12, atol=0)
    assert grads1.keys() == grads0.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-10, atol=1e-13, msg=name)
    # one choice, one observation and one block-mass estimate per layer per micro-batch
    assert rec1.chosen == rec0.chosen == [0, 1, 2, 3]
    assert rec1.observed == rec0.observed == [0, 1, 2, 3]
    assert est1 == est0 == 4
    assert [s.layer for s in ctx1.stats] == [0, 1, 2, 3]
    assert ctx1.layouts == {}  # every recomputation took its layout back


def test_recomputation_reuses_the_forward_layout(monkeypatch):
    """A rerun that selected again would see different layouts: make selection non-repeatable."""
    model = build_model("tiny", "cpu", torch.float64, seed=3)
    apply_activation_checkpointing(model, "full")
    batch = _batch()
    gammas = iter([0.3, 0.9, 0.5, 0.7, 0.99, 0.2, 0.4, 0.6])  # a second choice would differ
    ctx = PackedAttention(
        batch.cu_seqlens,
        Budget(gamma=1.0),
        block_size=32,
        backend="torch",
        choose_budget=lambda layer, est: Budget(gamma=next(gammas)),
    )
    out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, sb_attention=ctx, use_cache=False).logits
    out.sum().backward()
    assert next(gammas) == 0.99  # exactly four choices were made
    assert [s.budget for s in ctx.stats] == [0.3, 0.9, 0.5, 0.7]


def test_no_grad_forward_runs_without_checkpoint():
    model = build_model("tiny", "cpu", torch.float32, seed=0)
    apply_activation_checkpointing(model, "full")
    batch = _batch()
    ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=0.8), block_size=32, backend="torch")
    with torch.no_grad():
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, sb_attention=ctx, use_cache=False)
    assert len(ctx.stats) == 4 and ctx.layouts == {}


def test_decoder_layers_from_no_split_modules():
    model = build_model("tiny", "cpu", torch.float32, seed=0)
    layers = decoder_layers(model)
    assert [type(m).__name__ for m in layers] == ["Qwen2DecoderLayer"] * 4
    model._no_split_modules = []
    with pytest.raises(ValueError, match="_no_split_modules"):
        decoder_layers(model)


def test_bad_mode_and_double_wrap():
    model = build_model("tiny", "cpu", torch.float32, seed=0)
    with pytest.raises(ValueError, match="--activation-checkpointing"):
        apply_activation_checkpointing(model, "every-other")
    assert apply_activation_checkpointing(model, "off") == 0
    apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_activation_checkpointing(model, "full")
    assert set(MODES) == {"off", "full", "selective"}


def test_recompute_without_forward_layout_is_an_error():
    model = build_model("tiny", "cpu", torch.float32, seed=0)
    batch = _batch()
    ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=1.0), block_size=32, backend="torch")
    with attention.recompute_phase("recompute"), pytest.raises(RuntimeError, match="no layout"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, sb_attention=ctx, use_cache=False)
