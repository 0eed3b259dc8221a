"""A rank that dies while its CP unit's ring is running makes its partners fail, never hang:
they raise within the process group's timeout (bounded here) and their processes exit; under
torchrun that failure ends the job."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.ops import Budget, select_blocks
from sparsebalance.parallel import RankList, make_placement, ring_attention

from ..conftest import cu_from_lengths, make_qkv

BLOCK = 16
PG_TIMEOUT_S = 30


def _member(rank: int, world: int, init_file: str, out_dir: str, dead: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    cu = cu_from_lengths((120,))
    q, k, v = make_qkv(120, 2, 2, 8, requires_grad=False, seed=1)
    placement = make_placement("striped", 120, BLOCK, world)
    layout = select_blocks(q, k, cu, Budget(gamma=1.0), BLOCK)
    shards = [placement.shard(x, rank) for x in (q, k, v)]
    dist.barrier()  # everyone is up
    if rank == dead:
        os._exit(3)  # dies as the ring starts: its partners are already waiting for its shard
    try:
        ring_attention(RankList(tuple(range(world))), *shards, layout, placement)
        message = "finished"
    except Exception as exc:  # any error is what the test looks for
        message = f"raised {type(exc).__name__}: {exc}"
    with open(os.path.join(out_dir, f"rank-{rank}.txt"), "w") as f:
        f.write(message)
    os._exit(1)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_rank_dying_inside_a_ring_makes_its_partners_fail_not_hang(tmp_path):
    world, dead = 3, 1
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_member, args=(r, world, str(tmp_path / "rdzv"), str(tmp_path), dead)) for r in range(world)
    ]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks {alive} hung in the ring after rank {dead} died"
    assert procs[dead].exitcode == 3
    for r in range(world):
        if r == dead:
            continue
        message = (tmp_path / f"rank-{r}.txt").read_text()
        assert message.startswith("raised"), f"rank {r}: {message}"
    assert time.monotonic() - t0 < 180
