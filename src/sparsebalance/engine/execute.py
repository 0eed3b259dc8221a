"""Stage 3 of the step: one rank's units, forward + backward, each timed, with DST's per-layer
budgets; passes and gradient-sync contexts come from :class:`.Parallelized`.

A one-rank unit is a packed micro-batch on the whole model. A CP unit (k > 1 ranks) runs this
rank's striped shard through the ring (:mod:`.cp_unit`); its per-layer budgets come from a
controller of its own, built from the step decision alone (the unit's ranks share one budget) and
fed no measured times, so every rank of the unit chooses the same budget from the same estimate
without a message.

Time is device time (:mod:`sparsebalance.clock`): a mark at each micro-batch's start and when its
gradients are ready (the DDP comm hook's last bucket, else the end of its backward), resolved
with the layer statistics and the losses after *one* synchronize at the end of the rank's run.
Nothing inside a micro-batch waits for the device (on CPU, where the host does the work, the
marks are ``perf_counter`` stamps as before). DST's per-layer closed loop reads host times per
layer and runs on CPU only (:attr:`.StepEngine.layer_times`); on CUDA the layer controller decides from predicted
times inside the step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..clock import Clock, Mark, use_clock
from ..data import pack
from ..models.attention import LayerStats, PackedAttention
from ..parallel import watch
from ..parallel.groups import RingGroups
from ..parallel.p2p import RING_WAITS
from ..precision import Precision, resolve_precision
from .cp_unit import unit_batch
from .engine import StepEngine
from .loss import packed_loss
from .parallelize import Parallelized
from .records import LocalWork, MicroBatchResult, TunedStep


@dataclass(frozen=True)
class ExecutionConfig:
    """How a rank's micro-batches run (the own trainer's executor)."""

    block_size: int
    """Tokens per sparsity block (a CP unit's shards are striped in blocks)."""
    per_doc_weighting: bool = False
    """Every document's tokens share one total loss weight (LongAlign)."""
    loss: str = "auto"
    """LM loss implementation (:mod:`.loss`): auto | chunked | plain | liger."""


@dataclass
class _Timed:
    """A micro-batch before its times and statistics are read: marks, device tensors."""

    start: Mark
    ready: Mark
    lengths: tuple[int, ...]
    sample_ids: tuple[int, ...]
    stats: list[LayerStats]
    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    extra: dict = field(default_factory=dict)
    """``MicroBatchResult`` fields of a CP unit (slot, unit ranks, ring, local tokens)."""
    waits: tuple[int, int] = (0, 0)
    """Its ring waits: ``RING_WAITS.pairs[waits[0]:waits[1]]``."""

    def resolve(self, clock: Clock, origin: Mark) -> MicroBatchResult:
        """After the synchronize: seconds relative to ``origin``, Python floats."""
        return MicroBatchResult.from_stats(
            clock.seconds(self.start, self.ready),
            self.lengths,
            self.sample_ids,
            self.stats,
            self.loss_sum,
            self.weight_sum,
            start_s=clock.seconds(origin, self.start),
            ring_wait_s=RING_WAITS.seconds(*self.waits) if self.waits[1] else 0.0,
            **self.extra,
        )


@dataclass
class RankExecutor:
    """Runs a rank's share of a :class:`TunedStep` on the (parallelized) model."""

    par: Parallelized
    docs: Sequence[np.ndarray]
    """Token ids of every document of the corpus (indexed by sample id)."""
    engine: StepEngine
    """Every micro-batch's attention context and the rank's record come from it."""
    config: ExecutionConfig
    device: torch.device
    precision: Precision | None = None
    """Compute precision (autocast) of every forward, fillers included; None: the device's
    default (``--precision auto``)."""
    scaler: torch.amp.GradScaler | None = None
    """fp16's loss scaling (scales every backward); None otherwise."""
    ring_groups: RingGroups | None = None
    """The ring groups CP units talk on (created once by the trainer); None: default group."""

    def __post_init__(self) -> None:
        if self.precision is None:
            self.precision = resolve_precision("auto", self.device)

    @property
    def clock(self) -> Clock:
        return self.par.clock

    def run(
        self, step: TunedStep, rank: int, origin: Mark | None = None, ahead: Callable[[], None] | None = None
    ) -> LocalWork:
        """Rank ``rank``'s units (real or emulated rank); times in seconds after ``origin`` (a
        mark of :attr:`clock`; default: now), read after one synchronize at the end. ``ahead``
        (``--plan-ahead``): host work run once every unit is launched, before that wait, so it
        overlaps the device's share of the step."""
        clock = self.clock
        origin = origin or clock.mark()
        with use_clock(clock):
            timed, ready, done = self._run(step, rank)
            if ahead is not None:
                ahead()
            clock.synchronize()  # the step's one wait for the device: every mark is complete
            results = [t.resolve(clock, origin) for t in timed]
            ready_s = clock.seconds(origin, ready or done)
            done_s = clock.seconds(origin, done)
            RING_WAITS.fold()
        return LocalWork([self.engine.record(step, rank, results)], ready_s, done_s)

    def _run(self, step: TunedStep, rank: int) -> tuple[list[_Timed], Mark | None, Mark]:
        planned = step.planned
        units, position = planned.units, {u: j for j, u in enumerate(planned.rank_units[rank])}
        row = planned.rounds[rank]
        mine_units = [u for u in row if u is not None]
        passes = self.par.passes(len(mine_units), len(row))
        order = list(row) if self.par.kind == "fsdp2" else mine_units
        order += [None] * (passes - len(order))
        results, ready = [], None
        for m, u in enumerate(order):
            with self.par.microbatch(m, passes):
                if u is None:  # a zero-weight filler keeps this rank's collectives in step
                    ready = self.filler(step, rank)
                elif units[u].degree > 1:
                    with watch.at(unit=units[u].slot, ring_step=None):
                        res, ready = self.cp_unit(step, rank, position[u], step.loss_scale)
                    results.append(res)
                else:
                    res, ready = self.microbatch(step, rank, position[u], step.loss_scale)
                    res.extra["slot"] = units[u].slot
                    results.append(res)
        return results, ready, self.clock.mark()

    def cp_unit(self, step: TunedStep, rank: int, j: int, loss_scale: float) -> tuple[_Timed, Mark]:
        """Forward + backward of this rank's shard of CP unit ``j`` (in the rank's plan order;
        see the module docstring); the result (this rank's loss share, the unit's layer
        densities)."""
        cfg = self.config
        unit = step.planned.units[step.planned.rank_units[rank][j]]
        batch, ring = unit_batch(
            unit, rank, self.docs, cfg.block_size, self.device, cfg.per_doc_weighting, self.ring_groups
        )
        ctx = self.engine.attention(step, rank, j, batch.cu_seqlens, unit.lengths, ring=ring)
        t0, wait0 = self.clock.mark(), len(RING_WAITS)
        result, ready = self._forward_backward(batch, ctx, loss_scale, t0, unit.lengths, unit.sample_ids)
        local = _real_tokens(ring.placement, unit.ranks.index(rank))
        result.extra.update(slot=unit.slot, unit_ranks=tuple(unit.ranks), ring=unit.ring, local_tokens=local)
        result.waits = (wait0, len(RING_WAITS))
        return result, ready

    def microbatch(self, step: TunedStep, rank: int, j: int, loss_scale: float) -> tuple[_Timed, Mark]:
        """Forward + backward of the rank's micro-batch ``j`` (plan order); the result and when
        its gradients were ready (for an overlapped sync: when the last bucket was handed over,
        before the wait)."""
        unit = step.planned.units[step.planned.rank_units[rank][j]]
        docs = [self.docs[i][o : o + n] for i, o, n in zip(unit.sample_ids, unit.offsets, unit.lengths, strict=True)]
        batch = pack(docs, self.device, self.config.per_doc_weighting)
        t0 = self.clock.mark()  # before the context: DST's closed loop times the first layer too
        ctx = self.engine.attention(step, rank, j, batch.cu_seqlens, batch.lengths, start=t0.host)
        return self._forward_backward(batch, ctx, loss_scale, t0, unit.lengths, unit.sample_ids)

    def _forward_backward(
        self,
        batch,
        ctx: PackedAttention,
        loss_scale: float,
        t0: Mark,
        lengths: Sequence[int],
        sample_ids: Sequence[int],
    ) -> tuple[_Timed, Mark]:
        """The packed loss, its backward (scaled by ``loss_scale``, and by fp16's loss scale)
        and the micro-batch's record; ``ready``: when its gradients were handed to the sync
        (``t0``: its start). Nothing here waits for the device."""
        loss_sum = packed_loss(
            self.par.model,
            batch,
            ctx,
            self.config.loss,
            precision=self.precision,
            uniform_weights=not self.config.per_doc_weighting,
        )
        scaled = loss_sum * loss_scale
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        ready = self.par.ready_time() or self.clock.mark()
        timed = _Timed(
            t0, ready, tuple(lengths), tuple(sample_ids), list(ctx.stats), loss_sum.detach(), batch.loss_weights.sum()
        )
        return timed, ready

    def filler(self, step: TunedStep, rank: int) -> Mark:
        """A two-token forward/backward that adds nothing to the gradients (loss x 0), under the
        run's autocast like every micro-batch (one dtype per run: no graph of its own); returns
        when its gradients were ready."""
        batch = pack([np.zeros(2, dtype=np.int64)], self.device)
        ctx = self.engine.attention(step, rank, None, batch.cu_seqlens, batch.lengths)
        with self.precision.autocast():
            out = self.par.model(
                input_ids=batch.input_ids, position_ids=batch.position_ids, sb_attention=ctx, use_cache=False
            ).logits
        (out.float().sum() * 0.0).backward()
        return self.par.ready_time() or self.clock.mark()


def _real_tokens(placement, position: int) -> int:
    """Tokens of the pack (padding excluded) that placement rank ``position`` holds."""
    return int((placement.token_index(position) < placement.seq_len).sum())
