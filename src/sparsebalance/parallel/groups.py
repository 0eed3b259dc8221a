"""The process groups ring traffic travels on: created once per topology, never per step.

CP units change every step, so a group per unit is out of the question (``new_group`` is a
collective of the whole world and an NCCL communicator costs seconds and memory). Instead every
rank creates, once and in the same order, one group per ring *role* spanning all ranks:

- ``flat``: flat rings and the selection's all-gather ring (one after the other in program order);
- ``inner`` / ``outer``: the two levels of the hierarchical ring, on different groups so that
  NCCL runs them on different communicators and streams (on one communicator the slow
  cross-node transfer and the in-node transfers it should overlap would queue behind each other).

None of them is the default group, so ring messages never share a communicator with DDP's or
FSDP2's collectives. Matching then cannot depend on tags (NCCL ignores them): on each group, the
sends and receives between two ranks are issued by both in the same program order, whatever the
timing (every rank of a unit runs the same layers, ring steps and roles in the same sequence).

NCCL rule (``torch.distributed.batch_isend_irecv``): if the first operation on a group is a
batched P2P call, all ranks of the group must take part. Each group is therefore used once right
away by every rank (a one-element all-reduce), after which units of a few ranks may talk alone.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import watch

ROLES = ("flat", "inner", "outer")


@dataclass(frozen=True)
class RingGroups:
    """One process group per ring role over all ranks (group rank = global rank)."""

    groups: dict[str, dist.ProcessGroup] = field(compare=False)
    timeout_s: float | None = None
    """Seconds a ring transfer may wait before the rank reports where it waits
    (``--comm-timeout``); None: no limit beyond the process group's."""

    @classmethod
    def create(cls, timeout_s: float | None = None, device: torch.device | str = "cpu") -> RingGroups:
        """Create the groups (a collective: every rank calls it, once per topology)."""
        if not dist.is_initialized():
            raise ValueError("ring groups need an initialised process group (torchrun / --nproc)")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"--comm-timeout must be > 0 seconds, got {timeout_s}")
        ranks = list(range(dist.get_world_size()))
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        groups = {}
        with watch.at(where="the ring groups' set-up"):  # a stalled peer: one line, not gloo's
            for role in ROLES:
                group = dist.new_group(ranks, timeout=timeout)
                # The first call on a group involves all its ranks (batch_isend_irecv's NCCL rule).
                dist.all_reduce(torch.zeros(1, device=device), group=group)
                groups[role] = group
        return cls(groups, timeout_s)

    def group(self, role: str) -> dist.ProcessGroup:
        if role not in self.groups:
            raise ValueError(f"ring role must be one of {ROLES}, got {role!r}")
        return self.groups[role]
