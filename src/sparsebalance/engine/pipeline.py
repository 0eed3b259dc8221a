"""Stage 3 of the step with ``--pp P``: this rank's stage of its pipeline runs the pipeline's
micro-batches in the 1F1B order (PyTorch's ``Schedule1F1B``, Megatron-LM's default; the order is
:func:`sparsebalance.batching.schedule.schedule_order`, the one the simulator prices; interleaved
with ``--pp-virtual``), or with ``--pp-schedule zb-h1`` in the zero-bubble order
(:func:`sparsebalance.batching.zero_bubble.zb_order`: each backward is the input's gradient only,
sent at once, and a later W op runs the linear layers' weight GEMMs, :mod:`.deferred_weights`),
then the gradients are summed and averaged.

Shapes: every rank holds the step's plan, so every stage knows each micro-batch's token count and
receives exactly ``(1, T_m, H)``: no padding to a fixed capacity and no shape exchange (Megatron
exchanges shapes for packed batches; ``torch.distributed.pipelining``'s stages fix their receive
buffers at the first step's shapes). The attention metadata (pack, budgets, DST's per-layer
choices) is built on each stage from the shared plan (:meth:`.StepEngine.attention`), never sent.

Per step and micro-batch boundary the schedule sends one tensor each way (activations forward,
their gradients back: ``isend`` + ``recv``; from pinned host memory when a CUDA stage sends over
gloo); nothing else waits. The gradients' reduction over the stage's data-parallel peers starts
inside the stage's last backward of the step (:meth:`PipelineExecutor._arm_reduction`): with
``--parallel ddp`` buckets are all-reduced as their gradients complete (interleaved, each chunk's
from its own last backward on; zero bubble, the deferred weights' from the last W) and the tied
embedding's two copies are summed (:class:`.StageGradients`); with ``--parallel fsdp2``
(:meth:`.StageModel.shard`) the stage is gathered before the schedule and stays gathered through
it, its gradients accumulate unsharded, and the last backward reduce-scatters them (interleaved,
each chunk's last backward its units'; a pipeline without micro-batches joins with a two-token pass
at zero loss per chunk, :meth:`PipelineExecutor._reduce_shards`):
every unit all-gathers once and reduce-scatters once per step, and no forward waits for a peer
pipeline. The global gradient norm for clipping sums the stages' squares
(:meth:`PipelineExecutor.grad_norm`).

Each micro-batch's record is the whole model's: its stages' forward + backward seconds summed (what
the latency model predicts for a micro-batch), each stage's (forward, backward) seconds
(``stage_seconds``: what :mod:`.stage_calibration` learns the stages' pricing from), their layers'
densities and budgets in layer order, the loss of the last stage; the pipeline's record adds
per-stage busy and idle time (the bubbles).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..batching.interleaved import settled_sends, virtual_order
from ..batching.zero_bubble import zb_order
from ..clock import Clock, Mark, use_clock
from ..data import pack
from ..precision import Precision
from .deferred_weights import DeferredWeights
from .engine import StepEngine
from .execute import ExecutionConfig
from .pipeline_groups import PipelineGroups
from .records import LocalWork, MicroBatchResult, TunedStep
from .stage import PipelineLayout, StageModel
from .stage_gradients import StageGradients, embedded_rows


@dataclass
class _Op:
    """One micro-batch on one chunk of this stage (the stage, without ``--pp-virtual``): its
    batch (shared by its chunks), context, tensors kept for its backward, marks."""

    unit: object
    batch: object
    ctx: object = None
    inputs: torch.Tensor | None = None
    output: torch.Tensor | None = None
    marks: list[tuple[Mark, Mark]] = field(default_factory=list)


@dataclass
class PipelineExecutor:
    """Runs this rank's stage of its pipeline's share of a :class:`TunedStep` (see the module
    docstring); the planned rank is the data-parallel pipeline."""

    stage: StageModel
    groups: PipelineGroups
    docs: Sequence[np.ndarray]
    engine: StepEngine
    config: ExecutionConfig
    device: torch.device
    precision: Precision
    clock: Clock
    scaler: torch.amp.GradScaler | None = None
    schedule: str = "1f1b"
    """``--pp-schedule``: ``1f1b`` (interleaved with ``--pp-virtual``) or ``zb-h1`` (each backward
    split into B and W, :mod:`sparsebalance.batching.zero_bubble`; ``--parallel ddp``, V = 1)."""

    def __post_init__(self) -> None:
        # what crosses between stages lives where the backend sends from: NCCL sends device
        # tensors (no host copy, no wait), gloo host ones (one device-to-host copy per send)
        nccl = self.device.type == "cuda" and dist.get_backend() == "nccl"
        self.wire = self.device if nccl else torch.device("cpu")
        self.gradients = None if self.stage.sharded else StageGradients(self.stage, self.groups)
        """``--parallel ddp``: the stage's reduction, started in its last backward."""
        self.deferred = DeferredWeights(self.stage) if self.schedule == "zb-h1" else None
        """Zero bubble: the linear layers' weight GEMMs, moved from each B to its W."""

    @property
    def layout(self) -> PipelineLayout:
        return self.stage.layout

    def run(
        self, step: TunedStep, rank: int, origin: Mark | None = None, ahead: Callable[[], None] | None = None
    ) -> LocalWork:
        """This stage's forwards and backwards, the gradient sync, and the pipeline's record
        (``rank``: the world rank, unused: the pipeline is this rank's layout's; ``ahead``: as
        :meth:`RankExecutor.run <.execute.RankExecutor.run>`'s, before the device wait)."""
        clock, layout = self.clock, self.layout
        origin = origin or clock.mark()
        with use_clock(clock):
            if self.stage.sharded:  # FSDP2: gathered before the schedule, not in a timed forward
                self.stage.gather()
            ops, sends = self._schedule(step)
            for work, _tensor in sends.values():  # the tensor stays alive until its send is done
                work.wait()
            ready = clock.mark()
            self._sync_gradients(step, ran_backward=bool(ops))
            done = clock.mark()
            if ahead is not None:
                ahead()
            clock.synchronize()  # the step's one wait for the device
            mine = [self._result(chunks, origin) for chunks in ops]
            busy = sum(clock.seconds(a, b) for chunks in ops for op in chunks for a, b in op.marks)
            stage = {"busy_s": busy, "span_s": clock.seconds(origin, ready)}
            if self.deferred is not None:  # zero bubble: the W's share of the busy time
                stage["weight_s"] = sum(clock.seconds(*op.marks[2]) for chunks in ops for op in chunks)
            times = (clock.seconds(origin, ready), clock.seconds(origin, done))
        gathered = [None] * layout.stages
        objects = self.groups.pipeline_objects or self.groups.pipeline  # gloo when the default is NCCL
        dist.all_gather_object(gathered, (mine, stage, times), group=objects)
        split, v = self.stage.split, layout.virtual
        results = [_merge(parts, split, v) for parts in zip(*(g[0] for g in gathered), strict=True)]
        record = self.engine.record(step, layout.dp, results)
        span = max(g[1]["span_s"] for g in gathered)
        record.stages = [
            {
                "stage": s,
                "busy_s": g[1]["busy_s"],
                "idle_s": max(span - g[1]["busy_s"], 0.0),
                "chunks": v,
                **({"schedule": self.schedule, "weight_s": g[1]["weight_s"]} if "weight_s" in g[1] else {}),
            }
            for s, g in enumerate(gathered)
        ]
        ready_s, done_s = (max(g[2][i] for g in gathered) for i in (0, 1))
        return LocalWork([record], ready_s, done_s)

    def _schedule(self, step: TunedStep) -> tuple[list[list[_Op]], dict]:
        """The 1F1B order (interleaved with ``--pp-virtual``: :func:`.virtual_order`) of this
        stage's micro-batches: per micro-batch, its chunks' ops; the sends still in flight. A send
        is dropped (its wait returns at once) when a receive proves its peer received it
        (:func:`.settled_sends`), so a stage holds the sends of the micro-batches in flight, not
        of all of them."""
        planned, dp = step.planned, self.layout.dp
        units = [planned.units[u] for u in planned.rank_units[dp]]
        if any(u.degree > 1 for u in units):
            raise ValueError("--pp: a context-parallel unit in the plan (sab-cp cannot run in a pipeline)")
        layout = self.layout
        ops: list[list[_Op]] = []
        for unit in units:
            docs = [
                self.docs[i][o : o + n] for i, o, n in zip(unit.sample_ids, unit.offsets, unit.lengths, strict=True)
            ]
            batch = pack(docs, self.device, self.config.per_doc_weighting)
            ops.append([_Op(unit, batch) for _ in range(layout.virtual)])
        sends: dict = {}
        settled = settled_sends(layout.stages, layout.virtual, len(ops), layout.stage)  # W's send nothing
        if self.deferred is not None:
            order = zb_order(layout.stages, len(ops), layout.stage)
        else:
            order = virtual_order(layout.stages, layout.virtual, len(ops), layout.stage)
        # each chunk's last backward: its gradients' reduction starts inside it (zero bubble: the
        # last B for what B makes, the last W for the deferred weights)
        lasts = {c: i for i, (kind, _, c) in enumerate(order) if kind == "B"}
        arm_at, final = {i: c for c, i in lasts.items()}, max(lasts.values(), default=None)
        last_w = max((i for i, (kind, _, _) in enumerate(order) if kind == "W"), default=None)
        for i, (kind, m, c) in enumerate(order):
            done = [sends.pop(k) for k in settled.get((kind, m, c), [])]
            if kind == "F":
                self._forward(step, m, c, ops[m][c], sends, done)
            elif kind == "W":
                self._weights(m, ops[m][c], final=i == last_w)
            else:
                if i in arm_at:
                    self._arm_reduction(None if layout.virtual == 1 else arm_at[i], final=i == final)
                self._backward(m, c, ops[m][c], step.loss_scale, sends, done)
        if self.deferred is not None and self.deferred.pending:  # every B has its W in zb_order
            raise RuntimeError(f"zero bubble: deferred weight gradients left unrun ({sorted(self.deferred.pending)})")
        return ops, sends

    def _group(self, kind: str, chunk: int, step: int):
        """The group carrying ``kind``'s message between this rank's ``chunk`` and the virtual
        stage ``step`` (+1 / -1) away: one direction per group and pair of ranks."""
        p = self.layout.stages
        k = chunk * p + self.layout.stage
        wraps = k // p != (k + step) // p  # between rank P-1 and rank 0 (interleaved only)
        if kind == "F":
            return self.groups.wrap_activations if wraps else self.groups.activations
        return self.groups.wrap_gradients if wraps else self.groups.gradients

    def _arm_reduction(self, chunk: int | None, final: bool) -> None:
        """Before a chunk's last backward of the step (``chunk`` None: the stage's, one chunk):
        DDP's buckets of its parameters all-reduce as their gradients complete
        (:class:`.StageGradients`); FSDP2 reduce-scatters each of the chunk's units in its
        post-backward, and in the stage's last backward of all (``final``) reshards every unit
        (:meth:`.StageModel.sync_in_next_backward`)."""
        if self.gradients is not None:
            self.gradients.arm(chunk)
        if self.stage.sharded:
            self.stage.sync_in_next_backward(chunk or 0, final)

    def _forward(self, step: TunedStep, m: int, c: int, op: _Op, sends: dict, done: list) -> None:
        layout, batch = self.layout, op.batch
        first, last = layout.first_chunk(c), layout.last_chunk(c)
        if first:
            x = batch.input_ids
        else:
            shape = self.stage.hidden_shape(sum(batch.lengths))
            x = wire_buffer(shape, self.stage.hidden_dtype, self.device, self.wire)
            dist.recv(x, layout.peer(c, -1)[0], group=self._group("F", c, -1))
            _release(done)
            x = x.to(self.device, non_blocking=True).requires_grad_()
        t0 = self.clock.mark()
        op.ctx = self.engine.attention(step, layout.dp, m, batch.cu_seqlens, batch.lengths, start=t0.host)
        with self.precision.autocast():
            out = self.stage(x, batch.position_ids, op.ctx, c)
            if last:
                out = self.stage.loss(out, batch, self.config.loss, not self.config.per_doc_weighting)
        op.inputs, op.output = (None if first else x), out
        op.marks.append((t0, self.clock.mark()))
        if not last:
            sent = to_wire(out.detach(), self.wire)
            to = layout.peer(c, 1)[0]
            sends[("F", m, c)] = (dist.isend(sent, to, group=self._group("F", c, 1)), sent)

    def _backward(self, m: int, c: int, op: _Op, loss_scale: float, sends: dict, done: list) -> None:
        layout = self.layout
        first, last = layout.first_chunk(c), layout.last_chunk(c)
        if not last:
            grad = wire_buffer(op.output.shape, op.output.dtype, self.device, self.wire)
            dist.recv(grad, layout.peer(c, 1)[0], group=self._group("B", c, 1))
            _release(done)
        t0 = self.clock.mark()
        if self.deferred is not None:
            self.deferred.begin(m)
        if last:
            scaled = op.output * loss_scale
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        else:
            op.output.backward(grad.to(self.device, non_blocking=True))
        if self.deferred is not None:
            self.deferred.end()
        op.marks.append((t0, self.clock.mark()))
        if not first:
            sent = to_wire(op.inputs.grad, self.wire)
            to = layout.peer(c, -1)[0]
            sends[("B", m, c)] = (dist.isend(sent, to, group=self._group("B", c, -1)), sent)
        # its activations are freed now; the last virtual stage keeps the loss (detached) for the record
        op.inputs, op.output = None, (op.output.detach() if last else None)

    def _weights(self, m: int, op: _Op, final: bool) -> None:
        """Zero bubble's W of micro-batch ``m``: its deferred weight GEMMs; the step's last W hands
        each weight's final gradient to the data-parallel buckets."""
        ready = self.gradients.ready if final and self.gradients is not None else None
        t0 = self.clock.mark()
        self.deferred.run(m, ready)
        op.marks.append((t0, self.clock.mark()))

    def _result(self, chunks: list[_Op], origin: Mark) -> MicroBatchResult:
        """This stage's share of one micro-batch (after the synchronize): its chunks' seconds
        summed; its ``stage_seconds``: this stage's (forward, backward) seconds (each chunk's
        marks: the forward's, then the backward's), zero bubble (forward, B + W, W) (the marks'
        third: the W's); its layers' statistics in chunk order."""
        forward = sum(self.clock.seconds(*op.marks[0]) for op in chunks)
        backward = sum(self.clock.seconds(*op.marks[1]) for op in chunks)
        weight = sum(self.clock.seconds(*op.marks[2]) for op in chunks) if self.deferred is not None else None
        seconds = (forward, backward) if weight is None else (forward, backward + weight, weight)
        backward += weight or 0.0
        head, tail = chunks[0], chunks[-1]
        loss = tail.output if self.layout.last else 0.0
        weight = tail.batch.loss_weights.sum() if self.layout.last else 0.0
        return MicroBatchResult.from_stats(
            forward + backward,
            head.unit.lengths,
            head.unit.sample_ids,
            [stat for op in chunks for stat in op.ctx.stats],
            loss,
            weight,
            slot=head.unit.slot,
            start_s=self.clock.seconds(origin, head.marks[0][0]),
            stage_seconds=(seconds,),
        )

    def _reduce_shards(self, step: TunedStep) -> None:
        """FSDP2 on a pipeline that ran no micro-batch this step: its peers reduce-scatter in
        their chunks' last backwards, so this stage joins them with zero gradients: per chunk, in
        the order of those backwards (the last chunk first), a two-token pass through it at zero
        loss, armed as that backward is, runs its units' post-backwards in the order its peers'
        real backward runs them (public API only; ``torch.distributed.pipelining`` calls FSDP's
        internals)."""
        stage, layout = self.stage, self.layout
        batch = pack([np.zeros(2, dtype=np.int64)], self.device, False)
        for c in reversed(range(layout.virtual)):  # a later chunk's last backward comes first
            stage.sync_in_next_backward(c, final=c == 0)  # zeros first: the head, which this pass skips, too
            ctx = self.engine.attention(step, layout.dp, None, batch.cu_seqlens, batch.lengths)  # exact
            x = batch.input_ids
            if not layout.first_chunk(c):
                # requiring a gradient, as a received activation does: the stage's own unit's
                # post-backward then runs when the backward reaches it, as in its peers' backward
                x = torch.zeros(stage.hidden_shape(2), dtype=stage.hidden_dtype, device=self.device, requires_grad=True)
            with self.precision.autocast():
                out = stage(x, batch.position_ids, ctx, c)
            (out.float().sum() * 0.0).backward()

    def _sync_gradients(self, step: TunedStep, ran_backward: bool) -> None:
        """Finish averaging over the data-parallel pipelines what the last backward started
        (:meth:`_arm_reduction`) and sum the tied embedding's two copies (:class:`.StageGradients`;
        FSDP2 reduce-scattered in the last backward, then the copies' shards are summed here)."""
        if self.gradients is not None:
            if self.gradients.needs_rows():
                vocab = self.stage.model.config.vocab_size
                rows = embedded_rows(step.planned.units, self.docs, vocab, self.device)
            self.gradients.finish(rows if self.gradients.needs_rows() else None)
            return
        if not ran_backward:
            self._reduce_shards(step)
        tied = self.stage.tied_weight()
        if tied is not None and self.groups.tied is not None:
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            grad = tied.grad.to_local() if isinstance(tied.grad, DTensor) else tied.grad
            dist.all_reduce(grad, group=self.groups.tied)

    def grad_norm(self, max_norm: float) -> float:
        """The whole model's gradient norm (the stages' squares summed, the tied embedding
        counted once), clipping every stage's gradients to ``max_norm`` when it is above 0."""
        params = self.stage.parameters_owned()
        tied = self.stage.tied_weight()
        counted = [p.grad for p in params if p.grad is not None and not (self.layout.last and p is tied)]
        local = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=self.device)
        if isinstance(local, DTensor):  # FSDP2: the shards' norm, gathered over the stage's peers
            local = local.full_tensor()
        square = (local.float() ** 2).reshape(1)
        dist.all_reduce(square, group=self.groups.pipeline)
        total = square.sqrt()[0]
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
        return float(total)


def wire_buffer(shape, dtype: torch.dtype, device: torch.device, wire: torch.device) -> torch.Tensor:
    """An empty receive buffer on ``wire``; pinned host memory when the stage runs on CUDA and the
    backend sends from the host (gloo), so its copy to the device is one DMA, not blocking."""
    return torch.empty(shape, dtype=dtype, device=wire, pin_memory=_pinned(device, wire))


def to_wire(tensor: torch.Tensor, wire: torch.device) -> torch.Tensor:
    """``tensor`` where the backend sends from: itself on the same device, else a copy in pinned
    host memory (a CUDA tensor for gloo; the copy completes before the send reads it)."""
    if tensor.device == wire:
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=wire, pin_memory=_pinned(tensor.device, wire))
    return out.copy_(tensor)


def _pinned(device: torch.device, wire: torch.device) -> bool:
    return device.type == "cuda" and wire.type == "cpu"


def _release(sends: list) -> None:
    """Sends their peer has received (proven by the receive just made): the waits return at once
    and the tensors go."""
    for work, _tensor in sends:
        work.wait()


def _merge(parts: Sequence[MicroBatchResult], split: Sequence[int] = (), virtual: int = 1) -> MicroBatchResult:
    """One micro-batch's stage results (stage order) as the whole model's, each stage's
    (forward, backward) seconds kept in ``stage_seconds``; ``split``: layers per virtual stage,
    with which interleaved stages' layer statistics (each in chunk order) go back to model order."""
    first, last = parts[0], parts[-1]
    return replace(
        first,
        seconds=sum(p.seconds for p in parts),
        stage_seconds=tuple(fb for p in parts for fb in p.stage_seconds),
        layer_densities=_model_order([p.layer_densities for p in parts], split, virtual),
        budgets=_model_order([p.budgets for p in parts], split, virtual),
        loss_sum=last.loss_sum,
        weight_sum=last.weight_sum,
    )


def _model_order(per_stage: Sequence[tuple], split: Sequence[int], virtual: int) -> tuple:
    """Per-layer entries of each stage (its chunks' layers in turn) in the model's layer order:
    virtual stage ``k`` is chunk ``k // P`` of stage ``k % P``."""
    if virtual == 1:
        return tuple(x for entries in per_stage for x in entries)
    p = len(per_stage)
    taken, out = [0] * p, []
    for k, n in enumerate(split):
        s = k % p
        out.extend(per_stage[s][taken[s] : taken[s] + n])
        taken[s] += n
    return tuple(out)
