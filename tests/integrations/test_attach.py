"""``sparsebalance.attach``: exact varlen attention from HF's packed arguments, refusals."""

from __future__ import annotations

import pytest
import torch

import sparsebalance
from sparsebalance.integrations.attach import IMPLEMENTATION, cu_from_positions
from sparsebalance.models.hf import build_model
from sparsebalance.ops import Budget

LENGTHS = [97, 40, 163]  # not multiples of the block size


def _model(seed=0):
    return build_model("tiny", attn_implementation="sdpa", seed=seed).double().eval()


def _per_document_logits(model, ids):
    out, start = [], 0
    for n in LENGTHS:
        out.append(model(input_ids=ids[:, start : start + n]).logits)
        start += n
    return torch.cat(out, 1)


def test_attach_runs_exact_varlen_attention_from_positions_and_cu_seq_lens():
    torch.manual_seed(0)
    model = _model()
    ids = torch.randint(0, 1000, (1, sum(LENGTHS)))
    with torch.no_grad():
        ref = _per_document_logits(model, ids)  # each document alone, dense SDPA
        runtime = sparsebalance.attach(model, block_size=32)
        assert model.config._attn_implementation == IMPLEMENTATION
        pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        by_pos = model(input_ids=ids, position_ids=pos).logits
        cu = torch.tensor([0, 97, 137, 300], dtype=torch.int32)
        by_cu = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu).logits
    assert (by_pos - ref).abs().max() < 1e-10
    assert (by_cu - ref).abs().max() < 1e-10
    assert runtime.forwards == 2
    assert len(runtime.stats) == model.config.num_hidden_layers
    assert all(s.density == 1.0 for s in runtime.stats)  # gamma 1: every causal block
    assert sparsebalance.attach(model) is runtime  # idempotent


def test_attach_budget_makes_attention_sparse():
    torch.manual_seed(1)
    model = _model()
    runtime = sparsebalance.attach(model, block_size=16, budget=Budget(gamma=0.5))
    ids = torch.randint(0, 1000, (1, 600))
    with torch.no_grad():
        model(input_ids=ids)  # one document without positions
    assert runtime.stats and max(s.density for s in runtime.stats) < 1.0


def test_cu_from_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert cu_from_positions(pos, 6, "cpu").tolist() == [0, 3, 5, 6]
    assert cu_from_positions(None, 4, "cpu").tolist() == [0, 4]
    with pytest.raises(ValueError, match="position_ids holds 6 positions for 5 tokens"):
        cu_from_positions(pos, 5, "cpu")


def test_attach_refusals():
    model = _model()
    sparsebalance.attach(model)
    with pytest.raises(ValueError, match="batch size 2"):
        model(input_ids=torch.zeros(2, 8, dtype=torch.long))
    windowed = _model()
    windowed.config.use_sliding_window, windowed.config.sliding_window = True, 64
    with pytest.raises(ValueError, match="sliding-window"):
        sparsebalance.attach(windowed)
    capped = _model()
    capped.config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="soft-capping"):
        sparsebalance.attach(capped)
    other = _model()
    other.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        sparsebalance.attach(other)


def test_unattached_model_on_the_attached_implementation_is_refused():
    model = _model()
    sparsebalance.attach(_model())  # registers the implementation
    model.set_attn_implementation(IMPLEMENTATION)
    with pytest.raises(ValueError, match=r"call sparsebalance.attach\(model\)"):
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3"])
def test_attach_other_families_exact(kind):
    """Llama, Mistral (no sliding window) and Qwen3 through the same registration."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"sliding_window": None} if kind == "mistral" else {}
    config = AutoConfig.for_model(
        kind,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        head_dim=16,
        max_position_embeddings=1024,
        **extra,
    )
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    ids = torch.randint(0, 256, (1, sum(LENGTHS)))
    with torch.no_grad():
        ref = _per_document_logits(model, ids)
        sparsebalance.attach(model, block_size=32)
        pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        out = model(input_ids=ids, position_ids=pos).logits
    assert (out - ref).abs().max() < 1e-10


def test_an_attached_model_is_freed_when_dropped():
    """The review's L11: the layer -> runtime binding held the model alive for good."""
    import gc
    import weakref

    model = _model()
    sparsebalance.attach(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_the_model_keeps_its_runtime():
    """The model -> runtime registry is weak both ways: the model alone keeps its runtime (the
    one a second ``attach`` returns, the one its layers resolve through)."""
    import gc
    import weakref

    model = _model()
    runtime = weakref.ref(sparsebalance.attach(model, block_size=32, budget=Budget(gamma=0.5)))
    gc.collect()
    assert runtime() is not None and sparsebalance.attach(model) is runtime()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 1000, (1, 200)))
    assert runtime().forwards == 1
