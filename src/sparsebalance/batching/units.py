"""``Unit``: one entry of a hybrid data x context parallel plan, and the rules a plan must keep.

A unit is a micro-batch executed by a group of ranks. With one rank it is today's data-parallel
micro-batch (``placement="whole"``, ``ring="none"``). With k > 1 ranks (a *CP unit*) it holds one
document (or one ``--overlong split`` chunk of it) that every rank of the unit shards with the
``striped`` placement (``sparsebalance.parallel.make_placement("striped", length, block_size, k)``;
the j-th entry of ``ranks`` is placement rank j) and runs through the block-sparse ring
(``ring="flat"``: ``ring_attention``; ``ring="hierarchical"``: ``hierarchical_ring_attention`` with
``inner_size`` consecutive ranks of ``ranks`` per inner ring).

How a trainer executes a plan (the contract of ``../shared/DESIGN.md``, "Long documents"):

1. every rank runs ``plan.rank_units[rank]`` in order (indices into ``plan.units``);
2. ``slot`` is a unit's position in one global order, and every rank's units are in increasing
   ``slot``: the j-th collective any set of ranks runs together is the same unit on all of them, so
   the ring P2P of a unit cannot deadlock (checked by :func:`check_units`);
3. a CP unit's tokens are the document's ``[offset, offset + length)`` in the global token order;
   labels are shifted in that order before sharding and positions stay global;
4. a unit's ranks share one attention budget (one layout per document, DST treats the unit as one
   worker whose time is its slowest rank).

``seconds`` is the predicted forward + backward time of the unit on each of its ranks (the ring
couples them: they finish together); ``comm_seconds`` its exposed communication per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PLACEMENT_WHOLE = "whole"
PLACEMENT_STRIPED = "striped"


@dataclass(frozen=True)
class Unit:
    """A micro-batch on ``len(ranks)`` ranks (see the module docstring)."""

    slot: int
    """Position in the plan's global execution order."""
    ranks: tuple[int, ...]
    """The unit's ranks in ring order (contiguous, in-node first)."""
    placement: str
    """``whole`` (one rank holds every token) or ``striped`` (round-robin blocks over ``ranks``)."""
    ring: str
    """``none`` (one rank), ``flat`` or ``hierarchical``."""
    inner_size: int
    """Ranks per inner ring (``hierarchical``); ``len(ranks)`` for ``flat``, 1 for ``none``."""
    sample_ids: tuple[int, ...]
    offsets: tuple[int, ...]
    """First token of each entry inside its sample (non-zero for later ``--overlong`` chunks)."""
    lengths: tuple[int, ...]
    densities: tuple[float, ...]
    """Estimated density of each document at gamma0."""
    seconds: float
    """Predicted seconds of the unit on each of its ranks."""
    comm_seconds: float = 0.0
    """Predicted exposed communication (ring transfers + selection all-gather) per rank."""

    @property
    def degree(self) -> int:
        """k, the CP degree."""
        return len(self.ranks)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def canonical(self) -> list:
        """What :meth:`Plan.hash` covers: slot, ranks, placement, ring and documents."""
        docs = [[i, o, n] for i, o, n in zip(self.sample_ids, self.offsets, self.lengths, strict=True)]
        return [self.slot, list(self.ranks), self.placement, self.ring, self.inner_size, docs]

    def to_dict(self) -> dict:
        return {
            "slot": self.slot,
            "ranks": list(self.ranks),
            "placement": self.placement,
            "ring": self.ring,
            "inner_size": self.inner_size,
            "documents": [
                {"id": i, "offset": o, "length": n, "density": d}
                for i, o, n, d in zip(self.sample_ids, self.offsets, self.lengths, self.densities, strict=True)
            ],
            "seconds": self.seconds,
            "comm_seconds": self.comm_seconds,
        }


def check_units(
    units: Sequence[Unit],
    rank_units: Sequence[Sequence[int]],
    sample_lengths: dict[int, int],
    capacity: int | None = None,
    skipped: Sequence[int] = (),
    truncated: dict[int, int] | None = None,
) -> None:
    """Raise ``AssertionError`` unless the plan keeps every rule of the module docstring.

    Args:
        units / rank_units: ``plan.units`` and ``plan.rank_units``.
        sample_lengths: ``sample id -> tokens`` of the global batch.
        capacity: C; a rank may hold at most C tokens of a unit (``ceil(tokens / k)``).
        skipped: ids the plan skipped (``--overlong skip``); truncated: ``id -> kept tokens``.
    """
    num_ranks = len(rank_units)
    seen: dict[int, list[tuple[int, int]]] = {}
    members: dict[int, list[int]] = {u: [] for u in range(len(units))}
    for r, order in enumerate(rank_units):
        slots = [units[u].slot for u in order]
        assert slots == sorted(slots) and len(set(slots)) == len(slots), f"rank {r}: slot order"
        for u in order:
            members[u].append(r)
    for u, unit in enumerate(units):
        assert sorted(members[u]) == sorted(unit.ranks), f"unit {u}: ranks disagree with orders"
        assert len(set(unit.ranks)) == len(unit.ranks) and unit.ranks, f"unit {u}: bad ranks"
        assert all(0 <= r < num_ranks for r in unit.ranks), f"unit {u}: rank out of range"
        k = unit.degree
        if k == 1:
            assert (unit.placement, unit.ring) == (PLACEMENT_WHOLE, "none"), f"unit {u}"
        else:
            assert unit.placement == PLACEMENT_STRIPED and unit.ring in ("flat", "hierarchical")
            assert k % unit.inner_size == 0, f"unit {u}: inner size does not divide k"
        if capacity is not None:
            assert -(-unit.num_tokens // k) <= capacity, f"unit {u}: over capacity on a rank"
        for i, o, n in zip(unit.sample_ids, unit.offsets, unit.lengths, strict=True):
            assert n > 0, f"unit {u}: empty document entry"
            seen.setdefault(i, []).append((o, n))
    truncated = truncated or {}
    for i, total in sample_lengths.items():
        if i in skipped:
            assert i not in seen, f"sample {i} was skipped but is planned"
            continue
        spans = sorted(seen.get(i, []))
        want = truncated.get(i, total)
        pos = 0
        for o, n in spans:
            assert o == pos, f"sample {i}: tokens {pos}..{o} missing or assigned twice"
            pos += n
        assert pos == want, f"sample {i}: {pos} of {want} tokens assigned"
    assert set(seen) <= set(sample_lengths), "a unit holds an unknown sample id"
