"""Issue 43, one kernel resolution: the GQA mode a training step's flex call runs with is the
resolved :class:`~sparsebalance.engine.Kernel`'s, carried by the engine into every attention
context (no second default inside the op), for the own trainer and the integrations' planner.

Only the device is faked (as in ``test_cuda_defaults.py``): the kernel resolves for ``cuda``
(flex, block 128), the tensors stay on the CPU and the compiled flex kernel is a stand-in that
records what it was called with, forward only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsebalance.batching import PlanConfig
from sparsebalance.engine import StepEngine, resolve_kernel
from sparsebalance.integrations import PlannerConfig, StepPlanner
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.models.attention import PackedAttention, sparsebalance_attention
from sparsebalance.ops import Budget, block_sparse_flex
from sparsebalance.ops import attention as op_module
from sparsebalance.ops.flex_config import FlexSettings
from sparsebalance.tuning import DSTConfig
from sparsebalance.workload import Sample

LENGTHS = (1500, 1100, 700)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16

pytestmark = pytest.mark.filterwarnings("ignore::sparsebalance.latency.OutsideGridWarning")


@pytest.fixture
def flex_calls(monkeypatch):
    """``(kv heads the kernel got, its enable_gqa)`` of every flex call, on a faked CUDA device."""
    calls = []

    def stand_in(q, k, v, block_mask, scale, enable_gqa, kernel_options):
        calls.append((k.shape[1], enable_gqa))
        return q + (k.sum() + v.sum()) * 0.0

    monkeypatch.setattr(block_sparse_flex, "_compiled_flex", lambda: stand_in)
    monkeypatch.setattr(op_module, "flex_available", lambda device: True)  # the device, faked
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return calls


def _engine(kernel) -> StepEngine:
    latency = LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=kernel.block_size))
    dst = DSTConfig(mode="off", budget="gamma", gamma0=0.5)  # sparse: no document runs dense
    sample = lambda i: Sample(i, LENGTHS[i], "")  # noqa: E731
    return StepEngine(PlanConfig(world_size=1, capacity=4096), latency, dst, sample, kernel=kernel, world_size=1)


@pytest.mark.parametrize(
    "gqa, kernel_kv_heads, enable_gqa",
    [
        pytest.param(None, HEADS, False, id="default-expand"),
        pytest.param("native", KV_HEADS, True, id="native"),
    ],
)
def test_the_kernels_gqa_reaches_the_flex_call_of_a_training_step(flex_calls, gqa, kernel_kv_heads, enable_gqa):
    kernel = resolve_kernel("cuda", gqa=gqa)
    assert (kernel.backend, kernel.gqa) == ("flex", gqa or FlexSettings(kernel.block_size).gqa)
    engine = _engine(kernel)
    step = engine.begin([Sample(i, n, "") for i, n in enumerate(LENGTHS)])
    planned = step.planned
    lengths = planned.units[planned.rank_units[0][0]].lengths
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    ctx = engine.attention(step, 0, 0, cu, lengths)
    filler = engine.attention(step, 0, None, torch.tensor([0, 2], dtype=torch.int32), (2,))
    assert ctx.gqa == filler.gqa == kernel.gqa

    t, g = int(cu[-1]), torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, t, HEAD_DIM, generator=g)
    k, v = (torch.randn(1, KV_HEADS, t, HEAD_DIM, generator=g) for _ in range(2))
    layer = torch.nn.Module()
    layer.layer_idx = 0
    with torch.no_grad():
        out, _ = sparsebalance_attention(layer, q, k, v, None, sb_attention=ctx)
    assert out.shape == (1, t, HEADS, HEAD_DIM)
    assert flex_calls == [(kernel_kv_heads, enable_gqa)]


def test_the_default_gqa_is_expand_everywhere():
    """The default a run gets is the one a flex call had before the kernel carried it."""
    for device in ("cpu", "cuda"):
        assert resolve_kernel(device, backend="torch", precision="fp32").gqa == "expand"
    ctx = PackedAttention(torch.tensor([0, 8], dtype=torch.int32), Budget(gamma=1.0), 4, "torch")
    assert ctx.gqa is None  # a context built alone: the flex call's default, "expand"
    with pytest.raises(ValueError, match="gqa must be one of"):
        PackedAttention(torch.tensor([0, 8], dtype=torch.int32), Budget(gamma=1.0), 4, "torch", gqa="both")


def test_the_integrations_planner_hands_its_engine_the_resolved_kernel():
    latency = LatencyModel(analytic_profile(load_shapes("tiny"), "h100", block_size=32))
    config = PlannerConfig(global_batch=2, micro_batches=1, block_size=32, backend="torch")
    planner = StepPlanner(LENGTHS, config, latency, device="cpu")
    assert planner.engine.kernel == resolve_kernel("cpu", 32, "torch")
    assert planner.engine.kernel.gqa == "expand"
