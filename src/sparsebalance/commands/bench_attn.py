"""``sparsebalance bench-attn``: each part of a layer's sparse attention against dense attention.

For every packed length T: one document at each density (a random top-k-shaped layout), a mixed
pack (one long document and many short ones), a pack of short documents, and packs of 4 and of
64 selected documents; per backend, the selection, the mask build, the forward and the backward,
each timed apart and divided by the same run's dense baseline (SDPA causal; FlashAttention
varlen for packs), and a training layer's launches around the kernel and host reads, counted.
Cases and parts: :mod:`sparsebalance.commands.attention_cases`. The table ends with issues 36 and
42's targets, met or not, for what was measured (times on CUDA; a CPU run times the torch
backend, and flex's selection, mask and forward only: flex has no backward on the CPU; its counts
are the CUDA path's on any device).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

from ..engine.kernel import add_block_size_argument, resolve_block_size, resolve_gqa
from ..ops import available_backends
from ..ops.flex_config import GQA_MODES
from ..results import markdown_table, write_results
from ..timing import median_time
from .attention_cases import check_sizes, check_targets, measure_case

DEFAULT_DENSITIES = (1.0, 0.25, 0.1, 0.05)
PACK_CASES = ("mixed", "short", "docs4", "docs64")


def run_benchmark(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    backends = args.backends or [b for b in available_backends(device) if b != "reference"]
    cases = [f"d={d:g}" for d in args.densities] + list(args.packs)
    timer = lambda fn: median_time(fn, device, args.warmup, args.repeats)  # noqa: E731
    show = not args.json and sys.stderr.isatty()
    total_work = len(args.seq_lens) * len(cases) * len(backends)
    rows = []
    with tqdm(total=total_work, desc="bench-attn", file=sys.stderr, disable=not show) as bar:
        for total in args.seq_lens:
            for case in cases:
                for backend in backends:
                    rows.append(measure_case(total, case, args, backend, timer, device, dtype))
                    bar.update()
    config = {k: v for k, v in vars(args).items() if k not in ("func", "json", "out")}
    return {"config": config, "rows": rows, "targets": check_targets(rows)}


_COLUMNS = (
    "T",
    "case",
    "backend",
    "density",
    "dense docs",
    "select",
    "mask",
    "fwd",
    "bwd",
    "fwd+bwd",
    "layer (all parts)",
    "select+mask share",
    "SDPA fwd+bwd s",
    "launches / layer",
    "DST launches / layer",
    "host reads / layer",
)


def format_table(rows: list[dict], targets: list[dict] | None = None) -> str:
    table = markdown_table(list(_COLUMNS), [_cells(r) for r in rows])
    note = (
        "\n\nEach part is a ratio to the same run's dense baseline (select, mask: to its "
        "fwd+bwd; fwd and bwd: to its fwd and bwd). 'layer' = select + mask + fwd + bwd. "
        "'not measured': flex has no backward on the CPU (--counts-only times nothing). "
        "Launches: a training layer's operations around the attention kernel (forward; the "
        "pack's tables, built once per micro-batch, apart), with the budget fixed and with "
        "DST's layer controller cutting it."
    )
    if not targets:
        return table + note
    lines = [_target_line(t) for t in targets]
    return table + note + "\n\nTargets (issues 36 and 42, flex rows only):\n" + "\n".join(lines)


def _cells(r: dict) -> list:
    """One row of :func:`format_table`: the parts as ratios to the dense baseline, the launches."""
    return [
        r["seq_len"],
        r["case"],
        r["backend"],
        r["density"],
        f"{r['dense_docs']}/{r['num_docs']}",
        _part(r, "select_s"),
        _part(r, "mask_s"),
        _shown(r["fwd_ratio"]),
        _shown(r["bwd_ratio"]),
        _shown(r["ratio"]),
        _shown(r["layer_ratio"]),
        _shown(r["overhead_share"]),
        _shown(r["base_fwd_bwd_s"]),
        r["ops_per_layer"],
        r["ops_per_layer_dst"],
        r["host_reads_per_layer"],
    ]


def _target_line(t: dict) -> str:
    """``- target: measured values — met | missed`` (``not measured`` when it was not run)."""
    if t["met"] is None:
        return f"- {t['target']}: not measured"
    return f"- {t['target']}: " + ", ".join(_value(x) for x in t["measured"]) + (" — met" if t["met"] else " — missed")


def _shown(value):
    return "not measured" if value is None else value


def _part(row: dict, field: str):
    """A part's seconds over the baseline's fwd+bwd, or 'not measured'."""
    if row[field] is None:
        return "not measured"
    return row[field] / row["base_fwd_bwd_s"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seq-lens",
        type=_int_list,
        default=None,
        help="comma-separated T, e.g. 16k,32k (default: 16k,32k,64k,128k on CUDA, 2k,4k on CPU)",
    )
    p.add_argument(
        "--densities",
        type=_float_list,
        default=None,
        help="one-document cases, each in (0, 1] (default: 1,0.25,0.1,0.05; with --quick 1,0.05)",
    )
    p.add_argument(
        "--packs",
        type=_name_list,
        default=None,
        help="packed cases: mixed (one long document, many short), short (documents "
        "<= 4K), docs4 / docs64 (4 / 64 selected documents) or none (default: "
        "all four)",
    )
    p.add_argument("--heads", type=int, default=14, help="query heads Hq")
    p.add_argument(
        "--kv-heads", type=int, default=2, help="key/value heads Hkv, Hq %% Hkv == 0 (default: 2, as Qwen2.5-0.5B)"
    )
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D")
    add_block_size_argument(p)
    p.add_argument(
        "--backends",
        type=_name_list,
        default=None,
        help="comma-separated backends (default: every available one except reference)",
    )
    p.add_argument(
        "--gqa", choices=GQA_MODES, help="flex's grouped-query attention: expand K/V or native (default: the kernel's)"
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu | cuda (default: cuda when available, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="compute dtype (default: fp32 on CPU, bf16 on CUDA)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is kept")
    p.add_argument(
        "--counts-only",
        action="store_true",
        help="count a training layer's launches and host reads only: no timing, "
        "the kernels not run (a GPU's sizes on any machine)",
    )
    p.add_argument(
        "--quick", action="store_true", help="T=2048 (32K on CUDA), densities 1,0.05 unless given, no results file"
    )
    p.add_argument("--out", default="benchmarks/results", help="results folder ('' to write nothing)")
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")


def prepare_args(args: argparse.Namespace) -> argparse.Namespace:
    """Apply the ``--quick`` / device defaults and validate every flag (``ValueError``)."""
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    if args.quick:  # a small default grid; explicit --seq-lens and --densities still win
        args.seq_lens = args.seq_lens or [32768 if cuda else 2048]
        args.densities = args.densities or [1.0, 0.05]
    args.densities = args.densities or list(DEFAULT_DENSITIES)
    args.packs = [p for p in (args.packs or PACK_CASES) if p != "none"]
    if args.seq_lens is None:
        args.seq_lens = [16384, 32768, 65536, 131072] if cuda else [2048, 4096]
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    backends = args.backends or [b for b in available_backends(args.device) if b != "reference"]
    # several backends run: the block is checked for flex when flex is among them
    args.block_size = resolve_block_size(args.device, args.block_size, "flex" if "flex" in backends else None)
    args.gqa = resolve_gqa(args.gqa, args.block_size)
    if min(args.heads, args.kv_heads, args.head_dim) < 1 or args.heads % args.kv_heads:
        raise ValueError(
            f"--heads ({args.heads}) must be a positive multiple of --kv-heads ({args.kv_heads}); --head-dim >= 1"
        )
    if any(not 0.0 < d <= 1.0 for d in args.densities):  # also rejects nan
        raise ValueError(f"--densities must lie in (0, 1], got {args.densities}")
    if bad := [p for p in args.packs if p not in PACK_CASES]:
        raise ValueError(f"--packs must be mixed, short, docs4, docs64 or none, got {bad}")
    if any(t <= 0 for t in args.seq_lens) or args.block_size <= 0:
        raise ValueError("--seq-lens and --block-size must be positive")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats}, {args.warmup}")
    check_sizes(
        args.seq_lens,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.block_size,
        args.device,
        timed=not args.counts_only,
    )
    return args


def main(args: argparse.Namespace) -> int:
    args = prepare_args(args)
    result = run_benchmark(args)
    table = format_table(result["rows"], result["targets"])
    where = ""
    if args.out and not args.quick:
        name = "bench-attn-counts" if args.counts_only else "bench-attn"
        md, js = write_results(args.out, name, torch.device(args.device), table, result)
        where = f"\nwrote {md} and {js}"
    print(json.dumps(result, indent=2) if args.json else table + where)
    return 0


def _value(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def _int_list(s: str) -> list[int]:
    return [int(x.lower().replace("k", "")) * (1024 if "k" in x.lower() else 1) for x in s.split(",")]


def _float_list(s: str) -> list[float]:
    return [float(x) for x in s.split(",")]


def _name_list(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]
