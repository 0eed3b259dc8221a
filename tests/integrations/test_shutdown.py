"""``sparsebalance.shutdown()``: frees the caller's unreachable cycles, then destroys the process
group; a no-op without one (a one-process run of an example)."""

from __future__ import annotations

import gc
import socket
import weakref

import torch.distributed as dist

import sparsebalance


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_a_group_it_only_collects():
    assert not dist.is_initialized()
    gc.disable()  # only shutdown may collect the cycle
    try:
        ref = weakref.ref(_Cycle())
        assert ref() is not None
        sparsebalance.shutdown()
        assert ref() is None
    finally:
        gc.enable()
    assert not dist.is_initialized()


def test_it_destroys_the_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        sparsebalance.shutdown()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
