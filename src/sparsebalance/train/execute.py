"""Stage 3 of the step: one rank's units, forward + backward, each timed, with DST's per-layer
budgets; passes and gradient-sync contexts come from :class:`.Parallelized`.

A one-rank unit is a packed micro-batch on the whole model. A CP unit (k > 1 ranks) runs this
rank's striped shard through the ring (:mod:`.cp_unit`); its per-layer budgets come from a
controller of its own, built from the step decision alone (the unit's ranks share one budget) and
fed no measured times, so every rank of the unit chooses the same budget from the same estimate
without a message."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..batching import Unit
from ..data import pack
from ..latency import LatencyModel
from ..models.attention import PackedAttention
from ..ops import Budget
from ..parallel.p2p import ring_wait_seconds
from ..tuning import DSTConfig, Knob, LayerController
from ..workload import MicroBatch
from .cp_unit import unit_batch
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
    knob: Knob
    """DST's budget knob (top-k or gamma): turns the decisions' values into budgets."""
    device: torch.device
    block_size: int
    backend: str
    per_doc_weighting: bool
    time_layers: bool
    """Feed per-layer forward times to DST's closed loop (CPU, not ``--deterministic``)."""
    loss: str = "auto"
    """LM loss implementation (``train.loss``): auto | chunked | plain | liger."""
    _controllers: list[LayerController] = field(default_factory=list, init=False, repr=False)
    """This run's layer controllers (their decision time and coverage-bound stops)."""

    def run(self, step: TunedStep, rank: int) -> LocalWork:
        """Rank ``rank``'s units (real or emulated rank); ``perf_counter`` stamps."""
        planned = step.planned
        mine, units = step.decision.ranks[rank], planned.units
        controller = rank_controller(step, rank, self.latency, self.dst, self.knob)
        self._controllers = [] if controller is None else [controller]
        row = planned.rounds[rank]
        mine_units = [u for u in row if u is not None]
        passes = self.par.passes(len(mine_units), len(row))
        order = list(row) if self.par.kind == "fsdp2" else mine_units
        order += [None] * (passes - len(order))
        results, ready, m_solo = [], None, 0
        for m, u in enumerate(order):
            with self.par.microbatch(m, passes):
                if u is None:  # a zero-weight filler keeps this rank's collectives in step
                    ready = self.filler()
                elif units[u].degree > 1:
                    res, ready = self.cp_unit(units[u], rank, mine.budget, step.loss_scale)
                    results.append(res)
                else:
                    unit = units[u]
                    mb = MicroBatch(unit.sample_ids, unit.lengths, unit.densities)
                    res, ready = self.microbatch(m_solo, mb, unit.offsets, controller,
                                                 mine.budget, step.loss_scale)  # fmt: skip
                    results.append(replace(res, slot=unit.slot))
                    m_solo += 1
        done = time.perf_counter()
        record = RankRecord.from_results(mine, results)
        record.dst_layer_s = sum(c.decide_seconds for c in self._controllers)
        record.coverage_limited = sum(c.num_coverage_limited for c in self._controllers)
        return LocalWork([record], ready or done, done)

    def cp_unit(
        self, unit: Unit, rank: int, value: float, loss_scale: float
    ) -> tuple[MicroBatchResult, float]:
        """Forward + backward of this rank's shard of CP unit ``unit`` (see the module
        docstring); the result (this rank's loss share, the unit's layer densities)."""
        batch, ring = unit_batch(unit, rank, self.docs, self.block_size, self.device,
                                 self.per_doc_weighting)  # fmt: skip
        choose = None
        if self.dst.mode != "off":
            mb = MicroBatch(unit.sample_ids, unit.lengths, unit.densities)
            # Target: the unit's own prediction at its budget; fed no measured times, the
            # controller's choices depend on the shared estimates only (same on every rank).
            ctl = LayerController([mb], self.latency, self.dst, 0.0, value=value, knob=self.knob)
            ctl.target_seconds = float(ctl.planned.sum())
            self._controllers.append(ctl)
            choose = lambda layer, e: ctl.choose(0, layer, e)  # noqa: E731
        ctx = PackedAttention(batch.cu_seqlens, self.budget(value), self.block_size,
                              self.backend, choose_budget=choose, ring=ring)  # fmt: skip
        t0, wait0 = time.perf_counter(), ring_wait_seconds()
        result, ready = self._forward_backward(batch, ctx, loss_scale, t0, unit.lengths,
                                               unit.sample_ids)  # fmt: skip
        local = _real_tokens(ring.placement, unit.ranks.index(rank))
        result = replace(result, slot=unit.slot, unit_ranks=tuple(unit.ranks), ring=unit.ring,
                         ring_wait_s=ring_wait_seconds() - wait0, local_tokens=local)  # fmt: skip
        return result, ready

    def microbatch(
        self,
        m: int,
        mb: MicroBatch,
        offsets: Sequence[int],
        controller: LayerController | None,
        value: float,
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
        ctx = PackedAttention(batch.cu_seqlens, self.budget(value), self.block_size, self.backend,
                              choose_budget=choose, on_layer_end=on_layer_end)  # fmt: skip
        t0 = time.perf_counter()
        last[0] = t0
        return self._forward_backward(batch, ctx, loss_scale, t0, mb.lengths, mb.sample_ids)

    def _forward_backward(self, batch, ctx: PackedAttention, loss_scale: float, t0: float,
                          lengths: Sequence[int], sample_ids: Sequence[int],
                          ) -> tuple[MicroBatchResult, float]:  # fmt: skip
        """The packed loss, its backward (scaled by ``loss_scale``) and the micro-batch's
        result; ``ready``: when its gradients were handed to the sync (``t0``: its start)."""
        loss_sum = packed_loss(self.par.model, batch, ctx, self.loss)
        (loss_sum * loss_scale).backward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ready = self.par.ready_time() or time.perf_counter()
        result = MicroBatchResult(
            seconds=ready - t0,
            lengths=tuple(lengths),
            sample_ids=tuple(sample_ids),
            layer_densities=tuple(tuple(s.document_density) for s in ctx.stats),
            budgets=tuple(s.budget for s in ctx.stats),
            loss_sum=float(loss_sum.detach()),
            weight_sum=float(batch.loss_weights.sum()),
            start_s=t0,
        )
        return result, ready

    def budget(self, value: float) -> Budget:
        """The budget at knob ``value`` (the op's default anchors)."""
        return self.knob.budget(Budget(top_k=0), value)

    def filler(self) -> float:
        """A two-token forward/backward that adds nothing to the gradients (loss x 0); returns
        when its gradients were ready."""
        batch = pack([np.zeros(2, dtype=np.int64)], self.device)
        ctx = PackedAttention(batch.cu_seqlens, Budget(gamma=1.0), self.block_size, self.backend)
        out = self.par.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                             sb_attention=ctx, use_cache=False).logits  # fmt: skip
        (out.float().sum() * 0.0).backward()
        return self.par.ready_time() or time.perf_counter()


def rank_controller(
    step: TunedStep, rank: int, latency: LatencyModel, dst: DSTConfig, knob: Knob
) -> LayerController | None:
    """DST's closed-loop layer controller for rank ``rank``'s one-rank micro-batches of ``step``
    (None with ``--dst-mode off`` or when the rank has none); shared with the trainer
    integrations (:mod:`sparsebalance.integrations`). Micro-batch ``m`` of the controller is the
    rank's m-th one-rank micro-batch in plan order."""
    planned = step.planned
    plan, units = planned.plan, planned.units
    solo = [plan.ranks[rank][j] for j, u in enumerate(planned.rank_units[rank])
            if units[u].degree == 1]  # fmt: skip
    if dst.mode == "off" or not solo:
        return None
    controller = LayerController.from_decision(step.decision.ranks[rank], solo, latency, dst,
                                               knob=knob)  # fmt: skip
    if len(solo) < len(plan.ranks[rank]):  # its CP units are not the controller's
        controller.target_seconds = float(controller.planned.sum())
    return controller


def _real_tokens(placement, position: int) -> int:
    """Tokens of the pack (padding excluded) that placement rank ``position`` holds."""
    return int((placement.token_index(position) < placement.seq_len).sum())
