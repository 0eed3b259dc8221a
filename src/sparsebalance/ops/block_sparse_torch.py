"""Block-sparse attention in plain PyTorch (the CPU training path; also runs on CUDA).

Work and memory are proportional to the kept block pairs. A *row* is one (layout head, query block):
its ``Hq / H_layout`` query heads times ``B`` query tokens against the row's kept key blocks. Rows
are sorted by their number of key blocks and cut into chunks of similar width, so each chunk is one
batched matmul with little padding, and the chunk size bounds peak memory. Softmax is exact per row
(all of a row's key blocks are in the same chunk); the backward recomputes the probabilities from
the saved log-sum-exp, flash-attention style, instead of storing them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .layout import BlockLayout

# Score elements (query rows x key columns) per chunk: bounds the temporaries (~6 of this size).
_CHUNK_ELEMS = 1 << 23
# Rows whose key-block count is within this factor share a chunk (padding waste <= 25%).
_WIDTH_RATIO = 1.25


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialised output buffer; tests patch this to fill NaN and catch unwritten elements."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass
class _Chunk:
    row: torch.Tensor  # int64 (n,): flat row id, layout head * nb + query block
    kv_row: torch.Tensor  # int64 (n, W): flat key block id, kv head * nb + key block
    kblocks: torch.Tensor  # int64 (n, W): key blocks; full slots first, masked slots last
    valid: torch.Tensor  # bool (n, W)
    num_masked: int  # the last num_masked slots of every row need the token mask


def _chunks(layout: BlockLayout, g: int, kv_of_layout: torch.Tensor, start_last: torch.Tensor):
    """Group the layout's rows into chunks of similar width (see module docstring).

    Inside a row, slots are reordered so that *partial* key blocks (the diagonal, blocks crossing
    the query block's document start, padding) come last: softmax does not care about order, and
    only the chunk's trailing ``num_masked`` slots then need the token mask.
    """
    h, nb, max_kv = layout.kv_indices.shape
    dev = layout.device
    counts = layout.kv_num_blocks.reshape(-1).long()
    order = torch.argsort(counts, stable=True)
    counts_sorted = counts[order].cpu()
    bucket = torch.floor(torch.log(counts_sorted.clamp_min(1).double()) / math.log(_WIDTH_RATIO))
    row_elems = g * layout.block_size * layout.block_size
    flat_idx = layout.kv_indices.reshape(h * nb, max_kv).long()
    chunks: list[_Chunk] = []
    i = int((counts_sorted == 0).sum())  # rows without keys get zeros; no chunk
    while i < len(order):
        j = int(torch.searchsorted(bucket, bucket[i], right=True))
        width = int(counts_sorted[j - 1])
        per_chunk = max(1, _CHUNK_ELEMS // (row_elems * width))
        for s in range(i, j, per_chunk):
            rows = order[s : min(j, s + per_chunk)].to(dev)
            kb = flat_idx[rows, :width]
            valid = torch.arange(width, device=dev) < counts[rows, None]
            qb = (rows % nb)[:, None]
            full = valid & (kb < qb) & (kb * layout.block_size >= start_last[qb])
            slot_order = torch.argsort((~full).to(torch.int8), dim=1, stable=True)
            kb, valid = kb.gather(1, slot_order), valid.gather(1, slot_order)
            kb = torch.where(valid, kb, kb[:, :1])
            num_masked = int((~full).sum(1).max())
            kv_row = kv_of_layout[rows // nb][:, None] * nb + kb
            chunks.append(_Chunk(rows, kv_row, kb, valid, num_masked))
        i = j
    return chunks, order[:i].to(dev)


class _Geometry:
    """Per-call index tensors shared by forward and backward."""

    def __init__(self, layout: BlockLayout, hq: int, hkv: int, device: torch.device):
        self.B = layout.block_size
        self.nb = layout.num_blocks
        self.T = layout.seq_len
        self.hl = layout.num_heads
        self.g = hq // self.hl  # query heads per layout head
        tpad = self.nb * self.B
        pos = torch.arange(tpad, device=device)
        start = torch.empty(tpad, dtype=torch.long, device=device)
        cu = layout.cu_seqlens.to(device).long()
        start[: self.T] = cu[torch.searchsorted(cu[1:], pos[: self.T], right=True)]
        start[self.T :] = pos[self.T :]  # padded queries see only themselves
        self.qpos = pos.view(self.nb, self.B).repeat(1, self.g)  # (nb, g*B)
        self.qstart = start.view(self.nb, self.B).repeat(1, self.g)
        self.koff = torch.arange(self.B, device=device)
        kv_of_layout = torch.arange(self.hl, device=device) // (self.hl // hkv)
        self.chunks, self.empty_rows = _chunks(
            layout, self.g, kv_of_layout, start.view(self.nb, self.B)[:, -1]
        )

    def mask(self, c: _Chunk) -> torch.Tensor:
        """Bool ``(n, g*B, num_masked*B)``: doc-causal mask of the chunk's trailing slots."""
        kb, valid = c.kblocks[:, -c.num_masked :], c.valid[:, -c.num_masked :]
        n, w = kb.shape
        kpos = (kb[:, :, None] * self.B + self.koff).reshape(n, 1, w * self.B)
        kpos = torch.where(valid.repeat_interleave(self.B, 1)[:, None, :], kpos, -1)
        qb = c.row % self.nb
        return (kpos <= self.qpos[qb][:, :, None]) & (kpos >= self.qstart[qb][:, :, None])

    def masked_scores_(self, s: torch.Tensor, c: _Chunk) -> torch.Tensor:
        """Set the disallowed entries of the chunk's scores ``(n, g*B, W*B)`` to -inf, in place."""
        if c.num_masked:
            s[:, :, -c.num_masked * self.B :].masked_fill_(~self.mask(c), -math.inf)
        return s


def _to_blocks(x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """``(T, H, D)`` -> ``(H*nb, B*D)`` flat blocks, zero-padding the last block."""
    pad = geo.nb * geo.B - x.shape[0]
    x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
    h = x.shape[1]
    return x.view(geo.nb, geo.B, h, -1).permute(2, 0, 1, 3).reshape(h * geo.nb, -1)


def _q_rows(x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """``(T, Hq, D)`` -> ``(H_layout*nb, g*B, D)``: each row's query heads stacked."""
    pad = geo.nb * geo.B - x.shape[0]
    x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
    d = x.shape[-1]
    x = x.view(geo.nb, geo.B, geo.hl, geo.g, d).permute(2, 0, 3, 1, 4)
    return x.reshape(geo.hl * geo.nb, geo.g * geo.B, d)


def _from_q_rows(x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """Inverse of :func:`_q_rows`: ``(H_layout*nb, g*B, D)`` -> ``(T, Hq, D)``."""
    d = x.shape[-1]
    x = x.view(geo.hl, geo.nb, geo.g, geo.B, d).permute(1, 3, 0, 2, 4)
    return x.reshape(geo.nb * geo.B, geo.hl * geo.g, d)[: geo.T]


def _from_blocks(x: torch.Tensor, geo: _Geometry, heads: int) -> torch.Tensor:
    """Inverse of :func:`_to_blocks`: ``(H*nb, B*D)`` -> ``(T, H, D)``."""
    x = x.view(heads, geo.nb, geo.B, -1).permute(1, 2, 0, 3)
    return x.reshape(geo.nb * geo.B, heads, -1)[: geo.T]


def _gather(x: torch.Tensor, c: _Chunk, geo: _Geometry) -> torch.Tensor:
    """Flat blocks ``(Hkv*nb, B*D)`` -> ``(n, W*B, D)``: the chunk's key (or value) blocks."""
    n, w = c.kv_row.shape
    return x.index_select(0, c.kv_row.reshape(-1)).view(n, w * geo.B, -1)


class BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: BlockLayout, scale: float):  # type: ignore[override]
        geo = _Geometry(layout, q.shape[1], k.shape[1], q.device)
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        qr = _q_rows(q * scale, geo)  # the scale is folded into q once
        kb, vb = _to_blocks(k, geo), _to_blocks(v, geo)
        out = _new_output(qr.shape, q.dtype, q.device)
        out[geo.empty_rows] = 0
        # Rows with no key at all keep lse=+inf, which makes their outputs and gradients zero.
        lse = torch.full(qr.shape[:2], math.inf, dtype=acc, device=q.device)
        for c in geo.chunks:
            s = torch.bmm(qr.index_select(0, c.row), _gather(kb, c, geo).transpose(1, 2))
            s = geo.masked_scores_(s.to(acc), c)
            m = s.amax(-1, keepdim=True)
            m.nan_to_num_(neginf=0.0)
            p = s.sub_(m).exp_()
            denom = p.sum(-1, keepdim=True)
            o = torch.bmm(p.to(v.dtype), _gather(vb, c, geo))
            out[c.row] = o.div_(denom.clamp_min(1e-30)).to(q.dtype)
            lse[c.row] = torch.where(denom > 0, m + denom.log(), math.inf).squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.geo, ctx.scale = geo, scale
        return _from_q_rows(out, geo)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        geo, scale = ctx.geo, ctx.scale
        acc = lse.dtype
        qr = _q_rows(q * scale, geo)
        dor = _q_rows(grad_out.to(q.dtype), geo)
        kb, vb = _to_blocks(k, geo), _to_blocks(v, geo)
        delta = (dor.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # (rows, g*B, 1)
        dq = _new_output(qr.shape, acc, q.device)
        dq[geo.empty_rows] = 0
        dk = torch.zeros(kb.shape, dtype=acc, device=q.device)
        dv = torch.zeros_like(dk)
        for c in geo.chunks:
            qc, doc = qr.index_select(0, c.row), dor.index_select(0, c.row)
            kc, vc = _gather(kb, c, geo), _gather(vb, c, geo)
            s = geo.masked_scores_(torch.bmm(qc, kc.transpose(1, 2)).to(acc), c)
            p = s.sub_(lse.index_select(0, c.row)[:, :, None]).exp_()
            dv_c = torch.bmm(p.to(q.dtype).transpose(1, 2), doc)
            dv.index_add_(0, c.kv_row.reshape(-1), dv_c.view(c.kv_row.numel(), -1).to(acc))
            dp = torch.bmm(doc, vc.transpose(1, 2)).to(acc)
            ds = p.mul_(dp.sub_(delta.index_select(0, c.row))).to(q.dtype)
            dq[c.row] = torch.bmm(ds, kc).to(acc)
            dk_c = torch.bmm(ds.transpose(1, 2), qc)  # q was pre-scaled: no extra factor
            dk.index_add_(0, c.kv_row.reshape(-1), dk_c.view(c.kv_row.numel(), -1).to(acc))
        hkv = k.shape[1]
        dq = _from_q_rows(dq.mul_(scale), geo)
        dk, dv = _from_blocks(dk, geo, hkv), _from_blocks(dv, geo, hkv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def torch_block_sparse_attention(q, k, v, layout: BlockLayout, scale: float) -> torch.Tensor:
    """``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)`` -> ``(T, Hq, D)``; differentiable in q, k, v."""
    return BlockSparseAttention.apply(q, k, v, layout, scale)
