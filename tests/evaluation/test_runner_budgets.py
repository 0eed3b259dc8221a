"""HFRunner and layer_recall under top-k and per-document budgets (issue 29: evaluation at a
base K and at DST's final per-length-bin k)."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.evaluation import HFRunner
from sparsebalance.evaluation.recall import layer_recall
from sparsebalance.models.attention import IMPLEMENTATION, register
from sparsebalance.ops import Budget


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
    with torch.no_grad():  # sharp attention, so a dropped block changes the output
        for layer in net.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return net.double()


def docs_of(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(sum(lengths))
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in lengths]


def positions(docs):
    return [range(len(d)) for d in docs]


def test_a_top_k_budget_is_sparse_and_a_covering_one_is_exact(model):
    docs = docs_of(333, 97)
    dense = HFRunner(model, gamma=1.0, block_size=32, backend="torch")
    small = HFRunner(model, block_size=32, backend="torch", budget=Budget(top_k=1))
    covering = HFRunner(model, block_size=32, backend="torch", budget=Budget(top_k=20))
    ref = dense.logits(docs, positions(docs))
    got_small = small.logits(docs, positions(docs))
    got_cover = covering.logits(docs, positions(docs))
    for r, c in zip(ref, got_cover, strict=True):  # 11 blocks <= 20 + anchors: every block
        torch.testing.assert_close(c, r, rtol=1e-9, atol=1e-9)
    assert (got_small[0] - ref[0]).abs().max() > 1e-4  # blocks dropped in the long document
    assert small.densities[-1] < 0.9 and covering.densities[-1] == pytest.approx(1.0)


def test_per_document_budgets_equal_separate_forwards(model):
    docs = docs_of(320, 160, 300)
    by_length = {320: Budget(top_k=1), 160: Budget(top_k=2), 300: Budget(top_k=1)}
    mixed = HFRunner(model, block_size=32, backend="torch", budget=lambda n: by_length[n])
    got = mixed.logits(docs, positions(docs))
    assert len(mixed.densities) == 2  # one packed forward per distinct budget
    for i, doc in enumerate(docs):
        alone = HFRunner(model, block_size=32, backend="torch", budget=by_length[len(doc)])
        ref = alone.logits([doc], positions([doc]))[0]
        torch.testing.assert_close(got[i], ref, rtol=1e-9, atol=1e-9)
    nll = mixed.token_nll(docs)
    assert [len(x) for x in nll] == [319, 159, 299]


def test_bad_budget_is_refused(model):
    with pytest.raises(TypeError, match="budget"):
        HFRunner(model, budget=0.5, block_size=64)
    with pytest.raises(TypeError, match="budget"):
        layer_recall(model, [[1, 2, 3]], 1.0, budget="top-k", block_size=64)


def test_recall_under_top_k_and_per_length_budgets(model):
    docs = docs_of(400, 200)
    dense = layer_recall(model, docs, 1.0, block_size=32, budget=Budget(top_k=30))
    sparse = layer_recall(model, docs, 1.0, block_size=32, budget=Budget(top_k=1))
    per_doc = layer_recall(model, docs, 1.0, block_size=32, budget=lambda n: Budget(top_k=1 if n == 400 else 30))
    assert all(v == pytest.approx(1.0, abs=1e-9) for v in dense.values())
    assert all(0.0 < v < 0.999 for v in sparse.values())
    # the short document exact, the long one as sparse as before: in between
    assert all(sparse[k] < per_doc[k] < 1.0 for k in dense)
