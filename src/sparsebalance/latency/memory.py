"""Memory model: predicted peak bytes of one training micro-batch on one rank.

Beside the latency model: the latency model says how long a micro-batch takes, this one whether it
fits. ``MemoryModel(shapes, coefficients).peak_bytes(tokens, MemoryConfig(...))`` counts, for a
decoder-only transformer (Qwen2 / Llama family: RMSNorm, rotary, grouped-query attention, gated
MLP, tied or untied lm-head):

- **state**: weights + gradients + AdamW's two moments, divided by the FSDP2 degree (``shard``);
- **activations kept for the backward**, per token and layer (``9H + 4Hkv·D + Hq + 4I`` elements:
  the layer input, two norm outputs, q/k/v, their rotary copies, the attention output and its
  log-sum-exp, the o-projection input, the residual, and the MLP's gate/up/act/product); with
  ``checkpointing="full"`` only each layer's input (``H``) plus one layer rerun in the backward;
  with ``"selective"`` (the MLP recomputed) everything but the MLP's ``4I``, plus one MLP rerun;
- **the loss**: ``plain`` holds ``T x V`` logits, their log-softmax and both gradients
  (``logit_bytes`` per element, 16 in fp32); ``chunked`` holds one chunk's logits and ~1 more
  temporary of that size, the fp32 lm-head gradient buffer and the ``(T, H)`` hidden gradient;
- **the attention backend's workspace**: a fixed buffer (the torch backend's chunk temporaries)
  plus index metadata per kept (query block, key block) pair per layer (torch backend), or the
  dense ``(H, nb, nb)`` int32 block lists of FlexAttention's ``BlockMask`` (forward + backward
  copies) per layer;
- the backward's transients: one MLP's gradient temporaries (``3I`` per token) and, for a tied
  embedding, the embedding gradient's second ``V x H`` copy at the very end.

The peak is the largest of four moments: the end of the forward (kept activations + autocast's
low-precision weight copies), the loss (kept activations + the loss), the first layer's backward
(kept activations + lm-head gradient + one rerun layer + transients), and the end of the backward
(all gradients + the embedding's dense gradient beside a tied head's or an earlier micro-batch's,
+ the other micro-batches a pipeline stage has in flight).
With ``micro_batches >= 2`` the first three are a later micro-batch's, beside every gradient
accumulated so far, unsharded (sharded when FSDP2 reduce-scatters every micro-batch,
``reduce_every``); under DDP (``ddp``) every micro-batch's are, since its gradients are
views of its all-reduce buckets, allocated once (``gradient_as_bucket_view``). Autocast's
low-precision weight copies are cached through a forward and its loss, and saved for the backward
by every micro-batch in flight (unless full checkpointing recomputes each layer there).
A pipeline stage (``MemoryConfig.stage``, ``--pp``) counts its own layers, embedding or head and
loss, and the activations of the micro-batches 1F1B keeps in flight on it (``P - s`` on stage
``s``: the first stage keeps the most); with FSDP2 it stays gathered through the step.
Context parallelism of degree ``cp`` is assumed to split a micro-batch's tokens (activations,
loss, layouts) evenly over ``cp`` ranks, plus one remote K/V shard in flight (the ring's buffer).

Coefficients: :data:`ANALYTIC` gives bf16-autocast figures for ``h100``, ``h200``, ``a100``
(fp32 master weights, grads and AdamW; bf16 activations with fp32 norms and residual, ~2.5 bytes
per saved element on average); :func:`cpu_coefficients` the fp32 CPU ones, whose ``base_bytes``
(libraries, allocator) is measured as the resident set of a fresh process
(``benchmarks/memory.py`` and ``profile --memory`` measure peaks in fresh processes:
:func:`~.host_memory.peak_rss_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..models import ModelShapes
from ..models.checkpointing import MODES as CHECKPOINT_MODES

CHECKPOINTING = CHECKPOINT_MODES  # one list of modes: what models.checkpointing applies
LOSSES = ("plain", "chunked")
GIB = 1024**3
# Mirrors ``ops.loss.CHUNK_ELEMS`` (logit elements per chunk; a test keeps them equal).
LOSS_CHUNK_ELEMS = 1 << 26


@dataclass(frozen=True)
class MemoryCoefficients:
    """Bytes per element of each kind of tensor, and fixed costs, for one device and dtype."""

    name: str
    """Where they apply (``cpu-fp32``, ``h100-bf16``, ...)."""
    param_bytes: float = 4.0
    """Bytes per weight (fp32 master weights)."""
    grad_bytes: float = 4.0
    """Bytes per gradient element."""
    optimizer_bytes: float = 8.0
    """AdamW state per parameter (two fp32 moments)."""
    cast_bytes: float = 0.0
    """Low-precision weight copies alive during the forward (autocast's cache: 2 for bf16)."""
    act_bytes: float = 4.0
    """Bytes per saved activation element (average over the layer's saved tensors)."""
    logit_bytes: float = 16.0
    """Plain loss: bytes per (token, vocab) element at its peak (logits, log-softmax, gradients)."""
    base_bytes: float = 0.0
    """Fixed bytes outside the tensors counted here (CPU: the process and its libraries)."""
    workspace_bytes: float = 0.0
    """The attention backend's fixed workspace (torch backend: bounded chunk temporaries)."""
    pair_bytes: float = 24.0
    """Torch backend: bytes of index metadata per kept block pair per layout head per layer."""
    blockmask: bool = False
    """FlexAttention: the BlockMask's dense ``(H, nb, nb)`` int32 lists (x4: kv/q, full/partial)."""
    device_bytes: float | None = None
    """Device memory (GPUs); None on CPU (the budget must be given)."""


# Device memory as ``torch.cuda.get_device_properties().total_memory`` reports it (GiB).
_GPU_GIB = {"h100": 79.1, "h200": 139.8, "a100": 79.2}
ANALYTIC: dict[str, MemoryCoefficients] = {
    name: MemoryCoefficients(
        f"{name}-bf16 (analytic)",
        cast_bytes=2.0,
        act_bytes=2.5,
        logit_bytes=20.0,
        workspace_bytes=256 * 2**20,
        blockmask=True,
        device_bytes=gib * GIB,
    )
    for name, gib in _GPU_GIB.items()
}


def cpu_coefficients(base_bytes: float) -> MemoryCoefficients:
    """fp32 CPU training (the trainer's CPU path: torch backend, no autocast).

    ``base_bytes``: resident bytes of the process before the model exists (measured)."""
    # torch backend: <= 2**23 score elements per chunk, ~6 fp32 temporaries of that size.
    return MemoryCoefficients("cpu-fp32", base_bytes=base_bytes, workspace_bytes=6 * 4 * 2**23)


@dataclass(frozen=True)
class StageShare:
    """What one pipeline stage (``--pp``) holds: its decoder layers, the input embedding (the
    first stage), the final norm + LM head + loss (the last stage: a tied head is its own copy
    there), and the micro-batches whose saved activations it keeps at once (1F1B: ``P - s`` on
    stage ``s``, as :func:`~sparsebalance.batching.schedule.schedule_order` runs them; interleaved
    1F1B, ``--pp-virtual``: :func:`~sparsebalance.batching.interleaved.held_stages`, in whole
    stages, a fraction when chunks of several micro-batches are in flight), and zero bubble's
    (``--pp-schedule zb-h1``) pending W's: micro-batches past their B whose deferred weight GEMMs
    keep each linear layer's input and output gradient (:meth:`MemoryModel.weight_elems`), up to
    ``s + 1`` on stage s besides 1F1B's ``P - s`` in flight
    (:func:`~sparsebalance.batching.zero_bubble.pending_weights`)."""

    layers: int
    embedding: bool
    head: bool
    in_flight: float
    pending_weights: int = 0

    @classmethod
    def of(cls, split: tuple[int, ...], stage: int) -> StageShare:
        """Stage ``stage`` of a pipeline whose stages run ``split`` layers each."""
        p = len(split)
        if not 0 <= stage < p:
            raise ValueError(f"stage {stage} of a {p}-stage pipeline")
        return cls(int(split[stage]), stage == 0, stage == p - 1, p - stage)

    @classmethod
    def whole(cls, num_layers: int) -> StageShare:
        """The whole model, one micro-batch at a time (no pipeline)."""
        return cls(num_layers, True, True, 1)


@dataclass(frozen=True)
class MemoryConfig:
    """The features that change a micro-batch's memory."""

    checkpointing: str = "off"
    """Activation checkpointing: off | full | selective (the MLP of every layer recomputed)."""
    loss: str = "chunked"
    """plain (full ``T x V`` logits) | chunked (one chunk at a time; Liger's is counted alike)."""
    loss_chunk_tokens: int | None = None
    """Tokens per loss chunk; default ``2**26 // vocab`` as in ``ops.loss``."""
    shard: int = 1
    """FSDP2 degree: weights, gradients and optimizer state are divided by it."""
    cp: int = 1
    """Context-parallel degree: a micro-batch's tokens are split evenly over ``cp`` ranks."""
    density: float = 1.0
    """Attention density (kept / causal block pairs): sizes the torch backend's metadata."""
    micro_batches: int = 1
    """Micro-batches per rank and step. From the second on, a backward holds the gradients the
    earlier ones accumulated, unsharded (DDP's are always whole; FSDP2 keeps them unsharded
    until the last micro-batch reduce-scatters, sharded with ``reduce_every``): a run packed to
    a capacity gives 2 (any step may hold several), a probe of one micro-batch 1."""
    reduce_every: bool = False
    """FSDP2 reduce-scatters after every micro-batch (``--fsdp-gradient-sync micro-batch``): the
    gradients earlier micro-batches accumulated are held sharded (1/``shard``), not whole."""
    ddp: bool = False
    """DDP over several processes: the gradients are views of its all-reduce buckets, allocated
    once and zeroed in place, so every moment holds them, whole, as a later micro-batch does."""
    stage: StageShare | None = None
    """``--pp``: the pipeline stage this rank runs (its layers, embedding or head, and the
    micro-batches 1F1B keeps in flight); None: the whole model, one micro-batch at a time."""
    block_size: int = field(kw_only=True)
    """Sparse attention block size (tokens); a keyword, required."""

    def __post_init__(self) -> None:
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"--activation-checkpointing must be one of {CHECKPOINTING}, got {self.checkpointing!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.shard < 1 or self.cp < 1 or self.block_size < 1 or self.micro_batches < 1:
            raise ValueError("shard, cp, micro_batches and block_size must be >= 1")
        if not 0 < self.density <= 1:
            raise ValueError(f"density must lie in (0, 1], got {self.density}")
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1, got {self.loss_chunk_tokens}")


class MemoryModel:
    """Predicted peak bytes per rank (see the module docstring for what is counted)."""

    def __init__(self, shapes: ModelShapes, coefficients: MemoryCoefficients, tied_embeddings: bool = True):
        self.shapes = shapes
        self.c = coefficients
        self.tied = tied_embeddings
        """Input embedding and lm-head share one weight (Qwen2.5-0.5B and 3B do)."""

    def num_params(self, stage: StageShare | None = None) -> int:
        """Parameters of the whole model, or of one pipeline stage (a tied head is a copy of the
        embedding on the last stage; the first stage has the embedding alone)."""
        s = self.shapes
        st = stage or StageShare.whole(s.num_layers)
        embed = s.vocab_size * s.hidden_size
        embeds = int(st.embedding) + int(st.head) - int(self.tied and st.embedding and st.head)
        return st.layers * s.layer_params() + embed * embeds + s.hidden_size * int(st.head)

    def layer_elems(self) -> tuple[float, float]:
        """Saved elements per token of one decoder layer: (outside the MLP, inside the MLP)."""
        s = self.shapes
        kv = s.num_kv_heads * s.head_dim
        return 9 * s.hidden_size + 4 * kv + s.num_heads, 4 * s.intermediate_size

    def weight_elems(self) -> int:
        """Elements per token and decoder layer a pending zero-bubble W keeps (whatever the
        checkpointing: its GEMMs need them): the linear layers' inputs (q/k/v's and gate/up's
        shared, o's, down's: ``3 H + I``) and output gradients (``3 H + 2 kv + 2 I``)."""
        s = self.shapes
        return 6 * s.hidden_size + 3 * s.intermediate_size + 2 * s.num_kv_heads * s.head_dim

    def _state(self, params: int, cfg: MemoryConfig) -> tuple[float, float, float]:
        """``(weights + optimizer state, gradients after the step's last backward, autocast's
        weight copies)``: FSDP2 divides all three by ``shard``. A pipeline stage stays gathered
        through the step (:meth:`.StageModel.gather`): its whole weights beside their shards,
        whole gradients and copies; only the optimizer state is divided."""
        c, n = self.c, cfg.shard
        if cfg.stage is not None and n > 1:
            return (
                params * (c.param_bytes * (1 + 1 / n) + c.optimizer_bytes / n),
                params * c.grad_bytes,
                params * c.cast_bytes,
            )
        return params * (c.param_bytes + c.optimizer_bytes) / n, params * c.grad_bytes / n, params * c.cast_bytes / n

    def _kept(self, t: int, cfg: MemoryConfig, st: StageShare) -> tuple[float, float]:
        """``(activations kept for the backward by the micro-batches in flight, one layer's
        rerun under checkpointing)`` for ``t`` tokens per micro-batch on this rank."""
        s, a = self.shapes, self.c.act_bytes
        outer, mlp = self.layer_elems()
        full_layer = (outer + mlp) * t * a
        if cfg.checkpointing == "off":
            kept, rerun = st.layers * full_layer, 0.0
        elif cfg.checkpointing == "full":
            kept, rerun = st.layers * s.hidden_size * t * a, full_layer
        else:
            kept, rerun = st.layers * outer * t * a, mlp * t * a
        kept += (2 * s.head_dim + 2 * s.hidden_size * int(st.head)) * t * a  # rotary cos/sin, final norm
        if cfg.cp > 1:  # the ring's remote K/V shard in flight
            kept += 2 * s.num_kv_heads * s.head_dim * t * a
        pending = st.layers * self.weight_elems() * t * a
        if st.head and cfg.loss == "plain":  # the head's GEMM deferred too: its logits' gradient
            pending += t * s.vocab_size * a
        return st.in_flight * kept + st.pending_weights * pending, rerun

    def _gradients(self, params: int, grads: float, cfg: MemoryConfig, st: StageShare) -> tuple[float, float, float]:
        """Gradient bytes ``(held through a micro-batch, held through its backward, at its end)``.
        A micro-batch after the first (any, under DDP: its buckets) runs beside every gradient,
        unsharded (sharded where FSDP2 reduce-scatters every micro-batch: ``reduce_every``). A
        tied weight used by the embedding and the head on one rank gets its head gradient first;
        autograd keeps it until the embedding's arrives at the very end, where the two and their
        sum are alive at once (a held gradient then adds the sum in place). An embedding alone
        (untied, or a pipeline's first stage) lands its dense gradient beside a held one."""
        s, g = self.shapes, self.c.grad_bytes
        vh = s.vocab_size * s.hidden_size * g
        held = cfg.micro_batches > 1 or cfg.ddp
        both = self.tied and st.embedding and st.head
        prior = (grads if cfg.reduce_every else params * g) if held else 0.0
        backward = prior + vh * int(both) if held else vh * int(st.head)
        whole = held and not cfg.reduce_every  # a held gradient the new ones are added into, whole
        dense = (2 + int(whole) if both else int(whole)) if st.embedding else 0
        return prior, backward, (prior if held else grads) + vh * dense

    def breakdown(self, tokens: int, cfg: MemoryConfig) -> dict[str, float]:
        """Bytes of every component at the peak moment, and ``peak`` (their sum)."""
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        s, c = self.shapes, self.c
        st = cfg.stage or StageShare.whole(s.num_layers)
        t = math.ceil(tokens / cfg.cp)  # this rank's tokens
        h, v = s.hidden_size, s.vocab_size
        params = self.num_params(cfg.stage)
        head = v * h * int(st.head)
        state, grads, cast = self._state(params, cfg)
        kept, rerun = self._kept(t, cfg, st)
        transient = 3 * s.intermediate_size * t * c.act_bytes
        attention = c.workspace_bytes + st.in_flight * st.layers * self._layout_bytes(tokens, cfg)
        loss = 0.0
        if st.head and cfg.loss == "plain":
            loss = t * v * c.logit_bytes
        elif st.head:
            chunk = min(t, cfg.loss_chunk_tokens or max(1, LOSS_CHUNK_ELEMS // v))
            loss = 2 * chunk * v * 4 + head * 4 + t * h * 4
        prior, held_backward, at_end = self._gradients(params, grads, cfg, st)
        # autocast's weight copies: cached through a forward (and its loss), and saved for the
        # backward by every micro-batch in flight unless each layer is recomputed there
        saved = cast if cfg.checkpointing != "full" else 0.0
        forward = cast + (st.in_flight - 1) * saved
        others = (st.in_flight - 1) / st.in_flight  # at a backward's end, the other micro-batches in flight
        moments = {
            "forward end": kept + forward + prior,
            "loss": kept + loss + forward + prior,
            "later backward" if prior else "first layer backward": kept
            + st.in_flight * saved
            + held_backward
            + rerun
            + transient,
            "end": at_end + others * (kept + st.in_flight * saved),
        }
        if cfg.ddp:  # DDP rebuilds its buckets once (second step): old and new beside each other
            moments["bucket rebuild"] = 2 * prior
        moment = max(moments.items(), key=lambda kv: kv[1])
        parts = {
            "base": c.base_bytes,
            "weights+optimizer": state,
            "attention workspace": attention,
            "activations": kept if moment[0] not in ("end", "bucket rebuild") else 0.0,
            "loss": loss if moment[0] == "loss" else 0.0,
        }
        parts["other at peak"] = moment[1] - parts["activations"] - parts["loss"]
        parts["peak"] = sum(parts.values())
        parts["moment"] = moment[0]  # type: ignore[assignment]
        return parts

    def inference_peak_bytes(self, tokens: int, dtype_bytes: int, block_size: int) -> float:
        """Predicted peak of one no-grad forward over ``tokens`` packed tokens (``sparsebalance
        eval``): the weights in ``dtype_bytes``, the residual stream, one layer's temporaries
        (norm, q/k/v and their rotary copies, attention output, the MLP's gate/up/product), the
        attention workspace and one layer's layout metadata, and a 2,048-token logits chunk."""
        s, c = self.shapes, self.c
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        per_token = 3 * s.hidden_size + 2 * (q + 2 * kv) + q + 3 * s.intermediate_size
        layout = self._layout_bytes(tokens, MemoryConfig(block_size=block_size))
        logits = 3 * min(tokens, 2048) * s.vocab_size * 4
        return self.num_params() * dtype_bytes + per_token * tokens * dtype_bytes + c.workspace_bytes + layout + logits

    def _layout_bytes(self, tokens: int, cfg: MemoryConfig) -> float:
        """One layer's layout/index metadata on this rank (a whole micro-batch as one document:
        the upper bound; packs of shorter documents have fewer causal pairs)."""
        nb = math.ceil(tokens / cfg.block_size)
        heads = self.shapes.num_heads
        if self.c.blockmask:
            return 4 * 4 * heads * nb * math.ceil(nb / cfg.cp)
        pairs = cfg.density * nb * (nb + 1) / 2 / cfg.cp
        return self.c.pair_bytes * heads * pairs

    def peak_bytes(self, tokens: int, cfg: MemoryConfig) -> float:
        return float(self.breakdown(tokens, cfg)["peak"])

    def max_tokens(self, budget_bytes: float, cfg: MemoryConfig, limit: int = 1 << 24) -> int:
        """The largest token count (a multiple of ``cfg.block_size``) whose peak fits
        ``budget_bytes``; 0 when even one block does not fit."""
        if budget_bytes <= 0:
            raise ValueError(f"--memory-budget must be > 0 bytes, got {budget_bytes}")
        step = cfg.block_size * cfg.cp
        lo, hi = 0, limit // step
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_bytes(mid * step, cfg) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo * step


def device_coefficients(device, base_bytes: float = 0.0) -> MemoryCoefficients:
    """Coefficients for a ``torch.device``: the analytic bf16 ones with this GPU's memory on CUDA
    (the trainer's CUDA path: bf16 autocast, flex), fp32 ones with ``base_bytes`` on CPU."""
    if str(device).split(":")[0] == "cuda":  # a torch.device or its name
        import torch

        props = torch.cuda.get_device_properties(device)
        return replace(ANALYTIC["h100"], name=f"{props.name} bf16 (analytic)", device_bytes=float(props.total_memory))
    return cpu_coefficients(base_bytes)


__all__ = [
    "ANALYTIC",
    "CHECKPOINTING",
    "GIB",
    "LOSSES",
    "MemoryCoefficients",
    "MemoryConfig",
    "MemoryModel",
    "StageShare",
    "cpu_coefficients",
    "device_coefficients",
]
