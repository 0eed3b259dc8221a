"""One step as a timeline of units: which rank ran what, when, and which units spanned ranks.

Two sources, one drawing:

- :func:`plan_bars`: a :class:`~sparsebalance.batching.Plan`'s predicted schedule. Every rank runs
  its units in order (:meth:`Plan.execution`); a unit of k ranks starts when the last of them is
  free (the ring couples them) and lasts its predicted ``seconds`` on each.
- :func:`record_bars`: the measured schedule of one step from ``metrics.jsonl``'s per-rank
  ``units`` entries (:meth:`sparsebalance.engine.records.MicroBatchResult.unit_json`): measured
  starts where the trainer stamped them, else each rank's micro-batches back to back, a CP unit
  starting when its last rank arrives.

:func:`draw_timeline` draws either on a matplotlib axis: ranks on the y axis, time on the x axis,
one bar per unit; a CP unit on contiguous ranks is **one bar spanning its ranks** (non-contiguous
ranks: one bar per rank linked by a line), with the time its early ranks waited for the last one
hatched in front of it; a legend beside the axis names every colour, link and hatching drawn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Bar:
    """One unit of one step on the timeline."""

    slot: int
    """The unit's position in the step's execution order."""
    ranks: tuple[int, ...]
    """``(k,)`` the ranks that ran it (one for a data-parallel micro-batch)."""
    start: float
    """Seconds after the step began when every rank of the unit was there."""
    seconds: float
    """Duration on its ranks (the slowest rank's, for a measured CP unit)."""
    arrivals: tuple[float, ...] = ()
    """``(k,)`` when each rank reached the unit (``<= start``); empty = all at ``start``."""
    sample_ids: tuple[int, ...] = ()
    ring_wait: float = 0.0
    """Largest measured wait inside the unit over its ranks (0 where not measured)."""

    @property
    def degree(self) -> int:
        return len(self.ranks)

    @property
    def end(self) -> float:
        return self.start + self.seconds

    @property
    def contiguous(self) -> bool:
        return sorted(self.ranks) == list(range(min(self.ranks), max(self.ranks) + 1))


_UNSLOTTED = 10**9  # records without slots sort after slotted units, in their own order


def _schedule(units: Iterable[tuple[int, tuple[int, ...], float, tuple, float]]) -> list[Bar]:
    """Back-to-back schedule of ``(slot, ranks, seconds, sample ids, ring wait)`` in slot order
    (every rank's own order is increasing in slot, so one pass in slot order is consistent)."""
    clock: dict[int, float] = {}
    bars = []
    for slot, ranks, secs, ids, wait in sorted(units, key=lambda u: u[0]):
        arrivals = tuple(clock.get(r, 0.0) for r in ranks)
        start = max(arrivals)
        bars.append(Bar(slot, ranks, start, secs, arrivals, ids, wait))
        for r in ranks:
            clock[r] = start + secs
    return bars


def plan_bars(plan) -> list[Bar]:
    """The predicted schedule of ``plan`` (a :class:`~sparsebalance.batching.Plan`), slot order."""
    units, _ = plan.execution()
    return _schedule((u.slot, tuple(u.ranks), u.seconds, tuple(u.sample_ids), 0.0) for u in units)


def record_bars(rank_records: Sequence[dict]) -> list[Bar]:
    """The measured schedule of one step from its per-rank ``metrics.jsonl`` records.

    Every record needs ``rank`` and ``units`` (entries with ``slot``, ``ranks``, ``seconds``,
    optional ``start_s``, ``ring_wait_s``, ``sample_ids``); records without ``units`` (runs
    before unit telemetry) fall back to ``microbatch_s`` as one-rank units in order. Without
    start stamps a CP unit lasts its last-arriving rank's seconds (the others' include their
    wait for it).
    """
    groups: dict[tuple[int, tuple[int, ...]], list[tuple[int, dict]]] = {}
    for rec in rank_records:
        r = int(rec["rank"])
        units = rec.get("units")
        if units is None:
            units = [{"ranks": [r], "seconds": s} for s in rec.get("microbatch_s", [])]
        for m, u in enumerate(units):
            slot = int(u.get("slot", -1))
            key = (slot, tuple(u.get("ranks") or (r,))) if slot >= 0 else (_UNSLOTTED + m, (r,))
            groups.setdefault(key, []).append((r, u))
    stamped = all(u.get("start_s") is not None for parts in groups.values() for _, u in parts)
    if stamped and groups:
        return sorted((_measured(k, p) for k, p in groups.items()), key=lambda b: (b.start, b.slot))
    return _schedule(
        (
            slot,
            ranks,
            min(float(u["seconds"]) for _, u in parts),
            tuple(parts[0][1].get("sample_ids", ())),
            max(float(u.get("ring_wait_s", 0.0)) for _, u in parts),
        )
        for (slot, ranks), parts in groups.items()
    )


def _measured(key: tuple[int, tuple[int, ...]], parts: list[tuple[int, dict]]) -> Bar:
    """A unit from its ranks' stamped entries: it starts when the last rank arrived and ends
    when the last rank finished."""
    slot, ranks = key
    by_rank = dict(parts)
    arrivals = tuple(float(by_rank[r]["start_s"]) for r in ranks if r in by_rank)
    start = max(arrivals)
    end = max(float(u["start_s"]) + float(u["seconds"]) for _, u in parts)
    wait = max(float(u.get("ring_wait_s", 0.0)) for _, u in parts)
    ids = tuple(parts[0][1].get("sample_ids", ()))
    return Bar(slot, ranks, start, end - start, arrivals, ids, wait)


def draw_timeline(ax, bars: Sequence[Bar], num_ranks: int, title: str = "") -> None:
    """Draw ``bars`` on a matplotlib axis (rank 0 at the top). One colour per degree k; a CP
    unit's arrival waits are hatched; each bar is labelled with its documents when wide enough.
    The legend, outside the axis on its right, names what was drawn and nothing else."""
    height = 0.8
    span = max((b.end for b in bars), default=1.0) or 1.0
    degrees, linked, waited = set(), False, 0.0
    for b in bars:
        degrees.add(b.degree)
        bar_linked, bar_waited = _draw_bar(ax, b, span, height)
        linked = linked or bar_linked
        waited = max(waited, bar_waited)
    ax.set_xlim(0, span * 1.02)
    ax.set_ylim(num_ranks - 0.5, -0.5)
    ax.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
    ax.set_xlabel("seconds into the step")
    ax.set_title(title or "units per rank", fontsize=9)
    _draw_legend(ax, degrees, linked, waited)


def _draw_bar(ax, b: Bar, span: float, height: float) -> tuple[bool, float]:
    """Draw one bar: a CP unit on neighbouring ranks as one labelled rectangle, else one
    rectangle per rank (a CP unit's linked by a line; a micro-batch labelled with its first
    documents when wider than 6 % of ``span``), and the hatched arrival waits. Returns whether it
    was drawn linked and its longest wait (seconds)."""
    color = _color(b.degree)
    lo, hi = min(b.ranks), max(b.ranks)
    linked, waited = False, 0.0
    if b.degree > 1 and b.contiguous:
        ax.add_patch(_rect(b.start, lo - height / 2, b.seconds, hi - lo + height, color))
        ax.text(
            b.start + b.seconds / 2,
            (lo + hi) / 2,
            f"k={b.degree} doc " + ",".join(map(str, b.sample_ids)),
            ha="center",
            va="center",
            fontsize=7,
        )
    else:
        for r in b.ranks:
            ax.add_patch(_rect(b.start, r - height / 2, b.seconds, height, color))
        if b.degree > 1:  # linked bars: the unit's ranks are not neighbours
            x = b.start + b.seconds / 2
            ax.plot([x, x], [lo, hi], color="k", lw=1, marker="o", ms=3)
            linked = True
        elif b.seconds > 0.06 * span and b.sample_ids:
            ax.text(
                b.start + b.seconds / 2,
                lo,
                ",".join(map(str, b.sample_ids[:4])) + ("…" if len(b.sample_ids) > 4 else ""),
                ha="center",
                va="center",
                fontsize=6,
            )
    for r, t in zip(b.ranks, b.arrivals or (), strict=False):
        if b.start - t > 1e-9:  # waited for the unit's last rank
            ax.add_patch(_rect(t, r - height / 2, b.start - t, height, "none", hatch="//"))
            waited = max(waited, b.start - t)
    return linked, waited


def _draw_legend(ax, degrees: set[int], linked: bool, waited: float) -> None:
    """The legend, outside the axis on its right: one entry per degree drawn, the linked bars and
    the arrival waits when there were any."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(
            facecolor=_color(k),
            edgecolor="k",
            lw=0.6,
            alpha=0.85,
            label="micro-batch on one rank" if k == 1 else f"CP unit over {k} ranks",
        )
        for k in sorted(degrees)
    ]
    if linked:
        handles.append(
            Line2D([], [], color="k", lw=1, marker="o", ms=3, label="one CP unit on ranks\nthat are not neighbours")
        )
    if waited:  # with its size: a wait of a few ms is drawn but too thin to see
        longest = f"{1e3 * waited:.0f} ms" if waited < 1 else f"{waited:.2f} s"
        label = f"waiting for the unit's\nlast rank (up to {longest})"
        handles.append(Patch(facecolor="none", edgecolor="0.5", hatch="//", label=label))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0, fontsize=7)


def _color(degree: int) -> str:
    """The colour of a unit of ``degree`` ranks: C0 for one rank, then one colour per k."""
    return "C0" if degree == 1 else f"C{1 + (degree - 2) % 8}"


def _rect(x, y, w, h, color, hatch=None):
    from matplotlib.patches import Rectangle

    if hatch:
        return Rectangle((x, y), w, h, facecolor="none", edgecolor="0.5", hatch=hatch, lw=0.5)
    return Rectangle((x, y), w, h, facecolor=color, edgecolor="k", lw=0.6, alpha=0.85)
