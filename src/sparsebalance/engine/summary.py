"""What a step's records say over all ranks, computed once for every front end: the balance
(mean / max rank compute, bubble, density, tokens), each rank's derived bubble, and the one
:class:`StepReport` of the step. ``StepReport.to_log()`` is the one serialisation: the
``"rank": "all"`` line of ``metrics.jsonl``, TensorBoard and ``sparsebalance report`` (own loop),
and the integrations' ``planner.history`` whose numbers :func:`log_values` hands to a trainer's
log (``sparsebalance/<name>`` keys: the HF callback's ``log_history``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from .records import RankRecord, StepFeedback, TunedStep

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


def _balance(times: np.ndarray) -> float:
    peak = float(times.max())
    return float(times.mean()) / peak if peak > 0 else 1.0


def dst_balances(records: list[RankRecord]) -> dict[str, float]:
    """:class:`StepReport`'s three balances of DST (predicted before and after, and the measured
    one without DST, estimated) from every rank's record."""
    before = np.array([r.predicted_before_s for r in records], dtype=np.float64)
    after = np.array([r.predicted_s for r in records], dtype=np.float64)
    measured = np.array([r.compute_s for r in records], dtype=np.float64)
    ratio = np.divide(before, after, out=np.ones_like(before), where=after > 0)
    return {
        "balance_predicted_before": _balance(before),
        "balance_predicted_after": _balance(after),
        "balance_without_dst": _balance(measured * ratio),
    }


def derive_bubbles(records: list[RankRecord]) -> None:
    """Each rank's wait for the slowest, from compute times alone (``derived_bubble_s``)."""
    peak = max(r.compute_s for r in records)
    for rec in records:
        rec.derived_bubble_s = float(peak - rec.compute_s)


@dataclass(frozen=True, kw_only=True)
class StepReport:
    """One step over all ranks, the same for every front end (:meth:`of`), serialised once
    (:meth:`to_log`). Fields in ``metrics.jsonl``'s order; the ones a front end alone knows are
    None elsewhere and left out of the log: the own loop's loss, step time, throughput, optimizer
    time, learning rate, emulation, data mixture and skipped step (:data:`OWN_LOOP_ONLY`), the
    integrations' ``target_tokens``."""

    loss: float | None = None
    """Global mean token loss (own loop)."""
    step_seconds: float | None = None
    """Wall seconds of the whole step (own loop; an emulated cluster's: slowest rank + sync + optimizer)."""
    max_compute_s: float
    mean_compute_s: float
    efficiency: float
    """Balance efficiency: mean / max rank compute (1.0 = balanced)."""
    imbalance: float
    """max / mean rank compute."""
    bubble_fraction: float
    """``1 - efficiency``."""
    tokens: int
    tokens_per_s: float | None = None
    """Tokens / ``step_seconds`` (own loop)."""
    optimizer_s: float | None = None
    """Seconds of the optimizer update (own loop)."""
    mean_density: float
    """Mean of the ranks' realized densities."""
    dst_anchor_seconds: float
    dst_post_cut_seconds: float
    dst_budget_cut: float
    dst_budget_given: float
    predicted_max_before_s: float
    """Predicted step time (slowest rank) at the base budget, before DST."""
    predicted_max_s: float
    """Predicted step time (slowest rank) at DST's budgets."""
    balance_predicted_before: float
    """Predicted balance (mean / max rank time) at the base budget: what SAB's plan promised."""
    balance_predicted_after: float
    """Predicted balance at DST's budgets: what DST promised."""
    balance_without_dst: float
    """An estimate of the measured balance had DST not run: each rank's measured time priced
    back to the base budget by the latency model (``compute_s x predicted_before_s /
    predicted_s``); beside :attr:`efficiency` (measured, with DST) it says whether DST paid."""
    plan_hash: str
    strategy: str
    dst_mode: str
    plan_efficiency: float
    """The plan's predicted balance efficiency (mean / max predicted rank time)."""
    num_overlong: int
    lr: float | None = None
    """Learning rate of the step (own loop)."""
    emulated: bool | None = None
    """Ranks emulated in one process (own loop's ``--emulate-ranks``)."""
    data_documents: dict[str, int] | None = None
    """Documents drawn from each --data component this step (own loop)."""
    num_split_chunks: int
    """Chunks ``--overlong split`` cut over-long documents into this step (0: none was cut)."""
    cp_documents: tuple[dict, ...] = ()
    """Documents trained whole on a context-parallel unit of k > 1 ranks this step: ``id``,
    ``offset`` and ``tokens`` (a later ``--overlong`` chunk has offset > 0), ``degree`` k,
    ``ranks`` and ``ring`` (from the plan's units)."""
    plan_s: float
    """Seconds SAB's planning took (the planner, on every rank)."""
    dst_s: float
    """Seconds DST's step-level decision took."""
    dst_layer_s: float
    """Seconds the slowest-deciding rank's layer controllers took (inside its compute)."""
    overhead_s: float
    """``plan_s + dst_s + dst_layer_s``: the balancing pipeline's own time this step."""
    budget_kind: str
    """``top-k`` or ``gamma``."""
    coverage_limited: int
    """Layer decisions (all ranks) where the coverage bound stopped a cut."""
    skipped_nonfinite: bool | None = None
    """The loss or the gradients were NaN/inf: the step was skipped (own loop)."""
    planned_ahead: bool | None = None
    """The step was planned and tuned during the previous one's device work (own loop's
    ``--plan-ahead``): ``plan_s`` and ``dst_s`` ran in the device's shadow (the first step after
    a resume, re-planned at start-up: False)."""
    step: int
    budget_mean: float
    """Mean of the ranks' mean (micro-batch, layer) budgets (k or gamma)."""
    budget_min: float
    budget_max: float
    microbatches: int
    """Micro-batches of the plan, over all ranks."""
    cp_units: int
    """Context-parallel units (k > 1) of the plan."""
    measured: bool
    """The rank times are measured and fed back (else the predicted times stand in)."""
    target_tokens: int | None = None
    """Tokens with a loss target in the global batch (integrations)."""

    @classmethod
    def of(
        cls,
        tuned: TunedStep,
        records: list[RankRecord],
        *,
        step: int,
        strategy: str,
        dst_mode: str,
        budget_kind: str,
        measured: bool = True,
        **front_end,
    ) -> StepReport:
        """The report of a step from its tuned plan and every rank's record (rank order);
        ``front_end``: the fields only the calling front end knows (see the class)."""
        decision, plan = tuned.decision, tuned.planned.plan
        balance = Balance.of(records)
        budgets = [g for r in records for g in (r.budget_min, r.budget_max)]
        layer_s = max(r.dst_layer_s for r in records)
        cp_documents = tuple(
            {"id": i, "offset": o, "tokens": n, "degree": u.degree, "ranks": list(u.ranks), "ring": u.ring}
            for u in plan.units
            for i, o, n in zip(u.sample_ids, u.offsets, u.lengths, strict=True)
        )
        return cls(
            max_compute_s=balance.max_compute_s,
            mean_compute_s=balance.mean_compute_s,
            efficiency=balance.efficiency,
            imbalance=balance.imbalance,
            bubble_fraction=balance.bubble_fraction,
            tokens=balance.tokens,
            mean_density=balance.density,
            dst_anchor_seconds=decision.targets.anchor_seconds,
            dst_post_cut_seconds=decision.targets.post_cut_seconds,
            dst_budget_cut=decision.budget_cut,
            dst_budget_given=decision.budget_given,
            predicted_max_before_s=decision.step_seconds_before,
            predicted_max_s=decision.step_seconds_after,
            **dst_balances(records),
            plan_hash=tuned.planned.plan_hash,
            strategy=strategy,
            dst_mode=dst_mode,
            plan_efficiency=plan.metrics.efficiency,
            num_overlong=plan.metrics.num_overlong,
            num_split_chunks=plan.metrics.num_split_chunks,
            cp_documents=cp_documents,
            plan_s=plan.metrics.plan_seconds,
            dst_s=tuned.dst_seconds,
            dst_layer_s=layer_s,
            overhead_s=plan.metrics.plan_seconds + tuned.dst_seconds + layer_s,
            budget_kind=budget_kind,
            coverage_limited=sum(r.coverage_limited for r in records),
            step=step,
            budget_mean=float(np.mean([r.budget_mean for r in records])),
            budget_min=float(min(budgets)),
            budget_max=float(max(budgets)),
            microbatches=int(plan.metrics.num_microbatches),
            cp_units=len(plan.units),
            measured=bool(measured),
            **front_end,
        )

    def to_log(self) -> dict:
        """The one serialisation (JSON-ready, field order): every field a front end set."""
        return {k: v for k, v in asdict(self).items() if v is not None}


OWN_LOOP_ONLY = tuple(f.name for f in fields(StepReport) if f.default is None and f.name != "target_tokens")
"""Fields only ``sparsebalance train``'s own loop fills (None, and so not logged, elsewhere)."""


def log_values(history: list[dict], since: int) -> dict:
    """Means of the numbers in ``history[since:]`` (:meth:`StepReport.to_log` dicts) under
    ``sparsebalance/`` keys (the dict a trainer's log gets; the step, flags, names and lists are
    left out); empty when nothing is new."""
    new = history[since:]
    if not new:
        return {}
    out = {}
    for key, value in new[-1].items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[PREFIX + key] = float(np.mean([h[key] for h in new]))
    return out


@dataclass(frozen=True)
class StepResult:
    """What :meth:`StepRunner.run <sparsebalance.engine.step.StepRunner.run>` and
    :meth:`Trainer.run_step <sparsebalance.train.Trainer.run_step>` return and telemetry logs."""

    records: list[RankRecord]
    report: StepReport
    feedback: StepFeedback
