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


@dataclass
class _Chunk:
    head: torch.Tensor  # int64 (n,): layout head of each row
    qblock: torch.Tensor  # int64 (n,): query block of each row
    kblocks: torch.Tensor  # int64 (n, W): key blocks, padded slots repeat a valid one
    valid: torch.Tensor  # bool (n, W)


def _chunks(layout: BlockLayout, rows_per_head_token: int) -> list[_Chunk]:
    """Group the layout's rows into chunks of similar width (see module docstring)."""
    h, nb, max_kv = layout.kv_indices.shape
    counts = layout.kv_num_blocks.reshape(-1).long()
    order = torch.argsort(counts, stable=True)
    counts_sorted = counts[order].cpu()
    nonzero = int((counts_sorted > 0).nonzero()[0]) if bool((counts_sorted > 0).any()) else len(order)
    bucket = torch.floor(torch.log(counts_sorted.clamp_min(1).double()) / math.log(_WIDTH_RATIO))
    row_elems = rows_per_head_token * layout.block_size * layout.block_size
    chunks: list[_Chunk] = []
    i = nonzero
    flat_idx = layout.kv_indices.reshape(h * nb, max_kv).long()
    while i < len(order):
        j = i + 1
        b = bucket[i]
        while j < len(order) and bucket[j] == b:
            j += 1
        width = int(counts_sorted[j - 1])
        per_chunk = max(1, _CHUNK_ELEMS // (row_elems * width))
        for s in range(i, j, per_chunk):
            rows = order[s : min(j, s + per_chunk)].to(layout.device)
            kb = flat_idx[rows, :width]
            valid = torch.arange(width, device=layout.device) < counts[rows, None]
            kb = torch.where(valid, kb, kb[:, :1])
            chunks.append(_Chunk(rows // nb, rows % nb, kb, valid))
        i = j
    return chunks


class _Geometry:
    """Per-call index tensors shared by forward and backward."""

    def __init__(self, layout: BlockLayout, hq: int, hkv: int, device: torch.device):
        self.B = layout.block_size
        self.nb = layout.num_blocks
        self.T = layout.seq_len
        self.hl = layout.num_heads
        self.g = hq // self.hl  # query heads per layout head
        self.kv_of_layout = torch.arange(self.hl, device=device) // (self.hl // hkv)
        self.chunks = _chunks(layout, self.g)
        tpad = self.nb * self.B
        pos = torch.arange(tpad, device=device)
        start = torch.empty(tpad, dtype=torch.long, device=device)
        cu = layout.cu_seqlens.to(device).long()
        doc = torch.searchsorted(cu[1:], pos[: self.T], right=True)
        start[: self.T] = cu[doc]
        start[self.T :] = pos[self.T :]  # padded queries see only themselves
        self.qpos = pos.view(self.nb, self.B)
        self.qstart = start.view(self.nb, self.B)
        self.koff = torch.arange(self.B, device=device)

    def mask(self, c: _Chunk) -> torch.Tensor:
        """Bool ``(n, g*B, W*B)``: doc-causal and valid-slot mask of a chunk."""
        n, w = c.kblocks.shape
        kpos = (c.kblocks[:, :, None] * self.B + self.koff).reshape(n, 1, w * self.B)
        kpos = torch.where(c.valid.repeat_interleave(self.B, 1)[:, None, :], kpos, -1)
        qpos = self.qpos[c.qblock].repeat(1, self.g)[:, :, None]
        qstart = self.qstart[c.qblock].repeat(1, self.g)[:, :, None]
        return (kpos <= qpos) & (kpos >= qstart)


def _to_blocks(x: torch.Tensor, geo: _Geometry, heads: int) -> torch.Tensor:
    """``(T, H, D)`` -> ``(H, nb, B, D)`` with zero padding of the last block."""
    pad = geo.nb * geo.B - x.shape[0]
    x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
    return x.view(geo.nb, geo.B, heads, -1).permute(2, 0, 1, 3)


def _q_rows(qb: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """``(Hq, nb, B, D)`` -> ``(H_layout, nb, g*B, D)``: a row's query heads stacked."""
    hq, nb, b, d = qb.shape
    return qb.reshape(geo.hl, geo.g, nb, b, d).transpose(1, 2).reshape(geo.hl, nb, geo.g * b, d)


def _from_q_rows(x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """Inverse of :func:`_q_rows`, then back to ``(T, Hq, D)``."""
    hl, nb, gb, d = x.shape
    x = x.reshape(hl, nb, geo.g, geo.B, d).transpose(1, 2).reshape(hl * geo.g, nb * geo.B, d)
    return x.permute(1, 0, 2)[: geo.T]


def _gather_kv(xb: torch.Tensor, c: _Chunk, geo: _Geometry) -> torch.Tensor:
    """``(Hkv, nb, B, D)`` -> ``(n, W*B, D)``: the chunk's key (or value) blocks."""
    kvh = geo.kv_of_layout[c.head]
    n, w = c.kblocks.shape
    return xb[kvh[:, None], c.kblocks].reshape(n, w * geo.B, -1)


def _scatter_kv(grad: torch.Tensor, acc: torch.Tensor, c: _Chunk, geo: _Geometry) -> None:
    """Add ``grad (n, W*B, D)`` into ``acc (Hkv*nb, B*D)`` at the chunk's key blocks."""
    n, w = c.kblocks.shape
    flat = (geo.kv_of_layout[c.head][:, None] * geo.nb + c.kblocks).reshape(-1)
    acc.index_add_(0, flat, grad.reshape(n * w, -1).to(acc.dtype))


class BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: BlockLayout, scale: float):  # type: ignore[override]
        hq, hkv = q.shape[1], k.shape[1]
        geo = _Geometry(layout, hq, hkv, q.device)
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        qr = _q_rows(_to_blocks(q, geo, hq), geo)
        kb, vb = _to_blocks(k, geo, hkv), _to_blocks(v, geo, hkv)
        out = torch.zeros(qr.shape, dtype=q.dtype, device=q.device)
        # Rows with no key (none in layouts from select_blocks) keep lse=+inf: zero output/grads.
        lse = torch.full(qr.shape[:3], math.inf, dtype=acc_dtype, device=q.device)
        for c in geo.chunks:
            s = torch.bmm(qr[c.head, c.qblock], _gather_kv(kb, c, geo).transpose(1, 2))
            s = (s.to(acc_dtype) * scale).masked_fill_(~geo.mask(c), -math.inf)
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = torch.exp_(s.sub_(m))
            denom = p.sum(-1, keepdim=True)
            o = torch.bmm(p.to(v.dtype), _gather_kv(vb, c, geo)).to(acc_dtype)
            out[c.head, c.qblock] = (o / denom.clamp_min(1e-30)).to(q.dtype)
            row_lse = torch.where(denom > 0, m + torch.log(denom), torch.full_like(m, math.inf))
            lse[c.head, c.qblock] = row_lse.squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.geo, ctx.scale = geo, scale
        return _from_q_rows(out, geo)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        geo, scale = ctx.geo, ctx.scale
        hq, hkv = q.shape[1], k.shape[1]
        acc_dtype = lse.dtype
        qr = _q_rows(_to_blocks(q, geo, hq), geo)
        dor = _q_rows(_to_blocks(grad_out.to(q.dtype), geo, hq), geo)
        kb, vb = _to_blocks(k, geo, hkv), _to_blocks(v, geo, hkv)
        delta = (dor.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # (H_layout, nb, g*B)
        dq = torch.zeros(qr.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(hkv * geo.nb, geo.B * q.shape[2], dtype=acc_dtype, device=q.device)
        dv = torch.zeros_like(dk)
        for c in geo.chunks:
            qc, doc = qr[c.head, c.qblock], dor[c.head, c.qblock]
            kc, vc = _gather_kv(kb, c, geo), _gather_kv(vb, c, geo)
            s = torch.bmm(qc, kc.transpose(1, 2)).to(acc_dtype) * scale
            s = s.masked_fill_(~geo.mask(c), -math.inf)
            p = torch.exp_(s.sub_(lse[c.head, c.qblock][:, :, None]))
            _scatter_kv(torch.bmm(p.transpose(1, 2).to(q.dtype), doc), dv, c, geo)
            dp = torch.bmm(doc, vc.transpose(1, 2)).to(acc_dtype)
            ds = p.mul_(dp.sub_(delta[c.head, c.qblock][:, :, None])).mul_(scale).to(q.dtype)
            dq[c.head, c.qblock] = torch.bmm(ds, kc).to(acc_dtype)
            _scatter_kv(torch.bmm(ds.transpose(1, 2), qc), dk, c, geo)
        dk = dk.view(hkv, geo.nb, geo.B, -1).permute(1, 2, 0, 3).reshape(-1, hkv, q.shape[2])
        dv = dv.view(hkv, geo.nb, geo.B, -1).permute(1, 2, 0, 3).reshape(-1, hkv, q.shape[2])
        dq = _from_q_rows(dq, geo)
        return dq.to(q.dtype), dk[: geo.T].to(k.dtype), dv[: geo.T].to(v.dtype), None, None


def torch_block_sparse_attention(q, k, v, layout: BlockLayout, scale: float) -> torch.Tensor:
    """``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)`` -> ``(T, Hq, D)``; differentiable in q, k, v."""
    return BlockSparseAttention.apply(q, k, v, layout, scale)
