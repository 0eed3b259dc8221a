"""``Trainer``: builds every stage once (data, model, latency model, estimator, planner config,
tuner, parallelism, optimizer) and runs steps (:mod:`.step`), with checkpoints and telemetry."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import torch

from ..batching import HistoryEstimator
from ..data import load_corpus, load_tokenizer
from ..data.dataset import apply_vocabulary, compact_vocabulary
from ..latency import LatencyModel, Profile, default_latency_model, fingerprint, load_profile
from ..models import ModelShapes
from ..models.hf import build_model
from ..tuning import DSTTuner
from ..workload import Sample
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig, to_dict
from .execute import RankExecutor
from .parallelize import parallelize
from .records import StepResult
from .runtime import Runtime, rng_state, seed_everything, set_rng_state
from .step import StepRunner
from .telemetry import Telemetry


def training_kernel(device, backend: str) -> tuple[str, str]:
    """(dtype, attention backend) a run uses on ``device``: bf16 + flex on CUDA, fp32 + torch on
    CPU, unless ``--backend`` names one."""
    if device.type == "cuda":
        return "bf16", "flex" if backend == "auto" else backend
    return "fp32", "torch" if backend == "auto" else backend


def epoch_order(seed: int, epoch: int, num_docs: int) -> np.ndarray:
    """The documents' order in one epoch (seeded; the same on every rank and in every run)."""
    return np.random.default_rng([seed, epoch]).permutation(num_docs)


def next_position(epoch: int, cursor: int, num_docs: int, global_batch: int) -> tuple[int, int]:
    """Where the next global batch starts: a new epoch when this one's tail is too short (the tail
    is dropped, so a batch never holds the same document twice)."""
    return (epoch + 1, 0) if cursor + global_batch > num_docs else (epoch, cursor)


def batch_schedule(seed: int, num_docs: int, global_batch: int, steps: int) -> list[list[int]]:
    """Document indices of each step's global batch, exactly as :meth:`Trainer.next_batch`."""
    out, epoch, cursor = [], 0, 0
    for _ in range(steps):
        epoch, cursor = next_position(epoch, cursor, num_docs, global_batch)
        order = epoch_order(seed, epoch, num_docs)
        out.append([int(i) for i in order[cursor : cursor + global_batch]])
        cursor += global_batch
    return out


class Trainer:
    def __init__(self, cfg: TrainConfig, runtime: Runtime | None = None):
        self.cfg = cfg
        self.rt = rt = runtime or Runtime.init(cfg.device)
        if cfg.emulate_ranks and rt.distributed:
            raise ValueError("--emulate-ranks runs in one process: launch it with --nproc 1")
        self.num_ranks = cfg.emulate_ranks or rt.world_size
        seed_everything(cfg.seed)
        self.run_dir = Path(cfg.out)
        tokenizer = load_tokenizer(cfg.tokenizer)
        corpus = self._on_main_first(
            lambda: load_corpus(
                cfg.data,
                tokenizer,
                cfg.text_field,
                cfg.num_builtin,
                cfg.seed,
                cfg.min_len,
                cfg.max_len,
                on_bad_record=cfg.on_bad_record,
            )
        )
        self.model = build_model(cfg.model, rt.device, torch.float32, seed=cfg.seed)
        vocab = int(self.model.config.vocab_size)
        if corpus.max_token_id() >= vocab:
            corpus = apply_vocabulary(corpus, compact_vocabulary(corpus, vocab))
        self.corpus = corpus
        if cfg.global_batch > len(corpus):
            raise ValueError(
                f"--global-batch {cfg.global_batch} exceeds the dataset's {len(corpus)} documents"
            )
        if cfg.global_batch < self.num_ranks:
            raise ValueError(
                f"--global-batch {cfg.global_batch} is smaller than the {self.num_ranks} ranks: "
                "every rank needs at least one document per step"
            )
        shapes = ModelShapes.from_hf_config(self.model.config.to_dict(), name=Path(cfg.model).name)
        self.latency = self._latency_model(shapes)
        self.estimator = HistoryEstimator()
        self.par = parallelize(self.model, rt, cfg.parallel, cfg.measure_bubble)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        time_layers = not cfg.deterministic and rt.device.type == "cpu"
        executor = RankExecutor(self.par, corpus.docs, self.latency, cfg.dst, rt.device,
                                cfg.block_size, cfg.backend, cfg.per_doc_loss_weighting,
                                time_layers)  # fmt: skip
        self.runner = StepRunner(
            cfg, rt, self.num_ranks, self.latency, self.estimator, DSTTuner(cfg.dst), self.par,
            executor, self.params, self.optimizer, self.scheduler, self.sample,
        )  # fmt: skip
        self.step, self.epoch, self.cursor = 0, 0, 0
        self.order = self._epoch_order(0)
        earlier = [
            self.run_dir / n
            for n in ("metrics.jsonl", "checkpoints")
            if (self.run_dir / n).exists()
        ]
        if cfg.resume:
            self._resume()
        elif earlier and not cfg.overwrite:
            raise ValueError(
                f"--out {self.run_dir} holds an earlier run "
                f"({', '.join(p.name for p in earlier)}): pass --resume to continue it or "
                "--overwrite to replace it"
            )
        self._stale = [] if cfg.resume else earlier

    # ------------------------------------------------------------------ setup
    def _on_main_first(self, fn):
        """Run ``fn`` on rank 0 first (it fills caches), then on the others."""
        if self.rt.is_main:
            out = fn()
        self.rt.barrier()
        if not self.rt.is_main:
            out = fn()
        return out

    def _latency_model(self, shapes: ModelShapes) -> LatencyModel:
        """Rank 0 loads (or measures) the profile and sends it to every rank, so all ranks plan
        with the same model even across nodes with different caches."""
        cfg, dev = self.cfg, self.rt.device
        dtype, backend = training_kernel(dev, cfg.backend)
        profile = None
        if self.rt.is_main:
            if cfg.profile:
                profile = load_profile(cfg.profile)
                profile.check_fingerprint(fingerprint(shapes, dev, dtype, backend, cfg.block_size))
            else:
                top = cfg.capacity or max(cfg.max_len or 0, int(self.corpus.lengths().max()))
                profile = default_latency_model(
                    shapes, dev, dtype, backend, cfg.block_size, max_len=top
                ).profile
        data = self.rt.all_gather_object(profile.to_json() if profile is not None else None)[0]
        return LatencyModel(Profile.from_json(data))

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
    def _epoch_order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.cfg.seed, epoch, len(self.corpus))

    def next_batch(self) -> list[Sample]:
        """The next ``global_batch`` documents in the seeded order (same on every rank)."""
        g = self.cfg.global_batch
        epoch, self.cursor = next_position(self.epoch, self.cursor, len(self.corpus), g)
        if epoch != self.epoch:
            self.epoch, self.order = epoch, self._epoch_order(epoch)
        ids = self.order[self.cursor : self.cursor + g]
        self.cursor += g
        return [Sample(int(i), len(self.corpus.docs[i]), self.corpus.sources[i]) for i in ids]

    def sample(self, index: int) -> Sample:
        """The corpus document ``index`` as a :class:`Sample`."""
        return Sample(index, len(self.corpus.docs[index]), self.corpus.sources[index])

    @property
    def tuner(self) -> DSTTuner:
        """DST's step-level tuner (replaceable: the accuracy benchmark's dense variant)."""
        return self.runner.tuner

    @tuner.setter
    def tuner(self, tuner: DSTTuner) -> None:
        self.runner.tuner = tuner

    def run_step(self) -> StepResult:
        """One step on the next global batch (:class:`StepRunner`); advances ``self.step``."""
        result = self.runner.run(self.next_batch(), self.step + 1)
        self.step += 1
        return result

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        return {
            "step": self.step,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "latency": self.latency.state_dict(),
            "estimator": self.estimator.state_dict(),
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
            fsdp=self.par.sharded,
        )
        self.rt.barrier()

    def _resume(self) -> None:
        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise ValueError(f"--resume: no checkpoint in {self.run_dir / 'checkpoints'}")
        state = load_checkpoint(path, self.model, self.optimizer, self.scheduler,
                                fsdp=self.par.sharded)  # fmt: skip
        tr = state["trainer"]
        self.step, self.epoch, self.cursor = tr["step"], tr["epoch"], tr["cursor"]
        self.order = self._epoch_order(self.epoch)
        self.latency.load_state_dict(tr["latency"])
        self.estimator.load_state_dict(tr["estimator"])
        set_rng_state(state["rng"][self.rt.rank])

    # ------------------------------------------------------------------ loop
    def run(self) -> dict:
        cfg = self.cfg
        if self.rt.is_main:
            for path in self._stale:  # --overwrite: the earlier run's files go
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(
                json.dumps(to_dict(cfg), indent=1, default=str)
            )
            self.latency.profile.save(self.run_dir / "latency_profile.json")  # what planned it
        label = f"{cfg.strategy}+dst-{cfg.dst.mode}"
        tel = Telemetry(self.run_dir, cfg.steps, self.step, self.rt.is_main, label)
        summaries = []
        try:
            while self.step < cfg.steps:
                result = self.run_step()
                tel.log(self.step, result)
                summaries.append(result.summary.to_json())
                if (
                    cfg.checkpoint_every
                    and self.step % cfg.checkpoint_every == 0
                    and self.step < cfg.steps
                ):
                    self.save()
            self.save()
        finally:
            tel.close()
        return {
            "steps": self.step,
            "losses": [s["loss"] for s in summaries],
            "summaries": summaries,
        }
