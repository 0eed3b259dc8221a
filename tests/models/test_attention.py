"""The ``sparsebalance`` attention hook for Hugging Face models (``models/attention.py``): the
registered ``AttentionInterface`` implementation, packed ``cu_seqlens``, the per-layer budget
callback, and the keyword arguments it refuses."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.data import pack
from sparsebalance.models.attention import (
    IMPLEMENTATION,
    LayerGateView,
    PackedAttention,
    register,
    sparsebalance_attention,
)
from sparsebalance.models.hf import build_model
from sparsebalance.ops import BlockMassEstimate, Budget


def _docs(*lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (n,), generator=g).numpy() for n in lengths]


def _forward(model, batch, ctx):
    with torch.no_grad():
        return model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, sb_attention=ctx, use_cache=False
        ).logits[0]


def test_registered_with_transformers_and_idempotent():
    from transformers import AttentionInterface

    register()
    register()
    assert AttentionInterface()[IMPLEMENTATION] is sparsebalance_attention
    model = build_model("tiny", seed=1)
    assert model.config._attn_implementation == IMPLEMENTATION


@pytest.mark.parametrize("model_type", ["tiny"])
def test_gamma_one_logits_equal_eager_attention_on_packed_input(model_type):
    model = build_model(model_type, seed=1)
    eager = build_model(model_type, attn_implementation="eager", seed=1)
    eager.load_state_dict(model.state_dict())
    docs = _docs(70, 1, 130, 33)
    batch = pack(docs)
    ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=1.0), block_size=32, backend="torch")
    packed = _forward(model, batch, ctx)
    with torch.no_grad():
        refs = [eager(input_ids=torch.as_tensor(d)[None], use_cache=False).logits[0] for d in docs]
    torch.testing.assert_close(packed, torch.cat(refs), rtol=1e-4, atol=1e-4)
    assert len(ctx.stats) == model.config.num_hidden_layers
    assert all(s.density == 1.0 for s in ctx.stats)
    assert all(len(s.document_density) == len(docs) for s in ctx.stats)


def test_cu_seqlens_keep_documents_apart():
    """A document's logits do not depend on its neighbours in the pack (sparse budget too)."""
    model = build_model("tiny", seed=2)
    a, b, c = _docs(64, 96, 64, seed=3)
    budget = Budget(gamma=0.5)
    ref = _forward(model, pack([b]), PackedAttention(pack([b]).cu_seqlens, budget, 32, "torch"))
    for neighbours in ([a], [a, c]):  # b starts on a block boundary in every pack
        batch = pack([*neighbours[:1], b, *neighbours[1:]])
        got = _forward(model, batch, PackedAttention(batch.cu_seqlens, budget, 32, "torch"))
        torch.testing.assert_close(got[64:160], ref, rtol=1e-5, atol=1e-5)


def test_per_layer_budget_callback_and_layer_end():
    model = build_model("tiny", seed=1)
    batch = pack(_docs(100, 60))
    calls, ended = [], []

    def choose(layer, estimate):
        assert isinstance(estimate, LayerGateView) and isinstance(estimate.gate, BlockMassEstimate)
        calls.append(layer)
        return Budget(gamma=1.0 if layer == 0 else 0.3)

    ctx = PackedAttention(
        batch.cu_seqlens,
        Budget(gamma=0.9),
        block_size=16,
        backend="torch",
        choose_budget=choose,
        on_layer_end=ended.append,
    )
    _forward(model, batch, ctx)
    layers = list(range(model.config.num_hidden_layers))
    assert calls == layers and ended == layers
    assert [s.budget for s in ctx.stats] == [1.0] + [0.3] * (len(layers) - 1)
    assert ctx.stats[0].density == 1.0 and all(s.density < 1.0 for s in ctx.stats[1:])
    assert ctx.mean_density() == pytest.approx(sum(s.density for s in ctx.stats) / len(layers))


class _Layer(torch.nn.Module):
    layer_idx = 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sb_attention": None}, "sb_attention"),
        ({"sliding_window": 4096}, "sliding window"),
        ({"softcap": 30.0}, "soft-capping"),
        ({"dropout": 0.1}, "dropout"),
    ],
    ids=["no-context", "sliding-window", "softcap", "dropout"],
)
def test_unsupported_arguments_raise(kwargs, match):
    q = torch.randn(1, 2, 8, 4)
    ctx = PackedAttention(torch.tensor([0, 8], dtype=torch.int32), Budget(gamma=1.0), block_size=4)
    call = {"sb_attention": ctx, **kwargs}
    with pytest.raises(ValueError, match=match):
        sparsebalance_attention(_Layer(), q, q, q, None, **call)


def test_batch_of_two_refused_and_output_shape():
    q = torch.randn(2, 2, 8, 4)
    ctx = PackedAttention(torch.tensor([0, 8], dtype=torch.int32), Budget(gamma=1.0), block_size=4, backend="torch")
    with pytest.raises(ValueError, match="batch size 1"):
        sparsebalance_attention(_Layer(), q, q, q, None, sb_attention=ctx)
    out, weights = sparsebalance_attention(_Layer(), q[:1], q[:1], q[:1], None, sb_attention=ctx)
    assert out.shape == (1, 8, 2, 4) and weights is None  # (1, T, Hq, D), as transformers expects


def test_dst_does_not_select_where_its_lowest_budget_covers_every_document(monkeypatch):
    """The review's H2: with DST's layer controller every layer estimated block mass, even for
    a pack of documents any budget it may pick covers (the all-dense shortcut was reached only
    with a fixed budget)."""
    from sparsebalance.models import attention as module

    calls = []
    monkeypatch.setattr(module, "estimate_block_mass", lambda *a, **k: calls.append(1) or pytest.fail("estimated"))
    monkeypatch.setattr(module.TopKGate, "score", lambda *a, **k: calls.append(1) or pytest.fail("estimated"))
    model = build_model("tiny", seed=1)
    batch = pack(_docs(70, 33, 100))
    chosen = []
    ctx = PackedAttention(
        batch.cu_seqlens,
        Budget(top_k=8),
        block_size=32,
        backend="torch",
        choose_budget=lambda layer, e: chosen.append(layer) or Budget(top_k=8),
        min_budget=Budget(top_k=4),
        lengths=batch.lengths,
    )
    _forward(model, batch, ctx)
    assert not calls and not chosen
    assert all(s.density == 1.0 for s in ctx.stats)
    # a budget that does not cover the 100-token document (4 blocks of 32) is estimated
    ctx = PackedAttention(
        batch.cu_seqlens,
        Budget(top_k=8),
        block_size=32,
        backend="torch",
        choose_budget=lambda layer, e: Budget(top_k=1),
        min_budget=Budget(top_k=1),
        lengths=batch.lengths,
    )
    with pytest.raises(pytest.fail.Exception, match="estimated"):
        _forward(model, batch, ctx)
