"""Attention recall per layer (``sparsebalance.evaluation.recall``) on the tiny model."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.evaluation.recall import layer_recall
from sparsebalance.models.attention import IMPLEMENTATION, register


@pytest.fixture(scope="module")
def model():
    from transformers import AutoConfig, AutoModelForCausalLM

    register()
    cfg = AutoConfig.for_model(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(cfg, attn_implementation=IMPLEMENTATION)
    with torch.no_grad():  # sharper attention than the 0.02 init, so dropped blocks carry mass
        for layer in net.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return net


def test_dense_recall_is_one_and_sparse_recall_drops(model):
    docs = [torch.randint(1, 512, (300,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)]
    dense = layer_recall(model, docs, gamma=1.0, block_size=32)
    sparse = layer_recall(model, docs, gamma=0.3, block_size=32)
    assert sorted(dense) == sorted(sparse) == [0, 1]  # one entry per layer
    assert all(v == pytest.approx(1.0, abs=1e-9) for v in dense.values())
    assert all(0.0 < v < 0.999 for v in sparse.values())  # blocks were dropped: mass missing
    assert model.config._attn_implementation == "sparsebalance"  # restored


def test_bad_gamma_and_empty_docs_raise(model):
    with pytest.raises(ValueError, match="gamma"):
        layer_recall(model, [[1, 2, 3]], gamma=0.0, block_size=64)
    with pytest.raises(ValueError, match="docs"):
        layer_recall(model, [], gamma=0.5, block_size=64)
