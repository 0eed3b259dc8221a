"""Sparse block selection across a context-parallel group, identical to one device's.

``select_blocks`` scores *segments* (block ∩ document) from mean-pooled queries and keys. A
:class:`~.layouts.Placement` gives every rank whole blocks, so every segment lies on one rank:
each rank pools its own segments exactly as ``select_blocks`` would (same order of additions),
one ``all_gather`` of those means (``S ≈ T/B + N`` vectors per head, about ``1/B`` of the keys)
gives every rank the full pooled tensors, and the estimator and the budget rule run unchanged
(:func:`sparsebalance.ops.select.estimate_from_pooled`, public in the op). Every rank gets the
same :class:`~sparsebalance.ops.BlockLayout` as ``select_blocks`` on the whole sequence (bit for bit
on CPU; on CUDA ``index_add_`` itself is not deterministic, on one device or many).
"""

from __future__ import annotations

import torch

from ..ops.budget import Budget
from ..ops.layout import BlockLayout
from ..ops.select import BlockMassEstimate, estimate_from_pooled, pool_segments, segments
from ..ops.varlen import check_cu_seqlens, check_qkv
from .layouts import Placement
from .p2p import all_gather
from .ranks import Group, group_rank, group_size


def local_segments(placement: Placement, cu_seqlens: torch.Tensor, rank: int):
    """Segments of this rank's real tokens: (global segment ids ``(S_r,)``, segment of every
    real local token ``(n_real,)`` as an index into those ids, real-token mask ``(Tl,)``)."""
    start, _, _, _ = segments(cu_seqlens.cpu().long(), placement.seq_len, placement.block_size)
    pos = placement.token_index(rank)
    real = pos < placement.seq_len
    seg = torch.searchsorted(start, pos[real], right=True) - 1
    ids, local = torch.unique(seg, return_inverse=True)
    return ids, local, real


def estimate_block_mass_distributed(
    group: Group,
    q: torch.Tensor,
    k: torch.Tensor,
    placement: Placement,
    cu_seqlens: torch.Tensor,
    share_kv_groups: bool = False,
    scale: float | None = None,
    pack=None,
) -> BlockMassEstimate:
    """:func:`~sparsebalance.ops.estimate_block_mass` of the whole sequence, from the shards
    (``pack``: the global pack's :class:`~sparsebalance.ops.pack_index.PackIndex`, if built).

    Args:
        group: the context-parallel group (``None``: default group) or a
            :class:`~.ranks.RankList`, ``placement.world_size`` ranks.
        q: ``(Tl, Hq, D)`` and k: ``(Tl, Hkv, D)``: this rank's shards (``placement.shard``).
        placement: the token placement; its ``block_size`` is the selection's block size.
        cu_seqlens: int32 ``(N + 1,)`` of the *global* pack (0 .. T).

    Returns:
        The same :class:`BlockMassEstimate` on every rank.
    """
    check_qkv(q, k)
    check_cu_seqlens(cu_seqlens, placement.seq_len)
    world, rank = group_size(group), group_rank(group)
    if placement.world_size != world:
        raise ValueError(f"placement is for {placement.world_size} ranks, the group has {world}")
    if q.shape[0] != placement.local_len:
        raise ValueError(f"q has {q.shape[0]} tokens, the placement gives {placement.local_len}")
    hq = q.shape[1]
    _, length, _, _ = segments(cu_seqlens.cpu().long(), placement.seq_len, placement.block_size)
    per_rank = [local_segments(placement, cu_seqlens, r)[0] for r in range(world)]
    ids, local, real = local_segments(placement, cu_seqlens, rank)
    x = torch.cat([q.detach(), k.detach()], dim=1)[real.to(q.device)]
    pooled = pool_segments(x, local.to(q.device), length[ids].to(q.device))  # (S_r, Hq+Hkv, D)
    width = max(len(i) for i in per_rank)
    send = torch.zeros(width, *pooled.shape[1:], dtype=pooled.dtype, device=q.device)
    send[: len(ids)] = pooled
    parts = all_gather(group, send)
    full = torch.empty(length.numel(), *pooled.shape[1:], dtype=pooled.dtype, device=q.device)
    for r, seg_ids in enumerate(per_rank):
        full[seg_ids.to(q.device)] = parts[r][: len(seg_ids)]
    cu = cu_seqlens.to(q.device)
    return estimate_from_pooled(full[:, :hq], full[:, hq:], cu, placement.block_size, share_kv_groups, scale, pack)


def select_blocks_distributed(
    group: Group,
    q: torch.Tensor,
    k: torch.Tensor,
    placement: Placement,
    cu_seqlens: torch.Tensor,
    budget: Budget,
    share_kv_groups: bool = False,
    scale: float | None = None,
) -> BlockLayout:
    """:func:`~sparsebalance.ops.select_blocks` of the whole sequence, computed from the shards.

    Same arguments as :func:`estimate_block_mass_distributed` plus the :class:`Budget`; returns
    the global layout (``T = placement.seq_len``), identical on every rank, to pass to
    :func:`~.ring.ring_attention`.
    """
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a sparsebalance.ops.Budget, got {type(budget).__name__}")
    est = estimate_block_mass_distributed(group, q, k, placement, cu_seqlens, share_kv_groups, scale)
    return est.layout(budget)
