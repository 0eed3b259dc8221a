"""The dense path (``ops/dense.py``, issue 36 item 4): exact document-causal attention for runs of
documents the budget covers, equal to the float64 reference forward and backward on CPU (SDPA per
document); the FlashAttention varlen call's keywords for each torch signature, with a stand-in
(the real kernel is CUDA-only: gpu tier)."""

from __future__ import annotations

import pytest
import torch

from sparsebalance.ops import Budget, block_sparse_attention, select_blocks
from sparsebalance.ops import dense as dense_module
from sparsebalance.ops.dense import dense_attention
from tests.conftest import cu_from_lengths, make_qkv


@pytest.mark.parametrize(
    "lengths, hq, hkv",
    [
        pytest.param((97,), 4, 4, id="1doc-MHA"),
        pytest.param((40, 1, 200, 33), 6, 2, id="4docs-GQA3"),
        pytest.param((1025, 64), 4, 1, id="2docs-MQA"),
    ],
)
def test_dense_attention_equals_the_reference_forward_and_backward(lengths, hq, hkv):
    cu = cu_from_lengths(lengths)
    q, k, v = make_qkv(sum(lengths), hq, hkv, 16, dtype=torch.float64, seed=len(lengths))
    full = select_blocks(q.detach(), k.detach(), cu, Budget(gamma=1.0), block_size=64)
    ref = block_sparse_attention(q, k, v, full, cu, backend="reference")
    out = dense_attention(q, k, v, cu, lengths, 0.3 if hq == hkv else 16**-0.5)
    if hq == hkv:
        ref = block_sparse_attention(q, k, v, full, cu, scale=0.3, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _fake_api(monkeypatch, params: str):
    """A ``varlen_attn`` stand-in with the given keyword parameters; records its calls."""
    calls = []
    ns: dict = {}
    exec(
        f"def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, {params}):\n"
        "    calls.append((q, k, v, cu_q, max_q, dict(locals())))\n"
        "    return q.clone()",
        {"calls": calls},
        ns,
    )
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", ns["fake"])
    dense_module.varlen_api.cache_clear()
    monkeypatch.setattr(dense_module, "uses_varlen", lambda q, scale: True)
    return calls


@pytest.mark.parametrize(
    "params, expect",
    [
        pytest.param(
            "scale=None, window_size=(-1, -1), enable_gqa=False",
            {"window_size": (-1, 0), "enable_gqa": True, "scale": 0.125},
            id="torch-2.12+",
        ),
        pytest.param(
            "return_aux=None, scale=None, window_size=(-1, -1)",
            {"window_size": (-1, 0), "scale": 0.125},
            id="torch-2.11",
        ),
        pytest.param("is_causal=False, return_aux=None", {"is_causal": True}, id="torch-2.10"),
    ],
)
def test_varlen_keywords_follow_the_installed_signature(monkeypatch, params, expect):
    calls = _fake_api(monkeypatch, params)
    try:
        q, k, v = make_qkv(300, 4, 2, 64, requires_grad=False)
        cu = cu_from_lengths((100, 200))
        dense_attention(q, k, v, cu, (100, 200), 0.125)
        (_, kk, _, cu_q, max_q, kwargs) = calls[0]
        assert max_q == 200 and cu_q is cu
        for key, value in expect.items():
            assert kwargs[key] == value, (key, kwargs)
        # without enable_gqa, K and V reach the kernel expanded to the query heads
        assert kk.shape[1] == (2 if "enable_gqa" in expect else 4)
    finally:
        dense_module.varlen_api.cache_clear()


def test_varlen_is_used_only_where_flash_runs():
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    assert not dense_module.uses_varlen(q, 0.125)  # CPU: SDPA per document
