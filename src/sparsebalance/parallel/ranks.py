"""A context-parallel group given as a list of ranks of the default process group.

A hybrid plan forms a new CP unit (a set of ranks) for almost every step; a ``ProcessGroup`` per
unit would cost seconds (and, on NCCL, GBs) to create each step. A :class:`RankList` is a
plain tuple of global ranks: the rings talk point-to-point on the default group
(:class:`~.ring.RingComm` maps ring positions to global ranks), and the selection's all-gather
runs as a ring too (:func:`all_gather`). Every ring function takes either a ``ProcessGroup``
(``None``: the default group) or a :class:`RankList` as its ``group``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankList:
    """Global ranks of the default group, in ring order (position j = placement rank j)."""

    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"a rank list needs distinct ranks, got {list(self.ranks)}")


Group = dist.ProcessGroup | RankList | None
"""What the ring functions take as ``group``."""


def group_size(group: Group) -> int:
    """Ranks in ``group``."""
    if isinstance(group, RankList):
        return len(group.ranks)
    return dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's position in ``group`` (raises ``ValueError`` if it is not a member)."""
    if isinstance(group, RankList):
        me = dist.get_rank()
        if me not in group.ranks:
            raise ValueError(f"rank {me} is not in the rank list {list(group.ranks)}")
        return group.ranks.index(me)
    return dist.get_rank(group)


def global_rank(group: Group, position: int) -> int:
    """The default-group rank at ``position`` of ``group``."""
    if isinstance(group, RankList):
        return group.ranks[position]
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, position)


def p2p_group(group: Group) -> dist.ProcessGroup | None:
    """The process group point-to-point messages of ``group`` travel on."""
    return None if isinstance(group, RankList) else group


def all_gather(group: Group, tensor: torch.Tensor, tag: int = 16) -> list[torch.Tensor]:
    """``dist.all_gather`` over ``group``: every member's ``tensor`` (same shape everywhere), in
    group order. A :class:`RankList` gathers round a ring (``P - 1`` send/receive steps)."""
    if not isinstance(group, RankList):
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return parts
    from .ring import RingComm  # ring.py imports this module

    size, pos = len(group.ranks), group_rank(group)
    comm = RingComm(group, range(size))
    parts: list[torch.Tensor | None] = [None] * size
    cur = tensor.contiguous()
    parts[pos] = cur
    for s in range(1, size):  # after s hops we hold the tensor of position pos - s
        cur = comm.send_recv(cur, tag).wait()
        parts[(pos - s) % size] = cur
    return parts  # type: ignore[return-value]
