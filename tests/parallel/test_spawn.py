"""The spawn harness itself: a worker's failed assertion fails the test (no silent pass).

Kept in a module that imports only torch, so its two processes start quickly."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.multiprocessing import ProcessRaisedException

from .spawn import run_workers


def _fails_on_rank_1(rank, world):
    dist.barrier()
    assert rank == 0, f"rank {rank} of {world} fails on purpose"


@pytest.mark.distributed
def test_failed_worker_assertion_fails_the_test(tmp_path):
    with pytest.raises(ProcessRaisedException, match="fails on purpose"):
        run_workers(_fails_on_rank_1, 2, tmp_path)
