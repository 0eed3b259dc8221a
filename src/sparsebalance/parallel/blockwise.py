"""One rank's side of a ring call: its query rows, its key/value shard, one step per shard.

A ring step runs the op's own kernel (:func:`sparsebalance.ops.block_pairs_forward` /
:func:`~sparsebalance.ops.block_pairs_backward`) over the :class:`~sparsebalance.ops.BlockPairs`
between the rank's query blocks and the blocks of the shard it holds, with *global* block ids on
both sides so token positions, document starts and padding are exact; the forward merges each
step into running (output, log-sum-exp) accumulators (``merge=True``), the backward recomputes the
probabilities from the final log-sum-exp and returns the shard's key/value gradients. There is no
second attention kernel here: speeding up the op speeds up the ring.

Tensor forms (``n`` local blocks, ``g = Hq / H_layout``): query rows ``(H_layout * n, g * B, D)``
(:func:`~sparsebalance.ops.query_rows`); a key/value shard ``kv`` ``(2, Hkv * n, B * D)``: stacked
key and value blocks (:func:`~sparsebalance.ops.token_blocks`), one message;
``lse`` ``(H_layout * n, g * B)``: ``-inf`` while a query has no key yet.
"""

from __future__ import annotations

import math

import torch

from ..ops import (
    BlockLayout,
    BlockPairs,
    accumulation_dtype,
    block_pairs_backward,
    block_pairs_forward,
    blocks_to_tokens,
    query_rows,
    rows_to_tokens,
    token_blocks,
)
from ..ops.varlen import check_qkv, resolve_scale


def to_kv(k: torch.Tensor, v: torch.Tensor, block_size: int) -> torch.Tensor:
    """Keys and values ``(n*B, Hkv, D)`` -> one shard ``(2, Hkv*n, B*D)``."""
    return torch.stack([token_blocks(k, block_size), token_blocks(v, block_size)])


def forward_step(qr: torch.Tensor, kv: torch.Tensor, pairs: BlockPairs, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge this shard ``kv (2, Hkv*n, B*D)`` into the running ``out (R, g*B, D)`` and
    ``lse (R, g*B)`` (accumulation dtype), in place."""
    block_pairs_forward(qr, kv[0], kv[1], pairs, out, lse, merge=True)


def backward_step(qr, dor, kv, pairs: BlockPairs, lse, delta, dq) -> torch.Tensor:
    """Add this shard's query gradient to ``dq`` (in place); return its ``(2, Hkv*n, B*D)``
    key/value gradients in the accumulation dtype (see ``block_pairs_backward``)."""
    dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
    block_pairs_backward(qr, dor, kv[0], kv[1], pairs, lse, delta, dq, dkv[0], dkv[1])
    return dkv


def check_shard_inputs(q, k, v, layout: BlockLayout, placement, world_size: int) -> None:
    """Raise ``ValueError`` unless the local shards, the layout and the placement agree."""
    check_qkv(q, k, v)
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if placement.world_size != world_size:
        raise ValueError(f"placement is for {placement.world_size} ranks, the process group has {world_size}")
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
        self.qr = query_rows(q * scale, hl, b)
        self.kv = to_kv(k, v, b)
        blocks = placement.blocks
        self.plans = [BlockPairs(layout, blocks[rank], blocks[int(src)], k.shape[1], q.device) for src in sources]

    def new_accumulators(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.zeros(self.qr.shape, dtype=self.acc, device=self.qr.device)
        lse = torch.full(self.qr.shape[:2], -math.inf, dtype=self.acc, device=self.qr.device)
        return out, lse

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Rows -> ``(Tl, Hq, D)`` in the input dtype; padded tokens are zeros."""
        o = rows_to_tokens(out, self.num_layout_heads, self.block_size).to(self.dtype)
        return o.masked_fill(self.pad[:, None, None], 0.0)

    def grad_inputs(self, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
        """``dor`` rows, ``delta (R, g*B, 1)`` and the lse for the backward steps."""
        dout = dout.masked_fill(self.pad[:, None, None], 0.0)
        dor = query_rows(dout.to(self.dtype), self.num_layout_heads, self.block_size)
        delta = (dor.to(self.acc) * out).sum(-1, keepdim=True)
        return dor, delta, lse

    def grads(self, dq: torch.Tensor, dkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows and shard gradients -> ``dq (Tl, Hq, D)``, ``dk``/``dv (Tl, Hkv, D)``."""
        b = self.block_size
        dq = rows_to_tokens(dq.mul_(self.scale), self.num_layout_heads, b)
        dk = blocks_to_tokens(dkv[0], self.num_kv_heads, b)
        dv = blocks_to_tokens(dkv[1], self.num_kv_heads, b)
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
        ``k_blocks``. Merging the results over a partition of the key blocks with
        :func:`~sparsebalance.ops.merge_attention` gives ``block_sparse_attention``. Not
        differentiable: the ring Functions own autograd.
    """
    b, hl = layout.block_size, layout.num_heads
    scale = resolve_scale(scale, q.shape[-1])
    pairs = BlockPairs(layout, q_blocks, k_blocks, k.shape[1], q.device)
    qr = query_rows(q.detach() * scale, hl, b)
    acc = accumulation_dtype(q.dtype)
    out = torch.zeros(qr.shape, dtype=acc, device=q.device)
    lse = torch.full(qr.shape[:2], -math.inf, dtype=acc, device=q.device)
    block_pairs_forward(qr, token_blocks(k.detach(), b), token_blocks(v.detach(), b), pairs, out, lse)
    lse_t = rows_to_tokens(lse[..., None], hl, b)[..., 0]
    return rows_to_tokens(out, hl, b), lse_t
