"""Reference block-sparse attention: masked dense softmax. The spec the fast backends must match.

Memory ``Hq * T^2``; float64-capable; differentiable through plain autograd.
Query tokens with no computed key (possible only with hand-made layouts) output zeros.
"""

from __future__ import annotations

import math

import torch

from .layout import BlockLayout


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)`` -> ``(T, Hq, D)`` over ``layout.to_mask`` only."""
    hq = q.shape[1]
    group = hq // k.shape[1]
    mask = layout.to_mask(cu_seqlens).to(q.device)  # (Hq, T, T)
    kk = k.repeat_interleave(group, dim=1)
    vv = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, kk) * scale
    logits = logits.masked_fill(~mask, -math.inf)
    has_key = mask.any(-1, keepdim=True)
    prob = torch.softmax(logits.masked_fill(~has_key, 0.0), dim=-1) * has_key
    return torch.einsum("hqk,khd->qhd", prob, vv)
