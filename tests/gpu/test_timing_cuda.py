"""gpu tier (issue 26, item 3): CUDA-event times agree with a synchronized wall clock, and the
DDP comm hook's "gradients ready" is when the device computed them, not when the host enqueued
the bucket (a one-rank NCCL group: this machine has one GPU)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from sparsebalance.clock import Clock
from sparsebalance.engine.parallelize import ReadyClock

pytestmark = pytest.mark.gpu


def _matmuls(n: int, a: torch.Tensor) -> None:
    for _ in range(n):
        a = torch.tanh(a @ a)


@pytest.mark.parametrize("target_s", [0.05, 0.2])
def test_event_seconds_within_5_percent_of_a_synchronized_wall_clock(target_s):
    clock = Clock("cuda")
    a = torch.randn(4096, 4096, device="cuda") / 64
    _matmuls(3, a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _matmuls(10, a)
    torch.cuda.synchronize()
    n = max(10, int(10 * target_s / (time.perf_counter() - t0)))  # workload of >= target_s
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start = clock.mark()
    _matmuls(n, a)
    end = clock.mark()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    clock.synchronize()
    assert wall >= 0.9 * target_s
    assert abs(clock.seconds(start, end) - wall) / wall < 0.05


def test_comm_hook_ready_is_device_time_at_the_end_of_the_backward(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]).cuda()
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
        clock = Clock("cuda")
        ready = ReadyClock(clock)
        ddp.register_comm_hook(ready, ReadyClock.hook)
        x = torch.randn(16384, 4096, device="cuda")
        ddp(x).square().mean().backward()  # warm-up
        torch.cuda.synchronize()
        start = clock.mark()
        ddp(x).square().mean().backward()
        done = clock.mark()
        clock.synchronize()
        assert ready.last is not None and ready.last.event is not None
        backward_end = clock.seconds(start, done)
        # the first layer's gradients (the last bucket) exist only at the backward's end
        assert clock.seconds(start, ready.last) > 0.8 * backward_end
    finally:
        dist.destroy_process_group()
