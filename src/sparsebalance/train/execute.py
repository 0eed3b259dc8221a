"""Stage 3 of the step: one rank's micro-batches, forward + backward, each timed, with DST's
per-layer budgets; passes and gradient-sync contexts come from :class:`.Parallelized`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..data import pack
from ..latency import LatencyModel
from ..models.attention import PackedAttention
from ..ops import Budget
from ..tuning import DSTConfig, LayerController
from ..workload import MicroBatch
from .loss import packed_loss
from .parallelize import Parallelized
from .records import LocalWork, MicroBatchResult, RankRecord, TunedStep

BACKWARD_RATIO = 3.0  # forward + backward ~ 3x forward: prices a layer before its backward runs


@dataclass
class RankExecutor:
    """Runs a rank's share of a :class:`TunedStep` on the (parallelized) model."""

    par: Parallelized
    docs: Sequence[np.ndarray]
    """Token ids of every document of the corpus (indexed by sample id)."""
    latency: LatencyModel
    dst: DSTConfig
    device: torch.device
    block_size: int
    backend: str
    per_doc_weighting: bool
    time_layers: bool
    """Feed per-layer forward times to DST's closed loop (CPU, not ``--deterministic``)."""
    loss: str = "auto"
    """LM loss implementation (``train.loss``): auto | chunked | plain | liger."""

    def run(self, step: TunedStep, rank: int) -> LocalWork:
        """Rank ``rank``'s micro-batches (real or emulated rank); ``perf_counter`` stamps."""
        plan, mine = step.planned.plan, step.decision.ranks[rank]
        controller = None
        if self.dst.mode != "off" and plan.ranks[rank]:
            controller = LayerController.from_decision(mine, plan.ranks[rank], self.latency,
                                                       self.dst)  # fmt: skip
        pairs = list(zip(plan.ranks[rank], plan.offsets[rank], strict=True))
        passes = self.par.passes(len(pairs), max(len(r) for r in plan.ranks))
        results, ready = [], None
        for m in range(passes):
            with self.par.microbatch(m, passes):
                if m < len(pairs):
                    mb, offs = pairs[m]
                    res, ready = self.microbatch(m, mb, offs, controller, mine.gamma,
                                                 step.loss_scale)  # fmt: skip
                    results.append(res)
                else:  # a zero-weight filler keeps this rank's collectives in step with the others
                    ready = self.filler()
        done = time.perf_counter()
        return LocalWork([RankRecord.from_results(mine, results)], ready or done, done)

    def microbatch(
        self,
        m: int,
        mb: MicroBatch,
        offsets: Sequence[int],
        controller: LayerController | None,
        gamma: float,
        loss_scale: float,
    ) -> tuple[MicroBatchResult, float]:
        """Forward + backward of micro-batch ``m``; the result and when its gradients were ready
        (for an overlapped sync: when the last bucket was handed over, before the wait)."""
        docs = [self.docs[i][o : o + n] for i, o, n in zip(mb.sample_ids, offsets, mb.lengths,
                                                            strict=True)]  # fmt: skip
        batch = pack(docs, self.device, self.per_doc_weighting)
        last = [time.perf_counter()]

        def on_layer_end(layer: int) -> None:
            now = time.perf_counter()
            if self.time_layers and controller is not None:
                controller.observe(m, layer, (now - last[0]) * BACKWARD_RATIO)
            last[0] = now

        choose = None if controller is None else (lambda layer, e: controller.choose(m, layer, e))
        ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=gamma), self.block_size, self.backend,
                              choose_budget=choose, on_layer_end=on_layer_end)  # fmt: skip
        t0 = time.perf_counter()
        last[0] = t0
        loss_sum = packed_loss(self.par.model, batch, ctx, self.loss)
        (loss_sum * loss_scale).backward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ready = self.par.ready_time() or time.perf_counter()
        result = MicroBatchResult(
            seconds=ready - t0,
            lengths=tuple(mb.lengths),
            sample_ids=tuple(mb.sample_ids),
            layer_densities=tuple(tuple(s.document_density) for s in ctx.stats),
            gammas=tuple(s.gamma for s in ctx.stats),
            loss_sum=float(loss_sum.detach()),
            weight_sum=float(batch.loss_weights.sum()),
        )
        return result, ready

    def filler(self) -> float:
        """A two-token forward/backward that adds nothing to the gradients (loss x 0); returns
        when its gradients were ready."""
        batch = pack([np.zeros(2, dtype=np.int64)], self.device)
        ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=1.0), self.block_size, self.backend)
        out = self.par.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                             sb_attention=ctx, use_cache=False).logits  # fmt: skip
        (out.float().sum() * 0.0).backward()
        return self.par.ready_time() or time.perf_counter()
