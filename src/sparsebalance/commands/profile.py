"""``sparsebalance profile``: measure a latency profile, validate one, or build an analytic one.

    sparsebalance profile --model tiny --device cpu --out profile.json --budget 50
    sparsebalance profile --validate profile.json --num-batches 30 --json
    sparsebalance profile --analytic h100 --model qwen2.5-0.5b --out h100.json
    sparsebalance profile --model tiny --device cpu --memory-only --memory-tokens 1024,2048

Measuring times whole micro-batches of the model's shapes (attention with the training backend
and the block selection included) in interleaved rounds, fits the physical form of
:mod:`sparsebalance.latency.form`, and prints the timing noise and the fit's leave-one-out error
in one line. On CPU it measures with the threads a rank of ``sparsebalance train`` runs with
(``--threads``; the count is part of the profile's fingerprint). Validation times held-out
micro-batches (off-design lengths, random densities) and reports MAPE with a 95 % bootstrap
interval, what is mispredicted (attention by length and density, per-token part, overheads), and
how many steps of online recalibration a profile scaled by 1.5x needs to get back. It writes a
results file only with ``--results-dir``.

``--memory`` also measures the memory model's coefficients (``--memory-only``: only them): one
fresh process per ``--memory-tokens`` count runs a training micro-batch (chunked loss,
``--memory-checkpointing``) and reports its peak (CPU: peak RSS; CUDA:
``torch.cuda.max_memory_allocated``); the bytes per saved activation element and a constant
overhead are fitted to the peaks (:mod:`sparsebalance.latency.memory_fit`) and stored in the
profile's ``meta["memory"]`` and the cache, where ``train --capacity auto`` finds them (for runs
in the same checkpointing mode).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..engine.kernel import add_block_size_argument, resolve_block_size
from ..files import check_output_file, check_output_folder
from ..latency import (
    ACCELERATORS,
    analytic_profile,
    check_profile_fits,
    fingerprint,
    load_profile,
)
from ..latency.measure import measure_profile, noise_line
from ..latency.memory import MemoryConfig, MemoryModel, device_coefficients
from ..latency.validate import validate_profile
from ..models import BUILTIN_MODELS, check_trainable, load_shapes
from ..precision import DTYPES, default_precision
from ..results import markdown_table, write_results
from ..sizes import check_device_memory
from ..timing import torch_threads
from ..train.launch import CPU_NPROC, rank_threads
from .profile_memory import add_memory_arguments, measure_memory_profile, memory_summary, memory_tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_target_arguments(p)
    _add_measure_arguments(p)
    _add_validate_arguments(p)
    _add_analytic_arguments(p)
    p.add_argument("--results-dir", default=None, help="--validate also writes a dated results file here")
    p.add_argument(
        "--measure-links",
        action="store_true",
        help="also time gloo point-to-point transfers (2 processes) for context-parallel rings; "
        "stored in the profile's meta['links']",
    )
    add_memory_arguments(p)
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")


def _add_target_arguments(p: argparse.ArgumentParser) -> None:
    """What is profiled: the model, the device and dtype, the attention kernel and its layouts."""
    p.add_argument("--model", default="tiny", help=f"built-in {BUILTIN_MODELS} or a config.json path")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu | cuda (default: cuda when available, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="compute dtype (default: fp32 on CPU, bf16 on CUDA)",
    )
    p.add_argument("--backend", default="auto", help="attention backend training uses: auto | torch | flex")
    add_block_size_argument(
        p, "sparse block in tokens (default: the device's, 128 on CUDA and for --analytic, 64 on CPU)"
    )
    p.add_argument(
        "--budget-kind",
        choices=("top-k", "gamma"),
        default="top-k",
        help="the budgets training will run, so the layouts timed have their shape: top-k (equal "
        "rows, as train --budget top-k) or gamma (threshold rows)",
    )


def _add_measure_arguments(p: argparse.ArgumentParser) -> None:
    """Measuring: where the profile goes, its largest micro-batch, the time spent."""
    p.add_argument("--out", default="profile.json", help="where to write the profile")
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="most tokens per micro-batch to profile (default: 4096, as train --capacity, "
        "capped at the model's context)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=50.0,
        help="seconds spent timing micro-batches (total profiling ~1.1x this)",
    )
    p.add_argument("--quick", action="store_true", help="--budget 6 (a coarse profile, for tests)")
    p.add_argument(
        "--allreduce-world-size",
        type=int,
        default=0,
        help="gloo processes for an all-reduce timing (0: none)",
    )


def _add_validate_arguments(p: argparse.ArgumentParser) -> None:
    """Validation on held-out micro-batches; --rounds and --threads also govern measuring."""
    p.add_argument(
        "--validate",
        metavar="PROFILE",
        default=None,
        help="validate PROFILE on held-out micro-batches instead of profiling",
    )
    p.add_argument("--num-batches", type=int, default=30, help="held-out micro-batches (--validate)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="tokens per held-out micro-batch (default: the profile's max length)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="timings per micro-batch (median): the least for a profile (more rounds, up to 8, "
        "while --budget lasts), exactly this many for --validate's held-out set",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads to measure with (default: what each rank of `sparsebalance train` "
        f"uses: $OMP_NUM_THREADS, else 1, as torchrun sets for train's {CPU_NPROC} CPU "
        "processes; with --validate: the profile's own count)",
    )
    p.add_argument("--strict", action="store_true", help="error (not warn) on a fingerprint mismatch")


def _add_analytic_arguments(p: argparse.ArgumentParser) -> None:
    """An analytic (FLOP-count) profile instead of a measured one."""
    p.add_argument(
        "--analytic",
        choices=sorted(ACCELERATORS),
        default=None,
        help="write an analytic (FLOP-count) profile for this GPU instead of measuring",
    )
    p.add_argument("--efficiency", type=float, default=0.45, help="GEMM efficiency (--analytic)")


def main(args: argparse.Namespace) -> int:
    shapes = load_shapes(args.model)
    if args.analytic:  # a GPU's profile: its block size is CUDA's unless given
        return _analytic(args, shapes)
    device, dtype = _check_device_and_timing(args)
    check_trainable(args.model)  # a sliding window: refused before anything is timed
    if args.validate:
        return _validate(args, shapes, device, dtype)
    max_len, budget = _check_measure_arguments(args, shapes, device)
    threads = (args.threads or rank_threads(CPU_NPROC)) if device.type == "cpu" else None
    tokens = memory_tokens(args.memory_tokens, max_len, shapes.max_context)
    if args.memory_only:
        cal, path = measure_memory_profile(args, shapes, device, dtype, tokens)
        return _report({"wrote": str(path), "memory": memory_summary(cal)}, args)
    return _measure(args, shapes, device, dtype, max_len, budget, threads, tokens)


def _analytic(args, shapes) -> int:
    """Write the analytic profile of ``--analytic``'s GPU."""
    check_output_file(args.out, "--out")
    block = resolve_block_size("cuda", args.block_size, backend=None)  # priced, not compiled
    profile = analytic_profile(shapes, args.analytic, args.efficiency, block_size=block)
    profile.save(args.out)
    return _report({"wrote": args.out, "source": "analytic", "device": args.analytic, "block_size": block}, args)


def _check_device_and_timing(args) -> tuple[torch.device, str]:
    """The device and dtype; resolves ``args.block_size`` for them; refuses bad --rounds, --threads."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    dtype = args.dtype or default_precision(device)
    args.block_size = resolve_block_size(device, args.block_size, args.backend)
    if args.rounds < 2:
        raise ValueError(f"--rounds must be >= 2 (the noise needs repeats), got {args.rounds}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    return device, dtype


def _check_measure_arguments(args, shapes, device) -> tuple[int, float]:
    """Refuse, before minutes of measuring, what would fail after them; returns (max_len, budget)."""
    if not args.memory_only:  # the profile can be written
        check_output_file(args.out, "--out")
    max_len = args.max_len if args.max_len is not None else min(4096, shapes.max_context)
    if not args.block_size <= max_len <= shapes.max_context:
        raise ValueError(f"--max-len must be in [--block-size, {shapes.max_context}], got {max_len}")
    check_micro_batch_memory(shapes, max_len, device, args.block_size, "--max-len")
    budget = 6.0 if args.quick else args.budget
    if not budget > 0:  # nan included
        raise ValueError(f"--budget must be > 0 seconds, got {budget}")
    return max_len, budget


def _measure(args, shapes, device, dtype, max_len, budget, threads, tokens) -> int:
    """Measure the profile (with links and memory when asked), write it, report it."""
    profile = measure_profile(
        shapes,
        device,
        dtype,
        args.backend,
        block_size=args.block_size,
        max_len=max_len,
        budget_s=budget,
        rounds=args.rounds,
        allreduce_world_size=args.allreduce_world_size,
        quiet=True,
        threads=threads,
        layout=_layout(args),
        announce=lambda s: print(
            f"profile: measuring, about {s:.0f} s (estimated from a first timing here)", file=sys.stderr
        ),
        progress=True,
    )
    if args.measure_links:
        from ..latency.links import measure_p2p

        profile.meta["links"] = measure_p2p().to_dict()
    memory = None
    if args.memory:
        cal, _ = measure_memory_profile(args, shapes, device, dtype, tokens)
        profile.meta["memory"] = cal.to_json()
        memory = memory_summary(cal)
    profile.save(args.out)
    print(noise_line(profile), file=sys.stderr)
    summary = {
        "wrote": args.out,
        "links": profile.meta.get("links"),
        "fingerprint": profile.fingerprint,
        "profiling_seconds": profile.meta["profiling_seconds"],
        "noise": profile.noise,
        "fit": {k: v for k, v in profile.fit.items() if k != "design"},
        "optimizer_seconds": profile.optimizer_seconds,
        "allreduce_seconds": profile.allreduce_seconds,
        "memory": memory,
    }
    return _report(summary, args)


def _layout(args) -> str:
    return "top-k" if args.budget_kind == "top-k" else "threshold"


def check_micro_batch_memory(shapes, tokens: int, device, block_size: int, flag: str) -> None:
    """Refuse, with the estimate, a training micro-batch of ``tokens`` whose predicted peak (the
    memory model's: weights, optimizer, activations) exceeds what ``device`` has."""
    model = MemoryModel(shapes, device_coefficients(device))
    need = model.peak_bytes(tokens, MemoryConfig(block_size=block_size))
    check_device_memory(flag, f"a training micro-batch of {tokens:,} tokens", need, device)


def _validate(args, shapes, device, dtype) -> int:
    if args.results_dir:  # before the held-out batches are timed
        check_output_folder(args.results_dir, "--results-dir")
    profile = load_profile(args.validate)
    check_profile_fits(profile, shapes, args.block_size, device.type, f"--validate {args.validate}")
    tokens = args.max_tokens or int(profile.meta.get("max_len", 4096))
    check_micro_batch_memory(shapes, tokens, device, args.block_size, "--max-tokens")
    backend = profile.fingerprint.get("backend", "torch")
    threads = (args.threads or profile.fingerprint.get("threads")) if device.type == "cpu" else None
    running = fingerprint(
        shapes, device, dtype, backend, args.block_size, threads, profile.fingerprint.get("layout", "threshold")
    )
    profile.check_fingerprint(
        {**running, **{k: profile.fingerprint[k] for k in ("max_len", "schema") if k in profile.fingerprint}},
        strict=args.strict,
    )
    result = {"profile": args.validate}
    with torch_threads(threads):
        result.update(
            validate_profile(
                profile,
                shapes,
                device,
                dtype,
                backend,
                args.block_size,
                args.num_batches,
                args.max_tokens,
                args.rounds,
            )
        )
    result["threads"] = threads
    table = _tables(result)
    if args.results_dir:
        md, _ = write_results(args.results_dir, f"profile-validate-{shapes.name}", device, table, result)
        result["results_file"] = str(md)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(table + (f"\nwrote {result['results_file']}" if "results_file" in result else ""))
    return 0


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f} %"


def _tables(r: dict) -> str:
    lo, hi = r["mape_ci95"]
    main_t = markdown_table(
        [
            "held-out micro-batches",
            "MAPE [95 % CI]",
            "max error",
            "bias",
            "level",
            "shape MAPE (max)",
            "timing noise (CV)",
            "recalibration steps (1.5x profile)",
            "predict 10,000",
        ],
        [
            [
                r["num_batches"],
                f"{100 * r['mape']:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}]",
                f"{100 * r['max_error']:.1f} %",
                _pct(r["bias"]),
                _pct(r["level"]),
                f"{100 * r['shape_mape']:.1f} % ({100 * r['shape_max_error']:.1f} %)",
                f"{100 * r['validation_noise']['cv_median']:.1f} %",
                str(r["recalibration_steps_from_1.5x"]),
                f"{1e3 * r['predict_many_10k_seconds']:.1f} ms",
            ]
        ],
    )
    b = r["breakdown"]
    comp = markdown_table(
        ["component", "share of prediction", "error on its own"],
        [[c, f"{100 * b['mean_share'][c]:.0f} %", _pct(b["component_error"][c])] for c in b["mean_share"]],
    )
    groups = markdown_table(
        ["micro-batches", "n", "MAPE", "bias"],
        [
            [g["group"], g["n"], "-" if g["mape"] is None else f"{100 * g['mape']:.1f} %", _pct(g["bias"])]
            for g in b["groups"]
        ],
    )
    return "\n\n".join([main_t, comp, groups])


def _report(summary: dict, args) -> int:
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"wrote {summary['wrote']}")
    return 0
