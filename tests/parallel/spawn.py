"""Run a test body on ``world`` gloo processes (``mp.spawn``, file:// rendezvous in a tmp dir).

A worker's exception (a failed assertion included) makes ``mp.spawn`` kill the others and raise
``ProcessRaisedException`` in the test, so the test fails; a gloo timeout bounds hung peers.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, fn, world, init_file, args):
    torch.set_num_threads(1)  # several processes share 2 cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_workers(fn, world: int, tmp_path, *args) -> None:
    """Call ``fn(rank, world, *args)`` in ``world`` processes; ``fn`` must be module-level."""
    mp.spawn(_entry, args=(fn, world, str(tmp_path / "rendezvous"), args), nprocs=world, join=True)
