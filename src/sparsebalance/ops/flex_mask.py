"""A layout's FlexAttention ``BlockMask``, built once per layer from the bool block mask.

FlexAttention reads four index lists: per query block the *partial* key blocks (the document-
causal ``mask_mod`` applies) and the *full* ones (every token pair doc-causal: no mask_mod), for
the forward; per key block the same two lists over query blocks, for the backward's dK/dV.
``BlockMask.from_kv_blocks`` derives the query-side lists by converting the kv-side lists back to
a dense mask and argsorting it, twice per call; here both sides come straight from the dense
bool mask the layout already is (:func:`~.layout.dense_to_ordered`: a prefix count and a
scatter, no sort), so a layer costs a handful of ``O(H nb^2)`` kernels, built once and kept on
the layout for the backward and any recomputation. On the CPU the lists are checked equal to
``from_kv_blocks``' (``tests/ops/test_flex_mask.py``).

Query blocks wholly inside a run of dense documents (:mod:`.dense` computes those) get no key
block at all: the flex kernel skips them.
"""

from __future__ import annotations

import numpy as np
import torch

from .layout import BlockLayout, dense_to_ordered
from .pack_index import PackIndex, num_blocks


def block_tables(pack: PackIndex, total: int) -> dict[str, torch.Tensor]:
    """Per padded pack (``total >= T`` tokens; padding tokens form a document of their own
    starting at ``T``), device tensors: ``doc`` int64 ``(total,)`` each token's document,
    ``causal`` / ``full`` bool ``(nbp, nbp)`` doc-causal and full block pairs."""

    def build():
        bs, t = pack.block_size, pack.seq_len
        nbp = num_blocks(total, bs)
        off = np.append(pack.offsets, total) if total > t else pack.offsets
        starts = off[:-1]
        qb = np.arange(nbp)
        first_tok, last_tok = qb * bs, np.minimum((qb + 1) * bs, total) - 1
        first = starts[np.searchsorted(off[1:], first_tok, side="right")]
        last = starts[np.searchsorted(off[1:], last_tok, side="right")]
        doc = np.repeat(np.arange(starts.size), np.diff(off))
        up = pack.upload
        first_d, last_d, qb_d = up(first), up(last), up(qb)
        # "full": the key block lies inside the query block's only document and before it.
        one_doc = first_d == last_d
        kb_lo = (first_d + bs - 1) // bs  # first key block wholly at or after the doc start
        before = qb_d[None, :] < qb_d[:, None]
        full = one_doc[:, None] & (qb_d[None, :] >= kb_lo[:, None]) & before
        lo = first_d // bs
        causal = (qb_d[None, :] >= lo[:, None]) & (qb_d[None, :] <= qb_d[:, None])
        return {"doc": up(doc), "causal": causal, "full": full}

    return pack.memo(("flex_tables", total), build)


def dense_rows(pack: PackIndex, runs, total: int) -> torch.Tensor | None:
    """Bool ``(nbp,)`` device: query blocks wholly inside one of ``runs`` (``(doc0, doc1, t0,
    t1)`` each), which the dense kernel computes; None without runs."""
    if not runs:
        return None

    def build():
        bs = pack.block_size
        nbp = num_blocks(total, bs)
        qb = np.arange(nbp)
        lo, hi = qb * bs, np.minimum((qb + 1) * bs, pack.seq_len)
        inside = np.zeros(nbp, dtype=bool)
        for _, _, t0, t1 in runs:
            inside |= (lo >= t0) & (hi <= t1) & (lo < hi)
        return pack.upload(inside, torch.bool)

    return pack.memo(("dense_rows", runs, total), build)


def whole_block_runs(pack: PackIndex, dense_docs: tuple[bool, ...]):
    """The runs of dense documents worth a dense call: those holding at least one whole
    query block (the rest flex computes, exactly, at no extra cost)."""
    bs, t = pack.block_size, pack.seq_len

    def has_whole_block(run) -> bool:
        start = -(-run[2] // bs) * bs  # the first block starting inside the run
        return start < run[3] and min(start + bs, t) <= run[3]

    return tuple(r for r in pack.dense_runs(dense_docs) if has_whole_block(r))


def build_block_mask(layout: BlockLayout, num_heads: int, total: int, runs=()):
    """The layout as a FlexAttention ``BlockMask`` over ``num_heads`` query heads and ``total``
    padded tokens, the query blocks of ``runs`` emptied."""
    from torch.nn.attention.flex_attention import BlockMask

    pack, bs = layout.pack, layout.block_size
    nb, nbp = layout.num_blocks, num_blocks(total, bs)
    tables = block_tables(pack, total)
    kept = layout.block_mask
    if kept.shape[0] != num_heads:
        kept = kept.repeat_interleave(num_heads // kept.shape[0], dim=0)
    if nbp > nb:
        kept = torch.nn.functional.pad(kept, (0, nbp - nb, 0, nbp - nb))
    skip = dense_rows(pack, runs, total)
    if skip is not None:
        kept = kept & ~skip[None, :, None]
    partial = kept & (tables["causal"] & ~tables["full"])[None]
    full = kept & tables["full"][None]
    kv_num, kv_idx = dense_to_ordered(partial, nbp)
    full_num, full_idx = dense_to_ordered(full, nbp)
    q_num, q_idx = dense_to_ordered(partial.transpose(-2, -1), nbp)
    full_q_num, full_q_idx = dense_to_ordered(full.transpose(-2, -1), nbp)
    doc = tables["doc"]

    def doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])

    return BlockMask(
        seq_lengths=(total, total),
        kv_num_blocks=kv_num[None], kv_indices=kv_idx[None],
        full_kv_num_blocks=full_num[None], full_kv_indices=full_idx[None],
        q_num_blocks=q_num[None], q_indices=q_idx[None],
        full_q_num_blocks=full_q_num[None], full_q_indices=full_q_idx[None],
        BLOCK_SIZE=(bs, bs), mask_mod=doc_causal,
    )  # fmt: skip
