"""``sparsebalance bench-attn``: fwd+bwd time of block-sparse attention vs density and vs SDPA.

For each sequence length T and target density, a layout with exactly that density (per query
block: the diagonal, the first block, then random causal blocks) is timed forward+backward for
every available backend, next to dense causal ``scaled_dot_product_attention``. Also times
``select_blocks`` (the estimator) relative to dense attention. Timing: warm-up, then the median of
repeats, with device synchronisation on CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..ops import Budget, available_backends, block_sparse_attention, select_blocks
from ..ops.flex_config import check_flex_block_size, resolve_block_size
from ..ops.layout import random_layout
from ..results import markdown_table, write_results
from ..timing import median_time

DEFAULT_DENSITIES = (1.0, 0.5, 0.25, 0.1, 0.05)


def _timer(device: torch.device, warmup: int, repeats: int):
    return lambda fn: median_time(fn, device, warmup, repeats)


def _bench_length(total: int, args, backends, timer, device, dtype, bar) -> list[dict]:
    """All rows for one sequence length T."""
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(total, h, args.head_dim, generator=g).to(device, dtype).requires_grad_()
        for h in (args.heads, args.kv_heads, args.kv_heads)
    )
    cu = torch.tensor([0, total], dtype=torch.int32, device=device)
    grad = torch.randn(total, args.heads, args.head_dim, generator=g).to(device, dtype)

    def sdpa():
        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        out.backward(grad.transpose(0, 1)[None])

    t_sdpa = timer(sdpa)
    bar.update()
    budget = Budget(gamma=0.9)
    t_select = timer(lambda: select_blocks(q, k, cu, budget, block_size=args.block_size))
    bar.update()
    rows, dense_own = [], {}
    for density in args.densities:
        layout = random_layout(cu.cpu(), args.heads, args.block_size, density, seed=1).to(device)
        for backend in backends:

            def step(layout=layout, backend=backend):
                block_sparse_attention(q, k, v, layout, cu, backend=backend).backward(grad)

            t = timer(step)
            dense_own.setdefault(backend, t)
            rows.append({
                "seq_len": total, "backend": backend, "target_density": density,
                "density": round(layout.density(), 4), "seconds": t,
                "ratio_to_own_dense": t / dense_own[backend], "ratio_to_sdpa": t / t_sdpa,
                "sdpa_seconds": t_sdpa, "select_seconds": t_select,
                "select_ratio_to_sdpa": t_select / t_sdpa,
            })  # fmt: skip
            bar.update()
    return rows


def run_benchmark(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    backends = args.backends or [b for b in available_backends(device) if b != "reference"]
    timer = _timer(device, args.warmup, args.repeats)
    total_work = len(args.seq_lens) * (len(args.densities) * len(backends) + 2)
    show = not args.json and sys.stderr.isatty()
    with tqdm(total=total_work, desc="bench-attn", file=sys.stderr, disable=not show) as bar:
        rows = []
        for total in args.seq_lens:
            rows += _bench_length(total, args, backends, timer, device, dtype, bar)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "json", "out")}
    return {"config": config, "rows": rows}


def format_table(rows: list[dict]) -> str:
    headers = [
        "T",
        "backend",
        "density",
        "fwd+bwd s",
        "/ own dense",
        "/ SDPA causal",
        "SDPA s",
        "select / SDPA",
    ]
    body = [
        [r["seq_len"], r["backend"], r["density"], r["seconds"], r["ratio_to_own_dense"],
         r["ratio_to_sdpa"], r["sdpa_seconds"], r["select_ratio_to_sdpa"]]
        for r in rows
    ]  # fmt: skip
    return markdown_table(headers, body)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seq-lens",
        type=_int_list,
        default=None,
        help="comma-separated T, e.g. 4k,8k (default 4k,8k,16k on CPU; 32k,64k,128k on CUDA)",
    )
    p.add_argument(
        "--densities",
        type=_float_list,
        default=None,
        help="comma-separated, each in (0, 1] (default 1,0.5,0.25,0.1,0.05; --quick 1,0.25,0.05)",
    )
    p.add_argument("--heads", type=int, default=4, help="query heads Hq")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads Hkv (Hq %% Hkv == 0)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D (default 64)")
    p.add_argument("--block-size", type=int, default=None,
                   help="sparse block (tokens; default 128 on CUDA, 64 on CPU)")  # fmt: skip
    p.add_argument(
        "--backends",
        type=lambda s: s.split(","),
        default=None,
        help="comma-separated backends (default: every available one except reference)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu | cuda (default: cuda when available, else cpu)")  # fmt: skip
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="default fp32 on CPU, bf16 on CUDA",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1)")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs; the median is kept (default 3)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="T=2048, densities 1/0.25/0.05 unless given, no results file",
    )
    p.add_argument(
        "--out", default="benchmarks/results", help="results folder ('' to write nothing)"
    )
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")  # fmt: skip


def prepare_args(args: argparse.Namespace) -> argparse.Namespace:
    """Apply the ``--quick`` / device defaults and validate every flag (``ValueError``)."""
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    if args.quick:  # a small default grid; explicit --seq-lens and --densities still win
        args.seq_lens = args.seq_lens or [2048]
        args.densities = args.densities or [1.0, 0.25, 0.05]
    args.densities = args.densities or list(DEFAULT_DENSITIES)
    if args.seq_lens is None:
        args.seq_lens = [32768, 65536, 131072] if cuda else [4096, 8192, 16384]
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.block_size = resolve_block_size(args.block_size, args.device)
    backends = args.backends or [b for b in available_backends(args.device) if b != "reference"]
    if "flex" in backends:
        check_flex_block_size(args.block_size, args.device)
    if args.heads % args.kv_heads:
        raise ValueError(
            f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})"
        )
    if any(not 0.0 < d <= 1.0 for d in args.densities):  # also rejects nan
        raise ValueError(f"--densities must lie in (0, 1], got {args.densities}")
    if any(t <= 0 for t in args.seq_lens) or args.block_size <= 0:
        raise ValueError("--seq-lens and --block-size must be positive")
    return args


def main(args: argparse.Namespace) -> int:
    args = prepare_args(args)
    result = run_benchmark(args)
    table = format_table(result["rows"])
    if args.out and not args.quick:
        md, js = write_results(args.out, "bench-attn", torch.device(args.device), table, result)
        where = f"\nwrote {md} and {js}"
    else:
        where = ""
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table + where)
    return 0


def _int_list(s: str) -> list[int]:
    return [
        int(x.lower().replace("k", "")) * (1024 if "k" in x.lower() else 1) for x in s.split(",")
    ]


def _float_list(s: str) -> list[float]:
    return [float(x) for x in s.split(",")]
