"""DST across ranks: every rank derives the same step targets from one small all-gather.

Two ways to get every rank's predicted times, giving identical decisions:

- from the plan: every rank holds the whole plan (the planner is deterministic), so
  :meth:`DSTTuner.decide <sparsebalance.tuning.dst.DSTTuner.decide>` needs no communication;
- from the ranks: each rank prices only its own micro-batches and :func:`decide_distributed`
  exchanges two floats per rank (time at ``gamma0`` and at ``gamma_min``) with one
  ``all_gather`` (gloo or NCCL), then computes the shared targets and its own budget.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..workload import CostModel, MicroBatch
from .dst import DSTTuner
from .records import RankDecision, StepTargets


def gather_rank_values(
    local: Sequence[float], group: dist.ProcessGroup | None = None
) -> np.ndarray:
    """All-gather a short float vector from every rank: ``(K,)`` local -> ``(R, K)`` float64.

    Uses one ``all_gather`` of a float64 tensor on the backend's device (CUDA for NCCL, CPU
    otherwise); every rank gets the same array, bit for bit.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("gather_rank_values needs an initialized torch.distributed process group")
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    mine = torch.as_tensor(np.asarray(local, dtype=np.float64), device=device).reshape(-1)
    world = dist.get_world_size(group)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=group)
    return torch.stack(out).cpu().numpy()


def decide_distributed(
    tuner: DSTTuner,
    microbatches: Sequence[MicroBatch],
    cost_model: CostModel,
    group: dist.ProcessGroup | None = None,
) -> tuple[StepTargets, RankDecision]:
    """This rank's DST decision from its own micro-batches and one all-gather.

    Returns the shared :class:`StepTargets` (identical on every rank) and this rank's
    :class:`RankDecision` (the same one :meth:`DSTTuner.decide` computes from the full plan).
    """
    times = gather_rank_values(tuner.rank_times(microbatches, cost_model), group)
    targets = tuner.step_targets(times[:, 0], times[:, 1])
    rank = dist.get_rank(group)
    return targets, tuner.decide_rank(rank, microbatches, cost_model, targets)
