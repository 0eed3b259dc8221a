"""Reference block-sparse attention: masked dense softmax. The spec the fast backends must match.

Documents are computed one at a time (memory ``Hq * L^2`` per document of ``L`` tokens, plus the
``Hq * T^2`` mask); float64-capable; differentiable through plain autograd. Query tokens with no
computed key (possible only with hand-made layouts) output zeros. Positions a query does not see
contribute exact zeros, also when their values are NaN or inf (the value path is masked, not only
the scores); a non-finite value a query does see makes that output element NaN. Documents never
exchange anything, forward or backward, so a NaN stays inside its document.
"""

from __future__ import annotations

import itertools
import math

import torch

from .layout import BlockLayout


def _attend(q, k, v, mask, scale: float) -> torch.Tensor:
    """One document: ``q``/``k``/``v (L, Hq, D)``, ``mask (Hq, L, L)`` -> ``(L, Hq, D)``."""
    logits = torch.einsum("qhd,khd->hqk", q, k) * scale
    logits = logits.masked_fill(~mask, -math.inf)
    has_key = mask.any(-1, keepdim=True)
    prob = torch.softmax(logits.masked_fill(~has_key, 0.0), dim=-1) * has_key
    bad = ~torch.isfinite(v)
    out = torch.einsum("hqk,khd->qhd", prob, v.masked_fill(bad, 0.0))
    if not bool(bad.any()):
        return out
    hits = torch.einsum("hqk,khd->qhd", mask.to(v.dtype), bad.to(v.dtype))
    return out.masked_fill(hits > 0, math.nan)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)`` -> ``(T, Hq, D)`` over ``layout.to_mask`` only."""
    group = q.shape[1] // k.shape[1]
    mask = layout.to_mask(cu_seqlens).to(q.device)  # (Hq, T, T)
    kk = k.repeat_interleave(group, dim=1)
    vv = v.repeat_interleave(group, dim=1)
    bounds = cu_seqlens.tolist()
    outs = [_attend(q[s:e], kk[s:e], vv[s:e], mask[:, s:e, s:e], scale) for s, e in itertools.pairwise(bounds)]
    return torch.cat(outs)
