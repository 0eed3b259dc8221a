"""``sparsebalance profile --memory``: its flags, the probe token counts, and the memory model's
coefficients measured (one fresh process per count), fitted and cached."""

from __future__ import annotations

import argparse
import sys

from ..latency import fingerprint
from ..latency.memory import CHECKPOINTING
from ..latency.memory_fit import memory_fingerprint, save_calibration
from ..ops import resolve_backend
from ..train.memory_probe import measure_memory, tied_embeddings


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """The memory model's coefficients, measured by fresh probe processes."""
    p.add_argument(
        "--memory",
        action="store_true",
        help="also measure the memory model's coefficients (one fresh process per "
        "--memory-tokens count); stored in the profile's meta['memory'] and the cache",
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="only measure the memory coefficients (written to the cache; no latency profile)",
    )
    p.add_argument(
        "--memory-checkpointing",
        choices=CHECKPOINTING,
        default="off",
        help="activation checkpointing of the memory probes: the mode you train with (a "
        "calibration is used only by runs in its mode)",
    )
    p.add_argument(
        "--memory-tokens",
        default=None,
        help="token counts of the memory probes, >= 2 distinct (default: --max-len / 4, / 2, x 1)",
    )


def memory_tokens(text: str | None, max_len: int, context: int) -> list[int]:
    if text is None:
        return sorted({max(64, max_len // 4), max(128, max_len // 2), max_len})
    try:
        tokens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--memory-tokens must be comma-separated integers, got {text!r}") from None
    if len(set(tokens)) < 2 or min(tokens) < 2 or max(tokens) > context:
        raise ValueError(f"--memory-tokens needs >= 2 distinct counts in [2, {context}], got {text!r}")
    return sorted(set(tokens))


def measure_memory_profile(args, shapes, device, dtype, tokens):
    """Probe, fit, cache; prints the fit's line on stderr. Returns (calibration, cache path)."""
    backend = resolve_backend(args.backend, device)
    tied = tied_embeddings(args.model)
    fp = memory_fingerprint(fingerprint(shapes, device, dtype, backend, args.block_size), tied)
    cal = measure_memory(
        args.model, device, fp, tokens, args.memory_checkpointing, block_size=args.block_size, backend=backend
    )
    path = save_calibration(cal)
    errs = ", ".join(f"{p.tokens}: {100 * e:+.1f} %" for p, e in zip(cal.probes, cal.errors, strict=True))
    print(
        f"memory: act_bytes {cal.act_bytes:.2f} per saved element, overhead "
        f"{cal.overhead_bytes / 2**20:+.0f} MiB; fit error by tokens {errs}"
        + (" (act_bytes at the end of its range: check the probes)" if cal.at_range_end else ""),
        file=sys.stderr,
    )
    return cal, path


def memory_summary(cal) -> dict:
    return {
        "act_bytes": cal.act_bytes,
        "overhead_bytes": cal.overhead_bytes,
        "tokens": [p.tokens for p in cal.probes],
        "peak_bytes": [p.peak_bytes for p in cal.probes],
        "errors": list(cal.errors),
        "analytic_errors": list(cal.analytic_errors),
    }
