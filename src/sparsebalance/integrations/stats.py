"""A step's telemetry for the trainers' own loggers: plan and measured balance, bubble, density,
budgets, over-long documents. Flat ``sparsebalance/<name>`` keys holding numbers (what
``report_to`` integrations log); the plan hash rides along as a string for tests and files."""

from __future__ import annotations

import numpy as np

PREFIX = "sparsebalance/"


def step_telemetry(work, records: list, measured: bool) -> dict:
    """Telemetry of one finished step.

    Args:
        work: the :class:`~.planner.StepWork` (plan, DST decision).
        records: every rank's :class:`~sparsebalance.train.records.RankRecord` (rank order).
        measured: whether ``records`` hold measured seconds (else predicted ones).
    """
    plan, decision = work.tuned.planned.plan, work.tuned.decision
    computes = np.array([r.compute_s for r in records], dtype=np.float64)
    peak = max(float(computes.max()), 1e-12)
    budgets = [g for r in records for g in (r.budget_min, r.budget_max)]
    out = {
        "step": work.step,
        "plan_hash": work.plan_hash,
        "predicted_balance": float(plan.metrics.efficiency),
        "predicted_step_s": float(decision.step_seconds_after),
        "predicted_step_before_dst_s": float(decision.step_seconds_before),
        "balance": float(computes.mean() / peak),
        "bubble_fraction": float(1.0 - computes.mean() / peak),
        "max_compute_s": float(computes.max()),
        "measured": bool(measured),
        "density": float(np.mean([r.density for r in records])),
        "budget_mean": float(np.mean([r.budget_mean for r in records])),
        "budget_min": float(min(budgets)),
        "budget_max": float(max(budgets)),
        "dst_budget_cut": float(decision.budget_cut),
        "dst_budget_given": float(decision.budget_given),
        "tokens": int(sum(r.tokens for r in records)),
        "target_tokens": int(work.target_tokens),
        "microbatches": int(plan.metrics.num_microbatches),
        "num_overlong": int(plan.metrics.num_overlong),
        "num_split_chunks": int(plan.metrics.num_split_chunks),
        "cp_units": 0,
    }
    return out


def log_values(history: list[dict], since: int) -> dict:
    """Means of the numeric telemetry of ``history[since:]`` under ``sparsebalance/`` keys (the
    dict a trainer's ``on_log`` merges into its logs); empty when nothing is new."""
    new = history[since:]
    if not new:
        return {}
    out = {}
    for key, value in new[-1].items():
        if key in ("step", "plan_hash", "measured") or isinstance(value, str):
            continue
        out[PREFIX + key] = float(np.mean([h[key] for h in new]))
    return out
