"""Analytic profiles from FLOP counts, for hardware we cannot measure (an approximation).

Time = FLOPs / (peak * efficiency) + a fixed launch overhead per kernel group. Efficiencies are
stated, configurable guesses (defaults: 45 % of peak for dense GEMMs, 35 % for block-sparse
attention, typical of well-tuned bf16 training on Hopper); a measured profile, or online
recalibration from measured step times, replaces them in real runs.

FLOPs per micro-batch (forward + backward = 3x forward for GEMMs, 3.5x for attention, whose
backward recomputes the scores):
- attention, one layer, one document of L tokens at density d: ``3.5 * 4 * Hq * D * d * L^2 / 2``;
- one layer without attention: ``6 * layer_params * tokens``;
- head: ``6 * vocab * hidden * tokens`` (LM head GEMM; the embedding lookup is negligible);
- optimizer (memory bound): AdamW reads/writes ~16 bytes of state per fp32 parameter;
- gradient all-reduce: ring all-reduce of bf16 gradients (``allreduce_seconds``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models import ModelShapes
from .profile import AttentionTable, Profile, Table1D

DENSITY_GRID = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # per-GPU all-reduce bus bandwidth inside a node (NVLink)
    inter_node_bytes_per_s: float  # per-GPU bandwidth across nodes (InfiniBand)
    gpus_per_node: int = 8
    p2p_intra_bytes_per_s: float = 450e9
    """One direction of a GPU's NVLink, point to point (what a context-parallel ring step uses)."""


# NVLink per direction: 450 GB/s (NVLink 4, H100/H200), 300 GB/s (NVLink 3, A100); InfiniBand
# per GPU: 400 Gb/s NDR ~ 45 GB/s effective (H100/H200), 200 Gb/s HDR ~ 22.5 GB/s (A100).
ACCELERATORS = {
    "h100": Accelerator("NVIDIA H100 SXM (analytic)", 989e12, 3.35e12, 360e9, 45e9),
    "h200": Accelerator("NVIDIA H200 SXM (analytic)", 989e12, 4.8e12, 360e9, 45e9),
    "a100": Accelerator(
        "NVIDIA A100 SXM 80GB (analytic)",
        312e12,
        2.04e12,
        240e9,
        22.5e9,
        p2p_intra_bytes_per_s=300e9,
    ),
}


def allreduce_seconds(num_bytes: float, world_size: int, acc: Accelerator, latency_s: float = 10e-6) -> float:
    """Ring all-reduce: ``2 (R-1)/R * bytes / bandwidth + 2 (R-1) * latency``; the bandwidth is
    NVLink inside one node and the inter-node link once the ring spans nodes."""
    if world_size <= 1:
        return 0.0
    bw = acc.intra_node_bytes_per_s if world_size <= acc.gpus_per_node else acc.inter_node_bytes_per_s
    hops = 2 * (world_size - 1)
    return hops / world_size * num_bytes / bw + hops * latency_s


def analytic_profile(
    shapes: ModelShapes,
    device: str = "h100",
    efficiency: float = 0.45,
    attention_efficiency: float = 0.35,
    *,
    block_size: int,
    world_size: int = 8,
    launch_overhead_s: float = 30e-6,
) -> Profile:
    """A :class:`Profile` whose tables come from FLOP counts on an :data:`ACCELERATORS` entry."""
    if device not in ACCELERATORS:
        raise ValueError(f"--device for an analytic profile must be one of {sorted(ACCELERATORS)}")
    if not (0 < efficiency <= 1 and 0 < attention_efficiency <= 1):
        raise ValueError("efficiency and attention_efficiency must lie in (0, 1]")
    acc = ACCELERATORS[device]
    top = max(2 * shapes.max_context, 4 * block_size)
    # From one token: documents shorter than a block (a short example, a rank's two-token
    # filler) are priced by the same counts, not extrapolated outside the tables.
    short = [2**i for i in range(20) if 2**i < block_size]
    lengths = short + [block_size * 2**i for i in range(20) if block_size * 2**i <= top]
    dens = np.asarray(DENSITY_GRID)
    length = np.asarray(lengths, float)[:, None]
    pairs = dens[None, :] * (length**2 / 2 + length * block_size / 2)
    attn_flops = 3.5 * 4 * shapes.num_heads * shapes.head_dim * pairs
    # Selection: pooled scores over (L/B)^2 segment pairs, ~3 passes, plus launches.
    select_flops = 3 * 2 * shapes.num_heads * shapes.head_dim * (length / block_size) ** 2
    attn = (attn_flops + select_flops) / (acc.peak_flops * attention_efficiency) + 4 * launch_overhead_s
    tokens = np.asarray(lengths, float)
    gemm = acc.peak_flops * efficiency
    other = 6 * shapes.layer_params() * tokens / gemm + 8 * launch_overhead_s
    head = 6 * shapes.vocab_size * shapes.hidden_size * tokens / gemm + 4 * launch_overhead_s
    num_params = shapes.layer_params() * shapes.num_layers + shapes.vocab_size * shapes.hidden_size
    shape_dict = {k: v for k, v in shapes.to_dict().items() if k != "name"}
    return Profile(
        fingerprint={
            "device": acc.name,
            "analytic": True,
            "efficiency": efficiency,
            "attention_efficiency": attention_efficiency,
            "block_size": block_size,
            "dtype": "bf16",
            "shapes": shape_dict,
        },
        attention=AttentionTable(lengths, dens.tolist(), attn.tolist()),
        layer_other=Table1D(lengths, other.tolist()),
        head=Table1D(lengths, head.tolist()),
        num_layers=shapes.num_layers,
        optimizer_seconds=16 * num_params / acc.hbm_bytes_per_s,
        allreduce_seconds=allreduce_seconds(2 * num_params, world_size, acc),
        meta={"model": shapes.name, "source": "analytic", "world_size": world_size},
    )
