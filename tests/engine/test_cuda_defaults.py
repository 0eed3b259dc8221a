"""Issue 42, items 1-2: a training step with the settings a CUDA run gets by default reads nothing
back from the device before the step's end, and launches few operations per layer around the
attention kernel.

Only the device differs from a real CUDA run: the run's device (what the kernel resolution, the
engine and DST's layer controllers decide from) is ``cuda``, the tensors stay on the CPU, and
the kernels are stand-ins (FlexAttention's compiled kernel has no backward on CPU; the dense
one is FlashAttention varlen on CUDA, SDPA in bf16 here: seconds). Everything else
is what ``sparsebalance train --device cuda`` builds: the kernel's defaults (block 128, flex,
bf16), DST's defaults (top-k, 8,192 tokens, bidirectional, p = 0.1), no per-layer host timing,
the executor, the engine's plan and tune of two emulated ranks, the loss, forward and backward.
On the main of 2026-11-27 this test fails: the layer controller probed the gate for a CUDA
pack, took the host path, and read the coverage curve back in every cut layer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sparsebalance.batching import PlanConfig
from sparsebalance.engine import ExecutionConfig, RankExecutor, StepEngine
from sparsebalance.engine.kernel import resolve_kernel
from sparsebalance.engine.parallelize import parallelize
from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.launches import LaunchCounter
from sparsebalance.models import load_shapes
from sparsebalance.models.hf import build_model
from sparsebalance.ops import attention as op_module
from sparsebalance.ops import block_sparse_flex
from sparsebalance.precision import Precision
from sparsebalance.tuning import DSTConfig
from sparsebalance.workload import Sample

LENGTHS = (9300, 2500, 700, 1800, 600, 1200)
"""A long document (past the default budget's 8,192 tokens: selected) and short ones."""

pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning")


MICRO = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 16384,
    "tie_word_embeddings": True,
}
"""A model small enough for 27K tokens in bf16 on a CPU (the tiny one takes minutes there)."""


@pytest.fixture
def cuda_run(monkeypatch, tmp_path):
    """(engine, executor, samples, kernel calls) of a CUDA run's defaults, tensors on the CPU."""
    calls = []

    def stand_in(q, k, v, block_mask, scale, enable_gqa, kernel_options):
        calls.append(block_mask)
        return q + (k.sum() + v.sum()) * 0.0

    monkeypatch.setattr(block_sparse_flex, "_compiled_flex", lambda: stand_in)
    monkeypatch.setattr(
        block_sparse_flex,
        "dense_attention",  # CUDA's is FlashAttention varlen
        lambda q, k, v, *a: q + (k.sum() + v.sum()) * 0.0,
    )
    monkeypatch.setattr(op_module, "flex_available", lambda device: True)  # the device, faked
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    kernel = resolve_kernel("cuda")  # what --device cuda resolves with every flag at its default
    assert (kernel.block_size, kernel.backend, kernel.precision) == (128, "flex", "bf16")
    dst = DSTConfig()
    g = np.random.default_rng(0)
    docs = [g.integers(1, MICRO["vocab_size"], n) for n in LENGTHS]
    (tmp_path / "config.json").write_text(json.dumps(MICRO))
    latency = LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=128))
    engine = StepEngine(
        PlanConfig(world_size=2, capacity=16384),
        latency,
        dst,
        lambda i: Sample(i, len(docs[i]), ""),
        kernel=kernel,
        world_size=1,
    )
    assert not engine.layer_times  # the device is CUDA: no host layer times
    runtime = Runtime(0, 1, torch.device("cpu"))
    par = parallelize(build_model(str(tmp_path), seed=0), runtime, "ddp", "overlap")
    execution = ExecutionConfig(kernel.block_size)
    executor = RankExecutor(
        par, docs, engine, execution, torch.device("cpu"), precision=Precision(kernel.precision, "cpu")
    )
    samples = [Sample(i, n, "") for i, n in enumerate(LENGTHS)]
    return engine, executor, samples, calls


def test_a_cuda_default_step_reads_nothing_back_before_its_end(cuda_run):
    engine, executor, samples, calls = cuda_run
    step = engine.begin(samples)
    assert {r.role for r in step.decision.ranks} >= {"cut"}  # DST cuts a rank: the coverage bound
    clock = executor.clock
    at_sync, decided = [], []
    sync = clock.synchronize
    for rank in range(2):
        with LaunchCounter() as count:
            clock.synchronize = lambda: at_sync.append(len(count.reads)) or sync()
            try:
                work = executor.run(step, rank)
            finally:
                clock.synchronize = sync
        assert at_sync[-1] == 0, f"rank {rank}: host reads inside the step: {count.reads}"
        assert work.records[0].microbatches
        decided += [r for c in engine._step_layers(step).of(rank) for r in c.records]
    assert calls, "the sparse kernel never ran"
    assert any(r.floor is not None for r in decided), "no layer decided the bound on the device"
