"""Issue 55 (bad): a stalled pipeline stage hung the run. The pipeline's process groups were made
without the run's ``--comm-timeout``, so gloo's 30-minute default governed the activations'
sends and receives; a stage waiting for a stopped peer printed nothing. Now the wait fails after
``--comm-timeout`` seconds, as one line naming the rank, where it waited and the timeout."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.engine.pipeline import PipelineGroups
from sparsebalance.engine.stage import PipelineLayout
from sparsebalance.parallel import watch

TIMEOUT_S = 2
WAIT_S = 40  # far above the timeout, far below gloo's 30-minute default


def _stage(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=TIMEOUT_S)  # what Runtime.init does with --comm-timeout
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timeout)
    watch.set_comm_timeout(TIMEOUT_S)
    layout = PipelineLayout.of(rank, 2, 2)
    groups = PipelineGroups.create(layout, tied=True, timeout_s=TIMEOUT_S)  # what the trainer passes
    done = Path(out) / "done"
    if layout.first:  # the stalled stage: never sends its activations, stays alive
        deadline = time.monotonic() + WAIT_S + 20
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)
    x = torch.empty(4)
    t0 = time.monotonic()
    try:
        with watch.at(step=1, where="its units"):
            dist.recv(x, layout.rank(0, 0), group=groups.activations)
        line = "returned"
    except Exception as err:  # what the test looks at: its type and its text
        line = f"{type(err).__name__}: {err}"
    (Path(out) / "line").write_text(f"{time.monotonic() - t0:.1f}\n{line}")
    done.touch()
    os._exit(0)  # the abandoned transfer would hold a clean shutdown


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_stalled_stage_fails_after_comm_timeout_in_one_line(tmp_path):
    ctx = mp.start_processes(_stage, args=(str(tmp_path / "rdzv"), str(tmp_path)), nprocs=2, join=False)
    try:
        deadline = time.monotonic() + WAIT_S
        while not (tmp_path / "line").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "line").exists(), f"the waiting stage did not fail within {WAIT_S} s"
        seconds, line = (tmp_path / "line").read_text().split("\n")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    assert float(seconds) < TIMEOUT_S + 15
    assert line.startswith("CommTimeout: rank 1 waiting in its units, step 1: no message from rank 0")
    assert f"within {TIMEOUT_S} s (--comm-timeout)" in line
