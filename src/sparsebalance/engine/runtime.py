"""Process-level setup: torch.distributed (gloo on CPU, NCCL on CUDA), device, seeds, and the few
collectives the trainer needs (with a single-process fallback). A collective that times out
(``--comm-timeout``) or loses its peer raises :class:`~sparsebalance.parallel.watch.CommTimeout`,
one line naming the rank, where it waited, the collective, the peer and the timeout."""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ..parallel import watch


@dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    objects: object = None
    """Every rank on gloo when the default group is NCCL, for the object collectives (the plan's
    hash, the step's records: NCCL would stage each pickle in device memory); None: the default
    group."""

    said: set[str] = field(default_factory=set, repr=False, compare=False)
    """Lines :meth:`first_time` has seen: runs stepped together on these ranks (the demo's two)
    say a shared note once."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def first_time(self, line: str) -> bool:
        """Whether ``line`` is new on this runtime (and remember it)."""
        new = line not in self.said
        self.said.add(line)
        return new

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def init(cls, device: str = "auto", timeout_s: float | None = None) -> Runtime:
        """Join the process group torchrun describes (WORLD_SIZE/RANK), or run single-process;
        ``timeout_s``: how long a collective may wait (``--comm-timeout``) before it fails."""
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but CUDA is not available")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        if world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
            watch.set_comm_timeout(timeout_s)
        objects = None
        if world > 1 and dist.get_backend() == "nccl":  # every rank, once, before any other group
            objects = dist.new_group(backend="gloo", timeout=timeout)
        if use_cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dev = torch.device("cuda", local)
        else:
            dev = torch.device("cpu")
        return cls(rank, world, dev, objects)

    def barrier(self) -> None:
        if self.distributed:
            with watch.at(collective="barrier"):
                dist.barrier()

    def all_gather_object(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        with watch.at(collective="all_gather_object"):
            dist.all_gather_object(out, obj, group=self.objects)
        return out

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank (the others pass anything, e.g. None)."""
        if not self.distributed:
            return obj
        box = [obj]
        with watch.at(collective="broadcast_object_list"):
            dist.broadcast_object_list(box, src=0, group=self.objects)
        return box[0]

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every RNG's state as tensors and plain values (a checkpoint loads it weights-only):
    numpy's legacy generator as its dict form, the key array as a list."""
    numpy = np.random.get_state(legacy=False)
    numpy = {**numpy, "state": {**numpy["state"], "key": numpy["state"]["key"].tolist()}}
    return {
        "python": random.getstate(),
        "numpy": numpy,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    key = np.asarray(numpy["state"]["key"], dtype=np.uint32)
    np.random.set_state({**numpy, "state": {**numpy["state"], "key": key}})
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
