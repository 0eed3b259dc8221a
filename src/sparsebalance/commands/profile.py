"""``sparsebalance profile``: measure a latency profile, validate one, or build an analytic one.

    sparsebalance profile --model tiny --device cpu --out profile.json [--quick]
    sparsebalance profile --validate profile.json [--num-batches 30] [--strict]
    sparsebalance profile --analytic h100 --model qwen2.5-0.5b --out h100.json

Measuring sweeps attention (length x density, with the training backend and the block
selection), one decoder layer without attention (by tokens), embedding + head + loss (by tokens),
the optimizer step and, on CPU, a gloo all-reduce. Validation times held-out random micro-batches
(off-grid lengths and densities) end to end and reports the prediction error, plus how many steps
of online recalibration a profile scaled by 1.5x needs to get back within 5 %.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from tqdm import tqdm

from ..latency import ACCELERATORS, analytic_profile, fingerprint, load_profile
from ..latency.measure import DTYPES, default_grid, measure_profile
from ..latency.validate import validate_profile
from ..models import BUILTIN_MODELS, load_shapes
from ..results import markdown_table, write_results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="tiny", help=f"built-in {BUILTIN_MODELS} or a config.json path"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="fp32 on CPU, bf16 on CUDA"
    )
    p.add_argument(
        "--backend", default="auto", help="attention backend training uses (auto/torch/flex)"
    )
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--out", default="profile.json", help="where to write the profile")
    p.add_argument("--quick", action="store_true", help="a 3x3 grid (seconds; for tests)")
    p.add_argument(
        "--max-len", type=int, default=None, help="longest document (default: model max)"
    )
    p.add_argument(
        "--allreduce-world-size",
        type=int,
        default=None,
        help="gloo processes for the all-reduce timing (default 2 on CPU, 0 = skip)",
    )
    p.add_argument(
        "--validate",
        metavar="PROFILE",
        default=None,
        help="validate PROFILE on held-out micro-batches instead of profiling",
    )
    p.add_argument(
        "--num-batches", type=int, default=30, help="held-out micro-batches (--validate)"
    )
    p.add_argument(
        "--calibration-batches", type=int, default=None,
        help="end-to-end micro-batches that fit the component scales (8; 2 with --quick)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per held-out micro-batch")
    p.add_argument(
        "--strict", action="store_true", help="error (not warn) on a fingerprint mismatch"
    )
    p.add_argument(
        "--analytic",
        choices=sorted(ACCELERATORS),
        default=None,
        help="write an analytic (FLOP-count) profile for this GPU instead of measuring",
    )
    p.add_argument("--efficiency", type=float, default=0.45, help="GEMM efficiency (--analytic)")
    p.add_argument("--results-dir", default="benchmarks/results", help="where --validate writes")
    p.add_argument(
        "--measure-links", action="store_true",
        help="also time gloo point-to-point transfers (2 processes) for context-parallel rings; "
        "stored in the profile's meta['links']",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    shapes = load_shapes(args.model)
    if args.analytic:
        profile = analytic_profile(shapes, args.analytic, args.efficiency)
        profile.save(args.out)
        return _report({"wrote": args.out, "source": "analytic", "device": args.analytic}, args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if args.block_size <= 0:
        raise ValueError(f"--block-size must be > 0, got {args.block_size}")
    if args.validate:
        return _validate(args, shapes, device, dtype)
    world = args.allreduce_world_size
    world = (2 if device.type == "cpu" and not args.quick else 0) if world is None else world
    grid = default_grid(shapes, args.block_size, args.quick, args.max_len)
    calib = (
        args.calibration_batches
        if args.calibration_batches is not None
        else (2 if args.quick else 8)
    )
    profile = measure_profile(
        shapes, device, dtype, args.backend, args.block_size, grid, world, quiet=args.json,
        calibration_batches=calib,
    )  # fmt: skip
    if args.measure_links:
        from ..latency.links import measure_p2p

        profile.meta["links"] = measure_p2p().to_dict()
    profile.save(args.out)
    summary = {
        "wrote": args.out,
        "links": profile.meta.get("links"),
        "fingerprint": profile.fingerprint,
        "optimizer_seconds": profile.optimizer_seconds,
        "allreduce_seconds": profile.allreduce_seconds,
        "attention_call_seconds": profile.attention_call_seconds,
        "scales": profile.scales,
    }
    return _report(summary, args)


def _validate(args, shapes, device, dtype) -> int:
    profile = load_profile(args.validate)
    running = fingerprint(
        shapes, device, dtype, profile.fingerprint.get("backend", "torch"), args.block_size
    )
    profile.check_fingerprint(running, strict=args.strict)
    show = not args.json and sys.stderr.isatty()

    def progress(items):
        return tqdm(items, desc="validate", file=sys.stderr, disable=not show)

    result = {"profile": args.validate}
    result.update(validate_profile(
        profile, shapes, device, dtype, running["backend"], args.block_size, args.num_batches,
        args.max_tokens, progress,
    ))  # fmt: skip
    table = markdown_table(
        ["held-out micro-batches", "MAPE", "max error", "recalibration steps (1.5x profile)",
         "predict 10,000 micro-batches"],
        [[result["num_batches"], f"{100 * result['mape']:.1f} %",
          f"{100 * result['max_error']:.1f} %", str(result["recalibration_steps_from_1.5x"]),
          f"{1e3 * result['predict_many_10k_seconds']:.1f} ms"]],
    )  # fmt: skip
    if args.results_dir:
        md, _ = write_results(
            args.results_dir, f"profile-validate-{shapes.name}", device, table, result
        )
        result["results_file"] = str(md)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table + (f"\nwrote {result['results_file']}" if "results_file" in result else ""))
    return 0


def _report(summary: dict, args) -> int:
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {summary['wrote']}")
    return 0
