"""The step stages behind every trainer integration: which documents a step trains (seeded, the
same on every rank), SAB's plan and DST's budgets for it, this rank's micro-batches (always
``micro_batches`` of them, empty fillers where the plan gives the rank fewer), and the feedback
after the step (latency model, density estimator) with its telemetry.

One implementation of each stage: planning, tuning, the records and the feedback are the step
engine's (:class:`~sparsebalance.engine.StepEngine`, what ``sparsebalance train`` runs); this
module only draws the documents, lists this rank's micro-batches (fillers included) and keeps
the telemetry. It knows nothing of Hugging Face: the sampler / collator (:mod:`.sampler`),
:mod:`sparsebalance.hf` and :mod:`.loop` drive it.

Global batch ``k`` of epoch ``e`` is documents ``perm_e[k B : (k + 1) B]`` of the seeded
permutation ``epoch_permutation(seed, e, N)`` (the tail of ``N mod B`` documents is dropped):
exactly the batches ``sparsebalance train --seed S --global-batch B`` draws from one source.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .. import flags
from ..data.mixture import epoch_permutation
from ..engine import (
    OVERLONG,
    DSTConfig,
    LatencyModel,
    MicroBatchResult,
    PlanConfig,
    StepEngine,
    TunedStep,
    check_global_batch,
    resolve_kernel,
)
from ..workload import Sample

STRATEGIES = ("sequential", "sorted", "tokens", "flops", "sab")


@dataclass(frozen=True)
class PlannerConfig:
    """How an integration plans its steps (validated on construction)."""

    global_batch: int
    """Documents per optimizer step over all ranks."""
    micro_batches: int
    """Micro-batches every rank runs per step (the trainer's ``gradient_accumulation_steps``);
    a rank the plan gives fewer runs empty fillers (two tokens, no target) for the rest."""
    capacity: int | None = None
    """Tokens per micro-batch (the memory bound); None: no bound, the plan spreads a rank's
    documents over at most ``micro_batches`` micro-batches."""
    strategy: str = "sab"
    """sequential | sorted | tokens | flops | sab (``sab-cp`` is not available here)."""
    overlong: str = "split"
    """Documents longer than ``capacity``: split | truncate | skip (counted in the telemetry)."""
    dst: DSTConfig = field(default_factory=DSTConfig)
    """Budgets and dynamic sparsity tuning (default: the paper's top-k rule; exact attention:
    ``DSTConfig(mode="off", budget="gamma", gamma0=1.0)``)."""
    block_size: int | None = None
    """Tokens per sparsity block; None: the attached attention's (its device's default: 128 on
    CUDA, 64 elsewhere)."""
    backend: str = "auto"
    seed: int = 0
    """Seeds the document order of every epoch (the same on every rank)."""
    deterministic: bool = False
    """No measured time enters any decision (exact resume, runs comparable bit for bit)."""

    def __post_init__(self) -> None:
        flags.check_fields(self)  # types first (the Python API): one line naming the field
        if self.strategy == "sab-cp":
            raise ValueError(
                "strategy='sab-cp' is not available in the trainer integrations: documents longer "
                "than the capacity cannot run as context-parallel units inside another trainer's "
                "micro-batch loop; use overlong='split' (chunks) here, or `sparsebalance train "
                "--strategy sab-cp` to train them whole"
            )
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {OVERLONG}, got {self.overlong!r}")
        for name in ("global_batch", "micro_batches", "block_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {self.capacity}")


@dataclass
class MicroBatchSpec:
    """One of this rank's micro-batches of a step: documents (chunks) in pack order."""

    step: int
    index: int
    sample_ids: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    filler: bool = False


@dataclass
class StepWork:
    """A planned step on this rank: the agreed plan, DST's decision, this rank's micro-batches."""

    step: int
    epoch: int
    tuned: TunedStep
    """The plan, its hash, DST's decision and the loss scale."""
    specs: list[MicroBatchSpec]
    target_tokens: int = 0
    """Target tokens of the whole global batch (every rank): the loss normaliser."""
    tickets: list = field(default_factory=list)
    """The collated micro-batches' tickets, in order (their layer statistics)."""
    t_planned: float = 0.0
    counted_with: Callable[[int, int, int], int] | None = None
    """The dataset's target count ``target_tokens`` was counted with (None: n - 1 a chunk)."""

    @property
    def plan_hash(self) -> str:
        return self.tuned.planned.plan_hash


class StepPlanner:
    """Plans steps for one rank (see the module docstring).

    Args:
        lengths: int ``(N,)`` tokens of every document of the dataset.
        config: the :class:`PlannerConfig`.
        latency: the latency model plans and DST price with (the same on every rank).
        rank, world_size: this process and the data-parallel world.
        all_gather: ``obj -> [obj of every rank]`` (``torch.distributed.all_gather_object``).
        sources: optional ``(N,)`` source names (the density estimator learns per source).
        device: where the micro-batches train (DST decides on it off the CPU; layer times are
            fed back only on the CPU, :attr:`~sparsebalance.engine.StepEngine.layer_times`);
            the engine's kernel (block size, backend, GQA mode) is resolved for it from
            ``config`` and ``precision`` (what the forwards compute in; ``auto``: the device's)
            by :func:`~sparsebalance.engine.resolve_kernel`, as the latency start-up's.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        config: PlannerConfig,
        latency: LatencyModel,
        rank: int = 0,
        world_size: int = 1,
        all_gather: Callable[[object], list] | None = None,
        sources: Sequence[str] | None = None,
        *,
        device: torch.device | str,
        precision: str = "auto",
    ) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if self.lengths.size == 0 or int(self.lengths.min()) < 1:
            raise ValueError("every document needs at least one token (an empty one was given)")
        if config.block_size is None:
            raise ValueError("PlannerConfig.block_size: resolve it first (build_sampler does)")
        self.config = config
        check_global_batch(config.global_batch, self.lengths.size, world_size, flag="global_batch")
        self.rank, self.world_size = rank, world_size
        self.all_gather = all_gather or (lambda obj: [obj])
        self.sources = list(sources) if sources is not None else None
        plan = PlanConfig(
            world_size,
            None if config.capacity else config.micro_batches,
            config.capacity,
            config.strategy,
            config.overlong,
        )
        self.device = torch.device(device)
        kernel = resolve_kernel(self.device, config.block_size, config.backend, precision)
        self.engine = StepEngine(
            plan,
            latency,
            config.dst,
            self.sample,
            kernel=kernel,
            world_size=world_size,
            all_gather=self.all_gather,
            deterministic=config.deterministic,
        )
        self.history: list[dict] = []
        """One telemetry dict per finished step (what the trainer's loggers get)."""
        self._work: StepWork | None = None

    @property
    def latency(self) -> LatencyModel:
        return self.engine.latency

    @property
    def tuner(self):
        return self.engine.tuner

    @property
    def estimator(self):
        return self.engine.estimator

    # ------------------------------------------------------------------ data order
    @property
    def steps_per_epoch(self) -> int:
        return int(self.lengths.size // self.config.global_batch)

    def sample(self, index: int) -> Sample:
        src = self.sources[index] if self.sources is not None else ""
        return Sample(int(index), int(self.lengths[index]), src)

    def batch_ids(self, epoch: int, step_in_epoch: int) -> list[int]:
        """Document ids of global batch ``step_in_epoch`` of ``epoch`` (module docstring)."""
        b = self.config.global_batch
        perm = epoch_permutation(self.config.seed, epoch, int(self.lengths.size), 0, 1)
        return perm[step_in_epoch * b : (step_in_epoch + 1) * b].tolist()

    @property
    def current(self) -> StepWork | None:
        """The step planned last (the one being trained)."""
        return self._work

    # ------------------------------------------------------------------ plan + tune
    def work(
        self, epoch: int, step_in_epoch: int, target_count: Callable[[int, int, int], int] | None = None
    ) -> StepWork:
        """The planned step (planned once: every micro-batch of a step asks for it).
        ``target_count``: ``(sample id, offset, length) -> targets`` of the dataset the step
        draws from (masked prompts), for the global batch's target tokens; default n - 1."""
        step = epoch * self.steps_per_epoch + step_in_epoch
        if self._work is not None and self._work.step == step:
            if self._work.counted_with != target_count:  # planned without this dataset's count (== : bound methods)
                plan = self._work.tuned.planned.plan
                targets = self._targets(plan, target_count)
                self._work = replace(self._work, target_tokens=targets, counted_with=target_count)
            return self._work
        cfg = self.config
        samples = [self.sample(i) for i in self.batch_ids(epoch, step_in_epoch)]
        tuned = self.engine.begin(samples)
        plan = tuned.planned.plan
        counts = [len(r) for r in plan.ranks]
        if max(counts) > cfg.micro_batches:
            worst = int(np.argmax(counts))
            raise ValueError(
                f"step {step}: the plan needs {max(counts)} micro-batches of {cfg.capacity} tokens "
                f"on rank {worst} but gradient_accumulation_steps is {cfg.micro_batches}: raise "
                "gradient_accumulation_steps (ranks with fewer run empty fillers) or the capacity"
            )
        specs = [
            MicroBatchSpec(step, m, mb.sample_ids, offs, mb.lengths)
            for m, (mb, offs) in enumerate(zip(plan.ranks[self.rank], plan.offsets[self.rank], strict=True))
        ]
        fillers = range(len(specs), cfg.micro_batches)
        specs += [MicroBatchSpec(step, m, filler=True) for m in fillers]
        self._work = StepWork(
            step,
            epoch,
            tuned,
            specs,
            self._targets(plan, target_count),
            t_planned=time.perf_counter(),
            counted_with=target_count,
        )
        return self._work

    @staticmethod
    def _targets(plan, target_count: Callable[[int, int, int], int] | None) -> int:
        """Target tokens of the global batch (every rank's documents; labels shift inside a
        document, so a chunk of n tokens has n - 1 unless ``target_count`` says otherwise)."""
        total = 0
        for rank, rank_offs in zip(plan.ranks, plan.offsets, strict=True):
            for mb, offs in zip(rank, rank_offs, strict=True):
                for i, o, n in zip(mb.sample_ids, offs, mb.lengths, strict=True):
                    total += target_count(i, o, n) if target_count else n - 1
        return total

    # ------------------------------------------------------------------ feedback
    def finish(self, work: StepWork, seconds: Sequence[float] | None = None) -> dict:
        """After the step's optimizer update (every rank, in step order): fold every rank's
        measured micro-batches into the latency model and the density estimator, and return
        the step's :meth:`StepReport.to_log` (also appended to :attr:`history`).

        Args:
            work: the step (its tickets hold the layer statistics of each micro-batch).
            seconds: measured seconds of this rank's micro-batches, fillers included, in order;
                None: not measured (the predicted times stand in; nothing timed is fed back).
        """
        predicted = work.tuned.planned.plan.microbatch_times[self.rank]
        results = []
        for m, ticket in enumerate(work.tickets):
            if ticket.filler:
                continue
            spec = ticket.key
            secs = float(seconds[m]) if seconds is not None else float(predicted[spec.index])
            results.append(
                MicroBatchResult.from_stats(
                    secs,
                    spec.lengths,
                    spec.sample_ids,
                    ticket.attention.stats,
                    0.0,
                    float(sum(n - 1 for n in spec.lengths)),
                    slot=m,
                )
            )
        measured = seconds is not None
        step = self.engine.finish(
            work.tuned, self.rank, results, measured, step=work.step, target_tokens=int(work.target_tokens)
        )
        report = step.to_log()
        self.history.append(report)
        return report

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """JSON-ready: the latency model's calibration and the density estimator's state."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)
        self._work = None
