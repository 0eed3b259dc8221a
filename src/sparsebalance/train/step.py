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


def run_filler(trainer) -> None:
    """A two-token forward/backward that contributes nothing to the gradients (loss x 0)."""
    batch = pack([np.zeros(2, dtype=np.int64)], trainer.rt.device)
    ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=1.0), trainer.cfg.block_size,
                          trainer.cfg.backend)  # fmt: skip
    out = trainer.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                        sb_attention=ctx, use_cache=False).logits  # fmt: skip
    (out.float().sum() * 0.0).backward()


def run_rank(trainer, plan, decision, rank: int, loss_scale: float) -> dict:
    """One (real or emulated) rank's share of the step: its micro-batches, forward + backward."""
    cfg, latency = trainer.cfg, trainer.latency
    mine = decision.ranks[rank]
    controller = None
    if cfg.dst.mode != "off" and plan.ranks[rank]:
        controller = LayerController.from_decision(mine, plan.ranks[rank], latency, cfg.dst)
    pairs = list(zip(plan.ranks[rank], plan.offsets[rank], strict=True))
    fsdp = cfg.parallel == "fsdp2"
    # FSDP2 issues collectives in every forward/backward: all ranks must run as many passes.
    passes = max(len(r) for r in plan.ranks) if fsdp else len(pairs)
    results = []
    for m in range(passes):
        if fsdp:
            trainer.model.set_requires_gradient_sync(m == passes - 1)  # sync on the last only
        if m < len(pairs):
            mb, offs = pairs[m]
            results.append(run_microbatch(trainer, m, mb, offs, controller, mine.gamma, loss_scale))
        else:  # a zero-weight filler pass keeps this rank's collectives in step with the others
            run_filler(trainer)
    layer_gammas = [g for r in results for g in r.gammas]
    dens = [np.mean(d) for r in results for d in r.layer_densities]
    return {
        "compute_s": sum(r.seconds for r in results),
        "loss_sum": sum(r.loss_sum for r in results),
        "weight": sum(r.weight_sum for r in results),
        "tokens": sum(sum(r.lengths) for r in results),
        "microbatch_s": [r.seconds for r in results],
        "predicted_before_s": mine.predicted_before,
        "predicted_s": mine.predicted_after,
        "gamma": mine.gamma,
        "dst_role": mine.role,
        "target_s": mine.target_seconds,
        "gamma_min": min(layer_gammas, default=mine.gamma),
        "gamma_mean": float(np.mean(layer_gammas)) if layer_gammas else mine.gamma,
        "gamma_max": max(layer_gammas, default=mine.gamma),
        "density": float(np.mean(dens)) if dens else 0.0,
        "feedback": [
            (r.lengths, r.layer_densities, r.seconds, r.sample_ids, r.gammas) for r in results
        ],
    }


def train_step(trainer, samples: list[Sample]) -> tuple[list[dict], dict]:
    """Run one step; returns (per-rank records, step summary), identical on every rank.

    Under torchrun each process runs its own rank. With ``--emulate-ranks R`` one process runs
    the R ranks' micro-batches in turn (each timed alone): the step time of R ranks is then
    ``max(rank compute) + sync``, a real measurement of compute imbalance without a cluster.
    """
    cfg, rt, latency = trainer.cfg, trainer.rt, trainer.latency
    t_step = time.perf_counter()
    world = trainer.num_ranks
    plan = plan_batch(
        samples,
        latency,
        PlanConfig(world, cfg.micro_batches, cfg.capacity, cfg.strategy, cfg.overlong),
        estimator=trainer.estimator,
    )
    hashes = rt.all_gather_object(plan.hash())
    if len(set(hashes)) != 1:
        raise RuntimeError(f"ranks derived different plans (hashes {hashes}): inputs diverged")
    decision = trainer.tuner.decide(plan.ranks, latency)
    # Every rank's loss is a share of the global mean over all weighted tokens.
    global_weight = sum(
        trainer.label_weight(mb, offs)
        for rank_mbs, rank_offs in zip(plan.ranks, plan.offsets, strict=True)
        for mb, offs in zip(rank_mbs, rank_offs, strict=True)
    )
    # The all-reduce averages over processes; emulated ranks accumulate into one set of grads.
    loss_scale = rt.world_size / max(global_weight, 1e-9)
    if cfg.emulate_ranks:
        everyone = [run_rank(trainer, plan, decision, r, loss_scale) for r in range(world)]
        # The gradient all-reduce the emulated ranks would run: the profile's figure if it has
        # one (measured on CPU, analytic for GPUs), else 0 — recorded as sync time.
        sync = float(latency.profile.allreduce_seconds or 0.0)
        for e in everyone:
            e["bubble_s"], e["sync_s"] = 0.0, sync
    else:
        local = run_rank(trainer, plan, decision, rt.rank, loss_scale)
        t0 = time.perf_counter()
        rt.barrier()  # the wait for the slowest rank: the bubble
        local["bubble_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if cfg.parallel == "ddp":
            allreduce_gradients(trainer.params, rt.world_size)
        local["sync_s"] = sync = time.perf_counter() - t0
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
    computes = np.array([e["compute_s"] for e in everyone])
    step_s = time.perf_counter() - t_step
    if cfg.emulate_ranks:  # the emulated cluster's step: slowest rank, then sync and optimizer
        step_s = float(computes.max()) + sync + optim
    per_rank = [
        {"rank": r, **{k: v for k, v in e.items() if k not in ("loss_sum", "weight")},
         "derived_bubble_s": float(computes.max() - e["compute_s"])}
        for r, e in enumerate(everyone)
    ]  # fmt: skip
    tokens = sum(e["tokens"] for e in everyone)
    peak, mean = max(float(computes.max()), 1e-12), float(computes.mean())
    summary = {
        "loss": loss,
        "step_seconds": step_s,
        "max_compute_s": float(computes.max()),
        "mean_compute_s": mean,
        "efficiency": mean / peak,
        "imbalance": peak / max(mean, 1e-12),
        "bubble_fraction": 1 - mean / peak,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s,
        "optimizer_s": optim,
        "mean_density": float(np.mean([e["density"] for e in everyone])),
        "dst_anchor_seconds": decision.targets.anchor_seconds,
        "dst_post_cut_seconds": decision.targets.post_cut_seconds,
        "dst_budget_cut": decision.budget_cut,
        "dst_budget_given": decision.budget_given,
        "predicted_max_before_s": decision.step_seconds_before,
        "predicted_max_s": decision.step_seconds_after,
        "plan_hash": hashes[0],
        "strategy": cfg.strategy,
        "dst_mode": cfg.dst.mode,
        "plan_efficiency": plan.metrics.efficiency,
        "num_overlong": plan.metrics.num_overlong,
        "lr": trainer.scheduler.get_last_lr()[0],
        "emulated": bool(cfg.emulate_ranks),
    }
    return per_rank, summary
