"""Which (query block, key block) pairs one call of the block-sparse kernel computes, in chunks.

The torch backend's kernel (:mod:`.block_sparse_torch`) runs over a :class:`BlockPairs`: the kept
pairs of a global :class:`~.layout.BlockLayout` between a set of query blocks and a set of key
blocks, both given as *global* block ids, so token positions, document starts and padding are
exact wherever the blocks live. The single-device op uses every block on both sides; a step of the
context-parallel ring (``sparsebalance.parallel``) uses a rank's query blocks and the key blocks
of the shard it currently holds. One kernel, one plan, two callers.

A *row* is one (layout head, local query block): its ``g = Hq / H_layout`` query heads times ``B``
query tokens against the row's kept key blocks. Rows are sorted by their number of key blocks and
cut into chunks of similar width, so each chunk is one batched matmul with little padding, and the
chunk size bounds peak memory. Inside a row, *full* key blocks (every token pair doc-causal) come
first and *partial* ones (the diagonal, blocks crossing the document start, padding slots) last:
only a chunk's trailing ``num_masked`` slots need the token mask.

Tensor forms (``n`` query blocks, ``m`` key blocks):

- query rows ``(H_layout * n, g * B, D)``: row ``h * n + i`` holds the ``g`` query heads of layout
  head ``h`` for local query block ``i`` (:func:`query_rows`);
- key or value blocks ``(Hkv * m, B * D)``: row ``h * m + j`` is local key block ``j`` of KV head
  ``h`` (:func:`token_blocks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .layout import BlockLayout
from .varlen import doc_starts

CHUNK_ELEMS = 1 << 23
"""Score elements (query rows x key columns) per chunk: bounds the temporaries (~6 of this size)."""
WIDTH_RATIO = 1.25
"""Rows whose key-block count is within this factor share a chunk (padding waste <= 25%)."""


@dataclass
class PairChunk:
    """Rows of similar width computed by one batched matmul."""

    row: torch.Tensor
    """int64 ``(c,)``: query row, layout head * n + local query block."""
    kv_row: torch.Tensor
    """int64 ``(c, W)``: key row, kv head * m + local key block (padding slots repeat slot 0)."""
    kpos0: torch.Tensor
    """int64 ``(c, M)``: first global token of each of the ``M`` trailing (masked) slots."""
    valid: torch.Tensor
    """bool ``(c, M)``: the trailing slot holds a kept block (not padding)."""
    num_masked: int
    """``M``: trailing slots that need the token mask."""


class BlockPairs:
    """The kept block pairs of ``layout`` between ``q_blocks`` and ``k_blocks``, in chunks.

    Args:
        layout: the global layout (its ``cu_seqlens`` give the document starts).
        q_blocks: int64 ``(n,)`` global query block ids; ids ``>= layout.num_blocks`` are padding
            blocks (no query).
        k_blocks: int64 ``(m,)`` global key block ids.
        num_kv_heads: ``Hkv``.
        device: where the index tensors live.

    Tokens past ``T`` (padding) extend the last document: their outputs are discarded and their
    output gradients are zero, so they change nothing; real queries never see them.
    """

    def __init__(
        self,
        layout: BlockLayout,
        q_blocks: torch.Tensor,
        k_blocks: torch.Tensor,
        num_kv_heads: int,
        device: torch.device,
    ):
        b, nb, hl = layout.block_size, layout.num_blocks, layout.num_heads
        self.B, self.g, self.n = b, layout.num_q_heads // hl, q_blocks.numel()
        q_blocks, k_blocks = q_blocks.to(device), k_blocks.to(device)
        cap = int(max(q_blocks.max(), k_blocks.max())) + 1
        tpad = max(cap, nb) * b
        start = doc_starts(layout.cu_seqlens.to(device), layout.seq_len)
        start = torch.cat([start, start[-1:].expand(tpad - layout.seq_len)])  # (tpad,)
        qtok = q_blocks[:, None] * b + torch.arange(b, device=device)  # (n, B)
        self.qpos = qtok.repeat(1, self.g)  # (n, g*B)
        self.qstart = start[qtok].repeat(1, self.g)
        start_last = start[qtok[:, -1]]  # (n,)

        # Kept key blocks of each row that lie in k_blocks, as local indices.
        local = torch.full((cap,), -1, dtype=torch.long, device=device)
        local[k_blocks] = torch.arange(k_blocks.numel(), device=device)
        real = q_blocks < nb
        qb = q_blocks.clamp(max=nb - 1)
        idx = layout.kv_indices.to(device)[:, qb].long()  # (H, n, max_kv)
        cnt = layout.kv_num_blocks.to(device)[:, qb].long() * real  # (H, n)
        slot = torch.arange(idx.shape[-1], device=device)
        loc = local[idx]
        keep = (slot < cnt[..., None]) & (loc >= 0)
        full = keep & (idx < q_blocks[None, :, None]) & (idx * b >= start_last[None, :, None])
        # Per row: full slots first, then partial ones, then unkept ones.
        order = torch.argsort((~keep).to(torch.int8) * 2 + (~full).to(torch.int8), dim=-1, stable=True)
        loc, idx = loc.gather(-1, order).flatten(0, 1), idx.gather(-1, order).flatten(0, 1)
        counts = keep.sum(-1).flatten()
        num_full = full.sum(-1).flatten()
        kv_head = (torch.arange(hl, device=device) // (hl // num_kv_heads)).repeat_interleave(self.n)
        self.num_pairs = int(counts.sum())
        """Kept block pairs computed (summed over layout heads): the call's work."""
        self.chunks, self.empty_rows = self._chunks(counts, num_full, loc, idx, kv_head, k_blocks.numel())

    def _chunks(self, counts, num_full, loc, idx, kv_head, nk):
        """Rows of similar width share a chunk; returns the chunks and the rows without a key."""
        order = torch.argsort(counts, stable=True)
        counts_sorted = counts[order].cpu()
        bucket = torch.floor(torch.log(counts_sorted.clamp_min(1).double()) / math.log(WIDTH_RATIO))
        chunks = []
        i = int((counts_sorted == 0).sum())  # rows without a key here: no chunk
        while i < len(order):
            j = int(torch.searchsorted(bucket, bucket[i], right=True))
            width = int(counts_sorted[j - 1])
            per_chunk = max(1, CHUNK_ELEMS // (self.g * self.B * self.B * width))
            for s in range(i, j, per_chunk):
                rows = order[s : min(j, s + per_chunk)]
                valid = torch.arange(width, device=rows.device) < counts[rows, None]
                kb = torch.where(valid, loc[rows, :width], loc[rows, :1])
                m = width - int(num_full[rows].min())
                kv_row = kv_head[rows][:, None] * nk + kb
                kpos0 = idx[rows, width - m : width] * self.B
                chunks.append(PairChunk(rows, kv_row, kpos0, valid[:, width - m :], m))
            i = j
        return chunks, order[: int((counts_sorted == 0).sum())]

    def token_mask(self, c: PairChunk) -> torch.Tensor:
        """Bool ``(c, g*B, M*B)``: the doc-causal (query, key) token pairs of the trailing slots."""
        n, m = c.kpos0.shape
        kpos = (c.kpos0[:, :, None] + torch.arange(self.B, device=c.kpos0.device)).reshape(n, 1, m * self.B)
        kpos = torch.where(c.valid.repeat_interleave(self.B, 1)[:, None, :], kpos, -1)
        qb = c.row % self.n
        return (kpos <= self.qpos[qb][:, :, None]) & (kpos >= self.qstart[qb][:, :, None])

    def masked_scores_(self, s: torch.Tensor, c: PairChunk) -> torch.Tensor | None:
        """Set the disallowed entries of scores ``(c, g*B, W*B)`` to -inf, in place.

        Returns the trailing slots' token mask (``None`` when the chunk has none).
        """
        if not c.num_masked:
            return None
        ok = self.token_mask(c)
        s[:, :, -c.num_masked * self.B :].masked_fill_(~ok, -math.inf)
        return ok

    def gather(self, x: torch.Tensor, c: PairChunk) -> torch.Tensor:
        """Key or value blocks ``(Hkv*m, B*D)`` -> ``(c, W*B, D)``: the chunk's blocks."""
        n, w = c.kv_row.shape
        return x.index_select(0, c.kv_row.reshape(-1)).view(n, w * self.B, -1)


# ---------------------------------------------------------------------- tensor forms
def pad_tokens(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Zero-pad ``(T, H, D)`` to a multiple of ``block_size`` tokens."""
    pad = -x.shape[0] % block_size
    return F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x


def query_rows(x: torch.Tensor, num_layout_heads: int, block_size: int) -> torch.Tensor:
    """Queries ``(T, Hq, D)`` (zero-padded to whole blocks) -> rows ``(H_layout*n, g*B, D)``."""
    x = pad_tokens(x, block_size)
    t, hq, d = x.shape
    n, g = t // block_size, hq // num_layout_heads
    x = x.view(n, block_size, num_layout_heads, g, d).permute(2, 0, 3, 1, 4)
    return x.reshape(num_layout_heads * n, g * block_size, d)


def rows_to_tokens(x: torch.Tensor, num_layout_heads: int, block_size: int) -> torch.Tensor:
    """Inverse of :func:`query_rows`: ``(H_layout*n, g*B, D)`` -> ``(n*B, Hq, D)`` (padded)."""
    rows, gb, d = x.shape
    n, g = rows // num_layout_heads, gb // block_size
    x = x.view(num_layout_heads, n, g, block_size, d).permute(1, 3, 0, 2, 4)
    return x.reshape(n * block_size, num_layout_heads * g, d)


def token_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Keys or values ``(T, H, D)`` (zero-padded to whole blocks) -> ``(H*m, B*D)``."""
    x = pad_tokens(x, block_size)
    t, h, d = x.shape
    x = x.view(t // block_size, block_size, h, d).permute(2, 0, 1, 3)
    return x.reshape(h * (t // block_size), block_size * d)


def blocks_to_tokens(x: torch.Tensor, num_heads: int, block_size: int) -> torch.Tensor:
    """Inverse of :func:`token_blocks`: ``(H*m, B*D)`` -> ``(m*B, H, D)`` (padded)."""
    m = x.shape[0] // num_heads
    x = x.view(num_heads, m, block_size, -1).permute(1, 2, 0, 3)
    return x.reshape(m * block_size, num_heads, -1)
