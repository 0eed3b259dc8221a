"""A context-parallel group given as a list of ranks of the default process group.

A hybrid plan forms a new CP unit (a set of ranks) for almost every step; a ``ProcessGroup`` per
unit would cost seconds (and, on NCCL, GBs) to create each step. A :class:`RankList` is a
plain tuple of global ranks: the rings talk point-to-point on the default group
(:class:`~.p2p.RingComm` maps ring positions to global ranks), and the selection's all-gather
runs as a ring too (:func:`~.p2p.all_gather`). Every ring function takes either a ``ProcessGroup``
(``None``: the default group) or a :class:`RankList` as its ``group``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
