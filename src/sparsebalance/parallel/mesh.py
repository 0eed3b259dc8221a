"""The 2-D device mesh (data parallel x context parallel) and the planner hook.

``dp * cp`` ranks form ``dp`` context-parallel groups of ``cp`` consecutive ranks (consecutive, so
a group sits inside a node and its ring runs on the fast links). For the planner (SAB) a group is
*one* data-parallel rank with ``cp`` times the token capacity and ``cp`` times the speed: documents
up to ``cp * C`` tokens stay whole (no ``--overlong split``), and each micro-batch runs as ring
attention over the group. :func:`plan_context_parallel` plans on that view with the planner's own
public API; :class:`ContextParallelCost` is the cost model it sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..batching import Plan, PlanConfig, plan_batch
from ..workload import CostModel, Sample

DP, CP = "dp", "cp"


def build_mesh(dp: int, cp: int, device_type: str = "cpu") -> DeviceMesh:
    """A ``(dp, cp)`` :class:`DeviceMesh` named ``("dp", "cp")`` over the default process group.

    Rank ``r`` is data-parallel rank ``r // cp`` and context-parallel rank ``r % cp``. Gradients
    are reduced over ``mesh.get_group("dp")`` *and* ``"cp"`` (every rank of a group holds a slice of
    the same documents); ring attention runs on ``mesh.get_group("cp")``.
    """
    for name, value in (("dp", dp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"--dp ({dp}) x --cp ({cp}) must equal the world size ({world})")
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=(DP, CP))


@dataclass(frozen=True)
class MeshRanks:
    """This process's coordinates and groups in a ``(dp, cp)`` mesh."""

    dp_rank: int
    """Which context-parallel group (= planner rank) this process belongs to."""
    cp_rank: int
    """Position inside the group: the ``rank`` of ``Placement.shard``."""
    dp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup


def mesh_ranks(mesh: DeviceMesh) -> MeshRanks:
    return MeshRanks(
        mesh.get_local_rank(DP), mesh.get_local_rank(CP), mesh.get_group(DP), mesh.get_group(CP)
    )


class ContextParallelCost:
    """A :class:`~sparsebalance.workload.CostModel` for a ``cp``-rank group running ring attention.

    Document seconds are the base model's times ``ring_factor / cp``; the fixed micro-batch
    overhead is unchanged (every rank pays it in parallel). ``ring_factor >= 1`` is the ring's time
    over perfect balance, ``imbalance(ring_work(layout, placement))["ring"]`` (about 1.0-1.3 for
    striped; see ``sparsebalance ring-balance``); transfers are assumed hidden behind compute.
    """

    def __init__(self, base: CostModel, cp: int, ring_factor: float = 1.0):
        if cp <= 0:
            raise ValueError(f"--cp must be >= 1, got {cp}")
        if ring_factor < 1.0:
            raise ValueError(f"ring_factor must be >= 1, got {ring_factor}")
        self.base, self.cp, self.factor = base, cp, ring_factor / cp
        self.num_layers = base.num_layers

    def microbatch_overhead(self) -> float:
        return float(self.base.microbatch_overhead())

    def predict(self, lengths: Sequence[int], densities) -> float:
        ovh = self.microbatch_overhead()
        return ovh + (float(self.base.predict(lengths, densities)) - ovh) * self.factor

    def predict_many(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        ovh = self.microbatch_overhead()
        return ovh + (np.asarray(self.base.predict_many(lengths, densities)) - ovh) * self.factor

    def doc_seconds(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        return np.asarray(self.base.doc_seconds(lengths, densities)) * self.factor

    def layer_attention_seconds(self, lengths: np.ndarray, densities: np.ndarray) -> np.ndarray:
        return np.asarray(self.base.layer_attention_seconds(lengths, densities)) * self.factor

    def layer_other_seconds(self, num_tokens: int) -> float:
        return float(self.base.layer_other_seconds(num_tokens)) * self.factor


def min_context_parallel(max_tokens: int, capacity: int) -> int:
    """Smallest group size ``cp`` (a power of two) with ``cp * capacity >= max_tokens``."""
    if capacity <= 0 or max_tokens <= 0:
        raise ValueError("max_tokens and capacity must be positive")
    cp = 1
    while cp * capacity < max_tokens:
        cp *= 2
    return cp


def plan_context_parallel(
    samples: Sequence[Sample],
    cost_model: CostModel,
    config: PlanConfig,
    cp: int,
    ring_factor: float = 1.0,
    **kwargs,
) -> Plan:
    """Plan a global batch for a ``(dp, cp)`` mesh: ``plan.ranks[d]`` is group ``d``'s work.

    Args:
        samples: the global batch.
        cost_model: the *per-device* cost model.
        config: ``world_size`` = ``dp`` (number of groups) and the per-device ``capacity`` C (or
            ``micro_batches``); the group plans with capacity ``cp * C``, so documents up to
            ``cp * C`` tokens are not split.
        cp: ranks per context-parallel group.
        ring_factor: see :class:`ContextParallelCost`.
        **kwargs: ``densities=`` or ``estimator=``, passed to :func:`plan_batch`.
    """
    if config.capacity is not None:
        config = replace(config, capacity=config.capacity * cp)
    return plan_batch(samples, ContextParallelCost(cost_model, cp, ring_factor), config, **kwargs)
