"""Issue 26, item 4 on gloo: rings on process groups of their own (one per role, created once,
never the default group) give the same results as before; and a stalled rank turns its peer's
wait into one line 'rank N waiting in unit U, ring step S, step T' instead of a silent hang."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.ops import random_layout
from sparsebalance.parallel import (
    RankList,
    hierarchical_ring_attention,
    make_placement,
    ring_attention,
    watch,
)
from sparsebalance.parallel.groups import ROLES, RingGroups

from ..conftest import cu_from_lengths, make_qkv
from .spawn import run_workers

BLOCK = 16
LENGTHS = (50, 1, 79, 73)


def _inputs(rank, world):
    cu = cu_from_lengths(LENGTHS)
    q, k, v = make_qkv(int(cu[-1]), 4, 2, 8, seed=1)
    layout = random_layout(cu, 4, BLOCK, 0.5, seed=3)
    placement = make_placement("striped", int(cu[-1]), BLOCK, world)
    local = [placement.shard(x.detach(), rank).requires_grad_() for x in (q, k, v)]
    return local, layout, placement


def _same_results_on_ring_groups(rank, world):
    created = []
    real_new_group = dist.new_group
    groups = RingGroups.create(timeout_s=30.0)
    assert len({id(groups.group(r)) for r in ROLES}) == len(ROLES)
    assert all(groups.group(r) is not dist.group.WORLD for r in ROLES)
    dist.new_group = lambda *a, **kw: created.append(a) or real_new_group(*a, **kw)
    try:
        for run in ("flat", "hierarchical"):
            outs = []
            for ranks in (RankList(tuple(range(world))), RankList(tuple(range(world)), groups)):
                (q, k, v), layout, placement = _inputs(rank, world)
                if run == "flat":
                    out = ring_attention(ranks, q, k, v, layout, placement)
                else:
                    out = hierarchical_ring_attention(ranks, q, k, v, layout, placement, 2)
                out.sum().backward()
                outs.append([out.detach(), q.grad, k.grad, v.grad])
            for a, b in zip(*outs, strict=True):
                assert torch.equal(a, b), run
    finally:
        dist.new_group = real_new_group
    assert created == []  # no group per call (or per step): the ring groups are reused


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ring_groups_give_the_same_results_and_are_created_once(tmp_path):
    run_workers(_same_results_on_ring_groups, 4, tmp_path)


def _stall(rank, world, init_file, flag):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    groups = RingGroups.create(timeout_s=2.0)
    if rank == 1:  # stalled: never reaches the ring; leaves once rank 0 has reported
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    line = ""
    try:
        (q, k, v), layout, placement = _inputs(rank, world)
        with watch.at(step=7, unit=5):
            ring_attention(RankList((0, 1), groups), q, k, v, layout, placement)
    except watch.CommTimeout as err:
        line = str(err)
    finally:
        Path(flag).write_text(line)
    os._exit(0)  # the abandoned transfers would hold a clean shutdown


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_stalled_rank_becomes_one_line_naming_where_its_peer_waits(tmp_path):
    flag = tmp_path / "reported"
    mp.spawn(_stall, args=(2, str(tmp_path / "rdzv"), str(flag)), nprocs=2, join=True)
    line = flag.read_text()
    assert line == (  # gloo's own text ("[.../unbound_buffer.cc:81] Timed out ...") left out
        "rank 0 waiting in unit 5, ring step 0, step 7: no message from rank 1 within 2 s "
        "(--comm-timeout): it is stalled or has died"
    ), line
