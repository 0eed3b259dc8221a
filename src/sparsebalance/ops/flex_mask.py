"""A layout's FlexAttention ``BlockMask``, built once per layer from the bool block mask.

FlexAttention reads four index lists: per query block the *partial* key blocks (the document-
causal ``mask_mod`` applies) and the *full* ones (every token pair doc-causal: no mask_mod), for
the forward; per key block the same two lists over query blocks, for the backward's dK/dV.
``BlockMask.from_kv_blocks`` derives the query-side lists by converting the kv-side lists back to
a dense mask and argsorting it, twice per call. Here all four come from the layout's dense bool
mask in five device operations: split into partial and full by the pack's tables (one ``&``),
the two masks and their transposes stacked (one ``cat``), counted (one ``sum``) and ordered
(one stable sort of the rows, kept blocks first in ascending order; one cast to int32). The
four lists are slices of one tensor whose head dimension is rounded up to a multiple of 4, so
every slice starts 16-byte aligned (a misaligned input would be copied by Inductor per call). Built
once per layer, kept on the layout for the backward and any recomputation. On the CPU the lists
are checked equal to ``from_kv_blocks``' (``tests/ops/test_flex_mask.py``).

Query blocks wholly inside a run of dense documents (:mod:`.dense` computes those) get no key
block at all: the flex kernel skips them (the pack's tables leave them out).
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import BlockLayout
from .pack_index import PackIndex, num_blocks


def block_tables(pack: PackIndex, total: int, runs=()) -> dict[str, torch.Tensor]:
    """Per padded pack (``total >= T`` tokens; padding tokens form a document of their own
    starting at ``T``), device tensors: ``doc`` int64 ``(total,)`` each token's document and
    ``split`` bool ``(2, 1, nbp, nbp)`` the partial and the full doc-causal block pairs, without
    the query blocks of ``runs`` (computed by the dense kernel)."""

    def build():
        bs, t = pack.block_size, pack.seq_len
        nbp = num_blocks(total, bs)
        off = np.append(pack.offsets, total) if total > t else pack.offsets
        starts = off[:-1]
        qb = np.arange(nbp)
        first_tok, last_tok = qb * bs, np.minimum((qb + 1) * bs, total) - 1
        first = starts[np.searchsorted(off[1:], first_tok, side="right")]
        last = starts[np.searchsorted(off[1:], last_tok, side="right")]
        # "full": the key block lies inside the query block's only document and before it.
        one_doc = first == last
        kb_lo = (first + bs - 1) // bs  # first key block wholly at or after the doc start
        before = qb[None, :] < qb[:, None]
        full = one_doc[:, None] & (qb[None, :] >= kb_lo[:, None]) & before
        causal = (qb[None, :] >= (first // bs)[:, None]) & (qb[None, :] <= qb[:, None])
        rows = np.ones(nbp, dtype=bool)
        for _, _, t0, t1 in runs:  # query blocks the dense kernel computes: no key block
            lo, hi = qb * bs, np.minimum((qb + 1) * bs, t)
            rows &= ~((lo >= t0) & (hi <= t1) & (lo < hi))
        split = np.stack([causal & ~full, full]) & rows[None, :, None]
        doc = np.repeat(np.arange(starts.size), np.diff(off))
        up = pack.upload
        return {"doc": up(doc), "split": up(split[:, None], torch.bool)}

    return pack.memo(("flex_tables", total, runs), build)


def whole_block_runs(pack: PackIndex, dense_docs: tuple[bool, ...]):
    """The runs of dense documents worth a dense call: those holding at least one whole
    query block (the rest flex computes, exactly, at no extra cost)."""
    bs, t = pack.block_size, pack.seq_len

    def has_whole_block(run) -> bool:
        start = -(-run[2] // bs) * bs  # the first block starting inside the run
        return start < run[3] and min(start + bs, t) <= run[3]

    return pack.memo(
        ("whole_block_runs", dense_docs), lambda: tuple(r for r in pack.dense_runs(dense_docs) if has_whole_block(r))
    )


def build_block_mask(layout: BlockLayout, num_heads: int, total: int, runs=()):
    """The layout as a FlexAttention ``BlockMask`` over ``num_heads`` query heads and ``total``
    padded tokens, the query blocks of ``runs`` emptied (five device operations, see the module
    docstring; one more to pad the mask, one to repeat its heads, where needed)."""
    from torch.nn.attention.flex_attention import BlockMask

    pack, bs = layout.pack, layout.block_size
    nb, nbp = layout.num_blocks, num_blocks(total, bs)
    tables = block_tables(pack, total, tuple(runs))
    kept = layout.block_mask
    if kept.shape[0] != num_heads:
        kept = kept.repeat_interleave(num_heads // kept.shape[0], dim=0)
    if nbp > nb:
        kept = torch.nn.functional.pad(kept, (0, nbp - nb, 0, nbp - nb))
    # (2, H', nbp, nbp): partial, full. H' = H rounded up to 4 (heads past H unset, never read),
    # so that each of the four lists below starts 16-byte aligned: Inductor copies a misaligned
    # input of the compiled kernel on every call, forward and backward.
    heads = -(-num_heads // 4) * 4
    parts = torch.empty(2, heads, nbp, nbp, dtype=torch.bool, device=kept.device)
    torch.bitwise_and(kept[None], tables["split"], out=parts[:, :num_heads])
    lists = torch.cat([parts, parts.transpose(-2, -1)])  # kv side, then query side
    counts = lists.sum(-1, dtype=torch.int32)  # (4, H', nbp)
    # kept blocks first, in ascending order (a stable sort); what follows a row's count is unread
    order = torch.sort(lists.view(torch.uint8), dim=-1, descending=True, stable=True).indices
    order = order.to(torch.int32)
    doc = tables["doc"]

    def doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])

    num, idx = counts[:, :num_heads], order[:, :num_heads]  # each list a contiguous slice
    return BlockMask(
        seq_lengths=(total, total),
        kv_num_blocks=num[0][None],
        kv_indices=idx[0][None],
        full_kv_num_blocks=num[1][None],
        full_kv_indices=idx[1][None],
        q_num_blocks=num[2][None],
        q_indices=idx[2][None],
        full_q_num_blocks=num[3][None],
        full_q_indices=idx[3][None],
        BLOCK_SIZE=(bs, bs),
        mask_mod=doc_causal,
    )
