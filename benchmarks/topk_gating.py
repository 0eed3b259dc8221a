"""Top-k gating: per query token (MoBA's) vs per query block (what block kernels run) — recall
and cost at the same k.

MoBA's gate scores every key block for every query token (``q_t . mean(k_block)``) and each token
keeps its own top-k. A block kernel computes (query block, key block) tiles: under per-token
gating a query block must compute the *union* of its tokens' choices (up to ``B x k`` blocks),
under per-query-block gating (SparseBalance's: the block's mean query against the mean keys)
exactly ``k`` + anchors. This measures, for the same k:

- recall: the true attention mass (exact softmax per document, float64) the computed token pairs
  cover, mean over heads and query tokens (per-token gating: each token's own blocks only);
- cost: kept (query block, key block) tiles per query block a block kernel runs (the union for
  per-token gating), and the fwd+bwd time of the torch backend on that layout;

on three synthetic patterns of q/k (no trained weights ship with the project): ``local`` (the
queries of a block share one hot key block), ``token`` (every query token has its own hot key
block: the case per-token gating is made for) and ``random`` (no structure). Measure alone:

    python benchmarks/topk_gating.py                 # T 2048, block 64, k 2/4/8
    python benchmarks/topk_gating.py --quick         # small, for the slow test tier

Writes ``benchmarks/results/<date>-topk-gating-cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from sparsebalance.ops import BlockLayout, Budget, block_sparse_attention, select_blocks
from sparsebalance.ops.layout import causal_block_mask
from sparsebalance.results import markdown_table, write_results

PATTERNS = ("local", "token", "random")


def make_qk(pattern: str, total: int, heads: int, dim: int, block: int, seed: int):
    """``q, k (T, H, D)`` float32 with a planted attention pattern (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, heads, dim, generator=g) * 0.3
    k = torch.randn(total, heads, dim, generator=g) * 0.3
    if pattern == "random":
        return q, k
    nb = total // block
    keys = torch.randn(nb, heads, dim, generator=g)  # one direction per key block
    k += keys.repeat_interleave(block, 0)
    qb = torch.arange(total) // block
    if pattern == "local":  # a block's queries share one hot (earlier) block
        target = (torch.rand(nb, generator=g) * (torch.arange(nb) + 1)).long()[qb]
    else:  # every token its own hot block
        target = (torch.rand(total, generator=g) * (qb + 1)).long()
    q += 2.0 * keys[target]
    return q, k


def per_token_mask(q, k, top_k: int, block: int) -> torch.Tensor:
    """Bool ``(H, T, T)``: MoBA's per-token choice (own block and the first block always kept,
    plus each token's ``top_k`` other causal blocks by ``q_t . mean(k_block)``), causal."""
    total, heads, _ = q.shape
    nb = total // block
    kb = k.view(nb, block, heads, -1).mean(1)  # (nb, H, D)
    score = torch.einsum("thd,bhd->htb", q, kb)  # (H, T, nb)
    qb = torch.arange(total) // block
    blocks = torch.arange(nb)
    causal = blocks[None, :] <= qb[:, None]  # (T, nb)
    anchor = (blocks[None, :] == qb[:, None]) | (blocks[None, :] == 0)
    score = score.masked_fill(~(causal & ~anchor)[None], -math.inf)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    rank = order.argsort(-1)
    keep = ((rank < top_k) & (causal & ~anchor)[None]) | anchor[None]  # (H, T, nb)
    tok = keep.repeat_interleave(block, -1)  # (H, T, T)
    tril = torch.ones(total, total, dtype=torch.bool).tril()
    return tok & tril[None]


def recall(q, k, mask: torch.Tensor) -> float:
    """Mean over heads and queries of the exact softmax mass on ``mask`` (one document)."""
    logits = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    tril = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    prob = torch.softmax(logits.masked_fill(~tril[None], -math.inf), -1)
    return float((prob * mask).sum(-1).mean())


def time_layout(q, k, layout: BlockLayout, cu, repeats: int) -> float:
    """Median fwd+bwd seconds of the torch backend on ``layout``."""
    v = torch.randn_like(k)
    times = []
    for _ in range(repeats + 1):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        t0 = time.perf_counter()
        block_sparse_attention(qq, kk, vv, layout, cu, backend="torch").sum().backward()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]


def run(pattern, total, heads, dim, block, top_k, repeats, seed) -> dict:
    q, k = make_qk(pattern, total, heads, dim, block, seed)
    cu = torch.tensor([0, total], dtype=torch.int32)
    blockwise = select_blocks(q, k, cu, Budget(top_k=top_k), block_size=block)
    token_mask = per_token_mask(q, k, top_k, block)
    # The tiles a block kernel must compute for per-token gating: the union over its tokens.
    nb = total // block
    union = token_mask.view(heads, nb, block, nb, block).any(4).any(2)
    union &= causal_block_mask(cu, total, block)[None]
    union_layout = BlockLayout.from_block_mask(union, cu, block, heads)
    return {
        "pattern": pattern,
        "k": top_k,
        "recall_block": recall(q, k, blockwise.to_mask(cu)),
        "recall_token": recall(q, k, token_mask),
        "tiles_block": blockwise.num_kept_pairs() / (heads * nb),
        "tiles_token_union": union_layout.num_kept_pairs() / (heads * nb),
        "seconds_block": time_layout(q, k, blockwise, cu, repeats),
        "seconds_token_union": time_layout(q, k, union_layout, cu, repeats),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--top-k", default="2,4,8", help="comma list of k")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="T 512, block 32, k 2,4, 1 repeat")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    if args.quick:
        args.seq_len, args.block_size, args.top_k, args.repeats = 512, 32, "2,4", 1
    if args.seq_len % args.block_size:
        raise ValueError("--seq-len must be a multiple of --block-size")
    ks = [int(x) for x in args.top_k.split(",")]
    torch.set_num_threads(1)
    load = os.getloadavg()
    rows = [
        run(pat, args.seq_len, args.heads, args.head_dim, args.block_size, kk, args.repeats, args.seed)
        for pat in PATTERNS
        for kk in ks
    ]
    table = markdown_table(
        [
            "pattern",
            "k",
            "recall per-block",
            "recall per-token",
            "tiles/query block per-block",
            "tiles/query block per-token (union)",
            "fwd+bwd s per-block",
            "fwd+bwd s per-token",
        ],
        [
            [
                r["pattern"],
                r["k"],
                r["recall_block"],
                r["recall_token"],
                r["tiles_block"],
                r["tiles_token_union"],
                r["seconds_block"],
                r["seconds_token_union"],
            ]
            for r in rows
        ],
    )
    notes = (
        f"T = {args.seq_len} (one document), {args.heads} heads, head dim {args.head_dim}, "
        f"block {args.block_size}, 1 thread, torch backend; recall = exact softmax mass "
        f"covered (float64); load average before {load[0]:.2f}, after "
        f"{os.getloadavg()[0]:.2f}."
    )
    md, _ = write_results(
        args.out, "topk-gating", torch.device("cpu"), table, {"rows": rows, "args": vars(args)}, notes
    )
    print(table + "\n\n" + notes + f"\n\nwrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
