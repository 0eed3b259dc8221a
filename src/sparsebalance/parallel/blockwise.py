"""Block-sparse *partial* attention: local query blocks against one key/value shard.

A ring step computes, for the query blocks a rank holds, attention over the kept key blocks of the
global :class:`~sparsebalance.ops.BlockLayout` that lie in the key/value shard it currently holds,
and merges the result into running (output, log-sum-exp) accumulators; the backward recomputes the
probabilities from the final log-sum-exp and returns this shard's key/value gradients. It is the
torch backend's algorithm (``ops/block_sparse_torch.py``: rows = (layout head, query block) grouped
into chunks of similar width, one batched matmul per chunk, only partial block pairs masked), with
*global* block ids on both sides so the token positions, document starts and padding are exact.

Internal tensor forms (``n`` local blocks, ``g = Hq / H_layout``):

- query rows ``(H_layout * n, g * B, D)``: row ``h * n + i`` holds the ``g`` query heads of
  layout head ``h`` for local block ``i`` (see :func:`to_rows`);
- key/value shard ``kv`` ``(2, Hkv * n, B * D)``: stacked key and value blocks, one message;
- ``lse`` ``(H_layout * n, g * B)``: ``-inf`` while a query has no key yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops.layout import BlockLayout
from ..ops.varlen import doc_starts

# Score elements per chunk and width ratio: the torch backend's constants (same memory bound).
_CHUNK_ELEMS = 1 << 23
_WIDTH_RATIO = 1.25


@dataclass
class _Chunk:
    row: torch.Tensor  # int64 (c,): query row, layout head * n + local query block
    kv_row: torch.Tensor  # int64 (c, W): key row in the shard, kv head * n + local key block
    kpos0: torch.Tensor  # int64 (c, M): first global token of the M trailing (masked) slots
    valid: torch.Tensor  # bool (c, M): trailing slot holds a kept block
    num_masked: int


class StepPlan:
    """The kept block pairs between ``q_blocks`` and ``k_blocks`` (global ids), in chunks.

    Built once per ring step from the global layout; shared by the forward and the backward.
    Query tokens past ``T`` (padding) extend the last document: their outputs are discarded and
    their output gradients are zero, so they change nothing; real queries never see them.
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

        # Kept key blocks of each row that lie in this shard, as local shard indices.
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
        # Per row: full slots first, then partial ones (only those need the token mask).
        order = torch.argsort(
            (~keep).to(torch.int8) * 2 + (~full).to(torch.int8), dim=-1, stable=True
        )
        loc, idx = loc.gather(-1, order).flatten(0, 1), idx.gather(-1, order).flatten(0, 1)
        counts = keep.sum(-1).flatten()
        num_full = full.sum(-1).flatten()
        kv_head = (torch.arange(hl, device=device) // (hl // num_kv_heads)).repeat_interleave(
            self.n
        )
        self.work = int(counts.sum())
        self.chunks = self._chunks(counts, num_full, loc, idx, kv_head, k_blocks.numel())

    def _chunks(self, counts, num_full, loc, idx, kv_head, nk) -> list[_Chunk]:
        """Rows of similar width share a chunk. Slots past a row's full ones (its partial blocks,
        then its padding up to the chunk width) form the chunk's trailing ``num_masked`` slots."""
        order = torch.argsort(counts, stable=True)
        counts_sorted = counts[order].cpu()
        bucket = torch.floor(
            torch.log(counts_sorted.clamp_min(1).double()) / math.log(_WIDTH_RATIO)
        )
        chunks = []
        i = int((counts_sorted == 0).sum())  # rows without a key in this shard: no chunk
        while i < len(order):
            j = int(torch.searchsorted(bucket, bucket[i], right=True))
            width = int(counts_sorted[j - 1])
            per_chunk = max(1, _CHUNK_ELEMS // (self.g * self.B * self.B * width))
            for s in range(i, j, per_chunk):
                rows = order[s : min(j, s + per_chunk)]
                valid = torch.arange(width, device=rows.device) < counts[rows, None]
                kb = torch.where(valid, loc[rows, :width], loc[rows, :1])
                m = width - int(num_full[rows].min())
                kv_row = kv_head[rows][:, None] * nk + kb
                kpos0 = idx[rows, width - m : width] * self.B
                chunks.append(_Chunk(rows, kv_row, kpos0, valid[:, width - m :], m))
            i = j
        return chunks

    def masked_scores_(self, s: torch.Tensor, c: _Chunk) -> torch.Tensor:
        """Set the disallowed entries of scores ``(c, g*B, W*B)`` to -inf, in place."""
        if c.num_masked:
            n, m = c.kpos0.shape
            kpos = (c.kpos0[:, :, None] + torch.arange(self.B, device=s.device)).reshape(
                n, 1, m * self.B
            )
            kpos = torch.where(c.valid.repeat_interleave(self.B, 1)[:, None, :], kpos, -1)
            qb = c.row % self.n
            ok = (kpos <= self.qpos[qb][:, :, None]) & (kpos >= self.qstart[qb][:, :, None])
            s[:, :, -m * self.B :].masked_fill_(~ok, -math.inf)
        return s


# ---------------------------------------------------------------------- tensor forms
def to_rows(x: torch.Tensor, num_layout_heads: int, block_size: int) -> torch.Tensor:
    """Queries ``(n*B, Hq, D)`` -> rows ``(H_layout*n, g*B, D)``."""
    t, hq, d = x.shape
    n, g = t // block_size, hq // num_layout_heads
    x = x.view(n, block_size, num_layout_heads, g, d).permute(2, 0, 3, 1, 4)
    return x.reshape(num_layout_heads * n, g * block_size, d)


def from_rows(x: torch.Tensor, num_layout_heads: int, block_size: int) -> torch.Tensor:
    """Inverse of :func:`to_rows`: ``(H_layout*n, g*B, D)`` -> ``(n*B, Hq, D)``."""
    rows, gb, d = x.shape
    n, g = rows // num_layout_heads, gb // block_size
    x = x.view(num_layout_heads, n, g, block_size, d).permute(1, 3, 0, 2, 4)
    return x.reshape(n * block_size, num_layout_heads * g, d)


def to_kv(k: torch.Tensor, v: torch.Tensor, block_size: int) -> torch.Tensor:
    """Keys and values ``(n*B, Hkv, D)`` -> one shard ``(2, Hkv*n, B*D)``."""
    t, h, d = k.shape
    kv = torch.stack([k, v]).view(2, t // block_size, block_size, h, d)
    return kv.permute(0, 3, 1, 2, 4).reshape(2, h * (t // block_size), block_size * d)


def from_kv(kv: torch.Tensor, num_kv_heads: int, block_size: int) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`to_kv`: ``(2, Hkv*n, B*D)`` -> keys, values ``(n*B, Hkv, D)``."""
    n = kv.shape[1] // num_kv_heads
    kv = kv.view(2, num_kv_heads, n, block_size, -1).permute(0, 2, 3, 1, 4)
    k, v = kv.reshape(2, n * block_size, num_kv_heads, -1).unbind(0)
    return k, v


def _gather(x: torch.Tensor, c: _Chunk, block_size: int) -> torch.Tensor:
    """Shard blocks ``(Hkv*n, B*D)`` -> ``(c, W*B, D)``: the chunk's key (or value) blocks."""
    n, w = c.kv_row.shape
    return x.index_select(0, c.kv_row.reshape(-1)).view(n, w * block_size, -1)


# ---------------------------------------------------------------------- one step
def forward_step(
    qr: torch.Tensor, kv: torch.Tensor, plan: StepPlan, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Merge this shard into the running ``out (R, g*B, D)`` and ``lse (R, g*B)``, in place.

    ``qr`` are query rows with the softmax scale folded in; ``out`` holds normalised outputs in
    the accumulation dtype (``lse.dtype``); a query with no key so far has ``lse = -inf``, out 0.
    """
    acc, b = lse.dtype, plan.B
    for c in plan.chunks:
        s = torch.bmm(qr.index_select(0, c.row), _gather(kv[0], c, b).transpose(1, 2))
        s = plan.masked_scores_(s.to(acc), c)
        m = s.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)
        p = s.sub_(m).exp_()
        denom = p.sum(-1, keepdim=True)
        o = torch.bmm(p.to(qr.dtype), _gather(kv[1], c, b)).to(acc).div_(denom.clamp_min(1e-30))
        step_lse = torch.where(denom > 0, m + denom.log(), -math.inf).squeeze(-1)
        old = lse.index_select(0, c.row)
        new = torch.logaddexp(old, step_lse)
        seen = new > -math.inf  # both -inf: nothing yet, keep zeros (and avoid -inf - -inf)
        w_old = torch.where(seen, (old - new).exp(), 0.0)[..., None]
        w_new = torch.where(seen, (step_lse - new).exp(), 0.0)[..., None]
        out[c.row] = out.index_select(0, c.row) * w_old + o * w_new
        lse[c.row] = new


def backward_step(
    qr: torch.Tensor,
    dor: torch.Tensor,
    kv: torch.Tensor,
    plan: StepPlan,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dq: torch.Tensor,
) -> torch.Tensor:
    """Gradients of this shard's part of the attention, flash-attention style.

    Args:
        qr: scaled query rows ``(R, g*B, D)``; ``dor``: output-gradient rows, same shape.
        kv: the shard ``(2, Hkv*n, B*D)``.
        lse: the *final* log-sum-exp ``(R, g*B)``, ``+inf`` for queries without keys.
        delta: ``(R, g*B, 1)``, ``sum(dout * out)`` per query.
        dq: ``(R, g*B, D)`` accumulation dtype; this shard's query gradient (w.r.t. the scaled
            queries) is added in place.

    Returns:
        ``(2, Hkv*n, B*D)`` key/value gradients of this shard, accumulation dtype.
    """
    acc, b = lse.dtype, plan.B
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    for c in plan.chunks:
        qc, doc = qr.index_select(0, c.row), dor.index_select(0, c.row)
        kc, vc = _gather(kv[0], c, b), _gather(kv[1], c, b)
        s = plan.masked_scores_(torch.bmm(qc, kc.transpose(1, 2)).to(acc), c)
        p = s.sub_(lse.index_select(0, c.row)[:, :, None]).exp_()
        flat = c.kv_row.reshape(-1)
        dv_c = torch.bmm(p.to(qr.dtype).transpose(1, 2), doc)
        dkv[1].index_add_(0, flat, dv_c.reshape(flat.numel(), -1).to(acc))
        dp = torch.bmm(doc, vc.transpose(1, 2)).to(acc)
        ds = p.mul_(dp.sub_(delta.index_select(0, c.row))).to(qr.dtype)
        dq.index_add_(0, c.row, torch.bmm(ds, kc).to(acc))
        dk_c = torch.bmm(ds.transpose(1, 2), qc)  # q was pre-scaled: no extra factor
        dkv[0].index_add_(0, flat, dk_c.reshape(flat.numel(), -1).to(acc))
    return dkv


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def pad_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Zero-pad ``(T, H, D)`` to a multiple of ``block_size`` tokens."""
    pad = -x.shape[0] % block_size
    return F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x


# ---------------------------------------------------------------------- a ring call's local state
def check_shard_inputs(q, k, v, layout: BlockLayout, placement, world_size: int) -> None:
    """Raise ``ValueError`` unless the local shards, the layout and the placement agree."""
    from ..ops.varlen import check_qkv

    check_qkv(q, k, v)
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if placement.world_size != world_size:
        raise ValueError(
            f"placement is for {placement.world_size} ranks, the process group has {world_size}"
        )
    if (layout.seq_len, layout.block_size) != (placement.seq_len, placement.block_size):
        raise ValueError(
            f"layout (T={layout.seq_len}, B={layout.block_size}) and placement "
            f"(T={placement.seq_len}, B={placement.block_size}) differ"
        )
    if q.shape[0] != placement.local_len:
        raise ValueError(
            f"q has {q.shape[0]} tokens; this placement gives every rank {placement.local_len} "
            "(use placement.shard(x, rank))"
        )
    if q.shape[1] != layout.num_q_heads or layout.num_heads % k.shape[1]:
        raise ValueError(
            f"layout (Hq={layout.num_q_heads}, {layout.num_heads} heads) does not fit "
            f"q ({q.shape[1]} heads) and k ({k.shape[1]} heads)"
        )


class ShardState:
    """What one rank keeps for a ring call: scaled query rows, its own shard, the step plans."""

    def __init__(self, q, k, v, layout: BlockLayout, placement, rank: int, sources, scale: float):
        b, hl = layout.block_size, layout.num_heads
        self.block_size, self.num_layout_heads, self.scale = b, hl, scale
        self.num_kv_heads, self.dtype = k.shape[1], q.dtype
        self.acc = accumulation_dtype(q.dtype)
        self.pad = placement.token_index(rank).to(q.device) >= placement.seq_len  # (Tl,)
        self.qr = to_rows(q * scale, hl, b)
        self.kv = to_kv(k, v, b)
        blocks = placement.blocks
        self.plans = [
            StepPlan(layout, blocks[rank], blocks[int(src)], k.shape[1], q.device)
            for src in sources
        ]

    def new_accumulators(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.zeros(self.qr.shape, dtype=self.acc, device=self.qr.device)
        lse = torch.full(self.qr.shape[:2], -math.inf, dtype=self.acc, device=self.qr.device)
        return out, lse

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Rows -> ``(Tl, Hq, D)`` in the input dtype; padded tokens are zeros."""
        o = from_rows(out, self.num_layout_heads, self.block_size).to(self.dtype)
        return o.masked_fill(self.pad[:, None, None], 0.0)

    def grad_inputs(self, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
        """``dor`` rows, ``delta (R, g*B, 1)`` and the backward's lse (+inf where no key)."""
        dout = dout.masked_fill(self.pad[:, None, None], 0.0)
        dor = to_rows(dout.to(self.dtype), self.num_layout_heads, self.block_size)
        delta = (dor.to(self.acc) * out).sum(-1, keepdim=True)
        return dor, delta, lse.masked_fill(lse == -math.inf, math.inf)

    def grads(self, dq: torch.Tensor, dkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows and shard gradients -> ``dq (Tl, Hq, D)``, ``dk``/``dv (Tl, Hkv, D)``."""
        dq = from_rows(dq.mul_(self.scale), self.num_layout_heads, self.block_size)
        dk, dv = from_kv(dkv, self.num_kv_heads, self.block_size)
        return dq.to(self.dtype), dk.to(self.dtype), dv.to(self.dtype)


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    q_blocks: torch.Tensor,
    k_blocks: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of some query blocks over the kept pairs of ``layout`` in some key blocks.

    Args:
        q: ``(nq*B, Hq, D)``: the tokens of global blocks ``q_blocks`` (int64 ``(nq,)``), in order;
            blocks past the layout's ``nb`` and tokens past ``T`` are padding.
        k, v: ``(nk*B, Hkv, D)``: the tokens of global blocks ``k_blocks`` (``(nk,)``).
        layout: the global layout (its ``cu_seqlens`` give the document starts).
        scale: softmax scale, default ``D ** -0.5``.

    Returns:
        ``out (nq*B, Hq, D)`` and ``lse (nq*B, Hq)`` in the accumulation dtype (fp64 for fp64
        input, else fp32); ``lse = -inf`` and ``out = 0`` where a query has no key among
        ``k_blocks``. Merging the results over a partition of the key blocks by log-sum-exp gives
        ``block_sparse_attention``. Not differentiable: the ring Functions own autograd.
    """
    b, hl = layout.block_size, layout.num_heads
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    plan = StepPlan(layout, q_blocks, k_blocks, k.shape[1], q.device)
    qr = to_rows(q.detach() * scale, hl, b)
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(qr.shape, dtype=acc, device=q.device)
    lse = torch.full(qr.shape[:2], -math.inf, dtype=acc, device=q.device)
    forward_step(qr, to_kv(k.detach(), v.detach(), b), plan, out, lse)
    lse_t = from_rows(lse[..., None], hl, b)[..., 0]
    return from_rows(out, hl, b), lse_t
