"""``sparsebalance memory``: how long a micro-batch or document fits, from the memory model.

    sparsebalance memory --model qwen2.5-3b --analytic a100 --devices 1,8,32
    sparsebalance memory --model tiny --device cpu --memory-budget 8GiB
    sparsebalance memory --model qwen2.5-3b --analytic a100 --check 524288 --devices 32

For every feature combination (activation checkpointing off / selective / full x plain or chunked
loss) it prints the largest micro-batch per rank (FSDP2 over N devices shards the weights, gradients
and optimizer state) and the longest document (context parallelism over all N devices, plus FSDP2)
whose predicted peak fits the budget (default: 90% of the GPU's memory; required on CPU).
Predicted, not measured: see ``sparsebalance.latency.memory`` for what the model counts.
``--check TOKENS`` prints the peak's breakdown for a document of that length instead.
A run may put several micro-batches on a rank, so every figure counts a later micro-batch's
backward, which holds the gradients accumulated so far (sharded over the N devices, as FSDP2
reduce-scatters every micro-batch by default; whole with ``--fsdp-gradient-sync step``).

``--pp P``: pipelines of P stages (``--devices`` counts all devices, DP x PP; FSDP2 shards each
stage over its N / P data-parallel peers). The micro-batch column is the pipeline's: the largest
micro-batch that fits on every stage (split by layers as ``train --pp`` splits them), where 1F1B
keeps ``P - s`` micro-batches in flight on stage ``s``; ``--check`` breaks down each stage.
A pipeline runs whole documents, so there is no context-parallel column. ``--pp-virtual V``:
interleaved 1F1B, which keeps more in flight (:func:`~sparsebalance.batching.interleaved.
held_stages`), its stages sharded as without it. ``--pp-schedule zb-h1`` runs under DDP only
(``train`` refuses it with FSDP2): each stage whole, not sharded.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from functools import partial
from pathlib import Path

from ..batching.interleaved import check_virtual, held_stages
from ..batching.schedule import balanced_layers, head_layers
from ..engine.kernel import add_block_size_argument, resolve_block_size
from ..engine.parallelize import FSDP_GRADIENT_SYNC
from ..latency.host_memory import current_rss_bytes, parse_bytes
from ..latency.memory import (
    ANALYTIC,
    CHECKPOINTING,
    GIB,
    LOSSES,
    MemoryConfig,
    MemoryModel,
    StageShare,
    cpu_coefficients,
)
from ..latency.memory_bound import with_budget_fraction
from ..models import BUILTIN_MODELS, load_shapes
from ..results import markdown_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-0.5b", help=f"built-in {BUILTIN_MODELS} or a path")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--analytic",
        choices=sorted(ANALYTIC),
        default=None,
        help="a GPU's analytic coefficients (bf16 autocast, fp32 AdamW)",
    )
    where.add_argument(
        "--device",
        choices=["cpu"],
        default=None,
        help="fp32 CPU training (this process's resident size as the base)",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        help="bytes per device, e.g. 72GB or 16GiB (default: 90%% of the GPU)",
    )
    p.add_argument("--devices", default="1,8,32", help="comma-separated device counts")
    add_block_size_argument(
        p, "sparse block in tokens (default: the device's, 128 for --analytic, 64 for --device cpu)"
    )
    p.add_argument(
        "--density",
        type=float,
        default=0.1,
        help="attention density assumed for the layout metadata",
    )
    p.add_argument(
        "--check",
        type=int,
        default=None,
        metavar="TOKENS",
        help="breakdown of one document of TOKENS over the largest --devices",
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (--devices counts DP x PP devices)")
    p.add_argument(
        "--pp-virtual",
        type=int,
        default=1,
        metavar="V",
        help="as train's: V chunks of layers per stage (interleaved 1F1B keeps more activations in flight)",
    )
    p.add_argument(
        "--pp-schedule",
        choices=("1f1b", "zb-h1"),
        default="1f1b",
        help="as train's: zb-h1 (zero bubble) also keeps s + 1 micro-batches' pending weight GEMMs on stage s "
        "(their linear layers' inputs and output gradients: more than activation checkpointing keeps)",
    )
    p.add_argument(
        "--fsdp-gradient-sync",
        choices=FSDP_GRADIENT_SYNC,
        default=None,
        help="as train's: FSDP2 reduce-scatters after every micro-batch (a later one holds 1/N of the "
        "gradients; the default) or in the step's last only (it holds them whole); with --pp: step only",
    )
    p.add_argument("--json", action="store_true", help="print only JSON")


def _coefficients(args):
    if args.analytic:
        return ANALYTIC[args.analytic]
    return cpu_coefficients(current_rss_bytes())


def main(args: argparse.Namespace) -> int:
    if args.analytic is None and args.device is None:
        raise ValueError("give --analytic h100|h200|a100 or --device cpu")
    devices = [int(x) for x in str(args.devices).split(",") if x.strip()]
    if not devices or min(devices) < 1:
        raise ValueError(f"--devices must be positive integers, got {args.devices!r}")
    shapes = load_shapes(args.model)
    stages = _stages(args, devices, shapes)
    # an estimate: no kernel compiles, so any positive block is accepted
    args.block_size = resolve_block_size("cuda" if args.analytic else "cpu", args.block_size, backend=None)
    coeffs = _coefficients(args)
    budget = parse_bytes(args.memory_budget) if args.memory_budget is not None else with_budget_fraction(coeffs)
    model = MemoryModel(shapes, coeffs)
    # FSDP2 without pipelines reduce-scatters every micro-batch, as `train` does by default
    if args.pp > 1 and args.fsdp_gradient_sync == "micro-batch":
        raise ValueError(
            f"--fsdp-gradient-sync micro-batch: with --pp {args.pp} a stage stays gathered through its schedule "
            "and reduce-scatters once a step; use --fsdp-gradient-sync step (or leave it unset)"
        )
    every = args.pp == 1 and args.fsdp_gradient_sync != "step"
    ddp_only = args.pp_schedule == "zb-h1"  # train runs zero bubble under DDP only
    shard = (lambda n: 1) if ddp_only else (lambda n: n // args.pp)
    base = {"block_size": args.block_size, "density": args.density, "micro_batches": 2, "reduce_every": every}
    if args.check is not None:
        n = max(devices)
        rows = []
        for ckpt in CHECKPOINTING:
            for loss in LOSSES:
                for s, stage in enumerate(stages):
                    cp = n if stage is None else 1
                    cfg = MemoryConfig(ckpt, loss, shard=shard(n), cp=cp, stage=stage, **base)
                    parts = model.breakdown(args.check, cfg)
                    where = {} if stage is None else {"stage": s}
                    rows.append(
                        {
                            "checkpointing": ckpt,
                            "loss": loss,
                            "devices": n,
                            **where,
                            "fits": parts["peak"] <= budget,
                            "moment": parts["moment"],
                            **{f"{k} GiB": v / GIB for k, v in parts.items() if k != "moment"},
                        }
                    )
        what = f"{args.check:,} tokens " + (f"per micro-batch, PP {args.pp} over" if args.pp > 1 else "over")
        return _emit(args, rows, budget, coeffs, f"{what} {n} devices")
    rows = []
    for ckpt in CHECKPOINTING:
        for loss in LOSSES:
            row = {"checkpointing": ckpt, "loss": loss}
            for n in devices:
                fit = partial(model.max_tokens, budget)
                row[f"micro-batch/rank @{n}"] = min(
                    fit(MemoryConfig(ckpt, loss, shard=shard(n), stage=stage, **base)) for stage in stages
                )
                if n > 1 and args.pp == 1:
                    row[f"document (CP) @{n}"] = fit(MemoryConfig(ckpt, loss, shard=n, cp=n, **base))
            rows.append(row)
    pp = f", PP {args.pp}" if args.pp > 1 else ""
    if args.pp_virtual > 1:
        pp += f" x {args.pp_virtual} chunks (interleaved)"
    if args.pp_schedule == "zb-h1":
        pp += ", zero bubble (DDP: stages not sharded; stage s also holds s + 1 pending W's)"
    return _emit(args, rows, budget, coeffs, "longest trainable (tokens)" + pp)


def _stages(args, devices: list[int], shapes) -> list[StageShare | None]:
    """``--pp``'s stages as ``train --pp`` splits the model (``[None]``: no pipeline)."""
    if args.pp < 1:
        raise ValueError(f"--pp must be >= 1, got {args.pp}")
    check_virtual(args.pp, args.pp_virtual, shapes.num_layers)
    if args.pp == 1:
        return [None]
    if any(n % args.pp for n in devices):
        raise ValueError(f"--pp {args.pp} must divide every --devices count ({args.devices}): the devices are DP x PP")
    p, v = args.pp, args.pp_virtual
    split = tuple(balanced_layers(shapes.num_layers, p * v, head_layers(shapes)).tolist())
    ranks = tuple(sum(split[s::p]) for s in range(p))
    if v == 1 and args.pp_schedule == "zb-h1":
        if p < 2:
            raise ValueError("--pp-schedule zb-h1 needs a pipeline (--pp >= 2)")
        return [replace(StageShare.of(split, s), pending_weights=s + 1) for s in range(p)]
    if args.pp_schedule == "zb-h1":
        raise ValueError(f"--pp-schedule zb-h1 cannot run with --pp-virtual {v}: use one of them")
    if v == 1:
        return [StageShare.of(split, s) for s in range(p)]
    return [replace(StageShare.of(ranks, s), in_flight=held_stages(split, p, s)) for s in range(p)]


def _emit(args, rows, budget, coeffs, title) -> int:
    meta = {
        "model": args.model,
        "coefficients": coeffs.name,
        "budget_bytes": budget,
        "block_size": args.block_size,
        "density": args.density,
        "predicted": True,
    }
    if args.json:
        print(json.dumps({**meta, "rows": rows}, indent=1))
        return 0
    print(
        f"{Path(str(args.model)).name} on {coeffs.name}, budget {budget / GIB:.1f} GiB per "
        f"device — {title} (predicted by the memory model)"
    )
    headers = list(rows[0])
    print(markdown_table(headers, [[r[h] for h in headers] for r in rows]))
    return 0
