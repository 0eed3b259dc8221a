"""Measured point-to-point link speed (gloo), for the cost of context-parallel rings on this host.

:func:`measure_p2p` spawns two gloo processes on this machine and times ``send`` / ``recv``
ping-pongs of float32 buffers: a fit ``t(bytes) = latency + bytes / bandwidth`` over the sizes
(least squares on the one-way times) gives :class:`~sparsebalance.latency.context.Links` with the
same figure inside and across "nodes" (one host). ``sparsebalance profile --measure-links``
stores it in the profile's ``meta["links"]`` (an optional key: profiles without it fall back to
the analytic figures of ``--accelerator``);
:func:`~sparsebalance.latency.context.links_from_profile` reads it back.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .context import Links

DEFAULT_SIZES = (1 << 14, 1 << 18, 1 << 21, 1 << 23)  # bytes: 16 KiB .. 8 MiB


def _worker(rank: int, init_file: str, sizes: tuple[int, ...], repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        times = []
        for size in sizes:
            buf = torch.zeros(max(1, size // 4), dtype=torch.float32)
            for _ in range(2):  # warm up the connection at this size
                _pingpong(rank, buf)
            t0 = time.perf_counter()
            for _ in range(repeats):
                _pingpong(rank, buf)
            times.append((time.perf_counter() - t0) / (2 * repeats))  # one way
        if rank == 0:
            np.save(out, np.asarray(times))
    finally:
        dist.destroy_process_group()


def _pingpong(rank: int, buf: torch.Tensor) -> None:
    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def measure_p2p(sizes: tuple[int, ...] = DEFAULT_SIZES, repeats: int = 5) -> Links:
    """Links of this host measured with two gloo processes (seconds: a few).

    Args:
        sizes: message sizes in bytes (>= 2 distinct values, each >= 4).
        repeats: ping-pongs per size (>= 1).
    """
    if len(set(sizes)) < 2 or min(sizes) < 4:
        raise ValueError("measure_p2p: sizes needs >= 2 distinct values of >= 4 bytes")
    if repeats < 1:
        raise ValueError(f"measure_p2p: repeats must be >= 1, got {repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.npy")
        mp.spawn(_worker, args=(os.path.join(tmp, "rdv"), tuple(sizes), repeats, out), nprocs=2, join=True)
        times = np.load(out)
    x = np.asarray([4 * max(1, s // 4) for s in sizes], dtype=np.float64)
    slope, intercept = np.polyfit(x, times, 1)
    bandwidth = 1.0 / slope if slope > 0 else float(x.max() / times.max())
    bandwidth = float(bandwidth)
    return Links(bandwidth, bandwidth, 1 << 20, latency_s=max(float(intercept), 0.0), source="measured gloo")
