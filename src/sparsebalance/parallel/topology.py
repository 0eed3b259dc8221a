"""Which ranks share a machine: :class:`Topology`.

Built at start-up from the launcher's environment (torchrun's ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``
and ``LOCAL_RANK``; ``srun``'s variables are mapped to them by
:func:`sparsebalance.train.multinode.slurm_env`) or from an explicit ``--ranks-per-node``. What it
changes:

- the hybrid planner (``sab-cp``) keeps a CP unit of k <= G ranks inside one node and prices a
  ring that spans nodes at the inter-node link (``PlanConfig.ranks_per_node`` ->
  :meth:`~sparsebalance.latency.context.ContextCost.on_nodes`);
- a unit over several nodes runs the hierarchical ring with the ranks of one node as its inner
  ring (:func:`~sparsebalance.parallel.hierarchical.hierarchical_ring_attention`'s default
  ``inner_size`` is :meth:`Topology.inner_size` of the ring's ranks).

torchrun and ``srun`` (block distribution) number ranks node by node: node ``n`` holds ranks
``[n G, (n + 1) G)``; :meth:`Topology.from_launcher` checks it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

LAUNCHER_VARS = ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def launcher_placement(environ: Mapping[str, str] | None = None) -> dict[str, int | None]:
    """This process's place as its launcher reports it: ``group_rank`` (node), ``local_rank``
    and ``local_world_size`` (ranks on this node); ``None`` for a variable that is not set."""
    env = os.environ if environ is None else environ
    return {name.lower(): int(env[name]) if env.get(name, "").isdigit() else None for name in LAUNCHER_VARS}


@dataclass(frozen=True)
class Topology:
    """Ranks ``[n * ranks_per_node, (n + 1) * ranks_per_node)`` are node ``n``."""

    world_size: int
    """All ranks of the run."""
    ranks_per_node: int
    """G: ranks on each machine (every machine runs the same number)."""
    source: str = "one node"
    """Where G comes from: ``launcher`` (``LOCAL_WORLD_SIZE``), ``--ranks-per-node`` or
    ``one node`` (no launcher variables: every rank on one machine)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"--ranks-per-node ({self.ranks_per_node}) must divide the world size ({self.world_size})")

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def inner_size(self, ranks: Sequence[int]) -> int:
        """Ranks per inner ring of a ring over ``ranks`` (global ranks, in ring order): the
        length of its runs of consecutive members on one node. ``len(ranks)`` when they share one
        node (a flat ring), G for whole node-aligned nodes. Raises ``ValueError`` when the runs
        differ in length (no hierarchical ring fits: pass ``inner_size`` explicitly)."""
        if not ranks:
            raise ValueError("a ring needs at least one rank")
        runs, prev = [], None
        for r in ranks:
            node = self.node_of(r)
            if node == prev:
                runs[-1] += 1
            else:
                runs.append(1)
            prev = node
        if len(set(runs)) != 1:
            raise ValueError(
                f"ranks {list(ranks)} are spread unevenly over nodes of {self.ranks_per_node} "
                f"ranks (runs {runs}): pass inner_size"
            )
        return runs[0]

    @classmethod
    def from_env(cls, world_size: int, environ: Mapping[str, str] | None = None) -> Topology:
        """From this process's ``LOCAL_WORLD_SIZE`` alone (no check against the other ranks);
        one node holding every rank when it is absent."""
        g = launcher_placement(environ)["local_world_size"]
        return cls(world_size, g, "launcher") if g else cls(world_size, world_size)

    @classmethod
    def from_launcher(
        cls,
        world_size: int,
        reported: Sequence[Mapping[str, int | None]],
        ranks_per_node: int | None = None,
    ) -> tuple[Topology, str | None]:
        """The run's topology and a note for the user (or None).

        Args:
            world_size: ranks of the run.
            reported: every rank's :func:`launcher_placement`, indexed by global rank (empty:
                no launcher, e.g. ``--emulate-ranks`` in one process).
            ranks_per_node: ``--ranks-per-node``; wins over the launcher's figure (said in the
                note when they differ).

        Raises ``ValueError`` when the launcher's machines run different numbers of ranks or
        do not number them node by node (``srun --distribution=cyclic``).
        """
        sizes = {p.get("local_world_size") for p in reported}
        launcher = None
        if reported and None not in sizes:
            if len(sizes) != 1:
                raise ValueError(
                    f"machines run different numbers of ranks ({sorted(sizes)}): give every machine the same --nproc"
                )
            launcher = sizes.pop()
            for rank, p in enumerate(reported):
                node, local = p.get("group_rank"), p.get("local_rank")
                if node is not None and local is not None and rank != node * launcher + local:
                    raise ValueError(
                        f"rank {rank} is local rank {local} of node {node}: ranks are not "
                        "numbered node by node (with srun use --distribution=block)"
                    )
        if ranks_per_node is not None:
            note = None
            if launcher is not None and launcher != ranks_per_node:
                note = f"--ranks-per-node {ranks_per_node} overrides the launcher's {launcher} ranks per machine"
            return cls(world_size, ranks_per_node, "--ranks-per-node"), note
        if launcher is not None:
            return cls(world_size, launcher, "launcher"), None
        return cls(world_size, world_size), None

    def describe(self) -> dict:
        return {
            "world_size": self.world_size,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "source": self.source,
        }
