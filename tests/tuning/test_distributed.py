"""Two gloo processes each price only their own micro-batches, all-gather two floats, and derive
the same step targets and budgets as the plan path computes for the whole plan."""

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsebalance.tuning import DSTConfig, DSTTuner, decide_distributed, gather_rank_values

from .oracle import Oracle, random_plan

WORLD = 2


def _plan():
    plan = random_plan(np.random.default_rng(7), WORLD, mbs_per_rank=3)
    plan[0] = plan[0] * 2  # rank 0 has twice the work: a straggler
    return plan


def _worker(rank, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        tuner = DSTTuner(DSTConfig(anchor="mean", p=0.05))
        plan, oracle = _plan(), Oracle()
        targets, mine = decide_distributed(tuner, plan[rank], oracle)
        # every rank: the same targets as the single-process plan path, and its own decision
        reference = tuner.decide(plan, oracle)
        assert targets == reference.targets
        assert mine == reference.ranks[rank]
        assert targets.roles == ("cut", "raised")
        # both ranks hold bit-identical targets and the same gamma vector
        both = gather_rank_values([targets.post_cut_seconds, targets.anchor_seconds, mine.gamma])
        assert both[0, 0] == both[1, 0] and both[0, 1] == both[1, 1]
        np.testing.assert_array_equal(both[:, 2], reference.gammas)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_ranks_agree(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"),), nprocs=WORLD, join=True)


def test_gather_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(ValueError, match="process group"):
        gather_rank_values([1.0])
