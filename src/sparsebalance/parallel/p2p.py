"""Point-to-point transfers along a ring of ranks, and the all-gather built from them.

:class:`RingComm` sends to the next position of a ring and receives from the previous one
(``batch_isend_irecv``); a :class:`~.ranks.RankList` group talks on its ring groups
(:class:`~.groups.RingGroups`, one per role) or, without them, on the default group.

Time blocked in those transfers is device time (:mod:`sparsebalance.clock`): a mark before and
after every wait. On gloo the wait blocks the host, so the marks are host stamps around it; on
NCCL ``Work.wait()`` returns at once, having made the compute stream wait, so the marks are
events on that stream and their difference is how long the stream stood still. The pairs are
kept in :data:`RING_WAITS` and resolved after the step's synchronize.

A wait that exceeds the ring groups' timeout (``--comm-timeout``) raises
:class:`~.watch.CommTimeout` naming the rank, unit, ring step and training step (gloo); on CUDA
the waits are handed to the hang watch (:class:`~.watch.DeviceWaits`).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..clock import Mark, current_clock
from . import watch
from .ranks import Group, RankList, comm_timeout, global_rank, group_rank, p2p_group


class WaitLog:
    """The (before, after) marks of every ring wait since the last :meth:`fold`."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Mark, Mark]] = []
        self.folded = 0.0
        self.device_waits: watch.DeviceWaits | None = None
        """Set on CUDA by the trainer: every wait's event goes to the hang watch."""

    def __len__(self) -> int:
        return len(self.pairs)

    def seconds(self, start: int = 0, end: int | None = None) -> float:
        """Seconds waited in ``pairs[start:end]`` (event marks: after the step's synchronize)."""
        clock = current_clock()
        return sum(clock.seconds(a, b) for a, b in self.pairs[start:end])

    def fold(self) -> None:
        """Add every pair to the running total and forget them (the executor calls it once a
        step's times are read, so the list does not grow with the run)."""
        self.folded += self.seconds()
        self.pairs.clear()


RING_WAITS = WaitLog()


class _Pending:
    def __init__(
        self,
        buf: torch.Tensor,
        reqs: list | None,
        timeout_s: float | None = None,
        peer: int | None = None,
    ):
        self.buf, self.reqs, self.timeout_s, self.peer = buf, reqs, timeout_s, peer

    def wait(self) -> torch.Tensor:
        if not self.reqs:
            return self.buf
        clock = current_clock()
        start = clock.mark()
        for req in self.reqs:
            if self.timeout_s is None or clock.events:  # NCCL: a device wait, watched apart
                req.wait()
                continue
            try:
                req.wait(datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as err:  # gloo's text is the cause; the line says what it means
                reason = watch.failure(err, self.timeout_s, self.peer)
                raise watch.CommTimeout(f"{watch.waiting_line(dist.get_rank())}: {reason}") from err
        end = clock.mark()
        RING_WAITS.pairs.append((start, end))
        if RING_WAITS.device_waits is not None and end.event is not None:
            RING_WAITS.device_waits.record(end.event)
        return self.buf


def ring_wait_seconds() -> float:
    """Seconds this process has spent waiting for ring transfers (a peer's shard or gradient
    not there yet) since it started: the difference over a unit is its wait inside the ring.
    On CUDA, read it after a synchronize (it resolves events)."""
    return RING_WAITS.folded + RING_WAITS.seconds()


class RingComm:
    """Point-to-point exchange along a ring of positions of ``group`` (given in ring order), on
    the process group of ring ``role`` (:func:`~.ranks.p2p_group`)."""

    def __init__(self, group: Group, ring: Sequence[int], role: str = "flat"):
        self.group = p2p_group(group, role)
        self.timeout_s = comm_timeout(group)
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
        # The same two operations in the same order on every rank: matched by order per group
        # (NCCL ignores the tag), see groups.py.
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group, tag),
            dist.P2POp(dist.irecv, buf, self.prev, self.group, tag),
        ]
        return _Pending(buf, dist.batch_isend_irecv(ops), self.timeout_s, self.prev)


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
