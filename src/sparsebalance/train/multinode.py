"""More than one machine: the launcher's c10d rendezvous flags (``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``, ``--rdzv-id``) and SLURM's environment mapped to torchrun's variables."""

from __future__ import annotations

import os
from dataclasses import dataclass

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Rendezvous:
    """How this machine joins a multi-node run."""

    nnodes: int = 1
    """Machines in the run; 1 keeps ``torchrun --standalone``."""
    node_rank: int = 0
    """This machine's index in ``[0, nnodes)``; node 0 holds the run folder's lock."""
    endpoint: str | None = None
    """``HOST:PORT`` of the c10d rendezvous (usually node 0); required when ``nnodes > 1``."""
    rdzv_id: str = "sparsebalance"
    """Job id shared by every machine of one run (distinguishes concurrent runs)."""

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
                raise ValueError(f"--rdzv-endpoint must be HOST:PORT (port 1-65535), got "
                                 f"{self.endpoint!r}")  # fmt: skip
        if not self.rdzv_id:
            raise ValueError("--rdzv-id must not be empty")

    @property
    def multinode(self) -> bool:
        return self.nnodes > 1

    def torchrun_args(self, nproc: int) -> list[str]:
        """torchrun's flags for ``nproc`` processes on this machine."""
        if not self.multinode:
            return ["--standalone", f"--nproc_per_node={nproc}"]
        return [f"--nnodes={self.nnodes}", f"--node_rank={self.node_rank}",
                "--rdzv_backend=c10d", f"--rdzv_endpoint={self.endpoint}",
                f"--rdzv_id={self.rdzv_id}", f"--nproc_per_node={nproc}"]  # fmt: skip


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
            raise ValueError(f"under srun, {need} must be set (export MASTER_ADDR/MASTER_PORT "
                             f"in the batch script)")  # fmt: skip
    out = {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ["SLURM_NTASKS"],
           "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
           "GROUP_RANK": environ.get("SLURM_NODEID", "0")}  # fmt: skip
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # "4(x2)" -> "4"
    if per_node.isdigit():
        out["LOCAL_WORLD_SIZE"] = per_node
    return out


def adopt_slurm_env() -> None:
    """Apply :func:`slurm_env` to this process's environment (a no-op outside ``srun``)."""
    os.environ.update(slurm_env(dict(os.environ)))


@dataclass(frozen=True)
class Topology:
    """Which ranks share a machine: ranks ``[n * ranks_per_node, (n + 1) * ranks_per_node)`` are
    node ``n`` (torchrun and ``srun`` number ranks node by node)."""

    world_size: int
    """All ranks of the run."""
    ranks_per_node: int
    """Ranks on each machine (every machine runs the same number)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"--ranks-per-node ({self.ranks_per_node}) must divide the world "
                             f"size ({self.world_size})")  # fmt: skip

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @classmethod
    def from_env(cls, world_size: int, environ: dict[str, str] | None = None) -> Topology:
        """From the launcher's ``LOCAL_WORLD_SIZE`` (torchrun, or ``srun`` via :func:`slurm_env`);
        one node holding every rank when it is absent."""
        env = os.environ if environ is None else environ
        return cls(world_size, int(env.get("LOCAL_WORLD_SIZE", world_size)))

    def describe(self) -> dict:
        return {"world_size": self.world_size, "nodes": self.nodes,
                "ranks_per_node": self.ranks_per_node}  # fmt: skip
