"""Replay training steps over virtual ranks with the trainer's own planner, tuner and cost model.

One step: the global batch (lengths, densities at gamma0) -> :func:`~sparsebalance.batching.
plan_batch` for each planner strategy needed -> :meth:`DSTTuner.decide
<sparsebalance.tuning.DSTTuner.decide>` per ablation (sharing one :class:`~sparsebalance.tuning.
PlanWorkload` per plan) -> predicted rank times. Every ablation sees the same samples. Nothing is
re-implemented here: times, budgets, densities and budget moves are the tuner's
:class:`~sparsebalance.tuning.StepDecision`.

Budgets: under gamma the planner prices each document at its density at gamma0; under top-k at
the density the base k keeps at its length (SAB's estimate before DST has moved any budget: the
paper's per-length-bin average starts there; the simulator does not carry it across steps).
DST's coverage bound reads :class:`~sparsebalance.simulate.sparsity.CoverageModel` built on the
batch's densities at gamma0 (the documents' content), whatever the budget kind.

Padded micro-batches (``pad_micro_batches``): every document of a micro-batch is handed to DST
and the pricing as the micro-batch's longest (its length and content density, each keeping its
own budget), as the planner prices it (:func:`~sparsebalance.batching.plan.padded_packs`). The
coverage bound then reads the padded documents too: conservative (a right-padded document's
queries still see only its own keys, so its real coverage is at least the padded one's).

Step time = slowest rank's predicted compute + ``step_overhead`` (gradient all-reduce + optimizer,
not overlapped with compute: an assumption that makes speed-ups conservative).

Cost per step with R ranks and N = R x samples-per-rank documents: the planners' (O(N log N)
plus Python per micro-batch) and about 25 vectorised ``predict_many`` probes per DST ablation.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from ..batching import STRATEGIES as PLANNERS
from ..batching import PlanConfig
from ..batching.interleaved import check_virtual
from ..batching.pipeline import check_weight_share
from ..batching.plan import longest_in_rows
from ..batching.planner import Assignment, assign_batch
from ..batching.schedule import resolve_layers
from ..batching.zero_bubble import WEIGHT_SHARE, check_schedule
from ..tuning import ANCHORS, DensityCurve, DSTConfig, DSTTuner, Knob, PipelineWorkload, PlanWorkload, UnitWorkload
from ..tuning.dst import StepArrays
from ..tuning.records import CUT, RAISED
from ..workload import CostModel
from .pipeline import pipeline_record
from .sparsity import CoverageModel


@dataclass(frozen=True)
class Strategy:
    """One ablation: a planner strategy and a DST mode (and anchor; None = the config's)."""

    name: str
    planner: str
    dst_mode: str
    anchor: str | None = None


ABLATIONS = {
    "baseline": Strategy("baseline", "sequential", "off"),
    "sab": Strategy("sab", "sab", "off"),
    "dst": Strategy("dst", "sequential", "bidirectional"),
    "sab+dst": Strategy("sab+dst", "sab", "bidirectional"),
    "lbb": Strategy("lbb", "lbb", "off"),
    "lbb+dst": Strategy("lbb+dst", "lbb", "bidirectional"),
    **{f"sab+dst@{a}": Strategy(f"sab+dst@{a}", "sab", "bidirectional", a) for a in ANCHORS},
    # hybrid data x context parallel (long documents trained whole over CP units); not defaults
    "sab+cp": Strategy("sab+cp", "sab-cp", "off"),
    "sab+cp+dst": Strategy("sab+cp+dst", "sab-cp", "bidirectional"),
}
DEFAULT_STRATEGIES = ("baseline", "sab", "dst", "sab+dst", *(f"sab+dst@{a}" for a in ANCHORS))


def resolve_strategies(names: Sequence[str]) -> list[Strategy]:
    """Names -> strategies; ``baseline`` is always first (the speed-up reference).

    Accepted: the keys of :data:`ABLATIONS`, any planner strategy (``tokens``: planner, DST off)
    and ``<planner>+dst`` / ``<planner>+down`` (bidirectional / cut-only DST).
    """
    out = {"baseline": ABLATIONS["baseline"]}
    for name in names:
        if name in ABLATIONS:
            out[name] = ABLATIONS[name]
            continue
        planner, _, mode = name.partition("+")
        modes = {"": "off", "dst": "bidirectional", "down": "down"}
        if planner not in PLANNERS or mode not in modes:
            allowed = ", ".join([*ABLATIONS, *PLANNERS, "<planner>+dst", "<planner>+down"])
            raise ValueError(f"--strategy: unknown strategy {name!r} (allowed: {allowed})")
        out[name] = Strategy(name, planner, modes[mode])
    return list(out.values())


@dataclass(frozen=True)
class StepBatch:
    """One step's global batch: ``lengths`` int ``(N,)``, ``densities`` at gamma0 ``(N,)`` (the
    documents' content: planner densities under gamma, the coverage model's input always)."""

    lengths: np.ndarray
    densities: np.ndarray


def simulate_steps(
    batches: Sequence[StepBatch] | Sequence[tuple[Sequence[int], Sequence[float]]],
    world_size: int,
    cost_model: CostModel,
    *,
    micro_batches: int | None = None,
    capacity: int | None = None,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    dst: DSTConfig | None = None,
    curve: DensityCurve | None = None,
    block_size: int,
    coverage: bool = True,
    step_overhead: float = 0.0,
    show_step: int = 0,
    workers: int = 1,
    overlong: str = "split",
    pipeline_stages: int = 1,
    stage_layers: tuple[int, ...] = (),
    pad_micro_batches: bool = False,
    pipeline_virtual: int = 1,
    stage_times: bool = False,
    pipeline_schedule: str = "1f1b",
    weight_share: float = WEIGHT_SHARE,
) -> dict:
    """Predicted ablation table for explicit global batches (the simulator's and bench-e2e's API).

    Args:
        batches: per step, ``(lengths (N,), densities (N,))`` or :class:`StepBatch`.
        world_size: data-parallel ranks R (``--world-size``, >= 1).
        cost_model: a :class:`~sparsebalance.workload.CostModel` (e.g. ``LatencyModel``).
        micro_batches / capacity: exactly one (``--micro-batches`` / ``--capacity``).
        strategies: names for :func:`resolve_strategies` (baseline is always added).
        dst: DST flags (mode and anchor are set per strategy); curve: gamma's density response;
            block_size: the model's (top-k budgets are stated in tokens).
        coverage: DST's coverage bound reads the simulated :class:`CoverageModel` (False: no
            coverage information at the step level, as in the trainer before its forward).
        step_overhead: seconds per step added to every strategy (all-reduce + optimizer).
        show_step: which step's per-rank times to return (``rank_times``).
        workers: processes over steps (results do not depend on it).
        overlong: ``--overlong`` policy for documents over the capacity (``R x C`` for sab-cp).
        pipeline_stages: ``--pp`` P: each rank is a pipeline of P stages (1F1B, or
            ``pipeline_schedule``'s) and its time is the pipeline's makespan
            (:mod:`~sparsebalance.simulate.pipeline`); 1 = no pipeline.
        stage_layers: layers per pipeline stage, the one split the planner, DST and the pricing
            use (the trainer's: ``balanced_layers(L, P, head_layers(shapes))``); empty = even.
            With ``pipeline_virtual`` V > 1: P V entries, one per virtual stage.
        pipeline_virtual: ``--pp-virtual`` V: each rank of a pipeline holds V chunks of layers and
            runs the interleaved 1F1B schedule (:mod:`~sparsebalance.batching.interleaved`); SAB,
            DST and the pricing all read its makespan. 1 = plain 1F1B.
        stage_times: with a pipeline, also return ``stage_times``: name -> per step -> per rank
            ``(M_r, P V)`` forward + backward seconds of each micro-batch on each (virtual) stage,
            as priced (what another schedule can be priced on).
        pipeline_schedule: ``--pp-schedule``: ``"1f1b"`` or ``"zb-h1"``, zero bubble
            (:mod:`~sparsebalance.batching.zero_bubble`; needs P >= 2 and V = 1): SAB's order
            search and exchanges, DST's rank and micro-batch levels and the pricing (makespan,
            device busy = F + B + W) all read ZB-H1's makespan.
        weight_share: ZB-H1's W share of a stage's backward, in [0, 1) (read with ``"zb-h1"``).
        pad_micro_batches: run every micro-batch without packing, each document padded to the
            micro-batch's longest (``--pad-micro-batches``: Megatron-style ``(K, S)`` batches;
            every strategy, DST and the pricing see the padded documents, each keeping its own
            budget; :mod:`~sparsebalance.batching.padding`). Needs ``micro_batches``.

    Returns:
        JSON-ready dict: ``world_size``, ``num_steps``, ``strategies`` (name -> summary: mean step
        seconds, speedup vs baseline, balance efficiency, bubble fraction, mean density, budget
        cut/given), ``per_step`` (name -> step seconds list) and ``rank_times`` of ``show_step``.
    """
    steps = _checked_steps(batches, world_size, show_step, workers)
    dst = dst or DSTConfig()
    knob = dst.knob(block_size, curve)
    strats = resolve_strategies(strategies)
    # validates --micro-batches / --capacity / --overlong now
    PlanConfig(world_size, micro_batches, capacity, overlong=overlong, pad_micro_batches=pad_micro_batches)
    if pad_micro_batches and any(s.planner == "sab-cp" for s in strats):
        raise ValueError("--pad-micro-batches: context-parallel plans (sab-cp) are not padded; use sab")
    if stage_layers and pipeline_stages == 1:
        raise ValueError(f"stage_layers {tuple(stage_layers)} given without a pipeline (pipeline_stages 1)")
    cover = CoverageModel(knob.density, dst.gamma0) if coverage else None
    job = _Job(world_size, cost_model, micro_batches, capacity, tuple(strats), dst, knob, overlong, cover)
    job = replace(job, padded=pad_micro_batches)
    check_virtual(pipeline_stages, pipeline_virtual, cost_model.num_layers)
    check_schedule(pipeline_schedule, pipeline_stages, pipeline_virtual)
    check_weight_share(weight_share)
    if pipeline_stages != 1:
        _check_pipeline(pipeline_stages * pipeline_virtual, cost_model, strats, stage_layers)
        job = replace(
            job,
            pipeline_stages=pipeline_stages,
            stage_layers=tuple(stage_layers),
            pipeline_virtual=pipeline_virtual,
            pipeline_schedule=pipeline_schedule,
            weight_share=float(weight_share),
        )
    if stage_times and pipeline_stages == 1:
        raise ValueError("stage_times: only pipelines (pipeline_stages > 1) have stages")
    records = _run_steps(job, steps, workers)
    out = _summarize(records, strats, world_size, step_overhead, show_step)
    if stage_times:
        out["stage_times"] = {s.name: [rec[s.name]["stage_times"] for rec in records] for s in strats}
    return out


def _run_steps(job: _Job, steps: list[StepBatch], workers: int) -> list:
    """Every step's records, in step order: in this process, or over ``workers`` processes."""
    if workers == 1 or len(steps) == 1:
        return [job.run(b) for b in steps]
    with ProcessPoolExecutor(max_workers=min(workers, len(steps))) as pool:
        return list(pool.map(job.run, steps, chunksize=max(1, len(steps) // workers)))


def _checked_steps(batches, world_size: int, show_step: int, workers: int) -> list[StepBatch]:
    """``batches`` as :class:`StepBatch` es, after checking them and the other arguments of
    :func:`simulate_steps` that a step does not check itself (``ValueError`` naming the flag)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"--world-size must be an integer >= 1, got {world_size!r}")
    steps = [b if isinstance(b, StepBatch) else StepBatch(*map(np.asarray, b)) for b in batches]
    if not steps:
        raise ValueError("--steps must be >= 1: no global batch to simulate")
    for i, b in enumerate(steps):
        if b.lengths.size == 0 or b.lengths.shape != b.densities.shape:
            raise ValueError(f"step {i}: need >= 1 sample and one density per length")
    if not 0 <= show_step < len(steps):
        raise ValueError(f"show_step must be in [0, {len(steps)}), got {show_step}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be an integer >= 1, got {workers!r}")
    return steps


@dataclass(frozen=True)
class _Job:
    """One step for every strategy (a picklable callable for the process pool)."""

    world_size: int
    cost_model: CostModel
    micro_batches: int | None
    capacity: int | None
    strategies: tuple[Strategy, ...]
    dst: DSTConfig
    knob: Knob
    overlong: str = "split"
    coverage: CoverageModel | None = None
    pipeline_stages: int = 1
    stage_layers: tuple[int, ...] = ()
    padded: bool = False
    pipeline_virtual: int = 1
    pipeline_schedule: str = "1f1b"
    weight_share: float = WEIGHT_SHARE

    def planner_densities(self, batch: StepBatch) -> np.ndarray:
        """What SAB prices each document at: its density at gamma0 (gamma), or at the base k
        (top-k)."""
        if self.knob.kind == "gamma":
            return batch.densities
        return self.knob.density(batch.lengths, batch.densities, float(self.knob.base))

    def run(self, batch: StepBatch) -> dict[str, dict]:
        works, decided, out = {}, {}, {}
        dens = self.planner_densities(batch)
        for s in self.strategies:
            if s.planner not in works:  # one plan per planner (baseline and dst share one)
                cfg = PlanConfig(
                    self.world_size,
                    self.micro_batches,
                    self.capacity,
                    s.planner,
                    self.overlong,
                    pad_micro_batches=self.padded,
                )
                if self.pipeline_stages > 1:  # sab packs for the pipelines' makespans
                    cfg = replace(
                        cfg,
                        pipeline_stages=self.pipeline_stages,
                        stage_layers=self.stage_layers,
                        pipeline_virtual=self.pipeline_virtual,
                        pipeline_schedule=self.pipeline_schedule,
                        weight_share=self.weight_share,
                    )
                t0 = time.perf_counter()
                a = assign_batch(batch.lengths, dens, self.cost_model, cfg)
                plan_s = time.perf_counter() - t0
                work = _workload(a, self.cost_model, self.knob, batch.densities, self.coverage)
                t0 = time.perf_counter()
                if self.pipeline_stages > 1:  # DST reads makespans (heads priced once per plan)
                    work = PipelineWorkload(work, cfg.pipeline(self.cost_model.num_layers))
                stats = {**_cp_stats(a), "plan_s": plan_s, "pipe_s": time.perf_counter() - t0}
                skipped = a.extra.get("order_search_skipped", 0)
                works[s.planner] = (work, {**stats, "candidate": a.extra.get("candidate", ""), "skipped": skipped})
            cfg = replace(self.dst, mode=s.dst_mode, anchor=s.anchor or self.dst.anchor)
            # sab+dst and sab+dst@<default anchor> are the same decision: made once.
            if (s.planner, cfg) not in decided:
                work, stats = works[s.planner]
                t0 = time.perf_counter()
                dec = DSTTuner(cfg, knob=self.knob).decide_arrays(work)
                # DST's own cost: its decision and, with pipelines, the makespan pricing's set-up
                dst_s = time.perf_counter() - t0 + stats["pipe_s"] if cfg.mode != "off" else 0.0
                decided[s.planner, cfg] = {**_record(dec, work), **stats, "dst_s": dst_s}
                if self.pipeline_stages > 1:  # a rank's time is its pipeline's makespan
                    rec = pipeline_record(
                        work.work,
                        dec.budgets,
                        self.pipeline_stages,
                        mb_values=dec.microbatch_budgets,
                        stage_layers=self.stage_layers,
                        virtual=self.pipeline_virtual,
                        weight_share=self.weight_share if self.pipeline_schedule == "zb-h1" else None,
                    )
                    decided[s.planner, cfg].update(rec)
            out[s.name] = decided[s.planner, cfg]
        return out


def _check_pipeline(num_stages, cost_model: CostModel, strats: Sequence[Strategy], split: tuple[int, ...]) -> None:
    """``--pp``: at most one stage per layer, a split that fits the model, and no hybrid CP plans
    (not modelled in pipelines)."""
    resolve_layers(cost_model.num_layers, num_stages, tuple(split))
    cp = [s.name for s in strats if s.planner == "sab-cp"]
    if cp:
        raise ValueError(f"--pp: pipelines are not simulated with context-parallel plans ({', '.join(cp)}); use --pp 1")


def _workload(a: Assignment, cost_model: CostModel, knob: Knob, content: np.ndarray, coverage):
    """The DST workload of an assignment: ``PlanWorkload(plan_batch(...).ranks, ...)`` without
    the plan's ``MicroBatch`` objects; a :class:`~sparsebalance.tuning.UnitWorkload` (workers =
    ranks joined by CP units) for a hybrid ``sab-cp`` plan. Its per-document ``d0`` is the
    batch's density at gamma0 (``content``, by sample), what the knob and coverage model read."""
    f = a.flat
    d0 = content[a.items.sample_id]  # by item
    lengths, placed = a.items.tokens[f.item], d0[f.item]
    if a.items.padded and lengths.size:  # every document as its micro-batch's longest (the planner's pricing)
        longest = longest_in_rows(lengths, f.mb_sizes)
        lengths, placed = lengths[longest].repeat(f.mb_sizes), placed[longest].repeat(f.mb_sizes)
    args = (f.mb_rank, f.mb_sizes, lengths, placed, cost_model, knob, coverage)
    if a.cp is None:
        return PlanWorkload.from_flat(f.num_ranks, *args)
    u = a.cp.units
    return UnitWorkload(f.num_ranks, a.items.tokens[u.item], d0[u.item], u.degree, u.start_rank, *args)


def _cp_stats(a: Assignment) -> dict:
    """Split documents and the busiest rank's exposed communication of a plan (0 without CP)."""
    if a.cp is None:
        return {"split": 0, "comm": 0.0}
    u = a.cp.units
    comm = np.zeros(a.flat.num_ranks)
    for s, k, c in zip(u.start_rank.tolist(), u.degree.tolist(), u.comm.tolist(), strict=True):
        comm[s : s + k] += c
    return {"split": int(u.item.size), "comm": float(comm.max())}


def _record(dec: StepArrays, work) -> dict:
    """One ablation's step: what :func:`_summarize` reads (the sums as ``StepDecision`` forms
    them: Python sums in rank order). Times are per rank (a hybrid plan's workers expanded)."""
    w, dens = work.weights, dec.density_after
    times = work.rank_seconds(dec.budgets) if isinstance(work, UnitWorkload) else dec.times_after
    delta = (dec.attention_after - dec.attention_before).tolist()
    roles = dec.targets.roles
    return {
        "compute": float(times.max()),
        "mean_rank": float(times.mean()),
        "density": float((w * dens).sum() / w.sum()) if w.sum() > 0 else 1.0,
        "attention": float(sum(dec.attention_before.tolist())),
        "cut": float(sum(-min(d, 0.0) for d in delta)),
        "given": float(sum(max(d, 0.0) for d in delta)),
        "num_cut": sum(r == CUT for r in roles),
        "num_raised": sum(r == RAISED for r in roles),
        "rank_times": times,
    }


def _summarize(records, strats, world_size, step_overhead, show_step) -> dict:
    def series(name, key):
        return np.array([rec[name][key] for rec in records], dtype=np.float64)

    base = series("baseline", "compute") + step_overhead
    table, per_step, overhead = {}, {}, {}
    for s in strats:
        compute = series(s.name, "compute")
        step = compute + step_overhead
        balance = series(s.name, "mean_rank") / compute
        attention = series(s.name, "attention")
        table[s.name] = {
            "planner": s.planner,
            "dst_mode": s.dst_mode,
            "anchor": s.anchor,
            "step_seconds": float(step.mean()),
            "compute_seconds": float(compute.mean()),
            "speedup": float(base.mean() / step.mean()),
            "compute_speedup": float((base - step_overhead).mean() / compute.mean()),
            "balance_efficiency": float(balance.mean()),
            "bubble_fraction": float((1.0 - balance).mean()),
            "mean_density": float(series(s.name, "density").mean()),
            "budget_cut_seconds": float(series(s.name, "cut").mean()),
            "budget_given_seconds": float(series(s.name, "given").mean()),
            "budget_cut_fraction": float((series(s.name, "cut") / attention).mean()),
            "budget_given_fraction": float((series(s.name, "given") / attention).mean()),
            "ranks_cut": float(series(s.name, "num_cut").mean()),
            "ranks_raised": float(series(s.name, "num_raised").mean()),
            "split_documents": float(series(s.name, "split").mean()),
            "comm_seconds": float(series(s.name, "comm").mean()),
        }
        if "device_idle" in records[0][s.name]:  # --pp > 1: the pipelines' own numbers
            table[s.name]["device_idle_fraction"] = float(series(s.name, "device_idle").mean())
            table[s.name]["microbatch_imbalance"] = float(series(s.name, "mb_imbalance").mean())
        # which of sab's (or sab-cp's) plans was kept, in how many steps; {} for the others
        kept = Counter(rec[s.name]["candidate"] for rec in records if rec[s.name]["candidate"])
        table[s.name]["candidates"] = dict(sorted(kept.items()))
        # steps whose micro-batches were too many per pipeline to search their order, and the most
        table[s.name]["order_search_skipped"] = [
            sum(1 for rec in records if rec[s.name]["skipped"]),
            max((rec[s.name]["skipped"] for rec in records), default=0),
        ]
        per_step[s.name] = step.tolist()
        overhead[s.name] = {
            "plan_seconds": float(np.median(series(s.name, "plan_s"))),
            "dst_seconds": float(np.median(series(s.name, "dst_s"))),
        }
    return {
        "world_size": world_size,
        "num_steps": len(records),
        "step_overhead_seconds": step_overhead,
        "strategies": table,
        "per_step": per_step,
        # wall time of this machine's planner and step-level DST (median over steps): the only
        # measured numbers of a simulation, kept apart so the rest stays deterministic
        "overhead_seconds": overhead,
        "show_step": show_step,
        "rank_times": {s.name: records[show_step][s.name]["rank_times"].tolist() for s in strats},
    }
