"""``sparsebalance.attach(model)``: the block-sparse attention on a Hugging Face model that another
trainer drives (HF ``Trainer``, TRL, accelerate, a plain loop).

It switches the model to the ``sparsebalance`` attention (the one ``sparsebalance train`` runs,
registered through transformers' public ``AttentionInterface``; no private function is patched)
with ``model.set_attn_implementation`` and binds every attention layer to the runtime;
generation with a KV cache and padded batches at inference switch back to the model's own
attention for that forward (:mod:`.inference`). Per forward the function finds its
packed micro-batch in one of two ways:

- a :class:`MicroBatchTicket` under ``sb_attention`` (what :class:`~.sampler.PackedCollator`
  emits for a planned micro-batch): the plan's budgets (DST's layer controller), statistics;
- otherwise the packed-sequence arguments HF collators produce: ``cu_seq_lens_q`` (= ``_k``;
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) or ``position_ids`` restarting
  at 0 for every document (padding-free collators); a batch of one sequence without either is
  one document. The runtime's default budget applies (``Budget(gamma=1.0)``: exact varlen
  attention, no plan needed).

The attention itself is :func:`sparsebalance.models.attention.sparsebalance_attention` (the one
``sparsebalance train`` runs); this module only finds its :class:`PackedAttention`
(:meth:`AttachedRuntime.resolve`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..engine.kernel import resolve_block_size
from ..models import SUPPORTED_MODEL_TYPES, check_attention
from ..models.attention import IMPLEMENTATION, LayerStats, PackedAttention, bind_context, register
from ..models.shapes import SUPPORTED
from ..ops import Budget, resolve_backend
from ..transfer import upload
from . import inference


class MicroBatchTicket:
    """A planned micro-batch's attention settings, carried in the batch as ``sb_attention``.

    Deliberately not a dataclass: DDP's input copy (``device_ids`` on CUDA) rebuilds dataclasses
    and Trainer / accelerate pass other objects through untouched. The collator builds
    ``attention`` on the host; the first layer moves its pack to the queries' device
    (:meth:`~sparsebalance.models.attention.PackedAttention.to_device`).
    """

    __slots__ = ("attention", "filler", "index", "key", "result", "step")

    def __init__(
        self, attention: PackedAttention, step: int, index: int, key: Any = None, filler: bool = False
    ) -> None:
        self.attention = attention
        self.step = step
        """Global step number (0-based) the micro-batch belongs to."""
        self.index = index
        """Position among this rank's micro-batches of the step (0 .. GA - 1)."""
        self.key = key
        """What the planner needs back with the measurement (its micro-batch record)."""
        self.filler = filler
        """An empty filler micro-batch (a rank with fewer planned micro-batches)."""
        self.result: Any = None

    def __repr__(self) -> str:
        kind = "filler" if self.filler else "micro-batch"
        return f"MicroBatchTicket(step={self.step}, index={self.index}, {kind})"


@dataclass
class AttachedRuntime:
    """What :func:`attach` returns: the attention's settings and what it did.

    ``budget`` applies to forwards without a planned ticket; ``stats`` keeps the layer statistics
    of the last such forward (``LayerStats``: layer, budget, density, per-document density; a
    planned micro-batch keeps its own in its ticket) and ``forwards`` counts every forward.
    """

    model: torch.nn.Module
    block_size: int
    """Tokens per sparsity block (``attach`` resolves the device's default)."""
    backend: str = "auto"
    budget: Budget = field(default_factory=lambda: Budget(gamma=1.0))
    stats: list[LayerStats] = field(default_factory=list)
    forwards: int = 0
    dense_forwards: int = 0
    """Inference forwards run with :attr:`dense_implementation` (:mod:`.inference`)."""
    dense_implementation: str = "sdpa"
    """The attention the model had before ``attach``: what decoding with a KV cache and padded
    batches at inference run with."""
    planner: Any = None
    """The step planner when :mod:`sparsebalance.hf` or a plain loop drives the model."""
    chosen: set[str] = field(default_factory=lambda: {"block_size", "backend", "budget"})
    """The settings a caller chose (:func:`attach` leaves out those it defaulted): a later
    ``attach`` may still choose the others, until a planner is built."""
    _current: PackedAttention | None = field(default=None, repr=False)
    _prepared: bool = field(default=False, repr=False)

    def resolve(self, module, query: torch.Tensor, sb_attention, kwargs: dict) -> PackedAttention:
        """The :class:`PackedAttention` of attention ``module``'s forward (bound to every
        attention layer by :func:`attach`): a planned ticket's, or the one :meth:`prepare` built
        for this forward from the packed arguments HF collators produce (a layer called outside
        the model's forward builds it at its first layer, :meth:`context`)."""
        # transformers' attention modules carry layer_idx; a module without one counts as first
        first = int(getattr(module, "layer_idx", 0)) == 0
        if first:
            self.forwards += 1
        if isinstance(sb_attention, MicroBatchTicket):
            return sb_attention.attention  # the attention moves its pack to query's device
        if sb_attention is not None:
            raise TypeError(
                f"sb_attention must be a MicroBatchTicket or PackedAttention, got {type(sb_attention).__name__}"
            )
        if self._current is None or (first and not self._prepared):
            return self.context(query.shape[0], query.shape[2], query.device, kwargs)
        return self._current

    def prepare(self, args: tuple, kwargs: dict) -> None:
        """Before a forward of the model (``model(*args, **kwargs)``) without a ticket: its
        :class:`PackedAttention`, built once from the model's arguments (one read of the
        offsets: before the first layer, so no layer reads anything); after it, :meth:`done`."""
        self._prepared = False
        if isinstance(kwargs.get("sb_attention"), MicroBatchTicket):
            return
        ids = args[0] if args else kwargs.get("input_ids")
        ids = kwargs.get("inputs_embeds") if ids is None else ids
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            self.context(ids.shape[0], ids.shape[1], ids.device, kwargs)
            self._prepared = True

    def done(self) -> None:
        """After a forward: its context is not the next one's."""
        self._current, self._prepared = None, False

    def context(self, batch: int, total: int, device: torch.device, kwargs: dict) -> PackedAttention:
        """The :class:`PackedAttention` of a forward without a ticket over ``batch`` rows of
        ``total`` tokens (module docstring): its offsets read to the host once, the pack built
        from them and uploaded (no further read)."""
        if kwargs.get("cu_seq_lens_q") is None and batch != 1:
            raise ValueError(
                f"sparsebalance attention runs packed batches (batch size 1 with cu_seq_lens_q or "
                f"position_ids, as DataCollatorWithFlattening or sparsebalance's PackedCollator "
                f"make them); got batch size {batch}"
            )
        offsets = host_offsets(kwargs, total)
        cu = upload(offsets, torch.device(device), torch.int32)
        lengths = tuple(int(n) for n in np.diff(offsets))
        self._current = PackedAttention(cu, self.budget, self.block_size, self.backend, lengths=lengths)
        self.stats = self._current.stats
        return self._current


# model -> its runtime, weakly both ways: the model keeps its runtime alive (the forward hooks
# inference.install registers hold it), and a strong value would keep the model alive through
# runtime.model (the attached model must be freed when dropped).
_RUNTIMES: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[AttachedRuntime]] = weakref.WeakKeyDictionary()


def host_offsets(kwargs: dict, total: int) -> np.ndarray:
    """int64 ``(N + 1,)`` document offsets of a packed forward of ``total`` tokens, on the host,
    in one read: ``cu_seq_lens_q`` (checked equal to ``cu_seq_lens_k``), else where
    ``position_ids`` restart at 0, else one document."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return positions_offsets(kwargs.get("position_ids"), total)
    cu_k = kwargs.get("cu_seq_lens_k")
    parts = [cu.reshape(-1)] + ([] if cu_k is None else [cu_k.reshape(-1).to(cu.device)])
    host = torch.cat(parts).to("cpu", torch.int64).numpy()  # the read
    offsets, rest = host[: cu.numel()], host[cu.numel() :]
    if cu_k is not None and not np.array_equal(offsets, rest):
        raise ValueError(
            "sparsebalance attention: cu_seq_lens_q and cu_seq_lens_k differ (only "
            "self-attention over packed documents is supported)"
        )
    return offsets


def positions_offsets(position_ids: torch.Tensor | None, total: int) -> np.ndarray:
    """int64 ``(N + 1,)`` offsets of a packed row, on the host: a document starts wherever
    ``position_ids`` (``(1, T)``) is 0 (one read); without positions one document of ``total``."""
    if position_ids is None:
        return np.array([0, total], dtype=np.int64)
    pos = position_ids.reshape(-1)
    if pos.numel() != total:
        raise ValueError(f"position_ids holds {pos.numel()} positions for {total} tokens")
    starts = np.flatnonzero(pos.to("cpu").numpy() == 0)  # the read
    if starts.size == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return np.append(starts, total).astype(np.int64)


def cu_from_positions(position_ids: torch.Tensor | None, total: int, device) -> torch.Tensor:
    """int32 ``(N + 1,)`` document offsets of a packed row on ``device`` (:func:`positions_offsets`)."""
    return upload(positions_offsets(position_ids, total), torch.device(device), torch.int32)


def check_model(model: torch.nn.Module) -> None:
    """Refuse models whose attention this op does not implement, as ``sparsebalance train``
    would (sliding windows, logit soft-capping), and models it was not tested on."""
    # any torch module may be passed: one without a transformers config (or whose config has no
    # model_type) reads as model_type None and is refused below, naming what is supported
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"sparsebalance.attach: model_type {kind!r} is not supported (supported: "
            f"{SUPPORTED}; their attention goes through transformers' AttentionInterface with "
            "full causal attention)"
        )
    check_attention(config, "sparsebalance.attach")


def attached_runtime(model: torch.nn.Module) -> AttachedRuntime | None:
    """The runtime :func:`attach` returned for ``model``, or None if it was never attached."""
    ref = _RUNTIMES.get(model)
    return None if ref is None else ref()


def check_block_size(block_size, caller: str = "sparsebalance.attach") -> None:
    """``block_size`` is None or a positive integer (one line naming it otherwise)."""
    if block_size is None:
        return
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{caller}: block_size must be a positive integer, got {block_size!r}")
    if block_size < 1:
        raise ValueError(f"{caller}: block_size must be a positive integer, got {block_size}")


def check_device(device) -> None:
    """Refuse a CUDA device on a machine without CUDA (one line), before anything is built."""
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"sparsebalance.attach: device {str(device)!r} asked, but CUDA is not available on "
            "this machine (torch.cuda.is_available() is False): leave device out (where the "
            "model's parameters are) or pass 'cpu'"
        )


def reconcile(
    runtime: AttachedRuntime,
    caller: str,
    *,
    block_size: int | None = None,
    backend: str | None = None,
    budget: Budget | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Settings a later call asks of an attached model: the same (or left out) keep the runtime;
    one its attach left to the default is taken while no planner is built (a defaulted block
    size also follows the training ``device``); any other difference is refused in one line
    naming both values (the attention would silently keep the first)."""
    name = type(runtime.model).__name__
    for key, current, asked in (
        ("block_size", runtime.block_size, block_size),
        ("backend", runtime.backend, backend),
        ("budget", runtime.budget, budget),
    ):
        if asked is None:
            continue
        if asked != current:
            if key in runtime.chosen or runtime.planner is not None:
                raise ValueError(
                    f"{caller}: this {name} is attached already with {key}={current!r}; this call "
                    f"asks for {key}={asked!r}: pass {current!r} or leave {key} out (the attached "
                    f"runtime is used), or attach a freshly loaded model for another {key}"
                )
            setattr(runtime, key, asked)
        runtime.chosen.add(key)
    if device is not None and "block_size" not in runtime.chosen and runtime.planner is None:
        # attach(model) on a model loaded on the CPU, then a Trainer on CUDA: the block the
        # attention and the planner use is the training device's default (128 on CUDA)
        runtime.block_size = resolve_block_size(device, backend=None)


def attach(
    model: torch.nn.Module,
    *,
    budget: Budget | None = None,
    block_size: int | None = None,
    backend: str | None = None,
    device: torch.device | str | None = None,
) -> AttachedRuntime:
    """Run ``model``'s attention through SparseBalance's block-sparse op.

    Args:
        model: a Hugging Face causal LM (Qwen2 / Qwen2.5, Qwen3, Llama, Mistral families),
            not yet wrapped by DDP / FSDP.
        budget: the budget of forwards without a plan; default ``Budget(gamma=1.0)``, every
            causal block: exact varlen attention.
        block_size: tokens per sparsity block (a positive integer); None: the training device's
            default (128 on CUDA, where FlexAttention's tiles are, 64 elsewhere).
        backend: ``auto`` (the default) | ``torch`` | ``flex`` | ``reference``
            (``block_sparse_attention``).
        device: where the model will train (default: where its parameters are now); decides
            the default block size. ``cuda`` on a machine without CUDA is refused.

    Returns:
        The :class:`AttachedRuntime` (budget, layer statistics; the planner once a trainer
        integration drives it). Calling ``attach`` again on the same model returns the same one
        when it asks for the same settings or leaves them out; a setting the first call chose
        and this one asks to change is refused in one line naming both (:func:`reconcile`).
    """
    _check_attach(model, budget, block_size, backend, device)
    existing = attached_runtime(model)
    if existing is not None:
        reconcile(
            existing, "sparsebalance.attach", block_size=block_size, backend=backend, budget=budget, device=device
        )
        return existing
    check_model(model)
    register()
    # the backend is checked with the block where the trainer resolves its kernel (the model may
    # still move to another device); here the block only follows the device
    resolved = resolve_block_size(device or next(model.parameters()).device, block_size, backend=None)
    asked = {"block_size": block_size, "backend": backend, "budget": budget}
    runtime = AttachedRuntime(
        model,
        resolved,
        backend or "auto",
        budget or Budget(gamma=1.0),
        chosen={k for k, v in asked.items() if v is not None},
    )
    _bind_layers(model, runtime)
    inference.install(model, runtime)  # before the switch: it keeps the model's own attention
    model.set_attn_implementation(IMPLEMENTATION)
    _RUNTIMES[model] = weakref.ref(runtime)
    return runtime


def _check_attach(model: torch.nn.Module, budget, block_size, backend, device) -> None:
    """Refuse what :func:`attach` cannot take (one line each), before anything is built."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("sparsebalance.attach: pass the model before wrapping it in DDP")
    check_block_size(block_size)
    check_device(device)
    if backend is not None:  # a name the op does not know fails here, not at the first forward
        try:  # (the model may move to CUDA later: only the name is checked, as on CUDA)
            resolve_backend(backend, torch.device("cuda"))
        except ValueError as err:
            raise ValueError(f"sparsebalance.attach: {err}") from None
    if budget is not None and not isinstance(budget, Budget):
        raise TypeError(f"sparsebalance.attach: budget must be a Budget, got {budget!r}")


def _bind_layers(model: torch.nn.Module, runtime: AttachedRuntime) -> None:
    """Give every attention layer of ``model`` the runtime's context (none found: refused)."""
    found = 0
    for module in model.modules():
        # transformers' attention modules (Qwen2Attention, LlamaAttention, ...): no common base
        # class to test, so they are recognised by their attributes
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
            bind_context(module, runtime.resolve)
            found += 1
    if not found:
        raise ValueError(
            f"sparsebalance.attach: found no attention layer (a module with layer_idx and "
            f"q_proj) in {type(model).__name__}"
        )
