"""The language-model loss without ``(T, V)`` logits: lm-head + cross-entropy over token chunks.

``linear_cross_entropy(hidden, weight, labels, token_weights)`` returns
``sum_t w_t * CE(hidden_t @ weight.T, label_t)`` over the tokens whose label is not
``ignore_index``: the trainer's per-document weighting and its global-mean normalisation (the
caller's loss scale) are unchanged. Implementations (``impl``):

- ``"plain"``: the whole ``(T, V)`` logits in float32 (the reference; 2-3 ``T x V x 4`` bytes live
  at the loss: logits, log-softmax, their gradient).
- ``"chunked"`` (pure PyTorch, CPU and CUDA): the forward keeps only the per-token log-sum-exp
  ``(T,)``; the backward recomputes each chunk's logits. At most one chunk's ``(C, V)`` logits
  (+ ~2 temporaries of that size) exist at a time. Cost: one extra lm-head GEMM (the forward's,
  repeated in the backward: ~+1/3 of the head's FLOPs).
- ``"liger"``: Liger-Kernel's fused linear cross-entropy (CUDA, ``pip install liger-kernel``; it
  computes the gradients in its forward). It has no per-token weights, so it is used only where
  every weight is 1. It reads its target count back to the host in every call
  (``target_mask.sum().item()``, liger-kernel 0.8.5 ``fused_linear_cross_entropy.py:132``): one
  wait for the device per micro-batch, so only an explicit ``--loss liger`` runs it.
- ``"auto"``: ``chunked`` on every device (it reads nothing back). :func:`resolve_loss` says
  which one a call will use.

Precision: under autocast (``--precision bf16|fp16``) ``chunked`` computes its logits GEMMs in
the autocast dtype, explicitly and identically in its forward and its backward on CPU and CUDA
(so the backward's recomputed logits match the forward's log-sum-exp), with float32
accumulation; ``plain`` follows autocast. Liger needs ``liger-kernel >= 0.5.3`` under autocast
(earlier versions fail in ``addmm`` on mixed dtypes: Liger-Kernel #501).
"""

from __future__ import annotations

import contextlib

import torch

from ..precision import autocast_enabled

LOSS_IMPLS = ("auto", "chunked", "plain", "liger")
IGNORE_INDEX = -100
# Logit elements per chunk: 2**26 float32 = 256 MiB per temporary (~440 tokens at V = 151,936).
CHUNK_ELEMS = 1 << 26


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that one chunk's logits hold ~``CHUNK_ELEMS`` elements."""
    return max(1, CHUNK_ELEMS // max(1, vocab_size))


def liger_available() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_loss(impl: str, device: torch.device, uniform_weights: bool) -> str:
    """The implementation ``impl`` stands for on ``device`` (``auto`` resolved; others checked)."""
    if impl not in LOSS_IMPLS:
        raise ValueError(f"--loss must be one of {LOSS_IMPLS}, got {impl!r}")
    if impl == "liger":
        if device.type != "cuda" or not liger_available():
            raise ValueError("--loss liger needs CUDA and the liger-kernel package")
        if not uniform_weights:
            raise ValueError("--loss liger has no per-token weights: use chunked with --per-doc-loss-weighting")
    if impl == "auto":  # never Liger: its .item() makes the host wait once a micro-batch
        return "chunked"
    return impl


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Weighted sum of token cross-entropies; logits exist one chunk at a time (recomputed in the
    backward from the saved ``(T,)`` log-sum-exp)."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        token_weights,
        chunk: int,
        ignore_index: int,
        compute: torch.dtype | None = None,
    ):  # type: ignore[override]
        compute = compute or torch.promote_types(hidden.dtype, weight.dtype)
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        num_tokens = hidden.shape[0]
        lse = torch.empty(num_tokens, dtype=acc, device=hidden.device)
        coef = torch.where(labels != ignore_index, token_weights.to(acc), 0.0)  # (T,)
        safe = labels.clamp_min(0)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        with _no_autocast(hidden):  # the compute dtype is explicit, the same in the backward
            w, b = weight.to(compute), None if bias is None else bias.to(compute)
            for s in range(0, num_tokens, chunk):
                e = min(s + chunk, num_tokens)
                logits = _logits(hidden[s:e].to(compute), w, b).to(acc)  # (C, V)
                lse[s:e] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, safe[s:e, None])[:, 0]
                total += ((lse[s:e] - picked) * coef[s:e]).sum()
                del logits
        ctx.save_for_backward(hidden, weight, bias, safe, coef, lse)
        ctx.chunk, ctx.compute = chunk, compute
        return total

    @staticmethod
    def backward(ctx, grad_total):  # type: ignore[override]
        hidden, weight, bias, safe, coef, lse = ctx.saved_tensors
        acc, compute = lse.dtype, ctx.compute
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=acc, device=bias.device)
        scale = coef * grad_total.to(acc)  # (T,)
        with _no_autocast(hidden):
            w, b = weight.to(compute), None if bias is None else bias.to(compute)
            for s in range(0, hidden.shape[0], ctx.chunk):
                e = min(s + ctx.chunk, hidden.shape[0])
                h = hidden[s:e].to(compute)
                g = _logits(h, w, b).to(acc).sub_(lse[s:e, None]).exp_()  # softmax (C, V)
                g.scatter_add_(1, safe[s:e, None], torch.full((e - s, 1), -1.0, dtype=acc, device=g.device))
                g.mul_(scale[s:e, None])  # d total / d logits
                g_low = g.to(compute) if compute != acc else g
                grad_hidden[s:e] = (g_low @ w).to(hidden.dtype)
                grad_weight += (g_low.transpose(0, 1) @ h).to(acc)
                if grad_bias is not None:
                    grad_bias += g.sum(0)
                del g, g_low
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None, None, None


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(h, weight, bias)


def _no_autocast(t: torch.Tensor):
    if not autocast_enabled(t.device.type):  # also a device without autocast (meta)
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The lm-head GEMM's dtype: autocast's where it is on for the device, else the inputs'
    (promoted: float32 hidden with a float32 head stays float32)."""
    kind = hidden.device.type
    if autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _check_shapes(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor | None,
    chunk_tokens: int | None,
) -> None:
    """Refuse inputs :func:`linear_cross_entropy` cannot take, before any work."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be (T, H) and weight (V, H); got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be ({hidden.shape[0]},), got {tuple(labels.shape)}")
    if token_weights is not None and token_weights.shape != labels.shape:
        raise ValueError(f"token_weights must be ({labels.shape[0]},), got {tuple(token_weights.shape)}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")


def weighted_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """``sum_t w_t * CE(logits_t, label_t)`` on float32 logits (float64 kept): the plain reference.

    ``logits`` is ``(T, V)``, ``labels`` int64 ``(T,)``, ``token_weights`` ``(T,)``.
    """
    logits = logits if logits.dtype == torch.float64 else logits.float()
    ce = torch.nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")
    return (ce * token_weights.to(ce.dtype)).sum()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    impl: str = "auto",
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    uniform_weights: bool | None = None,
) -> torch.Tensor:
    """Weighted sum of next-token cross-entropies, differentiable in hidden, weight and bias.

    Args:
        hidden: ``(T, H)`` final hidden states (after the model's last norm).
        weight: ``(V, H)`` lm-head (output embedding) weight.
        labels: int64 ``(T,)`` target ids; ``ignore_index`` marks tokens without a target.
        token_weights: ``(T,)`` per-token loss weights (default 1); ignored tokens count 0.
        bias: optional ``(V,)`` lm-head bias.
        impl: ``auto`` | ``chunked`` | ``plain`` | ``liger`` (module docstring).
        chunk_tokens: tokens per chunk for ``chunked`` (default: :func:`default_chunk_tokens`).
        uniform_weights: every counted token weighs 1 (Liger's condition), if the caller knows;
            None: read from ``token_weights`` when Liger is a candidate (a host sync).

    Returns:
        A scalar: ``sum_t w_t * (logsumexp(z_t) - z_t[label_t])``, float32 (float64 inputs keep
        float64).
    """
    _check_shapes(hidden, weight, labels, token_weights, chunk_tokens)
    # Liger has no per-token weights: usable when every counted token weighs 1. Checking that
    # reads the weights on the host (a sync): only when Liger is a candidate and the caller
    # did not say (the trainer knows from --per-doc-loss-weighting).
    if uniform_weights is None:
        liger = impl == "liger" or (impl == "auto" and hidden.device.type == "cuda" and liger_available())
        uniform_weights = not liger or token_weights is None or bool((token_weights[labels != ignore_index] == 1).all())
    impl = resolve_loss(impl, hidden.device, uniform_weights)
    if token_weights is None:
        token_weights = torch.ones(labels.shape, dtype=torch.float32, device=labels.device)
    if impl == "plain":
        return weighted_cross_entropy(_logits(hidden, weight, bias), labels, token_weights, ignore_index)
    if impl == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        fn = LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction="sum")
        return fn(weight, hidden, labels, bias).float()
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    return ChunkedLinearCrossEntropy.apply(
        hidden,
        weight,
        bias,
        labels,
        token_weights,
        chunk,
        ignore_index,
        _compute_dtype(hidden, weight),
    )
