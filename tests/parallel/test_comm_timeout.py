"""Issue 45 (weak): a stalled peer is one line naming where this rank waited, the collective, the
peer and ``--comm-timeout``, on the rank that sees it; gloo's text (``[.../unbound_buffer.cc:129]
Timed out waiting 2000ms for send operation to complete``) stays the exception's cause. Before,
a collective of the runtime outside the step's positions was a raw gloo ``RuntimeError`` (a
traceback), and inside them a ``CommTimeout`` ending in gloo's source path."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.engine.runtime import Runtime
from sparsebalance.parallel import watch

TIMEOUT_S = 2


def _stalled_peer(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout)
    watch.set_comm_timeout(TIMEOUT_S)  # what Runtime.init does with --comm-timeout
    done = Path(out) / "done"
    if rank == 1:  # stalled past --comm-timeout: back only once rank 0 has reported
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    rt = Runtime(rank, world, torch.device("cpu"))
    lines = []
    for call in (
        lambda: rt.barrier(),  # outside any position: the collective alone
        lambda: _in_step(lambda: rt.all_gather_object({"plan": 1})),
    ):
        try:
            call()
            lines.append("returned")
        except Exception as err:  # what the test looks at: its type and its text
            lines.append(f"{type(err).__name__}: {err}")
    (Path(out) / "lines").write_text("\n".join(lines))
    done.touch()
    os._exit(0)  # the abandoned transfers would hold a clean shutdown


def _in_step(call) -> None:
    with watch.at(step=2, unit=None, ring_step=None, where="the plan agreement"):
        call()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_stalled_peer_is_one_line_naming_the_collective_peer_and_timeout(tmp_path):
    t0 = time.monotonic()
    mp.spawn(_stalled_peer, args=(2, str(tmp_path / "rdzv"), str(tmp_path)), nprocs=2, join=True)
    barrier, gather = (tmp_path / "lines").read_text().split("\n")
    stalled = f"no message from rank 1 within {TIMEOUT_S} s (--comm-timeout): it is stalled or has died"
    assert barrier == f"CommTimeout: rank 0 waiting in barrier: {stalled}"
    assert gather == (f"CommTimeout: rank 0 waiting in the plan agreement (all_gather_object), step 2: {stalled}")
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    "text, timeout_s, peer, says",
    [
        (
            "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
            "waiting 5000ms for recv operation to complete",
            None,
            1,
            "no message from rank 1 within 5 s (--comm-timeout): it is stalled or has died",
        ),
        (
            "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, "
            "Timeout(ms)=600000) ran for 600042 milliseconds before timing out.",
            None,
            "one of the other 3 ranks",
            "no message from one of the other 3 ranks within 600 s (--comm-timeout): it is stalled or has died",
        ),
        (
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500",
            5.0,
            2,
            "rank 2 closed its connection: it has stopped or died",
        ),
        ("[gloo/transport/tcp/pair.cc:99] Something else\nwith two lines", None, None, "Something else with two lines"),
    ],
)
def test_what_a_backend_error_means_in_one_line(text, timeout_s, peer, says):
    assert watch.failure(RuntimeError(text), timeout_s, peer) == says
