"""Block-sparse attention through FlexAttention (CUDA): a ``BlockMask`` built from the layout.

Block pairs strictly inside one document and strictly below the diagonal are passed as *full*
blocks (no ``mask_mod`` evaluated); the others carry the document-causal ``mask_mod``.
On CPU, FlexAttention in torch 2.13 is forward-only and its eager path ignores block lists, so
``backend="auto"`` never picks it there. Block size and kernel options: :mod:`.flex_config`
(a multiple of 128 tokens on CUDA, checked before anything compiles).

Compiled graphs stay few: flex is compiled once with dynamic shapes (``dynamic=True``: packed
lengths change every micro-batch; a first static graph followed by an automatic-dynamic recompile
would be two graphs, and on CPU that recompile's C++ does not even build in torch 2.13), and a
pack shorter than two blocks is padded to two (a size-1 block dimension would be specialised
into a graph of its own). One graph per dtype and grad mode; should Dynamo's recompile limit be
hit anyway, the call fails loudly instead of silently running flex eagerly, which materialises
``T x T`` scores (out of memory at long context).

Non-finite values: FlexAttention masks the scores, not the products ``p @ v``, and its backward
multiplies masked probabilities (``exp(-inf - lse)``) by the output gradient, so a NaN or inf at
a masked position of a computed block, or a row whose log-sum-exp is NaN, would reach other
queries and other keys' gradients (other documents included). The call runs on cleaned q, k and
v (non-finite entries set to 0) and marks as NaN exactly the outputs that read one: every
feature of a row whose query is non-finite or that sees a non-finite key, the features that read
a non-finite value. The rows are found from prefix counts of the non-finite entries
(:func:`nonfinite_reads`): device work only, no host sync, no second attention call. A poisoned
output passes no gradient back (its inputs' gradients are 0 where the reference has NaN); every
other document's outputs and gradients are exactly those of a clean run.
"""

from __future__ import annotations

import functools
import math

import torch

from .flex_config import flex_settings
from .layout import BlockLayout, dense_to_ordered, num_blocks
from .varlen import doc_ids, doc_starts


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


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


def _doc_tables(layout: BlockLayout, total: int, device: torch.device):
    """Per token of the padded pack: document id and document start (padding: a document of
    its own, starting at T)."""
    t, cu = layout.seq_len, layout.cu_seqlens.to(device)
    doc, start = doc_ids(cu, t), doc_starts(cu, t)
    if total > t:
        n = cu.shape[0] - 1
        doc = torch.cat([doc, torch.full((total - t,), n, dtype=doc.dtype, device=device)])
        start = torch.cat([start, torch.full((total - t,), t, dtype=start.dtype, device=device)])
    return doc, start


def build_block_mask(
    layout: BlockLayout,
    num_q_heads: int,
    device: torch.device,
    kept: torch.Tensor | None = None,
    total: int | None = None,
):
    """The layout as a FlexAttention ``BlockMask`` over ``num_q_heads`` heads, for ``total``
    tokens (default T; padding tokens form a document no real query sees); ``kept``:
    ``layout.to_block_mask()`` on ``device`` if already built."""
    from torch.nn.attention.flex_attention import BlockMask

    bs, total = layout.block_size, total or layout.seq_len
    nb, nbp = layout.num_blocks, num_blocks(total, bs)
    doc, start = _doc_tables(layout, total, device)
    kept = layout.to(device).to_block_mask() if kept is None else kept
    kept = kept.repeat_interleave(num_q_heads // layout.num_heads, dim=0)
    if nbp > nb:
        kept = torch.nn.functional.pad(kept, (0, nbp - nb, 0, nbp - nb))
    # A pair is "full" when every (query, key) token pair in it is doc-causal: the key block lies
    # inside the query block's document and strictly before the query block.
    qb = torch.arange(nbp, device=device)
    first = start[qb * bs]
    last = start[torch.clamp((qb + 1) * bs, max=total) - 1]
    one_doc = first == last
    kb_lo = (first + bs - 1) // bs  # first key block wholly at or after the document start
    full = one_doc[:, None] & (qb[None, :] >= kb_lo[:, None]) & (qb[None, :] < qb[:, None])
    lo = first // bs
    causal = (qb[None, :] >= lo[:, None]) & (qb[None, :] <= qb[:, None])
    kv_num, kv_idx = dense_to_ordered(kept & causal[None] & ~full[None], width=nbp)
    full_num, full_idx = dense_to_ordered(kept & full[None], width=nbp)

    def doc_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])

    return BlockMask.from_kv_blocks(
        kv_num[None], kv_idx[None], full_num[None], full_idx[None],
        BLOCK_SIZE=bs, mask_mod=doc_causal, seq_lengths=(total, total),
    )  # fmt: skip


def nonfinite_reads(
    bad: torch.Tensor, layout: BlockLayout, num_q_heads: int, kept: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool ``(T, Hq, E)``: output ``[i, h, e]`` reads a key ``j`` with ``bad[j, kv(h), e]``, i.e. a
    key of a kept block pair with ``doc_start_i <= j <= i``; ``bad``: bool ``(T, Hkv, E)`` (the
    non-finite entries of v, ``E = D``, or keys with any non-finite feature, ``E = 1``).

    For query token ``i`` in block ``qb`` with document start ``s``, every kept key block strictly
    between ``ceil(s / B)`` and ``qb`` is read whole (the same for all tokens of the block's first
    document: one block-level product), and at most two are read in part: the diagonal block
    (keys ``max(s, qb B) .. i``) and the block holding ``s`` when ``s`` is not on a block
    boundary (keys ``s .. end of that block``). Prefix counts of the non-finite entries over the
    tokens answer each part with two lookups.
    """
    t, hkv = bad.shape[:2]
    bs, nb, hl = layout.block_size, layout.num_blocks, layout.num_heads
    dev = bad.device
    # (T + 1, Hkv, E): bad entries before token j
    counts = torch.nn.functional.pad(
        bad.to(torch.int32).cumsum(0, dtype=torch.int32), (0, 0, 0, 0, 1, 0)
    )
    kv_of = (torch.arange(hl, device=dev) * (num_q_heads // hl)) // (num_q_heads // hkv)  # (Hl,)
    kept = layout.to(dev).to_block_mask() if kept is None else kept  # (Hl, nb, nb)
    start = doc_starts(layout.cu_seqlens.to(dev), t)  # (T,)
    tok = torch.arange(t, device=dev)
    qb = tok // bs
    # Whole blocks: the first document of each query block reads kept blocks [ceil(s0/B), qb).
    edges = torch.clamp(torch.arange(nb + 1, device=dev) * bs, max=t)
    per_block = (counts[edges[1:]] - counts[edges[:-1]]).permute(1, 0, 2)  # (Hkv, nb, D)
    s0 = start[torch.arange(nb, device=dev) * bs]  # (nb,)
    kb = torch.arange(nb, device=dev)
    whole = kept & (kb[None, :] >= ((s0 + bs - 1) // bs)[:, None]) & (kb[None, :] < kb[:, None])
    whole_bad = torch.bmm(whole.float(), per_block[kv_of].float()) > 0  # (Hl, nb, D)
    first_doc = start == s0[qb]  # (T,)
    hits = (whole_bad[:, qb] & first_doc[None, :, None]).permute(1, 0, 2)  # (T, Hl, D)
    # The diagonal block, in part: keys max(s, qb B) .. i.
    lo = torch.maximum(start, qb * bs)
    diag = (counts[tok + 1] - counts[lo]) > 0  # (T, Hkv, D)
    hits |= kept[:, qb, qb].T[:, :, None] & diag[:, kv_of]
    # The block holding the document start, in part, when it lies before the diagonal.
    sb = start // bs
    split = (start % bs != 0) & (sb < qb)
    tail = (counts[torch.clamp((sb + 1) * bs, max=t)] - counts[start]) > 0  # (T, Hkv, D)
    hits |= (kept[:, qb, sb].T & split[:, None])[:, :, None] & tail[:, kv_of]
    return hits.repeat_interleave(num_q_heads // hl, dim=1)


def flex_block_sparse_attention(q, k, v, layout: BlockLayout, scale: float) -> torch.Tensor:
    """``q (T, Hq, D)``, ``k``/``v (T, Hkv, D)`` -> ``(T, Hq, D)`` via compiled FlexAttention."""
    settings = flex_settings(layout.block_size, q.device)
    hq, hkv, t, d = q.shape[1], k.shape[1], q.shape[0], q.shape[2]
    total = padded_length(layout, (hq, hkv, d))
    kept = layout.to(q.device).to_block_mask()
    block_mask = build_block_mask(layout, hq, q.device, kept, total)
    bad_q, bad_k, bad_v = (~torch.isfinite(x) for x in (q, k, v))
    poisoned = (
        nonfinite_reads(bad_v, layout, hq, kept)
        | nonfinite_reads(bad_k.any(-1, keepdim=True), layout, hq, kept)
        | bad_q.any(-1, keepdim=True)
    )  # (T, Hq, D): outputs that read a non-finite entry
    q, k, v = q.masked_fill(bad_q, 0.0), k.masked_fill(bad_k, 0.0), v.masked_fill(bad_v, 0.0)
    pad = total - t

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # (T, H, D) -> (1, H, T', D)
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
        return x.transpose(0, 1).unsqueeze(0)

    qt, kt, vt = heads_first(q), heads_first(k), heads_first(v)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = _compiled_flex()(
            qt, kt, vt, block_mask=block_mask, scale=scale, enable_gqa=hq != hkv,
            kernel_options=settings.kernel_options or None,
        )  # fmt: skip
    return out[0].transpose(0, 1)[:t].masked_fill(poisoned, math.nan)
