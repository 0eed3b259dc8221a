"""The 2-D device mesh (data parallel x context parallel).

``dp * cp`` ranks form ``dp`` context-parallel groups of ``cp`` consecutive ranks (consecutive, so
a group sits inside a node and its ring runs on the fast links). Plans over such groups come from
the hybrid planner (``--strategy sab-cp``, ``--cp K``: :mod:`sparsebalance.batching.context`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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
    return MeshRanks(mesh.get_local_rank(DP), mesh.get_local_rank(CP), mesh.get_group(DP), mesh.get_group(CP))
