"""A context-parallel group given as a list of ranks of the default process group.

A hybrid plan forms a new CP unit (a set of ranks) for almost every step; a ``ProcessGroup`` per
unit would cost seconds (and, on NCCL, GBs) to create each step. A :class:`RankList` is a
plain tuple of global ranks: the rings talk point-to-point (:class:`~.p2p.RingComm` maps ring
positions to global ranks) on the ring groups created once per topology
(:class:`~.groups.RingGroups`, one per ring role, never the default group), or on the default
group when none is given (tests, one-off calls); the selection's all-gather runs as a ring too
(:func:`~.p2p.all_gather`). Every ring function takes either a ``ProcessGroup`` (``None``: the
default group) or a :class:`RankList` as its ``group``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from .groups import RingGroups


@dataclass(frozen=True)
class RankList:
    """Global ranks of the default group, in ring order (position j = placement rank j)."""

    ranks: tuple[int, ...]
    comm: RingGroups | None = field(default=None, compare=False)
    """The ring groups its transfers travel on (None: the default group)."""

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


def p2p_group(group: Group, role: str = "flat") -> dist.ProcessGroup | None:
    """The process group point-to-point messages of ``group`` travel on for ring ``role``
    (:data:`~.groups.ROLES`): a rank list's ring group, else ``group`` itself."""
    if isinstance(group, RankList):
        return None if group.comm is None else group.comm.group(role)
    return group


def comm_timeout(group: Group) -> float | None:
    """Seconds a ring transfer of ``group`` may wait (``--comm-timeout``), None: no limit."""
    return group.comm.timeout_s if isinstance(group, RankList) and group.comm else None
