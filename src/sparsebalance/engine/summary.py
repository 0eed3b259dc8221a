"""What a step's records say over all ranks, computed once for every front end: the balance
(mean / max rank compute, bubble, density, tokens), each rank's derived bubble, and the flat
telemetry the trainers' loggers get (``sparsebalance/<name>`` keys holding numbers; the plan hash
rides along as a string for tests and files). ``sparsebalance train``'s
:class:`~.records.StepSummary` and the integrations' telemetry are built from the same
:class:`Balance`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .records import RankRecord

PREFIX = "sparsebalance/"


@dataclass(frozen=True)
class Balance:
    """The step's rank times over all ranks (``records`` in rank order)."""

    max_compute_s: float
    mean_compute_s: float
    efficiency: float
    """mean / max rank compute (1.0 = balanced)."""
    imbalance: float
    """max / mean."""
    bubble_fraction: float
    """``1 - efficiency``: the share of the step the average rank waits."""
    density: float
    """Mean of the ranks' realized densities."""
    tokens: int

    @classmethod
    def of(cls, records: list[RankRecord]) -> Balance:
        computes = np.array([r.compute_s for r in records], dtype=np.float64)
        peak = max(float(computes.max()), 1e-12)
        mean = float(computes.mean())
        return cls(
            float(computes.max()),
            mean,
            mean / peak,
            peak / max(mean, 1e-12),
            1.0 - mean / peak,
            float(np.mean([r.density for r in records])),
            int(sum(r.tokens for r in records)),
        )


def derive_bubbles(records: list[RankRecord]) -> None:
    """Each rank's wait for the slowest, from compute times alone (``derived_bubble_s``)."""
    peak = max(r.compute_s for r in records)
    for rec in records:
        rec.derived_bubble_s = float(peak - rec.compute_s)


def step_telemetry(work, records: list[RankRecord], measured: bool) -> dict:
    """Telemetry of one finished step of a trainer integration.

    Args:
        work: the step (``step``, ``tuned`` plan and DST decision, ``target_tokens``).
        records: every rank's :class:`RankRecord` (rank order).
        measured: whether ``records`` hold measured seconds (else predicted ones).
    """
    plan, decision = work.tuned.planned.plan, work.tuned.decision
    balance = Balance.of(records)
    budgets = [g for r in records for g in (r.budget_min, r.budget_max)]
    return {
        "step": work.step,
        "plan_hash": work.tuned.planned.plan_hash,
        "predicted_balance": float(plan.metrics.efficiency),
        "predicted_step_s": float(decision.step_seconds_after),
        "predicted_step_before_dst_s": float(decision.step_seconds_before),
        "balance": balance.efficiency,
        "bubble_fraction": balance.bubble_fraction,
        "max_compute_s": balance.max_compute_s,
        "measured": bool(measured),
        "density": balance.density,
        "budget_mean": float(np.mean([r.budget_mean for r in records])),
        "budget_min": float(min(budgets)),
        "budget_max": float(max(budgets)),
        "dst_budget_cut": float(decision.budget_cut),
        "dst_budget_given": float(decision.budget_given),
        "tokens": balance.tokens,
        "target_tokens": int(work.target_tokens),
        "microbatches": int(plan.metrics.num_microbatches),
        "num_overlong": int(plan.metrics.num_overlong),
        "num_split_chunks": int(plan.metrics.num_split_chunks),
        "cp_units": 0,
    }


def log_values(history: list[dict], since: int) -> dict:
    """Means of the numeric telemetry of ``history[since:]`` under ``sparsebalance/`` keys (the
    dict a trainer's log gets); empty when nothing is new."""
    new = history[since:]
    if not new:
        return {}
    out = {}
    for key, value in new[-1].items():
        if key in ("step", "plan_hash", "measured") or isinstance(value, str):
            continue
        out[PREFIX + key] = float(np.mean([h[key] for h in new]))
    return out
