"""Block-sparse attention through FlexAttention (CUDA): a ``BlockMask`` built from the layout.

Block pairs strictly inside one document and strictly below the diagonal are passed as *full*
blocks (no ``mask_mod`` evaluated); the others carry the document-causal ``mask_mod``.
On CPU, FlexAttention in torch 2.13 is forward-only and its eager path ignores block lists, so
``backend="auto"`` never picks it there.

Non-finite values: FlexAttention masks the scores, not the products ``p @ v``, so a NaN or inf
value at a masked position would reach other queries (other documents included). When ``v`` is
not finite, the call runs on the cleaned values (non-finite set to 0) and a second call on the
0/1 indicator of the non-finite entries marks, as NaN, exactly the outputs that read one.
"""

from __future__ import annotations

import functools
import math

import torch

from .layout import BlockLayout, causal_block_range, dense_to_ordered
from .varlen import doc_ids, doc_starts


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Packed lengths change every micro-batch: let torch.compile go dynamic after the first
    # recompile instead of specialising (and eventually falling back to eager) per length.
    return torch.compile(flex_attention)


def build_block_mask(layout: BlockLayout, num_q_heads: int, device: torch.device):
    """The layout as a FlexAttention ``BlockMask`` over ``num_q_heads`` heads."""
    from torch.nn.attention.flex_attention import BlockMask

    total, bs, nb = layout.seq_len, layout.block_size, layout.num_blocks
    cu = layout.cu_seqlens.to(device)
    doc = doc_ids(cu, total)
    start = doc_starts(cu, total)
    kept = layout.to(device).to_block_mask()
    kept = kept.repeat_interleave(num_q_heads // layout.num_heads, dim=0)
    # A pair is "full" when every (query, key) token pair in it is doc-causal: the key block lies
    # inside the query block's document and strictly before the query block.
    qb = torch.arange(nb, device=device)
    first = start[qb * bs]
    last = start[torch.clamp((qb + 1) * bs, max=total) - 1]
    one_doc = first == last
    kb_lo = (first + bs - 1) // bs  # first key block wholly at or after the document start
    full = one_doc[:, None] & (qb[None, :] >= kb_lo[:, None]) & (qb[None, :] < qb[:, None])
    lo = causal_block_range(cu, total, bs)
    causal = (qb[None, :] >= lo[:, None]) & (qb[None, :] <= qb[:, None])
    kv_num, kv_idx = dense_to_ordered(kept & causal[None] & ~full[None], width=nb)
    full_num, full_idx = dense_to_ordered(kept & full[None], width=nb)

    def doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])

    return BlockMask.from_kv_blocks(
        kv_num[None], kv_idx[None], full_num[None], full_idx[None],
        BLOCK_SIZE=bs, mask_mod=doc_causal, seq_lengths=(total, total),
    )  # fmt: skip


def flex_block_sparse_attention(q, k, v, layout: BlockLayout, scale: float) -> torch.Tensor:
    """``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)`` -> ``(T, Hq, D)`` via compiled FlexAttention."""
    hq, hkv = q.shape[1], k.shape[1]
    block_mask = build_block_mask(layout, hq, q.device)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)

    def attend(values: torch.Tensor) -> torch.Tensor:
        return _compiled_flex()(
            qt, kt, values, block_mask=block_mask, scale=scale, enable_gqa=hq != hkv
        )[0].transpose(0, 1)

    bad = ~torch.isfinite(vt)
    if not bool(bad.any()):
        return attend(vt)
    out = attend(vt.masked_fill(bad, 0.0))
    with torch.no_grad():
        hits = attend(bad.to(vt.dtype))
    return out.masked_fill(hits > 0, math.nan)
