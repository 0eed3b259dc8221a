"""Block-sparse attention through FlexAttention (CUDA): the call does attention and nothing else.

Per layer and micro-batch the work around the kernel is ``O(H nb^2)`` index work on the block
mask, built once (:mod:`.flex_mask`, memoised on the layout for the backward and a
recomputation), plus the K/V expansion below; nothing reads, cleans or checks q, k, v or the
output (measured on an H100 at 32K tokens, d = 0.05: such passes cost 8 ms of a 19.6 ms call,
the kernel itself 3.5 ms; ``../shared/gpu/README.md``).

- **GQA**: flex's backward loops serially over the query heads of a KV group in its dK/dV
  programs (``enable_gqa=True``: 7.9 ms at 32K, d = 0.05, Qwen2.5-0.5B heads); with K/V
  ``repeat_interleave``'d to the query heads it is 3.5 ms. ``gqa="expand"`` (the default) does
  that, at ``2 T (Hq - Hkv) D`` more elements held for the backward per layer; ``"native"``
  keeps flex's own GQA (``bench-attn`` measures both).
- **Dense documents** (the budget keeps every causal block: ``layout.dense_docs``) run through
  FlashAttention varlen (:mod:`.dense`) when a run of them holds a whole query block; their
  query blocks are emptied from the flex mask. A pack of dense documents never calls flex.
- **Non-finite values** are not contained here: FlexAttention masks scores, not ``p @ v``, so a
  NaN or inf at a masked position of a computed block can reach other queries of that block
  (other documents included). Training checks the loss and the gradients once per step on the
  device and skips a non-finite step (``docs/reliability.md``); the ``torch`` and
  ``reference`` backends keep the exact per-document containment for debugging.

Block size and kernel options: :mod:`.flex_config` (a multiple of 128 tokens on CUDA, checked
before anything compiles). On CPU, FlexAttention in torch 2.13 is forward-only and its eager
path ignores block lists, so ``backend="auto"`` never picks it there.

Compiled graphs stay few: flex is compiled once with dynamic shapes (``dynamic=True``: packed
lengths change every micro-batch; a first static graph followed by an automatic-dynamic recompile
would be two graphs, and on CPU that recompile's C++ does not even build in torch 2.13), and a
pack shorter than two blocks is padded to two (a size-1 block dimension would be specialised
into a graph of its own). One graph per dtype and grad mode; should Dynamo's recompile limit be
hit anyway, the call fails loudly instead of silently running flex eagerly, which materialises
``T x T`` scores (out of memory at long context); that setting is switched on around each call
by a patcher built once (:func:`_fail_on_recompile_limit`), not a ``config.patch`` per call.
"""

from __future__ import annotations

import functools
import sys

import torch

from ..launches import kernel
from .dense import dense_attention
from .flex_config import flex_settings
from .flex_mask import build_block_mask, whole_block_runs
from .layout import BlockLayout, num_blocks


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


@functools.cache
def _fail_on_recompile_limit():
    """``() -> revert``: Dynamo's ``fail_on_recompile_limit_hit`` on for one call, built once.
    torch's own hot-path patcher (``_make_closure_patcher``, what ``torch.compile(dynamic=...)``
    applies per call: ~2 us) instead of ``config.patch`` per call (a context manager built each
    time: 13-50 us of host time per layer, measured); a torch without it gets ``patch``."""
    config = torch._dynamo.config
    maker = getattr(config, "_make_closure_patcher", None)  # a private torch API: probed, with a fallback
    if maker is not None:
        return maker(fail_on_recompile_limit_hit=True)

    def change():
        patch = config.patch(fail_on_recompile_limit_hit=True)
        patch.__enter__()
        return lambda: patch.__exit__(None, None, None)

    return change


_ANNOUNCED: set[tuple[torch.dtype, bool]] = set()


def _announce_compile(dtype: torch.dtype, grad: bool) -> None:
    """One line on stderr (rank 0) before the first call of each graph compiles it: a silent
    wait of several seconds (~17 s for forward and backward on an H100's 16-core host)."""
    if (dtype, grad) in _ANNOUNCED:
        return
    _ANNOUNCED.add((dtype, grad))
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    what = "forward and backward" if grad else "forward"
    print(
        f"sparsebalance: compiling the block-sparse attention kernel (FlexAttention, "
        f"{str(dtype).removeprefix('torch.')}, {what}; once per process, ~20 s on a 16-core "
        "host)",
        file=sys.stderr,
        flush=True,
    )


def padded_length(layout: BlockLayout, static_sizes: tuple[int, ...] = ()) -> int:
    """Tokens the flex call runs on: T, raised until the pack has >= 2 blocks and neither its
    length nor its block count equals 1 or a static size of the call (heads, head dim).

    Dynamo gives equal sizes one symbol ("duck sizing") and flex marks heads and head dim static,
    so a block count that happens to equal the head dim (or 1) would specialise into a graph of
    its own; one empty block more (never read by a real query) costs nothing and avoids it."""
    avoid = {0, 1, *static_sizes}
    total, bs = max(layout.seq_len, layout.block_size + 1), layout.block_size
    while total in avoid or num_blocks(total, bs) in avoid:
        total = total + 1 if total in avoid else num_blocks(total, bs) * bs + 1
    return total


def flex_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    scale: float,
    gqa: str | None = None,
) -> torch.Tensor:
    """``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)`` -> ``(T, Hq, D)``: compiled FlexAttention over
    the layout's sparse documents, FlashAttention varlen over its runs of dense ones.
    ``gqa``: ``"expand"`` or ``"native"`` (default: the device's :func:`flex_settings`)."""
    settings = flex_settings(layout.block_size, q.device)
    gqa = settings.gqa if gqa is None else gqa
    pack = layout.pack
    hq, hkv, t, d = q.shape[1], k.shape[1], q.shape[0], q.shape[2]
    runs = whole_block_runs(pack, layout.dense_docs) if layout.dense_docs else ()
    if len(runs) == 1 and runs[0][2] == 0 and runs[0][3] == t:  # every document dense
        return kernel(dense_attention, q, k, v, pack.cu_seqlens, pack.lengths, scale, like=q)
    expand = gqa == "expand" and hq != hkv
    total = padded_length(layout, (hq, hq if expand else hkv, d))
    block_mask = layout.memo(("flex", hq, total, runs), lambda: build_block_mask(layout, hq, total, runs))
    pad = total - t

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # (T, H, D) -> (1, H, T', D)
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
        return x.transpose(0, 1).unsqueeze(0)

    if q.device.type == "cpu" and not torch.is_grad_enabled():
        # forward only on the CPU: flex refuses inputs that require grad there, whatever the mode
        q, k, v = q.detach(), k.detach(), v.detach()
    qt, kt, vt = heads_first(q), heads_first(k), heads_first(v)
    if expand:  # contiguous heads-first copies, as measured (K/V repeated to the query heads)
        kt, vt = (x.repeat_interleave(hq // hkv, dim=1) for x in (kt, vt))
    _announce_compile(qt.dtype, torch.is_grad_enabled() and qt.requires_grad)
    revert = _fail_on_recompile_limit()()
    try:
        out = kernel(
            _compiled_flex(),
            qt,
            kt,
            vt,
            like=qt,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=hq != kt.shape[1],
            kernel_options=settings.kernel_options or None,
        )
    finally:
        revert()
    out = out[0].transpose(0, 1)[:t]
    if not runs:
        return out
    # The dense runs' rows replace flex's (emptied) ones: one gather of their tokens, one dense
    # call, one scatter, however many runs (a constant number of T x H x D passes).
    idx, cu, lengths = pack.dense_tokens(runs)
    qd = q.index_select(0, idx)
    dense = kernel(dense_attention, qd, k.index_select(0, idx), v.index_select(0, idx), cu, lengths, scale, like=qd)
    return out.index_copy(0, idx, dense)
