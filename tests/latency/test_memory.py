"""The memory model: what it counts, its monotonicity, its capacity search, the command."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from sparsebalance.cli import main
from sparsebalance.data import pack
from sparsebalance.latency.host_memory import current_rss_bytes, parse_bytes
from sparsebalance.latency.memory import (
    ANALYTIC,
    LOSS_CHUNK_ELEMS,
    MemoryConfig,
    MemoryModel,
    cpu_coefficients,
    device_coefficients,
)
from sparsebalance.latency.memory_bound import auto_capacity, with_budget_fraction
from sparsebalance.models import load_shapes
from sparsebalance.models.attention import PackedAttention
from sparsebalance.models.hf import build_model
from sparsebalance.ops import Budget
from sparsebalance.ops.loss import CHUNK_ELEMS

H100 = ANALYTIC["h100"]


def test_parameter_count_of_qwen():
    # Qwen2.5-0.5B has 494,032,768 parameters (tied embedding), Qwen2.5-3B 3,085,938,688.
    assert MemoryModel(load_shapes("qwen2.5-0.5b"), H100).num_params() == 494_032_768
    assert MemoryModel(load_shapes("qwen2.5-3b"), H100).num_params() == 3_085_938_688


def test_saved_activations_match_the_real_layer():
    """The per-token, per-layer count equals what autograd really saves in a Qwen2 layer (fp32)."""
    model = build_model("tiny", "cpu", torch.float32, seed=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack_hook(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and t.is_floating_point():
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    tokens = 1024
    batch = pack([torch.randint(0, 4096, (tokens,)).numpy()], "cpu")
    ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=1.0), 64, "torch")
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        model.model(input_ids=batch.input_ids, position_ids=batch.position_ids, sb_attention=ctx, use_cache=False)
    shapes = load_shapes("tiny")
    mem = MemoryModel(shapes, cpu_coefficients(0))
    outer, mlp = mem.layer_elems()
    per_layer = (outer + mlp) * 4 * tokens
    predicted = shapes.num_layers * per_layer + (2 * shapes.hidden_size + 2 * 64) * 4 * tokens
    measured = sum(seen.values())
    assert abs(measured - predicted) / measured < 0.10, (measured, predicted)


@pytest.mark.parametrize("model", ["qwen2.5-0.5b", "qwen2.5-3b"])
def test_features_only_lower_the_peak(model):
    mem = MemoryModel(load_shapes(model), H100)
    for t in (4096, 32768, 131072):
        peak = {
            (c, lo): mem.peak_bytes(t, MemoryConfig(c, lo, block_size=64))
            for c in ("off", "selective", "full")
            for lo in ("plain", "chunked")
        }
        for lo in ("plain", "chunked"):
            assert peak[("full", lo)] <= peak[("selective", lo)] <= peak[("off", lo)]
        for c in ("off", "selective", "full"):
            assert peak[(c, "chunked")] <= peak[(c, "plain")]
    # linear-or-faster growth in tokens; sharding and CP only lower it
    cfg = MemoryConfig("full", "chunked", block_size=64)
    assert mem.peak_bytes(65536, cfg) > mem.peak_bytes(32768, cfg)
    assert mem.peak_bytes(65536, replace(cfg, shard=8)) < mem.peak_bytes(65536, cfg)
    assert mem.peak_bytes(65536, replace(cfg, cp=8)) < mem.peak_bytes(65536, cfg)


def test_breakdown_adds_up_and_plain_logits_dominate():
    mem = MemoryModel(load_shapes("qwen2.5-0.5b"), H100)
    parts = mem.breakdown(32768, MemoryConfig("off", "plain", block_size=64))
    total = sum(v for k, v in parts.items() if k not in ("peak", "moment"))
    assert parts["peak"] == pytest.approx(total)
    assert parts["moment"] == "loss"
    assert parts["loss"] == pytest.approx(32768 * 151_936 * 20)  # the 19.9 GB x ~2.5


def test_max_tokens_is_the_largest_that_fits():
    mem = MemoryModel(load_shapes("qwen2.5-0.5b"), H100)
    cfg = MemoryConfig("full", "chunked", block_size=128)
    budget = with_budget_fraction(H100)
    n = mem.max_tokens(budget, cfg)
    assert n % 128 == 0 and n > 0
    assert mem.peak_bytes(n, cfg) <= budget < mem.peak_bytes(n + 128, cfg)
    assert mem.max_tokens(1.0, cfg) == 0  # nothing fits in one byte
    with pytest.raises(ValueError, match="--memory-budget"):
        mem.max_tokens(0, cfg)


def test_chunk_constant_matches_the_loss():
    assert LOSS_CHUNK_ELEMS == CHUNK_ELEMS


def test_bad_input():
    with pytest.raises(ValueError, match="--activation-checkpointing"):
        MemoryConfig("sometimes", block_size=64)
    with pytest.raises(ValueError, match="density"):
        MemoryConfig(density=0, block_size=64)
    with pytest.raises(ValueError, match="required on CPU"):
        with_budget_fraction(cpu_coefficients(0))
    assert parse_bytes("72GB") == 72e9 and parse_bytes("1.5GiB") == 1.5 * 2**30
    assert parse_bytes("1e9") == 1e9
    for bad in ("lots", "-3GB", "5 parsecs"):
        with pytest.raises(ValueError, match="--memory-budget"):
            parse_bytes(bad)


def test_memory_command(capsys):
    assert main(["memory", "--model", "qwen2.5-3b", "--analytic", "a100", "--devices", "1,32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {(r["checkpointing"], r["loss"]): r for r in out["rows"]}
    assert len(rows) == 6 and out["predicted"] is True
    best, worst = rows[("full", "chunked")], rows[("off", "plain")]
    assert best["document (CP) @32"] > worst["document (CP) @32"] > 0
    assert best["document (CP) @32"] >= best["micro-batch/rank @32"]
    assert main(["memory", "--device", "cpu"]) == 2  # CPU needs --memory-budget
    assert "--memory-budget" in capsys.readouterr().err
    assert main(["memory", "--model", "qwen2.5-3b", "--analytic", "a100", "--devices", "32", "--check", "524288"]) == 0
    assert "524,288 tokens over 32 devices" in capsys.readouterr().out


def test_auto_capacity_and_device_coefficients():
    shapes = replace(load_shapes("qwen2.5-0.5b"), num_layers=2)
    coeffs = device_coefficients(torch.device("cpu"), base_bytes=0.5 * 2**30)
    assert coeffs.base_bytes == 0.5 * 2**30 and coeffs.device_bytes is None
    mem = MemoryModel(shapes, coeffs)
    cfg = MemoryConfig("full", "chunked", block_size=64)
    cap = auto_capacity(mem, 8 * 2**30, cfg)
    assert cap % 64 == 0 and mem.peak_bytes(cap, cfg) <= 8 * 2**30 < mem.peak_bytes(cap + 64, cfg)
    assert auto_capacity(mem, 8 * 2**30, replace(cfg, checkpointing="off")) < cap
    with pytest.raises(ValueError, match="fits no micro-batch"):
        auto_capacity(mem, 2**30, cfg)  # weights + AdamW alone exceed 1 GiB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_a_probe_reports_its_own_peak_not_its_parents():
    """``profile --memory`` starts probes from a process holding torch: Linux's ``ru_maxrss``
    carries that parent's peak across fork + exec (a tiny-model probe reported ~0.7 GB at every
    size); ``peak_rss_bytes`` is the child program's own high-water mark."""
    ballast = bytearray(600 * 2**20)  # the parent's resident set grows by 600 MiB, touched
    ballast[::4096] = b"x" * len(ballast[::4096])
    parent = current_rss_bytes()
    code = "from sparsebalance.latency.host_memory import peak_rss_bytes; print(*peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak, source = out.stdout.split()
    assert source == "VmHWM" and 0 < int(peak) < parent - 400 * 2**20
    del ballast
