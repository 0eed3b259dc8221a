"""The one parallelism seam: :func:`parallelize` applies DDP or FSDP2 to the model and returns a
:class:`Parallelized` that the step asks *how* to run and sync its micro-batches. Nothing else
in the trainer looks at ``--parallel`` (context parallelism plugs in here next).

Gradient sync, ``--measure-bubble``:

- ``overlap`` (default): DDP's reducer (``torch.nn.parallel.DistributedDataParallel``) all-reduces
  gradient buckets while the last micro-batch's backward still runs; earlier micro-batches run
  under ``no_sync()``. FSDP2 reduce-scatters after every micro-batch's backward (``--fsdp-gradient-sync
  micro-batch``, the default: sharded gradients accumulate) or in the last only (``step``). The
  bubble is derived afterwards from per-rank timestamps (one all-gather, no barrier in the hot path).
- ``exact``: every micro-batch runs without sync, then a barrier (its wait is the bubble) and one
  bucketed all-reduce (timed alone): bubble and sync measured apart, for experiments.

Both modes compute the same weights: on 2 ranks bit for bit (``a / 2 + b / 2 == (a + b) / 2`` in
binary floating point), on more ranks within rounding (the summation order of the all-reduce).

Every time taken here is a :class:`~sparsebalance.clock.Mark` of the run's one
:class:`~sparsebalance.clock.Clock` (``Parallelized.clock``): on CUDA an event on the compute
stream, so "gradients ready" is when the device has computed them, not when the host enqueued
the bucket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..clock import Clock, Mark
from ..precision import Precision
from .runtime import Runtime

PARALLEL = ("ddp", "fsdp2")
FSDP_GRADIENT_SYNC = ("micro-batch", "step")
MEASURE_BUBBLE = ("overlap", "exact")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, found as Hugging Face tooling does: instances of the classes
    ``model._no_split_modules`` names (``Qwen2DecoderLayer``, ``LlamaDecoderLayer``, ...),
    outermost first, never one nested inside another."""
    # transformers' PreTrainedModel attribute, absent on plain torch modules (refused below)
    names = set(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"--parallel fsdp2: {type(model).__name__} names no _no_split_modules, so its "
            "decoder layers cannot be found to shard them"
        )
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in names and not any(name.startswith(prefix + ".") for prefix, _ in found):
            found.append((name, module))
    if not found:
        raise ValueError(
            f"--parallel fsdp2: no module of {sorted(names)} (the model's _no_split_modules) in {type(model).__name__}"
        )
    return [m for _, m in found]


class ReadyClock:
    """DDP comm hook state: marks when each gradient bucket is handed to the all-reduce (the
    last mark of a backward = this rank's gradients are computed), then runs the default hook.
    The mark is the clock's: on CUDA an event on the compute stream (the autograd engine's
    stream for the backward), complete once the bucket's gradients are."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.last: Mark | None = None

    @staticmethod
    def hook(state, bucket):  # no annotations: DDP checks them against the real classes
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        state.last = state.clock.mark()
        return allreduce_hook(None, bucket)


@dataclass
class Parallelized:
    """A model made parallel, and how a step runs and syncs its micro-batches on it."""

    model: nn.Module
    """What the forward calls: the DDP wrapper, the FSDP2-sharded model, or the model itself."""
    module: nn.Module
    """The Hugging Face model underneath (state-dict keys without DDP's ``module.`` prefix)."""
    kind: str
    """``"single"`` (one process), ``"ddp"`` or ``"fsdp2"``."""
    measure_bubble: str
    """``"overlap"`` or ``"exact"`` (see the module docstring)."""
    world_size: int
    clock: Clock = dataclasses.field(default_factory=Clock)
    """The run's clock (the device's): every time of the step is one of its marks."""
    _ready: ReadyClock | None = None
    sync_every_micro_batch: bool = True
    """FSDP2: reduce-scatter after every micro-batch's backward (sharded gradients accumulate),
    not only the step's last (``--fsdp-gradient-sync``; True, the default, as :func:`parallelize`'s)."""

    @property
    def sharded(self) -> bool:
        """Parameters are sharded (checkpoints gather full state dicts collectively)."""
        return self.kind == "fsdp2"

    @property
    def keeps_gradients(self) -> bool:
        """DDP's gradients are views of its buckets: zeroed in place after a step, never dropped
        (dropped, the next step's would be allocated again beside the buckets)."""
        return self.kind == "ddp"

    @property
    def exact(self) -> bool:
        """Barrier, then a separately timed all-reduce (only meaningful with several ranks)."""
        return self.measure_bubble == "exact" and self.kind != "single"

    def passes(self, mine: int, most: int) -> int:
        """Forward/backward passes this rank runs for ``mine`` micro-batches when the busiest
        rank has ``most``: FSDP2 gathers parameters in every pass, so all ranks run ``most``;
        overlapped DDP syncs in one backward, so an empty rank still runs one (a zero-weight
        filler); otherwise just its own."""
        if self.kind == "fsdp2":
            return most
        if self.kind == "ddp" and not self.exact:
            return max(mine, 1)
        return mine

    @contextlib.contextmanager
    def microbatch(self, index: int, passes: int) -> Iterator[None]:
        """Context for pass ``index`` of ``passes``: DDP's gradients sync (overlapped with the
        backward) on the last pass only, and never in ``exact`` mode (synced afterwards); FSDP2's
        reduce-scatter in every pass's backward (``sync_every_micro_batch``) or the last, in both
        modes."""
        sync = index == passes - 1 and not self.exact
        if self._ready is not None:
            self._ready.last = None  # marked again only if this pass syncs
        if self.kind == "fsdp2":  # reduce-scatter in every backward, or the last, in both modes
            self.model.set_requires_gradient_sync(self.sync_every_micro_batch or index == passes - 1)
            yield
        elif self.kind == "ddp" and not sync:
            with self.model.no_sync():
                yield
        else:
            yield

    def ready_time(self) -> Mark | None:
        """The mark taken when the last overlapped backward handed its last gradient bucket to
        the sync (``None`` if no bucket was synced: a pass under ``no_sync``, or not DDP)."""
        return self._ready.last if self._ready is not None else None

    def sync_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """``exact`` mode's separate gradient all-reduce (FSDP2 already reduce-scattered in its
        backwards); a no-op otherwise."""
        if self.exact and self.kind == "ddp":
            allreduce_gradients(params, self.world_size)


def mixed_precision(precision: Precision | None):
    """FSDP2's ``MixedPrecisionPolicy`` for a run computing in ``precision``: parameters gathered
    in its compute dtype (bf16 / fp16: half the all-gather bytes, and the copy autocast would make
    per layer is made once, by the gather), gradients reduce-scattered in float32 (fp32 master
    weights and their optimizer state are unchanged). Forward inputs are left as they are:
    casting them would rebuild the ``PackedAttention`` dataclass passed to every layer (losing
    the statistics it collects), and token ids are not cast anyway."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param = precision.dtype if precision is not None and precision.mixed else None
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=torch.float32, cast_forward_inputs=False)


def parallelize(
    model: nn.Module,
    runtime: Runtime,
    parallel: str,
    measure_bubble: str,
    *,
    fsdp_sync_every_micro_batch: bool = True,
    precision: Precision | None = None,
):
    """Apply data parallelism to ``model`` (replicas start from rank 0's weights).

    Args:
        model: a Hugging Face causal LM on ``runtime.device``.
        runtime: the process group's rank / world size (one process: the model is returned as is).
        parallel: ``"ddp"`` (replicated; DDP's bucketed all-reduce) or ``"fsdp2"``
            (``fully_shard`` on every decoder layer, then the root).
        measure_bubble: ``"overlap"`` or ``"exact"``.
        fsdp_sync_every_micro_batch: FSDP2 reduce-scatters after every micro-batch (True: a
            later micro-batch holds sharded gradients) or in the step's last backward only.
        precision: the run's compute precision: FSDP2 gathers parameters in it and reduces
            gradients in float32 (:func:`mixed_precision`); None: float32 throughout.
    """
    if parallel not in PARALLEL:
        raise ValueError(f"--parallel must be one of {PARALLEL}, got {parallel!r}")
    if measure_bubble not in MEASURE_BUBBLE:
        raise ValueError(f"--measure-bubble must be one of {MEASURE_BUBBLE}, got {measure_bubble!r}")
    world = runtime.world_size
    clock = Clock(runtime.device)
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        if not runtime.distributed:
            raise ValueError("--parallel fsdp2 needs several processes (--nproc >= 2)")
        policy = mixed_precision(precision)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return Parallelized(
            model, model, "fsdp2", measure_bubble, world, clock, sync_every_micro_batch=fsdp_sync_every_micro_batch
        )
    if not runtime.distributed:
        return Parallelized(model, model, "single", measure_bubble, world, clock)
    # device_ids=None: inputs are already on the device, and DDP would otherwise copy the
    # PackedAttention dataclass in the kwargs (losing the layer statistics it collects).
    # broadcast_buffers=False: the only buffers (rotary frequencies) are identical constants
    # (torch 2.13 deprecates the name in favour of forward_sync_buffers, which still syncs at
    # init; the old name keeps the documented behaviour, so its FutureWarning is silenced).
    # gradient_as_bucket_view: the gradients are views of the all-reduce buckets, not a second
    # copy beside them (a whole model's gradients saved; the Updater zeroes them in place). DDP
    # turns existing gradients into views as it wraps the model, missing ones at the first synced
    # backward: zeros now, so that the first step's no_sync() micro-batches use the buckets too.
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=None, broadcast_buffers=False, gradient_as_bucket_view=True
        )
    ready = ReadyClock(clock)
    ddp.register_comm_hook(ready, ReadyClock.hook)
    return Parallelized(ddp, model, "ddp", measure_bubble, world, clock, ready)


def allreduce_gradients(
    params: list[torch.nn.Parameter], world_size: int, bucket_elems: int = 1 << 24, group=None
) -> None:
    """Average gradients over the ``world_size`` ranks of ``group`` (default: all) with a few flat
    buckets (DDP's reducer without its overlap with the backward: ``--measure-bubble exact`` times
    wait and sync apart; a pipeline stage's data-parallel peers). A rank that had no document this
    step joins with zero gradients."""
    if world_size <= 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0
    grads = [p.grad for p in params]
    for i, g in enumerate(grads):
        bucket.append(g)
        size += g.numel()
        if size >= bucket_elems or i == len(grads) - 1:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=group)
            flat /= world_size
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = [], 0


def _buckets(params: list[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """``params`` in order, cut after each run reaching ``limit`` bytes (the last run may be
    smaller)."""
    out, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            out.append(current)
            current, size = [], 0
    return [*out, current] if current else out


class OverlappedAllReduce:
    """A pipeline stage's gradients averaged over its data-parallel peers while the stage's last
    backward still runs (what DDP's reducer does; a stage runs outside DDP, whose forward would
    copy the attention metadata it is passed).

    The parameters are put in buckets of about ``bucket_bytes`` in reverse order (the order a
    backward makes their gradients); the last bucket is cut again into buckets of about
    ``tail_bytes`` (one parameter or more each): its all-reduce is the one no computation hides,
    so it is kept small (DDP makes its *first* bucket small, for the same reason at the start).
    :meth:`arm` before a step's last backward: a hook on every
    parameter counts its gradient final, and a bucket whose gradients all are is all-reduced
    asynchronously (``async_op``; gloo runs it on its own threads, NCCL on its stream) while the
    backward computes the next. Buckets are launched in order, so every peer issues the same
    collectives in the same order, whatever order its gradients come in. :meth:`finish` launches
    the buckets the backward did not complete (a pipeline without micro-batches: zeros), waits
    for all of them and writes the averages back. Earlier backwards only accumulate.

    Args:
        params: the stage's parameters (those without ``requires_grad`` are left out).
        group: the stage's data-parallel group; ``world_size``: its size.
        bucket_bytes: a bucket's size (DDP's default, 25 MiB); ``tail_bytes``: the last one's pieces.
    """

    def __init__(self, params, group, world_size: int, bucket_bytes: int = 25 << 20, tail_bytes: int = 1 << 20) -> None:
        self.group, self.world_size = group, world_size
        trainable = [p for p in params if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = _buckets(trainable[::-1], bucket_bytes)
        if self.buckets:  # the last one, in pieces
            self.buckets += _buckets(self.buckets.pop(), tail_bytes)
        self._bucket = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._armed = False
        self._final: set[int] = set()
        """The parameters whose next gradient is their last this step (:meth:`arm`)."""
        self._pending: list[int] = []
        self._next = 0
        self._works: list[tuple[object, torch.Tensor, list[nn.Parameter]]] = []
        self.launched_in_backward = 0
        """Buckets the last armed backward launched itself (the rest waited for :meth:`finish`)."""
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self.ready)

    def arm(self, params=None) -> None:
        """The next backward is the step's last for ``params`` (None: every parameter): reduce
        their buckets as their gradients complete. Interleaved 1F1B arms each chunk's parameters
        before that chunk's last backward (a chunk's earlier backwards still only accumulate)."""
        if not self._armed:
            self._armed, self._next, self._works, self._final = True, 0, [], set()
            self._pending = [len(b) for b in self.buckets]
        self._final |= set(self._bucket) if params is None else {id(p) for p in params}

    def ready(self, param: nn.Parameter) -> None:
        """``param``'s gradient is complete (its hook; or a gradient made outside autograd, zero
        bubble's deferred weights): once armed and final, its bucket counts it."""
        if not self._armed or id(param) not in self._final:
            return
        self._pending[self._bucket[id(param)]] -= 1
        self._launch(force=False)
        self.launched_in_backward = self._next

    def _launch(self, force: bool) -> None:
        while self._next < len(self.buckets) and (force or self._pending[self._next] <= 0):
            bucket = self.buckets[self._next]
            for p in bucket:  # reached by no backward this step (a pipeline without micro-batches)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            self._works.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket))
            self._next += 1

    def finish(self) -> None:
        """After the step's backwards: every bucket reduced, each gradient its peers' mean."""
        if not self._armed:  # no backward ran on this stage this step
            self.arm()
            self.launched_in_backward = 0
        self._launch(force=True)
        for work, flat, bucket in self._works:
            work.wait()
            flat /= self.world_size
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._armed, self._works = False, []
