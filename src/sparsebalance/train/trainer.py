"""``Trainer``: builds every stage once (data, model, latency model, estimator, planner config,
tuner, parallelism, optimizer) and runs steps (:mod:`.step`), with checkpoints and telemetry."""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import signal
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from .. import flags
from ..batching import make_estimator
from ..data import load_tokenizer
from ..data.batches import BatchSource
from ..data.dataset import (
    DataSource,
    apply_vocabulary,
    compact_vocabulary,
    open_corpus,
    resolve_data,
)
from ..data.mixture import MixtureSampler
from ..data.store import is_store
from ..engine import (
    ExecutionConfig,
    PlanningConfig,
    RankExecutor,
    StepEngine,
    StepRunner,
    UpdateConfig,
    Updater,
    load_latency_model,
    resolve_kernel,
)
from ..engine.parallelize import parallelize
from ..engine.records import StepResult
from ..engine.runtime import Runtime, rng_state, seed_everything, set_rng_state
from ..engine.stages import layer_feedback
from ..latency import LatencyModel, OutsideGridWarning, context_cost, fingerprint, load_profile
from ..latency.memory import (
    GIB,
    MemoryBound,
    MemoryConfig,
    MemoryModel,
    auto_capacity,
    current_rss_bytes,
    device_coefficients,
    parse_bytes,
    with_budget_fraction,
)
from ..latency.memory_fit import find_calibration, memory_fingerprint
from ..models import ModelShapes, check_attention, check_trainable
from ..models.checkpointing import apply_activation_checkpointing
from ..models.hf import build_model
from ..parallel.groups import RingGroups
from ..parallel.p2p import RING_WAITS
from ..parallel.watch import DeviceWaits
from ..precision import resolve_precision
from ..tuning import DSTTuner
from ..workload import Sample
from .checkpoint import clean_temporaries, load_checkpoint, save_checkpoint
from .config import RUN_FILES, RUN_STATE, TrainConfig, resolve_strategy, to_dict, to_record
from .multinode import Topology, launcher_placement, node_leaders, resolve_on_nodes
from .resume import choose_checkpoint
from .signals import Stopped, StopSignals
from .telemetry import Telemetry


def batch_schedule(seed: int, num_docs: int, global_batch: int, steps: int) -> list[list[int]]:
    """Document indices of each step's global batch for one unfiltered source of ``num_docs``
    documents, exactly as :meth:`Trainer.next_batch` draws them."""
    sampler = MixtureSampler([np.arange(num_docs)], [1.0], seed, global_batch)
    return [[i for _, i in sampler.next_batch()] for _ in range(steps)]


def profile_length(cfg: TrainConfig, lengths: np.ndarray) -> int:
    """Longest micro-batch the latency profile must cover: ``--capacity`` (with ``--micro-batches``
    the longest document), but never more than the ``--global-batch`` longest documents together
    (a capacity of 10^6 with short documents must not profile 10^6 tokens), and at least 256
    tokens (the quick profile needs two lengths; ``--capacity 64`` is valid)."""
    if isinstance(cfg.capacity, int):
        top = min(cfg.capacity, int(np.sort(lengths)[-cfg.global_batch :].sum()))
    else:
        top = max(cfg.max_len or 0, int(lengths.max()))
    return max(top, 256)


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
        self.cfg = cfg
        self.rt = rt = runtime or Runtime.init(cfg.device, cfg.comm_timeout)
        self.precision = resolve_precision(cfg.precision, rt.device)
        # block, backend and precision on this device, checked before anything compiles
        self.kernel = resolve_kernel(rt.device, cfg.block_size, cfg.backend, cfg.precision)
        if cfg.emulate_ranks and rt.distributed:
            raise ValueError("--emulate-ranks runs in one process: launch it with --nproc 1")
        self.num_ranks = cfg.emulate_ranks or rt.world_size
        self.cfg = cfg = resolve_strategy(cfg, self.num_ranks)  # --strategy auto
        if cfg.cp is not None and self.num_ranks % cfg.cp:
            raise ValueError(
                f"--cp {cfg.cp} must divide the world size ({self.num_ranks}): the ranks form "
                "world / K context-parallel groups"
            )
        # every rank's launcher variables: the topology and which rank writes each node's caches
        self._placements = rt.all_gather_object(launcher_placement())
        self.topology = self._topology()
        seed_everything(cfg.seed)
        self.run_dir = Path(cfg.out)
        named = flags.given(cfg, "model", cfg.model)  # --model M, or TrainConfig.model='M'
        check_trainable(cfg.model, named)  # a type or an attention it cannot run: before building
        tokenizer = load_tokenizer(cfg.tokenizer)
        corpus = open_corpus(self._resolve_data(tokenizer), cfg.min_len, cfg.max_len)
        self.model = build_model(cfg.model, rt.device, torch.float32, seed=cfg.seed)
        check_attention(self.model.config, named)  # as built: defaults the file left out
        apply_activation_checkpointing(self.model, cfg.activation_checkpointing)
        vocab = int(self.model.config.vocab_size)
        if corpus.max_token_id() >= vocab:
            corpus = apply_vocabulary(corpus, compact_vocabulary(corpus, vocab))
        self.corpus = corpus
        if cfg.global_batch < self.num_ranks:
            raise ValueError(
                f"--global-batch {cfg.global_batch} is smaller than the {self.num_ranks} ranks: "
                "every rank needs at least one document per step"
            )
        self.data = BatchSource(corpus, cfg.seed, cfg.global_batch)
        # --resume: the same run or a refusal, decided before anything expensive (profiling)
        self._checkpoint = self._resume_checkpoint() if cfg.resume else None
        self.stops: StopSignals | None = None
        """Set by the worker entry point: SIGINT/SIGTERM stop at a step boundary, saved."""
        shapes = ModelShapes.from_hf_config(self.model.config.to_dict(), name=Path(cfg.model).name)
        self.memory_bound: MemoryBound | None = None
        """``--capacity auto``: the memory model and budget; ``sab-cp`` takes each document's
        minimum CP degree from it."""
        if cfg.capacity == "auto":
            self.cfg = cfg = replace(cfg, capacity=self._auto_capacity(shapes, base_rss))
        self.latency = load_latency_model(
            shapes,
            self.kernel,
            cfg.dst.budget,
            cfg.profile,
            profile_length(cfg, self.corpus.lengths()),
            rt.is_main,
            rt.all_gather_object,
        )
        tuner = DSTTuner(cfg.dst, block_size=cfg.block_size)
        self.estimator = make_estimator(cfg.estimator, tuner.knob)
        if rt.is_main:
            print(f"sparsebalance train: {tuner.knob.note(corpus.lengths())}", file=sys.stderr, flush=True)
        self.par = parallelize(self.model, rt, cfg.parallel, cfg.measure_bubble)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.scaler = self.precision.grad_scaler()  # fp16's loss scaling, None otherwise
        self.engine = self._engine(tuner, shapes)
        self.runner = self._runner()
        self.step = 0
        earlier = [self.run_dir / n for n in RUN_STATE if (self.run_dir / n).exists()]
        if cfg.resume:
            self._resume()
        elif earlier and not cfg.overwrite:
            raise ValueError(
                f"--out {self.run_dir} holds an earlier run "
                f"({', '.join(p.name for p in earlier)}): pass --resume to continue it or "
                "--overwrite to replace it"
            )
        # --overwrite: the earlier run's outputs go (launch-config.json is this launch's)
        stale = [p for n in RUN_FILES if (p := self.run_dir / n).exists()]
        self._stale = [p for p in stale if p.name != "launch-config.json"] if cfg.overwrite else []

    # ------------------------------------------------------------------ setup
    def _engine(self, tuner: DSTTuner, shapes: ModelShapes) -> StepEngine:
        """The step engine over this run's latency model, tuner and estimator; ``sab-cp``
        prices split documents with a ``ContextCost`` (measured links, else analytic H100)."""
        cfg, cost = self.cfg, None
        if cfg.strategy == "sab-cp":
            cost = context_cost(self.latency, "h100", shapes, block_size=cfg.block_size, memory=self.memory_bound)
            cost = cost.on_nodes(self.topology.ranks_per_node)  # the planner's and DST's nodes
            self._price_long_documents(self.corpus.lengths())
        planning = PlanningConfig(
            num_ranks=self.num_ranks,
            micro_batches=cfg.micro_batches,
            capacity=cfg.capacity,
            strategy=cfg.strategy,
            overlong=cfg.overlong,
            cp_degree=cfg.cp,
            ranks_per_node=self.topology.ranks_per_node,
            per_doc_weighting=cfg.per_doc_loss_weighting,
            deterministic=cfg.deterministic,
        )
        return StepEngine(
            planning,
            self.latency,
            tuner,
            self.estimator,
            self.sample,
            all_gather=self.rt.all_gather_object,
            cost=cost,
            device=self.rt.device,
        )

    def _runner(self) -> StepRunner:
        """The own loop's step: the engine, this rank's executor and the optimizer update."""
        cfg, rt = self.cfg, self.rt
        time_layers = layer_feedback(cfg.dst, cfg.deterministic, rt.device)
        execution = ExecutionConfig(
            block_size=self.kernel.block_size,
            backend=self.kernel.backend,
            per_doc_weighting=cfg.per_doc_loss_weighting,
            time_layers=time_layers,
            loss=cfg.loss,
        )
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
        update = UpdateConfig(grad_clip=cfg.grad_clip, max_nonfinite_steps=cfg.max_nonfinite_steps)
        updater = Updater(self.params, self.optimizer, self.scheduler, update, scaler=self.scaler, is_main=rt.is_main)
        return StepRunner(
            self.engine,
            executor,
            updater,
            self.par,
            rt,
            emulated=bool(cfg.emulate_ranks),
            labels=(cfg.strategy, cfg.dst.mode),
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

    def _topology(self) -> Topology:
        """Which ranks share a node: ``--ranks-per-node``, else the launcher's (checked to agree
        on every rank), else one node. Emulated ranks have no launcher."""
        cfg = self.cfg
        reported = [] if cfg.emulate_ranks else self._placements
        topology, note = Topology.from_launcher(self.num_ranks, reported, cfg.ranks_per_node)
        if note:
            self._say(f"note: {note}")
        return topology

    def _resolve_data(self, tokenizer) -> list[DataSource]:
        """Rank 0 resolves ``--data`` (preparing raw inputs into the cache once) while the others
        wait; every rank then maps rank 0's stores. A node that cannot see them (its own cache)
        uses the stores its first rank (``LOCAL_RANK`` 0) resolves alone (:func:`resolve_on_nodes`):
        one writer per node-local cache."""
        cfg = self.cfg

        def resolve():
            return resolve_data(
                cfg.data,
                tokenizer,
                cfg.text_field,
                cfg.num_builtin,
                cfg.seed,
                cfg.min_len,
                cfg.max_len,
                on_bad_record=cfg.on_bad_record,
                progress=self.rt.is_main,
            )

        def usable(sources) -> bool:
            return all(is_store(s.store) for s in sources)

        leaders = node_leaders(self._placements)
        return resolve_on_nodes(resolve, usable, self.rt.rank, leaders, self.rt.all_gather_object)

    def _auto_capacity(self, shapes: ModelShapes, base_rss: int) -> int:
        """``--capacity auto``: the largest micro-batch whose predicted peak fits the budget (the
        smallest over ranks, so every rank plans with the same bound). The memory model uses the
        coefficients ``sparsebalance profile --memory`` measured for this setup (from
        ``--profile``'s ``meta["memory"]`` or the cache) when there are some, else the analytic
        ones; the line printed says which."""
        cfg, dev = self.cfg, self.rt.device
        analytic = device_coefficients(dev, base_rss)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", True))
        kernel = self.kernel
        running = memory_fingerprint(fingerprint(shapes, dev, kernel.precision, kernel.backend, cfg.block_size), tied)
        meta = load_profile(cfg.profile).meta if cfg.profile else None
        cal, source = find_calibration(running, meta, checkpointing=cfg.activation_checkpointing)
        coeffs = cal.coefficients(analytic) if cal is not None else analytic
        budget = parse_bytes(cfg.memory_budget) if cfg.memory_budget else with_budget_fraction(coeffs)
        mem_cfg = MemoryConfig(
            cfg.activation_checkpointing,
            "plain" if cfg.loss == "plain" else "chunked",
            shard=self.rt.world_size if cfg.parallel == "fsdp2" else 1,
            block_size=cfg.block_size,
        )
        mine = MemoryModel(shapes, coeffs, tied)
        # Every rank plans with the most constrained rank's model (same plan, same hash).
        gathered = self.rt.all_gather_object((auto_capacity(mine, budget, mem_cfg), coeffs, budget))
        cap, coeffs, budget = min(gathered, key=lambda g: g[0])
        memory = MemoryModel(shapes, coeffs, tied)
        self.memory_bound = MemoryBound(memory, budget, mem_cfg)
        self.memory_source = source  # measured or analytic coefficients (tests read it)
        if self.rt.is_main:
            print(
                f"sparsebalance train: --capacity auto = {cap} tokens per micro-batch (predicted "
                f"peak {memory.peak_bytes(cap, mem_cfg) / GIB:.2f} GiB of a "
                f"{budget / GIB:.2f} GiB budget, {coeffs.name}; {source})",
                file=sys.stderr,
            )
        return cap

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
    @property
    def epoch(self) -> int:
        return self.data.epoch

    def next_batch(self) -> list[Sample]:
        """The next ``global_batch`` documents (seeded mixture sampler; same on every rank)."""
        return self.data.next_batch()

    def sample(self, index: int) -> Sample:
        """The corpus document ``index`` as a :class:`Sample` (length from the store offsets)."""
        return self.data.sample(index)

    @property
    def tuner(self) -> DSTTuner:
        """DST's step-level tuner (replaceable: the accuracy benchmark's dense variant)."""
        return self.engine.tuner

    @tuner.setter
    def tuner(self, tuner: DSTTuner) -> None:
        self.engine.tuner = tuner

    def run_step(self) -> StepResult:
        """One step on the next global batch (:class:`StepRunner`); advances ``self.step``."""
        result = self.runner.run(self.next_batch(), self.step + 1)
        self.step += 1
        counts = self.data.metrics()["documents"]  # documents per --data component
        return replace(result, report=replace(result.report, data_documents=counts))

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        return {
            "step": self.step,
            "data": self.data.state_dict(),
            # the latency calibration, the estimator and sab-cp's recalibrated ring terms
            **self.engine.state_dict(),
            "grad_scaler": None if self.scaler is None else self.scaler.state_dict(),
            "vocab_map": self.corpus.vocab_map,
            "config": to_dict(self.cfg),
        }

    def save(self) -> None:
        rngs = self.rt.all_gather_object(rng_state())
        save_checkpoint(
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
            self._say(line)
        return path

    def _say(self, line: str) -> None:
        if self.rt.is_main:
            print(f"sparsebalance train: {line}", file=sys.stderr, flush=True)

    def _resume(self) -> None:
        path = self._checkpoint
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler, runtime=self.rt)
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
        if self.scaler is not None and tr.get("grad_scaler"):
            self.scaler.load_state_dict(tr["grad_scaler"])
        set_rng_state(state["rng"][self.rt.rank])

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

    def run(self) -> dict:
        cfg = self.cfg
        if self.rt.is_main:
            for path in self._stale:  # --overwrite: the earlier run's files go
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for path in clean_temporaries(self.run_dir):  # an interrupted save's leftovers
                self._say(f"removed {path.name}, left by an interrupted checkpoint save")
            (self.run_dir / "config.json").write_text(json.dumps(to_record(cfg), indent=1, default=str))
            self.latency.profile.save(self.run_dir / "latency_profile.json")  # what planned it
            topology = self.topology.describe()
            (self.run_dir / "topology.json").write_text(json.dumps(topology) + "\n")
            data = self.data.describe()
            (self.run_dir / "data.json").write_text(json.dumps(data, indent=1) + "\n")
            for comp in data["components"]:
                if comp["usable"] < comp["documents"]:
                    dropped = comp["documents"] - comp["usable"]
                    print(
                        f"data {comp['name']}: {dropped} of {comp['documents']} documents "
                        f"filtered out ({comp['filtered']})"
                    )
        label = f"{cfg.strategy}+dst-{cfg.dst.mode}"
        tel = Telemetry(self.run_dir, cfg.steps, self.step, self.rt.is_main, label)
        summaries = []
        stops = self.stops.deferred() if self.stops is not None else contextlib.nullcontext()
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
                self.save()
        finally:
            tel.close()
        return {
            "steps": self.step,
            "losses": [s["loss"] for s in summaries],
            "summaries": summaries,
        }
