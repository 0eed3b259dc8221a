"""One training step on one rank: plan (SAB) -> budgets (DST) -> forward/backward per micro-batch
-> wait at the sync (bubble) -> gradient all-reduce -> optimizer; measured and fed back."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..batching import PlanConfig, plan_batch
from ..data import pack
from ..models.attention import PackedAttention
from ..ops import Budget
from ..tuning import LayerController
from ..workload import Sample
from .runtime import allreduce_gradients

BACKWARD_RATIO = 3.0  # forward + backward ~ 3x forward: prices a layer before its backward runs


class NonFiniteLoss(RuntimeError):
    """The loss became NaN/inf; the step was not applied."""


@dataclass
class MicroBatchResult:
    seconds: float
    lengths: list[int]
    layer_densities: list[list[float]]  # (num_layers, N)
    gammas: list[float]  # per layer
    sample_ids: list[int]
    loss_sum: float
    weight_sum: float


def run_microbatch(
    trainer,
    m: int,
    mb,
    offsets,
    controller: LayerController | None,
    gamma: float,
    loss_scale: float,
) -> MicroBatchResult:
    cfg, rt = trainer.cfg, trainer.rt
    docs = [
        trainer.corpus.docs[i][o : o + n]
        for i, o, n in zip(mb.sample_ids, offsets, mb.lengths, strict=True)
    ]
    batch = pack(docs, rt.device, cfg.per_doc_loss_weighting)
    measure_layers = controller is not None and not cfg.deterministic and rt.device.type == "cpu"
    last = [time.perf_counter()]

    def on_layer_end(layer: int) -> None:
        now = time.perf_counter()
        if measure_layers:
            controller.observe(m, layer, (now - last[0]) * BACKWARD_RATIO)
        last[0] = now

    ctx = PackedAttention(
        batch.cu_seqlens,
        Budget(gamma=gamma),
        cfg.block_size,
        cfg.backend,
        choose_budget=(lambda layer, est: controller.choose(m, layer, est)) if controller else None,
        on_layer_end=on_layer_end,
    )
    t0 = time.perf_counter()
    last[0] = t0
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=rt.device.type == "cuda"):
        logits = trainer.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            sb_attention=ctx,
            use_cache=False,
        ).logits
    token_loss = F.cross_entropy(
        logits[0].float(), batch.labels[0], ignore_index=-100, reduction="none"
    )
    loss_sum = (token_loss * batch.loss_weights[0]).sum()
    (loss_sum * loss_scale).backward()
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    seconds = time.perf_counter() - t0
    layer_dens = [s.document_density for s in ctx.stats]
    return MicroBatchResult(
        seconds,
        list(mb.lengths),
        layer_dens,
        [s.gamma for s in ctx.stats],
        list(mb.sample_ids),
        float(loss_sum.detach()),
        float(batch.loss_weights.sum()),
    )


def train_step(trainer, samples: list[Sample]) -> tuple[list[dict], dict]:
    """Run one step; returns (per-rank records, step summary), identical on every rank."""
    cfg, rt, latency = trainer.cfg, trainer.rt, trainer.latency
    t_step = time.perf_counter()
    plan = plan_batch(
        samples,
        latency,
        PlanConfig(rt.world_size, cfg.micro_batches, cfg.capacity, cfg.strategy, cfg.overlong),
        estimator=trainer.estimator,
    )
    hashes = rt.all_gather_object(plan.hash())
    if len(set(hashes)) != 1:
        raise RuntimeError(f"ranks derived different plans (hashes {hashes}): inputs diverged")
    decision = trainer.tuner.decide(plan.ranks, latency)
    mine = decision.ranks[rt.rank]
    controller = None
    if cfg.dst.mode != "off" and plan.ranks[rt.rank]:
        controller = LayerController.from_decision(mine, plan.ranks[rt.rank], latency, cfg.dst)
    # Every rank's loss is a share of the global mean over all weighted tokens.
    global_weight = sum(
        trainer.label_weight(mb, offs)
        for rank_mbs, rank_offs in zip(plan.ranks, plan.offsets, strict=True)
        for mb, offs in zip(rank_mbs, rank_offs, strict=True)
    )
    loss_scale = rt.world_size / max(global_weight, 1e-9)  # the all-reduce averages over ranks
    results = [
        run_microbatch(trainer, m, mb, offs, controller, mine.gamma, loss_scale)
        for m, (mb, offs) in enumerate(zip(plan.ranks[rt.rank], plan.offsets[rt.rank], strict=True))
    ]
    compute = sum(r.seconds for r in results)
    t0 = time.perf_counter()
    rt.barrier()  # the wait for the slowest rank: the bubble
    bubble = time.perf_counter() - t0
    t0 = time.perf_counter()
    if cfg.parallel == "ddp":
        allreduce_gradients(trainer.params, rt.world_size)
    sync = time.perf_counter() - t0
    local = {
        "compute_s": compute,
        "bubble_s": bubble,
        "sync_s": sync,
        "loss_sum": sum(r.loss_sum for r in results),
        "weight": sum(r.weight_sum for r in results),
        "tokens": sum(sum(r.lengths) for r in results),
        "microbatch_s": [r.seconds for r in results],
        "predicted_before_s": mine.predicted_before,
        "predicted_s": mine.predicted_after,
        "gamma": mine.gamma,
        "layer_gammas": [g for r in results for g in r.gammas],
        "density": float(np.mean([np.mean(d) for r in results for d in r.layer_densities]))
        if results
        else 0.0,
        "feedback": [
            (r.lengths, r.layer_densities, r.seconds, r.sample_ids, r.gammas) for r in results
        ],
    }
    everyone = rt.all_gather_object(local)
    loss = sum(e["loss_sum"] for e in everyone) / max(sum(e["weight"] for e in everyone), 1e-9)
    if not math.isfinite(loss):
        trainer.optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLoss(
            f"non-finite loss ({loss}) at step {trainer.step + 1}; the step was not applied"
        )
    t0 = time.perf_counter()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(trainer.params, cfg.grad_clip)
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    optim = time.perf_counter() - t0
    trainer.feedback([e.pop("feedback") for e in everyone])
    step_s = time.perf_counter() - t_step
    computes = np.array([e["compute_s"] for e in everyone])
    per_rank = []
    for r, e in enumerate(everyone):
        lg = e.pop("layer_gammas")
        per_rank.append(
            {
                "rank": r,
                **{k: v for k, v in e.items() if k not in ("loss_sum", "weight")},
                "gamma_min": min(lg, default=e["gamma"]),
                "gamma_mean": float(np.mean(lg)) if lg else e["gamma"],
                "gamma_max": max(lg, default=e["gamma"]),
                "derived_bubble_s": float(computes.max() - e["compute_s"]),
            }
        )
    tokens = sum(e["tokens"] for e in everyone)
    summary = {
        "loss": loss,
        "step_seconds": step_s,
        "max_compute_s": float(computes.max()),
        "mean_compute_s": float(computes.mean()),
        "efficiency": float(computes.mean() / max(computes.max(), 1e-12)),
        "imbalance": float(computes.max() / max(computes.mean(), 1e-12)),
        "bubble_fraction": float(1 - computes.mean() / max(computes.max(), 1e-12)),
        "tokens": tokens,
        "tokens_per_s": tokens / step_s,
        "optimizer_s": optim,
        "mean_density": float(np.mean([e["density"] for e in everyone])),
        "predicted_max_before_s": decision.step_seconds_before,
        "predicted_max_s": decision.step_seconds_after,
        "plan_hash": hashes[0],
        "strategy": cfg.strategy,
        "dst_mode": cfg.dst.mode,
        "plan_efficiency": plan.metrics.efficiency,
        "num_overlong": plan.metrics.num_overlong,
        "lr": trainer.scheduler.get_last_lr()[0],
    }
    return per_rank, summary
