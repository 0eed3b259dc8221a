"""``Trainer``: ``sparsebalance train``'s own loop. Built from the parts :mod:`.build` makes (data,
model, ``--capacity auto``, the run folder's checks) and the step engine's (latency model, DST,
planning: :class:`~sparsebalance.engine.StepEngine`; execution and update:
:class:`~sparsebalance.engine.StepRunner`), it runs steps with checkpoints and telemetry."""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from ..clock import Clock
from ..data.batches import BatchSource
from ..engine import (
    ExecutionConfig,
    PlanConfig,
    RankExecutor,
    StepEngine,
    StepRunner,
    UpdateConfig,
    Updater,
    check_global_batch,
    load_latency_model,
    profile_length,
    resolve_kernel,
)
from ..engine.parallelize import Parallelized, parallelize
from ..engine.pipeline import PipelineExecutor, PipelineGroups
from ..engine.runtime import Runtime, rng_state, seed_everything, set_rng_state
from ..engine.summary import StepResult
from ..latency import LatencyModel, OutsideGridWarning, context_cost
from ..latency.host_memory import current_rss_bytes
from ..latency.memory_bound import MemoryBound
from ..models import ModelShapes
from ..parallel import watch
from ..parallel.groups import RingGroups
from ..parallel.p2p import RING_WAITS
from ..parallel.watch import DeviceWaits
from ..precision import resolve_precision
from ..tuning import DSTTuner
from ..workload import Sample
from . import ahead as plan_ahead
from . import build
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .config_io import to_dict
from .multinode import launcher_placement
from .pipeline_checkpoint import load_pipeline_checkpoint, save_pipeline_checkpoint
from .resume import choose_checkpoint, saved_capacity
from .signals import Stopped, StopSignals
from .telemetry import Telemetry


def long_document_note(latency: LatencyModel, lengths: np.ndarray) -> str | None:
    """The line saying that documents longer than the profile's tables (``sab-cp`` trains them
    whole over several ranks) are priced by its fitted form; None when every one is inside."""
    top, longest = int(latency.profile.attention.lengths[-1]), int(np.max(lengths))
    if longest <= top:
        return None
    return (
        f"latency: documents up to {longest:,} tokens are priced by the profile's fitted "
        f"form beyond its {top:,}-token tables (sab-cp trains them whole over several ranks)"
    )


class Trainer:
    def __init__(self, cfg: TrainConfig, runtime: Runtime | None = None):
        base_rss = current_rss_bytes()  # libraries loaded, no model yet: the memory model's base
        self.rt = rt = runtime or Runtime.init(cfg.device, cfg.comm_timeout)
        self.precision = resolve_precision(cfg.precision, rt.device)
        # block, backend and precision on this device, checked before anything compiles
        self.kernel = resolve_kernel(rt.device, cfg.block_size, cfg.backend, cfg.precision)
        self.cfg, self.num_ranks = build.check_world(cfg, rt)  # --strategy auto resolved
        cfg = self.cfg
        # every rank's launcher variables: the topology and which rank writes each node's caches
        self._placements = rt.all_gather_object(launcher_placement())
        self.topology = build.topology(
            cfg, rt, self.num_ranks, self._placements[:: cfg.pp]
        )  # a pipeline: its first stage
        seed_everything(cfg.seed)
        self.run_dir = Path(cfg.out)
        named = build.check_model(cfg)  # before the data is prepared
        corpus = build.open_data(cfg, rt, self._placements)
        self.model = build.checked_model(cfg, rt.device, named)
        self.stage = build.pipeline_stage(cfg, rt, self.model)  # --pp: this rank's stage, else None
        self.corpus = build.fit_vocabulary(corpus, self.model)
        check_global_batch(cfg.global_batch, self.corpus.lengths().size, self.num_ranks)
        self.data = BatchSource(self.corpus, cfg.seed, cfg.global_batch)
        # --resume: the same run or a refusal, decided before anything expensive (profiling)
        self._checkpoint = self._resume_checkpoint() if cfg.resume else None
        self.stops: StopSignals | None = None
        """Set by the worker entry point: SIGINT/SIGTERM stop at a step boundary, saved."""
        shapes = ModelShapes.from_hf_config(self.model.config.to_dict(), name=Path(cfg.model).name)
        self.memory_bound: MemoryBound | None = None
        """``--capacity auto``: the memory model and budget; ``sab-cp`` takes each document's
        minimum CP degree from it."""
        if cfg.capacity == "auto":
            capacity, self.memory_bound = build.fit_capacity(
                cfg, rt, self.model, shapes, self.kernel, base_rss, self.stage
            )
            if self._checkpoint is not None:
                capacity = self._resumed_capacity(capacity)
            self.cfg = cfg = replace(cfg, capacity=capacity)
        self.engine = self._engine(shapes)
        self.runner = self._runner()
        self.step = 0
        self.plan_ahead = plan_ahead.resolve(cfg.plan_ahead, rt.device)
        self._ahead: plan_ahead.Ahead | None = None
        """--plan-ahead: the next step, planned and tuned during this one."""
        self._stale = build.check_run_folder(cfg)
        if cfg.resume:
            self._resume()

    # ------------------------------------------------------------------ setup
    def _engine(self, shapes: ModelShapes) -> StepEngine:
        """The step engine over this run's latency model (loaded, or measured for the layouts the
        run uses), DST and estimator; ``sab-cp`` prices split documents with a ``ContextCost``
        (measured links, else analytic H100)."""
        cfg, rt, cost = self.cfg, self.rt, None
        capacity = cfg.capacity if isinstance(cfg.capacity, int) else None
        lengths = self.corpus.lengths()
        length = profile_length(capacity, lengths, cfg.global_batch, cfg.max_len)
        self.latency = load_latency_model(
            shapes, self.kernel, cfg.dst.budget, cfg.profile, length, rt.is_main, rt.all_gather_object
        )
        if cfg.strategy == "sab-cp":
            cost = context_cost(self.latency, "h100", shapes, block_size=cfg.block_size, memory=self.memory_bound)
            cost = cost.on_nodes(self.topology.ranks_per_node)  # the planner's and DST's nodes
            self._price_long_documents(self.corpus.lengths())
        plan = PlanConfig(
            world_size=self.num_ranks,
            micro_batches=cfg.micro_batches,
            capacity=cfg.capacity,
            strategy=cfg.strategy,
            overlong=cfg.overlong,
            cp_degree=cfg.cp,
            ranks_per_node=self.topology.ranks_per_node,
            pipeline_stages=cfg.pp,
            stage_layers=() if self.stage is None else self.stage.layout.split,  # what the stages run
            pipeline_virtual=cfg.pp_virtual,
            pipeline_schedule=cfg.pp_schedule,
        )
        engine = StepEngine(
            plan,
            self.latency,
            cfg.dst,
            self.sample,
            kernel=self.kernel,
            world_size=self.num_ranks,  # the processes averaged: pipelines, not their stages
            estimator=cfg.estimator,
            all_gather=self.rt.all_gather_object,
            cost=cost,
            per_doc_weighting=cfg.per_doc_loss_weighting,
            deterministic=cfg.deterministic,
        )
        self.estimator = engine.estimator
        note = f"sparsebalance train: {engine.knob.note(lengths)}"
        if rt.is_main and rt.first_time(note):  # the demo's two runs share it: said once
            print(note, file=sys.stderr, flush=True)
        return engine

    def _runner(self) -> StepRunner:
        """The own loop's step: the engine, this rank's executor (over the parallelized model,
        or this rank's pipeline stage) and the optimizer update."""
        cfg, rt = self.cfg, self.rt
        if self.stage is None:
            every = cfg.fsdp_sync_every_micro_batch
            self.par = parallelize(
                self.model,
                rt,
                cfg.parallel,
                cfg.measure_bubble,
                fsdp_sync_every_micro_batch=every,
                precision=self.precision,
            )
            self.params = [p for p in self.model.parameters() if p.requires_grad]
        else:  # gradients are averaged by the pipeline executor, after its schedule
            self.par = Parallelized(
                self.model, self.model, "single", cfg.measure_bubble, rt.world_size, Clock(rt.device)
            )
            self.params = [p for p in self.stage.parameters_owned() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.scaler = self.precision.grad_scaler()  # fp16's loss scaling, None otherwise
        execution = ExecutionConfig(
            block_size=self.kernel.block_size,
            per_doc_weighting=cfg.per_doc_loss_weighting,
            loss=cfg.loss,
        )
        if self.stage is None:
            executor = RankExecutor(
                self.par,
                self.corpus.docs,
                self.engine,
                execution,
                rt.device,
                precision=self.precision,
                scaler=self.scaler,
                ring_groups=self._ring_groups(),
            )
            norm = None
        else:
            groups = PipelineGroups.create(self.stage.layout, self.stage.tied, cfg.comm_timeout)
            executor = PipelineExecutor(
                self.stage,
                groups,
                self.corpus.docs,
                self.engine,
                execution,
                rt.device,
                self.precision,
                self.par.clock,
                schedule=cfg.pp_schedule,
            )
            norm = executor.grad_norm
        update = UpdateConfig(grad_clip=cfg.grad_clip, max_nonfinite_steps=cfg.max_nonfinite_steps)
        updater = Updater(
            self.params,
            self.optimizer,
            self.scheduler,
            update,
            scaler=self.scaler,
            is_main=rt.is_main,
            norm=norm,
            keep_gradients=self.par.keeps_gradients,
        )
        return StepRunner(
            self.engine,
            executor,
            updater,
            self.par,
            rt,
            emulated=bool(cfg.emulate_ranks),
            labels=(cfg.strategy, cfg.dst.mode),
            stages=cfg.pp,
        )

    def _ring_groups(self) -> RingGroups | None:
        """``sab-cp`` on several processes: the ring groups, created once (every rank, same
        order), and on CUDA the watch that turns a stuck ring transfer into one line."""
        if self.cfg.strategy != "sab-cp" or not self.rt.distributed:
            return None
        groups = RingGroups.create(self.cfg.comm_timeout, self.rt.device)
        if self.rt.device.type == "cuda" and RING_WAITS.device_waits is None:
            RING_WAITS.device_waits = DeviceWaits(self.rt.rank, self.cfg.comm_timeout)
            RING_WAITS.device_waits.start()
        return groups

    def _price_long_documents(self, lengths: np.ndarray) -> None:
        """``sab-cp`` prices whole documents longer than one rank's micro-batch with the
        profile's fitted form: said once (rank 0) instead of a warning on every rank."""
        note = long_document_note(self.latency, lengths)
        if note is not None:
            warnings.filterwarnings("ignore", category=OutsideGridWarning)
            if self.rt.is_main:
                print(note, file=sys.stderr)

    def _lr_factor(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        if cfg.schedule == "cosine":
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        if cfg.schedule == "linear":
            return max(0.1, 1.0 - 0.9 * frac)
        return 1.0

    # ------------------------------------------------------------------ data
    def next_batch(self) -> list[Sample]:
        """The next ``global_batch`` documents (seeded mixture sampler; same on every rank)."""
        return self.data.next_batch()

    def sample(self, index: int) -> Sample:
        """The corpus document ``index`` as a :class:`Sample` (length from the store offsets)."""
        return self.data.sample(index)

    @property
    def tuner(self) -> DSTTuner:
        """DST's step-level tuner."""
        return self.engine.tuner

    def run_step(self) -> StepResult:
        """One step on the next global batch (:class:`StepRunner`); advances ``self.step``. With
        ``--plan-ahead`` the step was planned during the previous one, and this one plans the
        next (:mod:`.ahead`)."""
        pending, self._ahead = self._ahead, None
        if pending is None:
            batch = self.next_batch()
            counts = self.data.metrics()["documents"]  # documents per --data component
        else:
            batch, counts = pending.tuned, pending.documents
        # the last step plans one more too: its checkpoint then extends exactly (--steps larger)
        hook = self._plan_next if self.plan_ahead else None
        result = self.runner.run(batch, self.step + 1, hook)
        self.step += 1
        report = replace(result.report, data_documents=counts, planned_ahead=pending is not None and pending.shadowed)
        return replace(result, report=report)

    def _plan_next(self) -> None:
        with watch.at(step=self.step + 2, where="planning the next step ahead (--plan-ahead)"):
            self._ahead = plan_ahead.plan_next(self.data, self.engine)

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        return {
            "step": self.step,
            # --plan-ahead: the position before the next step's batch, re-planned on resume
            "data": self.data.state_dict() if self._ahead is None else self._ahead.data_state,
            "ahead": None if self._ahead is None else {"engine": self._ahead.engine_state},
            # the latency calibration, the estimator and sab-cp's recalibrated ring terms
            **self.engine.state_dict(),
            "grad_scaler": None if self.scaler is None else self.scaler.state_dict(),
            "vocab_map": self.corpus.vocab_map,
            "config": to_dict(self.cfg),
        }

    def save(self) -> None:
        rngs = self.rt.all_gather_object(rng_state())
        save = save_checkpoint
        if self.stage is not None:
            objects = self.runner.executor.groups.objects
            save = partial(save_pipeline_checkpoint, self.stage, self.rt, group=objects)
        save(
            self.run_dir,
            self.step,
            self.model,
            self.optimizer,
            self.scheduler,
            self._state(),
            rngs,
            self.rt.is_main,
            keep_last=self.cfg.keep_checkpoints,
        )
        self.rt.barrier()

    def _resume_checkpoint(self) -> Path:
        """The checkpoint to resume from: rank 0 chooses and verifies it, checks it belongs to
        this run and tells every rank (:func:`choose_checkpoint`); one line per skipped
        checkpoint and per allowed change."""
        path, lines = choose_checkpoint(self.run_dir, self.cfg, self.data.state_dict()["identity"], self.rt)
        for line in lines:
            build.say(self.rt, line)
        return path

    def _resumed_capacity(self, fitted: int) -> int:
        """``--capacity auto`` on ``--resume``: the capacity the run started with (rank 0 reads
        its checkpoint; every rank plans with it), said when a fresh fit (``fitted``) differs."""
        saved = self.rt.broadcast_object(saved_capacity(self._checkpoint) if self.rt.is_main else None)
        if saved is None:
            return fitted
        if saved != fitted:
            line = f"--resume: --capacity auto keeps the run's {saved} tokens (a fresh start fits {fitted})"
            build.say(self.rt, line)
        return saved

    def _resume(self) -> None:
        path = self._checkpoint
        if self.stage is None:
            state = load_checkpoint(path, self.model, self.optimizer, self.scheduler, runtime=self.rt)
        else:
            groups = self.runner.executor.groups
            state = load_pipeline_checkpoint(path, self.stage, self.optimizer, self.scheduler, self.rt, groups.objects)
        # The LR of the next step follows this run's schedule (its --steps may have changed),
        # not the one the checkpoint's scheduler last computed.
        factor = self._lr_factor(self.scheduler.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * factor
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        tr = state["trainer"]
        if "data" not in tr:
            raise ValueError(
                f"--resume: {path} predates data identities (no sampler state): it cannot be "
                "resumed exactly; start a new run"
            )
        self.data.load_state_dict(tr["data"])
        if tr.get("vocab_map") != self.corpus.vocab_map:
            raise ValueError("--resume: the checkpoint's compact vocabulary differs from this one")
        self.step = tr["step"]
        self.engine.load_state_dict(tr)
        self._resume_ahead(tr.get("ahead"))
        if self.scaler is not None and tr.get("grad_scaler"):
            self.scaler.load_state_dict(tr["grad_scaler"])
        set_rng_state(state["rng"][self.rt.rank])

    def _resume_ahead(self, saved: dict | None) -> None:
        """The step the saving run had planned ahead, re-planned exactly (:func:`.ahead.replan`);
        without --plan-ahead now it is planned after the feedback, as this run plans."""
        if saved is None or self.step >= self.cfg.steps:
            return
        if self.plan_ahead:
            self._ahead = plan_ahead.replan(saved["engine"], self.data, self.engine)
        else:
            build.say(
                self.rt,
                f"--resume: step {self.step + 1} was planned ahead by the saving run (--plan-ahead); this run "
                f"plans each step after the last one's feedback (--plan-ahead {self.cfg.plan_ahead} on "
                f"{self.rt.device.type}), from the newer latency model: its plans and budgets follow that",
            )

    # ------------------------------------------------------------------ loop
    def _stop_if_asked(self, saved: bool) -> None:
        """At a step boundary: if any rank got SIGINT/SIGTERM, save (all ranks) and stop."""
        signum = self.stops.agreed(self.rt) if self.stops is not None else None
        if signum is None or self.step >= self.cfg.steps:
            return
        if not saved:
            self.save()
        name = signal.Signals(signum).name
        raise Stopped(
            signum,
            f"stopped by {name} after step {self.step}: checkpoint step-{self.step:06d} saved, continue with --resume",
        )

    def open_run(self, bar: bool = True) -> Telemetry:
        """Write the run folder and open its telemetry (``bar``: this run's own progress bar;
        :func:`~.interleave.run_interleaved` shows one for its runs)."""
        cfg = self.cfg
        build.write_run_folder(self.rt, cfg, self._stale, self.latency, self.topology, self.data)
        label = f"{cfg.strategy}+dst-{cfg.dst.mode}"
        return Telemetry(self.run_dir, cfg.steps, self.step, self.rt.is_main, label, bar=bar)

    def run(self) -> dict:
        cfg = self.cfg
        tel = self.open_run()
        summaries = []
        stops = self.stops.deferred() if self.stops is not None else contextlib.nullcontext()
        start = self.step
        try:
            with stops:
                while self.step < cfg.steps:
                    result = self.run_step()
                    tel.log(self.step, result)
                    summaries.append(result.report.to_log())
                    periodic = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                    if periodic and self.step < cfg.steps:
                        self.save()
                    self._stop_if_asked(saved=bool(periodic))
                if self.step > start:  # a resume with nothing left to run keeps its checkpoint as is
                    self.save()
        finally:
            tel.close()
        return {
            "steps": self.step,
            "losses": [s["loss"] for s in summaries],
            "summaries": summaries,
        }
