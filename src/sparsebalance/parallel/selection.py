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

import numpy as np
import torch

from ..ops.budget import Budget
from ..ops.layout import BlockLayout
from ..ops.pack_index import PackIndex
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


def _segment_plan(pack: PackIndex, placement: Placement, rank: int) -> dict:
    """Which of the pack's segments each rank holds, from host facts (the pack's segments, the
    placement's blocks), uploaded once per pack, placement and rank: ``real`` int64 ``(n_real,)``
    this rank's real local tokens, ``local`` their segment as an index into its ``ids``,
    ``length`` those segments' token counts, ``ids`` every rank's segment ids (device), ``sizes``
    their counts (host). :func:`local_segments`, without a read of the device."""

    def build() -> dict:
        start, length, _, _ = pack._host_segments

        def held(r: int):
            pos = placement.token_index(r).numpy()
            real = np.flatnonzero(pos < placement.seq_len)
            seg = np.searchsorted(start, pos[real], side="right") - 1
            ids, local = np.unique(seg, return_inverse=True)
            return ids, local, real

        per_rank = [held(r)[0] for r in range(placement.world_size)]
        ids, local, real = held(rank)
        up = pack.upload
        return {
            "real": up(real),
            "local": up(local),
            "length": up(length[ids]),
            "ids": [up(i) for i in per_rank],
            "sizes": [int(i.size) for i in per_rank],
        }

    # keyed by the placement object (the entry keeps it alive, so its id stays its own): a key
    # made of its block table would read that table in every layer
    return pack.memo(("cp segments", id(placement), rank), lambda: {**build(), "placement": placement})


def estimate_block_mass_distributed(
    group: Group,
    q: torch.Tensor,
    k: torch.Tensor,
    placement: Placement,
    cu_seqlens: torch.Tensor,
    share_kv_groups: bool = False,
    scale: float | None = None,
    pack: PackIndex | None = None,
) -> BlockMassEstimate:
    """:func:`~sparsebalance.ops.estimate_block_mass` of the whole sequence, from the shards
    (``pack``: the global pack's :class:`~sparsebalance.ops.pack_index.PackIndex`, if built:
    then nothing is read back, and which segments each rank holds is uploaded once per pack).

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
    check_cu_seqlens(cu_seqlens, placement.seq_len, values=None if pack is None else False)  # pack: checked
    world, rank = group_size(group), group_rank(group)
    if placement.world_size != world:
        raise ValueError(f"placement is for {placement.world_size} ranks, the group has {world}")
    if q.shape[0] != placement.local_len:
        raise ValueError(f"q has {q.shape[0]} tokens, the placement gives {placement.local_len}")
    hq = q.shape[1]
    if pack is None:  # the pack's shape from its offsets (one read where they live on a device)
        pack = PackIndex.build(cu_seqlens, placement.block_size)
    pack = pack.to(q.device)
    plan = _segment_plan(pack, placement, rank)
    x = torch.cat([q.detach(), k.detach()], dim=1).index_select(0, plan["real"])
    pooled = pool_segments(x, plan["local"], plan["length"])  # (S_r, Hq+Hkv, D)
    width = max(plan["sizes"])
    send = torch.zeros(width, *pooled.shape[1:], dtype=pooled.dtype, device=q.device)
    send[: pooled.shape[0]] = pooled
    parts = all_gather(group, send)
    full = torch.empty(pack.num_segments, *pooled.shape[1:], dtype=pooled.dtype, device=q.device)
    for r, (seg_ids, size) in enumerate(zip(plan["ids"], plan["sizes"], strict=True)):
        full[seg_ids] = parts[r][:size]
    return estimate_from_pooled(
        full[:, :hq], full[:, hq:], pack.cu_seqlens, placement.block_size, share_kv_groups, scale, pack
    )


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
