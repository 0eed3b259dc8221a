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
(all gradients + the embedding's second copy).
Context parallelism of degree ``cp`` is assumed to split a micro-batch's tokens (activations,
loss, layouts) evenly over ``cp`` ranks, plus one remote K/V shard in flight (the ring's buffer).

Coefficients: :data:`ANALYTIC` gives bf16-autocast figures for ``h100``, ``h200``, ``a100``
(fp32 master weights, grads and AdamW; bf16 activations with fp32 norms and residual, ~2.5 bytes
per saved element on average); :func:`cpu_coefficients` the fp32 CPU ones, whose ``base_bytes``
(libraries, allocator) is measured as the resident set of a fresh process
(``benchmarks/memory.py`` and ``profile --memory`` measure peaks in fresh processes:
:func:`peak_rss_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

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
    block_size: int = field(kw_only=True)
    """Sparse attention block size (tokens); a keyword, required."""

    def __post_init__(self) -> None:
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"--activation-checkpointing must be one of {CHECKPOINTING}, got {self.checkpointing!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.shard < 1 or self.cp < 1 or self.block_size < 1:
            raise ValueError("shard, cp and block_size must be >= 1")
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

    def num_params(self) -> int:
        s = self.shapes
        embed = s.vocab_size * s.hidden_size
        return s.num_layers * s.layer_params() + embed * (1 if self.tied else 2) + s.hidden_size

    def layer_elems(self) -> tuple[float, float]:
        """Saved elements per token of one decoder layer: (outside the MLP, inside the MLP)."""
        s = self.shapes
        kv = s.num_kv_heads * s.head_dim
        return 9 * s.hidden_size + 4 * kv + s.num_heads, 4 * s.intermediate_size

    def breakdown(self, tokens: int, cfg: MemoryConfig) -> dict[str, float]:
        """Bytes of every component at the peak moment, and ``peak`` (their sum)."""
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        s, c = self.shapes, self.c
        t = math.ceil(tokens / cfg.cp)  # this rank's tokens
        h, v, n_layers = s.hidden_size, s.vocab_size, s.num_layers
        params = self.num_params()
        head = v * h
        state = params * (c.param_bytes + c.optimizer_bytes) / cfg.shard
        grads = params * c.grad_bytes / cfg.shard
        outer, mlp = self.layer_elems()
        full_layer = (outer + mlp) * t * c.act_bytes
        if cfg.checkpointing == "off":
            kept, rerun = n_layers * full_layer, 0.0
        elif cfg.checkpointing == "full":
            kept, rerun = n_layers * h * t * c.act_bytes, full_layer
        else:
            kept, rerun = n_layers * outer * t * c.act_bytes, mlp * t * c.act_bytes
        kept += (2 * h + 2 * s.head_dim) * t * c.act_bytes  # final norm, rotary cos/sin
        if cfg.cp > 1:  # the ring's remote K/V shard in flight
            kept += 2 * s.num_kv_heads * s.head_dim * t * c.act_bytes
        transient = 3 * s.intermediate_size * t * c.act_bytes
        attention = c.workspace_bytes + n_layers * self._layout_bytes(tokens, cfg)
        if cfg.loss == "plain":
            loss = t * v * c.logit_bytes
        else:
            chunk = min(t, cfg.loss_chunk_tokens or max(1, LOSS_CHUNK_ELEMS // v))
            loss = 2 * chunk * v * 4 + head * 4 + t * h * 4
        at_forward_end = kept + params * c.cast_bytes / cfg.shard  # autocast's weight copies
        at_loss = kept + loss
        at_first_layer = kept + head * c.grad_bytes + rerun + transient
        at_end = grads + (head * c.grad_bytes if self.tied else 0.0)
        moment = max(
            ("forward end", at_forward_end),
            ("loss", at_loss),
            ("first layer backward", at_first_layer),
            ("end", at_end),
            key=lambda kv: kv[1],
        )
        parts = {
            "base": c.base_bytes,
            "weights+optimizer": state,
            "attention workspace": attention,
            "activations": kept if moment[0] != "end" else 0.0,
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


def auto_capacity(model: MemoryModel, budget_bytes: float, cfg: MemoryConfig) -> int:
    """``--capacity auto``: the largest micro-batch (tokens per rank) whose predicted peak fits
    ``budget_bytes``. Raises ValueError when not even one block fits."""
    tokens = model.max_tokens(budget_bytes, cfg)
    if tokens == 0:
        need = model.peak_bytes(cfg.block_size, cfg)
        raise ValueError(
            f"--capacity auto: --memory-budget {budget_bytes / GIB:.2f} GiB fits no micro-batch "
            f"({cfg.block_size} tokens need {need / GIB:.2f} GiB, mostly weights and optimizer "
            "state); raise the budget, shard with --parallel fsdp2, or give --capacity"
        )
    return tokens


@dataclass(frozen=True)
class MemoryBound:
    """What a memory budget allows, for the planners: the per-rank token capacity of a
    micro-batch (``--capacity auto``) and each document's minimum context-parallel degree."""

    model: MemoryModel
    budget_bytes: float
    """Bytes per device (``--memory-budget``)."""
    config: MemoryConfig
    """Features of the run (checkpointing, loss, FSDP2 degree, block size); its ``cp`` is
    ignored (each query sets its own)."""

    def capacity(self) -> int:
        """The largest micro-batch (tokens per rank) that fits (:func:`auto_capacity`)."""
        return auto_capacity(self.model, self.budget_bytes, replace(self.config, cp=1))

    def fits(self, tokens: int, degree: int) -> bool:
        """Whether one document of ``tokens`` on ``degree`` ranks (CP) fits on each of them."""
        return self.model.peak_bytes(tokens, replace(self.config, cp=degree)) <= self.budget_bytes

    def min_degree(self, lengths, max_degree: int) -> np.ndarray:
        """``(N,)`` smallest CP degree ``k <= max_degree`` whose predicted per-rank peak for the
        document fits the budget; ``max_degree + 1`` where none does. Counts what ``ceil(L /
        capacity)`` misses: the ring's remote K/V shard and the layout metadata of the whole
        document (a rank's query blocks x all key blocks), which grow with ``L``, not ``L / k``.
        Binary search per distinct length (the peak falls as k grows)."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        out = np.empty_like(lengths)
        for n in np.unique(lengths).tolist():
            lo, hi = 1, max_degree + 1  # the answer lies in [lo, hi]; hi means "none fits"
            while lo < hi:
                mid = (lo + hi) // 2
                if self.fits(n, mid):
                    hi = mid
                else:
                    lo = mid + 1
            out[lengths == n] = lo
        return out

    def max_document(self, degree: int) -> int:
        """The longest document (a multiple of the block size) that fits on ``degree`` ranks."""
        return self.model.max_tokens(self.budget_bytes, replace(self.config, cp=degree))


def with_budget_fraction(coefficients: MemoryCoefficients, fraction: float = 0.9) -> float:
    """The default memory budget on a GPU: ``fraction`` of its memory."""
    if coefficients.device_bytes is None:
        raise ValueError("--memory-budget is required on CPU (no device memory to take 90% of)")
    if not 0 < fraction <= 1:
        raise ValueError(f"budget fraction must lie in (0, 1], got {fraction}")
    return fraction * coefficients.device_bytes


def _status_bytes(field: str) -> int:
    """``field`` of Linux's ``/proc/self/status`` in bytes (0 where unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def current_rss_bytes() -> int:
    """Resident bytes of this process now (Linux ``VmRSS``; 0 where unavailable)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> tuple[int, str]:
    """``(bytes, source)``: this process's peak resident size since it started its program.

    Linux ``VmHWM`` (the high-water mark of this program's own memory). Not ``ru_maxrss``: Linux
    carries the parent's peak across ``fork`` + ``exec`` into it, so a probe started by a
    ``sparsebalance profile`` process holding torch reported that process's ~0.7 GB instead of
    its own peak. Elsewhere ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    hwm = _status_bytes("VmHWM")
    if hwm:
        return hwm, "VmHWM"
    import resource
    import sys

    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, "ru_maxrss"


def parse_bytes(text: str) -> float:
    """``"80GB"``, ``"72GiB"``, ``"512MiB"``, ``"1e9"`` -> bytes (for ``--memory-budget``)."""
    units = {
        "": 1,
        "b": 1,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    raw = text.strip().lower().replace(" ", "")
    num = raw.rstrip("kmgtib")
    unit = raw[len(num) :]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(
            f"--memory-budget {text!r}: expected a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        ) from None
    if not (math.isfinite(value) and value > 0):  # nan, inf
        raise ValueError(f"--memory-budget must be a finite number of bytes > 0, got {text!r}")
    return value


__all__ = [
    "ANALYTIC",
    "CHECKPOINTING",
    "GIB",
    "LOSSES",
    "MemoryBound",
    "MemoryCoefficients",
    "MemoryConfig",
    "MemoryModel",
    "auto_capacity",
    "cpu_coefficients",
    "current_rss_bytes",
    "device_coefficients",
    "parse_bytes",
    "with_budget_fraction",
]
