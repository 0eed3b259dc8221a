"""What ``bench-attn`` measures: one row per (T, case, backend), each part of a layer's attention
timed apart and against the dense baseline of the same run.

Cases per packed length T:

- ``d=<density>``: one document of T tokens, a random top-k-shaped layout of that density (at
  d = 1 every block is kept and the document runs on the dense path);
- ``mixed``: one long document of T / 2 tokens and short ones (256..4,096 tokens) filling the
  rest, selected by a top-k budget of 4,096 tokens (the short documents are covered: dense path;
  the long one sparse);
- ``short``: documents of 256..4,096 tokens only, the same budget: every document dense;
- ``docs4`` / ``docs64``: 4 (64) documents of ``T / 4`` (``T / 64``) tokens, top-k of one block:
  every document selected once it spans more than 3 blocks (``T >= 192`` blocks for 64 of them:
  24K tokens at block 128); what a layer launches must not depend on how many there are.

Parts, each a median of ``repeats`` after ``warmup`` calls: ``select`` (the gate and the budget
rule on a pack index built outside, as per layer in training), ``mask`` (the kernel's index form
from the layout, with the pack's block tables), ``fwd`` (the op's forward) and ``fwd+bwd``; the
baseline is dense causal attention: SDPA for one document, FlashAttention varlen (SDPA per
document off CUDA) for a pack, both with the same GQA heads. FlexAttention has no backward on
the CPU: there its rows time selection, mask and forward, the rest is reported as not measured.

Launches: one layer of a training step (:func:`count_layer`: the model's attention function on
the case's pack, its budget fixed, then with DST's layer controller cutting it), counted with
:class:`~sparsebalance.launches.LaunchCounter`: the operations launched around the kernel and the
host reads, per layer once the pack's tables exist (``ops_per_microbatch``: what building them
launches, once per micro-batch). Flex rows count the CUDA path (DST decides on the device) on
any device.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from ..latency import OutsideGridWarning
from ..launches import LaunchCounter
from ..models.attention import sparsebalance_attention
from ..ops import BlockLayout, Budget, block_sparse_attention, select_blocks, topk_for_density
from ..ops.dense import uses_varlen, varlen_kernel
from ..ops.layout import random_layout
from ..ops.pack_index import PackIndex
from ..sizes import check_memory

SHORT_LENGTHS = (256, 512, 1024, 2048, 4096, 768, 1536, 3072)
"""The short documents of the packed cases, cycled (mean ~1.6K tokens)."""
PACK_BUDGET_TOKENS = 4096
"""The packed cases' top-k budget in tokens: covers every short document."""


def pack_lengths(total: int, case: str) -> list[int]:
    """Document lengths of a packed case (``mixed``, ``short``, ``docs4``, ``docs64``) of
    ``total`` tokens."""
    if case.startswith("docs"):
        n = int(case[4:])
        return [total // n] * (n - 1) + [total - (n - 1) * (total // n)]
    out = [total // 2] if case == "mixed" else []
    for n in itertools.cycle(SHORT_LENGTHS):
        left = total - sum(out)
        if left <= 0:
            break
        out.append(min(n, left))
    return out


def check_sizes(seq_lens, heads: int, kv_heads: int, head_dim: int, block: int, device, timed: bool = True) -> None:
    """Refuse, before allocating, a length whose tensors or layouts cannot fit: the layouts are
    drawn on the host (priorities, ranks: ~32 bytes per head and block pair), q/k/v, their
    gradients, the expanded K/V and the outputs live on ``device`` (4-byte estimate); timed on
    the CPU, the dense baseline's attention holds a ``T x T`` score matrix per head."""
    t = max(seq_lens)
    nb = -(-t // block)
    check_memory("--seq-lens", f"bench-attn at T={t} ({heads} heads, {nb} blocks)", 32 * heads * nb * nb)
    need = 4 * t * head_dim * (6 * heads + 4 * kv_heads) + 20 * heads * nb * nb
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if need > free:
            raise ValueError(
                f"--seq-lens: bench-attn at T={t} would need about {need / 2**30:,.1f} GiB of "
                f"GPU memory; {free / 2**30:,.1f} GiB are free"
            )
    else:
        if timed:  # SDPA on the CPU (grouped-query heads) materialises the scores
            need += 4 * heads * t * t
        check_memory(
            "--seq-lens",
            f"bench-attn at T={t}"
            + (" (timed: dense attention's scores on the CPU; --counts-only counts without them)" if timed else ""),
            need,
        )


def _inputs(lengths, heads, kv_heads, head_dim, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, h, head_dim, generator=g).to(device, dtype).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(total, heads, head_dim, generator=g).to(device, dtype)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return q, k, v, grad, cu.to(device)


def _baseline(q, k, v, grad, cu, lengths, scale):
    """Dense causal attention of the same documents, called directly (not through the op):
    (forward fn, forward+backward fn). One document: SDPA causal. A pack: the FlashAttention
    varlen kernel itself where it runs (CUDA, bf16/fp16), else SDPA once per document."""

    def sdpa(qd, kd, vd):
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (qd, kd, vd))
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(
            0, 1
        )

    if len(lengths) == 1:

        def fwd():
            return sdpa(q, k, v)
    elif uses_varlen(q, scale):

        def fwd():
            return varlen_kernel(q, k, v, cu, max(lengths), scale)
    else:

        def fwd():
            sizes = list(lengths)
            parts = zip(q.split(sizes), k.split(sizes), v.split(sizes), strict=True)
            return torch.cat([sdpa(*p) for p in parts])

    return fwd, lambda: fwd().backward(grad)


def measure_case(total, case, args, backend, timer, device, dtype) -> dict:
    """One row: the parts' seconds and their ratios to the dense baseline."""
    heads, kv_heads, d, block = args.heads, args.kv_heads, args.head_dim, args.block_size
    lengths = [total] if case.startswith("d=") else pack_lengths(total, case)
    q, k, v, grad, cu = _inputs(lengths, heads, kv_heads, d, device, dtype)
    pack = PackIndex.build(cu, block, lengths)
    layout, k_blocks = _case_layout(total, case, q, k, cu, heads, block, pack, device)
    budget = Budget(top_k=k_blocks)
    counts = count_layer(q, k, v, cu, lengths, budget, block, backend, device, run_kernels=not args.counts_only)
    row = {
        "seq_len": total,
        "case": case,
        "backend": backend,
        "gqa": args.gqa,
        "target_density": float(case[2:]) if case.startswith("d=") else None,
        "num_docs": len(lengths),
        "density": round(layout.density(), 4),
        "dense_docs": sum(layout.dense_docs or ()),
        **counts,
    }
    if args.counts_only:
        return {**row, **dict.fromkeys(TIMED)}
    row.update(_time_case(q, k, v, grad, cu, lengths, layout, pack, budget, args, backend, timer, device))
    return row


def _case_layout(total, case, q, k, cu, heads, block, pack, device) -> tuple[BlockLayout, int]:
    """The case's layout and its top-k: ``d=X`` a random top-k layout of density X over one
    document, else the selection's over the pack (one block per query for ``docs`` cases)."""
    if case.startswith("d="):
        density = float(case[2:])
        layout = random_layout(cu.cpu(), heads, block, density, seed=1, shape="top-k").to(device)
        k_blocks = int(np.ceil(topk_for_density(total, density, block)[()]))
    else:
        k_blocks = 1 if case.startswith("docs") else PACK_BUDGET_TOKENS // block
        layout = select_blocks(q.detach(), k.detach(), cu, Budget(top_k=k_blocks), block, pack=pack)
    return layout, k_blocks


def _time_case(q, k, v, grad, cu, lengths, layout, pack, budget, args, backend, timer, device) -> dict:
    """The timed columns of one row: selection, a fresh mask, the sparse op's forward (and
    forward + backward where the backend has one here), the dense baseline's, and their ratios."""
    heads, kv_heads, d, block = args.heads, args.kv_heads, args.head_dim, args.block_size
    scale = d**-0.5
    t_select = timer(lambda: select_blocks(q.detach(), k.detach(), cu, budget, block, pack=pack))

    def fresh_mask():  # what one layer pays once: the kernel's index form, block tables included
        fresh = BlockLayout(layout.block_mask, PackIndex.build(cu, block, lengths).to(device), heads, layout.dense_docs)
        if backend == "flex":
            _flex_mask(fresh, heads, kv_heads, d, args.gqa)
        else:
            fresh.kv_indices  # noqa: B018  (the torch backend's sorted rows start here)

    t_mask = timer(fresh_mask)

    def op():
        return _op(q, k, v, layout, cu, scale, backend, args.gqa)

    with torch.no_grad():
        t_fwd = timer(op)
    backward = backend != "flex" or torch.device(device).type == "cuda"  # no flex bwd on CPU
    t_fb = timer(lambda: op().backward(grad)) if backward else None
    base_fwd, base_fb = _baseline(q, k, v, grad, cu, lengths, scale)
    with torch.no_grad():
        b_fwd = timer(base_fwd)
    b_fb = timer(base_fb)
    return _timed_columns(t_select, t_mask, t_fwd, t_fb, b_fwd, b_fb)


def _timed_columns(t_select, t_mask, t_fwd, t_fb, b_fwd, b_fb) -> dict:
    """The seconds and the ratios to the dense baseline; the backward's only where it was timed."""
    columns = {
        "select_s": t_select,
        "mask_s": t_mask,
        "fwd_s": t_fwd,
        "fwd_bwd_s": t_fb,
        "bwd_s": None,
        "base_fwd_s": b_fwd,
        "base_fwd_bwd_s": b_fb,
        "base_bwd_s": max(b_fb - b_fwd, 0.0),
        "fwd_ratio": t_fwd / b_fwd,
        "bwd_ratio": None,
        "ratio": None,
        "layer_ratio": None,
        "overhead_share": None,
    }
    if t_fb is not None:  # the backward's parts
        sparse = t_select + t_mask + t_fb
        columns.update(
            bwd_s=max(t_fb - t_fwd, 0.0),
            ratio=t_fb / b_fb,
            layer_ratio=sparse / b_fb,
            bwd_ratio=_ratio(t_fb - t_fwd, b_fb - b_fwd, b_fb),
            overhead_share=(t_select + t_mask) / sparse,
        )
    return columns


TIMED = (
    "select_s",
    "mask_s",
    "fwd_s",
    "fwd_bwd_s",
    "bwd_s",
    "base_fwd_s",
    "base_fwd_bwd_s",
    "base_bwd_s",
    "fwd_ratio",
    "bwd_ratio",
    "ratio",
    "layer_ratio",
    "overhead_share",
)
"""A row's timed fields (None under ``--counts-only``)."""


def count_layer(
    q, k, v, cu, lengths, budget: Budget, block: int, backend: str, device, run_kernels: bool = True
) -> dict:
    """One training layer's launches around the kernel and host reads (see the module
    docstring): ``ops_per_layer`` with ``budget`` fixed, ``ops_per_layer_dst`` with DST's layer
    controller cutting it (the coverage bound decided as on a GPU for flex), the larger number of
    ``host_reads_per_layer``, ``ops_per_microbatch`` (the pack's tables, once); ``run_kernels``
    False: the kernels are not run (their outputs are left uninitialised)."""
    from ..engine.layers import packed_attention
    from ..latency import LatencyModel, analytic_profile
    from ..models import ModelShapes
    from ..tuning import DSTConfig, LayerController
    from ..workload import MicroBatch

    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    shapes = ModelShapes("bench", 2, hq * d, hq, hkv, d, 4 * hq * d, 1024, max(lengths))
    latency = LatencyModel(analytic_profile(shapes, "h100", block_size=block))
    decide_on = "cuda" if backend == "flex" else device
    cfg = DSTConfig(budget_tokens=budget.top_k * block)
    mb = MicroBatch(tuple(range(len(lengths))), tuple(lengths), (0.5,) * len(lengths))
    qh, kh, vh = (x.detach().transpose(0, 1)[None] for x in (q, k, v))  # as the model hands them
    out = {}
    warnings.simplefilter("ignore", OutsideGridWarning)  # a stand-in cost model: its grid is moot
    for name, cut in (("ops_per_layer", False), ("ops_per_layer_dst", True)):
        ctl = None
        if cut:
            ctl = LayerController([mb], latency, cfg, 0.0, knob=cfg.knob(block), device=decide_on)
            ctl.target_seconds = 0.3 * float(ctl.planned.sum())  # a bottleneck rank: cut
        ctx = packed_attention(cu, lengths, budget, block_size=block, backend=backend, controller=ctl)
        counts = []
        with torch.no_grad():
            for layer in range(2):  # the first builds the pack's tables
                with LaunchCounter(run_kernels=run_kernels) as count:
                    sparsebalance_attention(_Layer(layer), qh, kh, vh, None, sb_attention=ctx)
                counts.append(count)
        out[name] = counts[1].num_ops
        out.setdefault("ops_per_microbatch", counts[0].num_ops - counts[1].num_ops)
        out["host_reads_per_layer"] = max(out.get("host_reads_per_layer", 0), len(counts[1].reads))
        out[f"{name}_tally"] = counts[1].tally()
    return out


class _Layer:
    """An attention module as transformers hands it to the attention function (its index)."""

    def __init__(self, layer: int) -> None:
        self.layer_idx = layer


def _ratio(part: float, base: float, whole: float) -> float:
    """``part / base``, NaN when the baseline's part is lost in timing noise (< 5 % of whole)."""
    return part / base if base > 0.05 * whole else float("nan")


def _op(q, k, v, layout, cu, scale, backend, gqa):
    if backend == "flex":
        from ..ops.block_sparse_flex import flex_block_sparse_attention

        return flex_block_sparse_attention(q, k, v, layout, scale, gqa=gqa)
    return block_sparse_attention(q, k, v, layout, cu, scale=scale, backend=backend)


def _flex_mask(layout, heads, kv_heads, head_dim, gqa) -> None:
    from ..ops.block_sparse_flex import padded_length
    from ..ops.flex_mask import build_block_mask, whole_block_runs

    runs = whole_block_runs(layout.pack, layout.dense_docs) if layout.dense_docs else ()
    if runs and runs[0][2] == 0 and runs[0][3] == layout.seq_len:
        return  # every document dense: no mask at all
    total = padded_length(layout, (heads, heads if gqa == "expand" else kv_heads, head_dim))
    build_block_mask(layout, heads, total, runs)


TARGETS = (
    ("launches per layer around the kernel (budget fixed): <= 40", None, None, "ops_per_layer", 40),
    ("launches per layer around the kernel (DST cutting): <= 40", None, None, "ops_per_layer_dst", 40),
    ("host reads per layer: 0", None, None, "host_reads_per_layer", 0),
    ("d=0.05 at 32K: fwd+bwd <= 0.25x SDPA", 32768, "d=0.05", "ratio", 0.25),
    ("d=0.05 at 128K: fwd+bwd <= 0.12x SDPA", 131072, "d=0.05", "ratio", 0.12),
    ("d=0.1 at 32K: fwd+bwd <= 0.30x SDPA", 32768, "d=0.1", "ratio", 0.30),
    ("d=1 (every block kept): <= 1.1x SDPA", None, "d=1", "ratio", 1.10),
    ("packs of documents <= 4K, every part: <= 1.1x dense varlen", None, "short", "layer_ratio", 1.10),
    ("selection + mask at 32K, d=0.05: <= 10 % of the sparse call", 32768, "d=0.05", "overhead_share", 0.10),
)
"""Issues 36 and 42's targets: (text, T or None for every T measured, case or None for every
case, row field, bound)."""


def check_targets(rows: list[dict]) -> list[dict]:
    """Each target with the rows that measure it (flex only): measured values, met or not;
    targets no row measures are reported as not measured. Plus issue 42's: a pack of 64
    documents launches what a pack of 4 does."""
    out = []
    for text, t, case, field, bound in TARGETS:
        hits = [
            r
            for r in rows
            if r["backend"] == "flex"
            and case in (None, r["case"])
            and (t is None or r["seq_len"] == t)
            and r.get(field) is not None
        ]
        values = [r[field] for r in hits]
        out.append({"target": text, "measured": values, "met": None if not values else all(x <= bound for x in values)})
    pairs = [
        (a, b)
        for a in rows
        for b in rows
        if a["backend"] == b["backend"] == "flex"
        and a["case"] == "docs4"
        and b["case"] == "docs64"
        and a["seq_len"] == b["seq_len"]
        and a["dense_docs"] == b["dense_docs"] == 0
    ]  # both packs wholly selected
    same = [a[f] == b[f] for a, b in pairs for f in ("ops_per_layer", "ops_per_layer_dst")]
    out.append(
        {
            "target": "launches per layer: a pack of 64 documents as one of 4",
            "measured": [(a[f], b[f]) for a, b in pairs for f in ("ops_per_layer", "ops_per_layer_dst")],
            "met": None if not pairs else all(same),
        }
    )
    return out
