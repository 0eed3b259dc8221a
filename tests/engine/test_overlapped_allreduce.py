"""Issue 54, item 3: a pipeline stage's gradients are averaged over its data-parallel peers while
its last backward runs (:class:`OverlappedAllReduce`), not after the schedule. Two gloo
processes: every bucket's all-reduce is issued inside the armed backward, none in an earlier
one, in bucket order, and the result is the peers' mean bit for bit; a peer without any backward
(a pipeline without micro-batches) joins with zeros at :meth:`finish`."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from sparsebalance.engine.parallelize import OverlappedAllReduce


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def _grads(rank: int, backwards: bool) -> list[torch.Tensor]:
    """This rank's accumulated local gradients (two micro-batches), or zeros without any."""
    model = _model()
    if not backwards:
        return [torch.zeros_like(p) for p in model.parameters()]
    x = torch.full((3, 8), float(rank + 1))
    model(x).sum().backward()
    model(x * 2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _worker(rank: int, init: str, out: str, idle_rank: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    model = _model()
    reducer = OverlappedAllReduce(model.parameters(), None, 2, bucket_bytes=128)  # several buckets
    calls, state = [], {"in": False}
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        calls.append((state["in"], tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    if rank != idle_rank:
        x = torch.full((3, 8), float(rank + 1))
        model(x).sum().backward()  # an earlier micro-batch: accumulates only
        reducer.arm()
        state["in"] = True
        model(x * 2).sum().backward()
        state["in"] = False
    launched = reducer.launched_in_backward
    reducer.finish()
    dist.all_reduce = original
    result = {
        "calls": calls,
        "launched": launched,
        "buckets": [sum(p.numel() for p in b) for b in reducer.buckets],
        "grads": [p.grad.clone() for p in model.parameters()],
    }
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()
    os._exit(0)


def _run(tmp_path: Path, idle_rank: int) -> list[dict]:
    mp.spawn(_worker, args=(str(tmp_path / "rdzv"), str(tmp_path), idle_rank), nprocs=2, join=True)
    return [pickle.loads((tmp_path / f"{r}.pkl").read_bytes()) for r in range(2)]


@pytest.mark.distributed
def test_every_bucket_is_reduced_inside_the_last_backward(tmp_path):
    results = _run(tmp_path, idle_rank=-1)
    mean = [(a + b) / 2 for a, b in zip(_grads(0, True), _grads(1, True), strict=True)]
    for r in results:
        assert len(r["buckets"]) > 2
        assert r["launched"] == len(r["buckets"])  # all before finish()
        assert r["calls"] == [(True, n) for n in r["buckets"]]  # in the armed backward, in order
        for got, want in zip(r["grads"], mean, strict=True):
            assert torch.equal(got, want)


@pytest.mark.distributed
def test_a_peer_without_micro_batches_joins_with_zeros(tmp_path):
    results = _run(tmp_path, idle_rank=1)
    assert results[1]["launched"] == 0 and [c[0] for c in results[1]["calls"]] == [False] * len(results[1]["buckets"])
    mean = [(a + b) / 2 for a, b in zip(_grads(0, True), _grads(1, False), strict=True)]
    for r in results:
        for got, want in zip(r["grads"], mean, strict=True):
            assert torch.equal(got, want)
