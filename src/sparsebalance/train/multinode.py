"""More than one machine: the launcher's c10d rendezvous flags (``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``, ``--rdzv-id``), SLURM's environment mapped to torchrun's variables, and
node-local caches written by one rank per machine (:func:`resolve_on_nodes`). Which ranks share a
machine: :class:`~sparsebalance.parallel.topology.Topology`.

Trusted networks only: torchrun's c10d store has no authentication and the ranks unpickle each
other's objects (``all_gather_object``), so anyone who can reach the endpoint can join a run or
run code in it. Run multi-node jobs on a private cluster network, never an open one."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..parallel.topology import Topology, launcher_placement

__all__ = [
    "Rendezvous",
    "Topology",
    "adopt_slurm_env",
    "launcher_placement",
    "node_leaders",
    "resolve_on_nodes",
    "slurm_env",
]

T = TypeVar("T")
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Rendezvous:
    """How this machine joins a multi-node run."""

    nnodes: int = 1
    """Machines in the run; 1 keeps ``torchrun --standalone``."""
    node_rank: int = 0
    """This machine's index in ``[0, nnodes)``; node 0 holds the run folder's lock."""
    endpoint: str | None = None
    """``HOST:PORT`` of the c10d rendezvous: node 0's address and a free port there (node 0's
    launcher hosts the rendezvous store); required when ``nnodes > 1``."""
    rdzv_id: str | None = None
    """Job id shared by every machine of one run (distinguishes concurrent runs); required, and
    unique per run, when ``nnodes > 1`` (a constant default let two jobs on one endpoint join
    each other)."""

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.endpoint is None:
            raise ValueError("--rdzv-endpoint HOST:PORT is required with --nnodes > 1")
        if self.endpoint is not None:
            host, sep, port = self.endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--rdzv-endpoint must be HOST:PORT (port 1-65535), got {self.endpoint!r}")
        if self.nnodes > 1 and self.rdzv_id is None:
            raise ValueError(
                "--rdzv-id is required with --nnodes > 1: an id unique to this run, the same on "
                "every node (e.g. --rdzv-id $SLURM_JOB_ID)"
            )
        if self.rdzv_id is not None and not self.rdzv_id:
            raise ValueError("--rdzv-id must not be empty")

    @property
    def multinode(self) -> bool:
        return self.nnodes > 1

    def torchrun_args(self, nproc: int) -> list[str]:
        """torchrun's flags for ``nproc`` processes on this machine."""
        if not self.multinode:
            return ["--standalone", f"--nproc_per_node={nproc}"]
        # node 0 hosts the rendezvous store, the others never do: left to torchrun, every
        # launcher whose hostname matches the endpoint tries to host it (all of them when the
        # "nodes" share a machine), the first wins, and whichever node that is may end (its
        # workers failed, or a slow exit) while the others still poll the store
        host = "1" if self.node_rank == 0 else "0"
        return [
            f"--nnodes={self.nnodes}",
            f"--node_rank={self.node_rank}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={self.endpoint}",
            f"--rdzv_conf=is_host={host}",
            f"--rdzv_id={self.rdzv_id}",
            f"--nproc_per_node={nproc}",
        ]


def slurm_env(environ: dict[str, str]) -> dict[str, str]:
    """torchrun's variables derived from ``srun``'s (one task per rank), only when torchrun's
    are absent: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK`` from
    ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``/``SLURM_NTASKS_PER_NODE``/``SLURM_NODEID``.
    ``MASTER_ADDR``/``MASTER_PORT`` must be set by the batch script (see
    ``examples/slurm_train.sbatch``). Returns the variables to add (empty when not under SLURM
    or when torchrun already set them)."""
    if any(v in environ for v in TORCHRUN_VARS) or "SLURM_PROCID" not in environ:
        return {}
    for need in ("SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT"):
        if need not in environ:
            raise ValueError(f"under srun, {need} must be set (export MASTER_ADDR/MASTER_PORT in the batch script)")
    out = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "GROUP_RANK": environ.get("SLURM_NODEID", "0"),
    }
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "4(x2)" -> "4"
    if per_node.isdigit():
        out["LOCAL_WORLD_SIZE"] = per_node
    return out


def adopt_slurm_env() -> None:
    """Apply :func:`slurm_env` to this process's environment (a no-op outside ``srun``)."""
    os.environ.update(slurm_env(dict(os.environ)))


def node_leaders(placements: Sequence[Mapping[str, int | None]]) -> list[int]:
    """For every rank (index = global rank), the rank that writes its machine's node-local
    caches: the machine's ``LOCAL_RANK`` 0 (``GROUP_RANK`` names the machine); the rank itself
    when its launcher says neither."""
    first = {
        p["group_rank"]: r
        for r, p in enumerate(placements)
        if p.get("local_rank") == 0 and p.get("group_rank") is not None
    }
    return [first.get(p.get("group_rank"), r) for r, p in enumerate(placements)]


def resolve_on_nodes(
    resolve: Callable[[], T],
    usable: Callable[[T], bool],
    rank: int,
    leaders: Sequence[int],
    gather: Callable[[object], list],
) -> T:
    """Node-local caches written once per machine (a collective: every rank calls it).

    Rank 0 runs ``resolve`` (filling its machine's cache) while the others wait; a rank that
    cannot use rank 0's result (``usable`` false: another machine with a cache of its own) takes
    its machine's, computed by the machine's first rank alone (``leaders``: :func:`node_leaders`)
    while the machine's other ranks wait. ``gather``: all-gather of one object per rank.
    """
    first = gather(resolve() if rank == 0 else None)[0]
    needs = gather(not usable(first))
    if not any(needs):
        return first
    busy = {leaders[r] for r, need in enumerate(needs) if need}
    own = gather(resolve() if rank in busy else None)
    return own[leaders[rank]] if needs[rank] else first
