"""Point-to-point transfers along a ring of ranks, and the all-gather built from them.

:class:`RingComm` sends to the next position of a ring and receives from the previous one
(``batch_isend_irecv``); a :class:`~.ranks.RankList` group talks on the default group, so CP units
need no process group of their own. Time blocked in those transfers is counted process-wide
(:func:`ring_wait_seconds`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .ranks import Group, RankList, global_rank, group_rank, p2p_group


class _Pending:
    waited = 0.0
    """Seconds this process has spent blocked in ring transfers, over all rings so far."""

    def __init__(self, buf: torch.Tensor, reqs: list | None):
        self.buf, self.reqs = buf, reqs

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        for req in self.reqs or ():
            req.wait()
        _Pending.waited += time.perf_counter() - t0
        return self.buf


def ring_wait_seconds() -> float:
    """Seconds this process has spent waiting for ring transfers (a peer's shard or gradient
    not there yet) since it started: the difference over a unit is its wait inside the ring."""
    return _Pending.waited


class RingComm:
    """Point-to-point exchange along a ring of positions of ``group`` (given in ring order); a
    :class:`~.ranks.RankList` group talks on the default group."""

    def __init__(self, group: Group, ring: Sequence[int]):
        self.group = p2p_group(group)
        me = group_rank(group)
        if me not in ring:
            raise ValueError(f"rank {me} is not in the ring {list(ring)}")
        pos, self.size = list(ring).index(me), len(ring)
        self.next = global_rank(group, ring[(pos + 1) % self.size])
        self.prev = global_rank(group, ring[(pos - 1) % self.size])

    def send_recv(self, tensor: torch.Tensor, tag: int) -> _Pending:
        """Send ``tensor`` to the next rank and receive the previous rank's, asynchronously."""
        if self.size == 1:
            return _Pending(tensor, None)
        buf = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group, tag),
            dist.P2POp(dist.irecv, buf, self.prev, self.group, tag),
        ]
        return _Pending(buf, dist.batch_isend_irecv(ops))


def all_gather(group: Group, tensor: torch.Tensor, tag: int = 16) -> list[torch.Tensor]:
    """``dist.all_gather`` over ``group``: every member's ``tensor`` (same shape everywhere), in
    group order. A :class:`RankList` gathers round a ring (``P - 1`` send/receive steps)."""
    if not isinstance(group, RankList):
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return parts
    size, pos = len(group.ranks), group_rank(group)
    comm = RingComm(group, range(size))
    parts: list[torch.Tensor | None] = [None] * size
    cur = tensor.contiguous()
    parts[pos] = cur
    for s in range(1, size):  # after s hops we hold the tensor of position pos - s
        cur = comm.send_recv(cur, tag).wait()
        parts[(pos - s) % size] = cur
    return parts  # type: ignore[return-value]
