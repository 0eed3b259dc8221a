"""The ``sparsebalance`` attention implementation for Hugging Face models.

Registered with transformers' ``AttentionInterface`` (and a mask function that builds no dense
mask), so any decoder whose attention goes through that interface (Qwen2/Qwen2.5, Llama, Qwen3)
runs packed, document-causal, dynamically sparse attention. Per forward the caller passes a
:class:`PackedAttention` as ``model(..., sb_attention=ctx, use_cache=False)``; transformers hands
extra keyword arguments through to the attention function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..ops import Budget, block_sparse_attention, estimate_block_mass, select_blocks

IMPLEMENTATION = "sparsebalance"


@dataclass
class LayerStats:
    """What one attention layer did in one forward."""

    layer: int
    gamma: float
    density: float
    document_density: list[float]


@dataclass
class PackedAttention:
    """Per-forward attention settings for one packed micro-batch (``batch size 1``)."""

    cu_seqlens: torch.Tensor
    """int32 ``(N + 1,)`` document offsets of the pack."""
    budget: Budget = field(default_factory=lambda: Budget(gamma=1.0))
    """Budget for every layer unless ``choose_budget`` is given (DST's layer controller)."""
    block_size: int = 64
    backend: str = "auto"
    choose_budget: Any = None
    """Optional ``(layer_idx, BlockMassEstimate) -> Budget``: per-layer budgets at run time."""
    on_layer_end: Any = None
    """Optional ``(layer_idx) -> None`` called after each attention (for per-layer timing)."""
    stats: list[LayerStats] = field(default_factory=list)

    def mean_density(self) -> float:
        return sum(s.density for s in self.stats) / max(1, len(self.stats))


def sparsebalance_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sb_attention: PackedAttention | None = None, **kwargs):  # fmt: skip
    """transformers attention function: ``query (1, Hq, T, D)`` -> ``((1, T, Hq, D), None)``."""
    if sb_attention is None:
        raise ValueError(
            "the 'sparsebalance' attention needs model(..., sb_attention=PackedAttention(...), "
            "use_cache=False): it only runs packed inputs with cu_seqlens"
        )
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError(
            "the 'sparsebalance' attention implements full document-causal attention: this "
            "model uses a sliding window or logit soft-capping, which it does not support"
        )
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by 'sparsebalance'")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got {query.shape[0]}")
    ctx = sb_attention
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    layer = int(getattr(module, "layer_idx", len(ctx.stats)))
    if ctx.choose_budget is not None:
        estimate = estimate_block_mass(q, k, ctx.cu_seqlens, ctx.block_size, scale=scaling)
        budget = ctx.choose_budget(layer, estimate)
        layout = estimate.layout(budget)
    else:
        budget = ctx.budget
        layout = select_blocks(q, k, ctx.cu_seqlens, budget, ctx.block_size, scale=scaling)
    out = block_sparse_attention(
        q, k, v, layout, ctx.cu_seqlens, scale=scaling, backend=ctx.backend
    )
    ctx.stats.append(
        LayerStats(layer, budget.gamma, layout.density(), layout.document_density().tolist())
    )
    if ctx.on_layer_end is not None:
        ctx.on_layer_end(layer)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    """Document-causal masking happens inside the op: no dense (T, T) mask is ever built."""
    return None


def register() -> None:
    """Register the implementation with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, sparsebalance_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)
