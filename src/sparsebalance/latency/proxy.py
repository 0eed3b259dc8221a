"""A plain-PyTorch stand-in of a Qwen2/Llama decoder with the model's shapes, for timing.

The profiler times its parts (one layer without attention, attention, embedding + head + loss) and
``--validate`` times it end to end; the cost of the real Hugging Face model with the same shapes
matches it up to what online recalibration absorbs. It is never trained.

Precision as in training (:mod:`sparsebalance.precision`): float32 parameters, the forward under
the run's autocast (bf16 on CUDA by default), q/k/v brought to one dtype before the attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models import ModelShapes
from ..ops import BlockLayout, Budget, block_sparse_attention, estimate_block_mass
from ..precision import DTYPES, Precision, compute_dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(positions: torch.Tensor, head_dim: int, dtype: torch.dtype, theta: float = 1e4):
    """cos/sin ``(T, 1, head_dim)`` for per-document positions ``(T,)``."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    ang = positions.float()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], -1)[:, None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ProxyLayer(nn.Module):
    """Norm, q/k/v/o projections, rotary, attention (pluggable), norm, SwiGLU MLP."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.s = s
        h, d = s.hidden_size, s.head_dim
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        self.q = nn.Linear(h, s.num_heads * d, bias=s.qkv_bias)
        self.k = nn.Linear(h, s.num_kv_heads * d, bias=s.qkv_bias)
        self.v = nn.Linear(h, s.num_kv_heads * d, bias=s.qkv_bias)
        self.o = nn.Linear(s.num_heads * d, h, bias=False)
        self.gate = nn.Linear(h, s.intermediate_size, bias=False)
        self.up = nn.Linear(h, s.intermediate_size, bias=False)
        self.down = nn.Linear(s.intermediate_size, h, bias=False)

    def forward(self, x, cos, sin, attention) -> torch.Tensor:
        """``x (T, hidden)``; ``attention(q, k, v) -> (T, Hq, D)`` or None to skip attention."""
        t, s = x.shape[0], self.s
        y = self.norm1(x)
        q = _rotate(self.q(y).view(t, s.num_heads, s.head_dim), cos, sin)
        k = _rotate(self.k(y).view(t, s.num_kv_heads, s.head_dim), cos, sin)
        v = self.v(y).view(t, s.num_kv_heads, s.head_dim)
        # Without attention the layer still has to consume k and v: a cheap GQA broadcast.
        a = (
            attention(q, k, v)
            if attention is not None
            else q + (k + v).repeat_interleave(s.num_heads // s.num_kv_heads, 1)
        )
        x = x + self.o(a.reshape(t, -1))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class ProxyHead(nn.Module):
    """Embedding + final norm + (tied) LM head + cross-entropy."""

    def __init__(self, s: ModelShapes):
        super().__init__()
        self.embed = nn.Embedding(s.vocab_size, s.hidden_size)
        self.norm = RMSNorm(s.hidden_size)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.norm(hidden), self.embed.weight)
        return F.cross_entropy(logits.float(), labels)


class ProxyModel(nn.Module):
    """The whole stack, for end-to-end validation of predictions; ``precision``: the compute
    precision its forward runs in (``fp32`` | ``bf16`` | ``fp16``; parameters stay float32)."""

    def __init__(self, s: ModelShapes, num_layers: int | None = None, precision: str = "fp32"):
        super().__init__()
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
        self.s, self.precision = s, precision
        self.head = ProxyHead(s)
        self.layers = nn.ModuleList(ProxyLayer(s) for _ in range(num_layers or s.num_layers))

    def step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        layouts: list[BlockLayout],
        block_size: int,
        backend: str = "auto",
        layout: str = "threshold",
    ) -> torch.Tensor:
        """Forward + backward of one packed micro-batch; each layer also runs the block selection
        of the budget kind ``layout`` describes (its layout is then replaced by ``layouts[i]`` so
        densities are controlled)."""
        budget = Budget(top_k=8) if layout == "top-k" else Budget(gamma=0.9)
        with Precision(self.precision, ids.device.type).autocast():
            x = self.head.embed(ids)
            cos, sin = rotary(positions, self.s.head_dim, x.dtype)
            for layer, layout_i in zip(self.layers, layouts, strict=True):
                attention = _attention(layout_i, cu_seqlens, block_size, backend, budget)
                x = layer(x, cos, sin, attention)
            loss = self.head.loss(x, torch.roll(ids, -1))
        loss.backward()
        return loss.detach()


def _attention(layout: BlockLayout, cu_seqlens: torch.Tensor, block_size: int, backend: str, budget: Budget):
    """The layer's attention as the trainer runs it: one dtype for q/k/v, selection (of
    ``budget``'s kind) and op outside autocast."""

    def attention(q, k, v):
        dtype = compute_dtype(q, k, v)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        with torch.autocast(q.device.type, enabled=False):
            estimate_block_mass(q, k, cu_seqlens, block_size).layout(budget)
            return block_sparse_attention(q, k, v, layout, cu_seqlens, backend=backend)

    return attention
