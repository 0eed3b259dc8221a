"""The ``sparsebalance`` command line: one explicit ``command -> (module, help)`` table.

Each command module exposes ``add_arguments(parser)`` and ``main(args) -> int``. Commands appear
here only once they work; there are no placeholders.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .flags import command_line

# command -> (module under sparsebalance.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench-attn": ("bench_attn", "time block-sparse attention vs density and vs dense SDPA"),
    "eval": ("eval", "accuracy under an attention setting: synthetic tasks, perplexity, LongBench"),
    "prepare": ("prepare", "tokenize inputs once into a memory-mapped token store (--data STORE)"),
    "memory": ("memory", "longest trainable micro-batch / document from the memory model"),
    "plan": ("plan", "pack a global batch into ranks x micro-batches (sparsity-aware batching)"),
    "profile": ("profile", "measure, validate or build the latency profile of a model"),
    "ring-balance": ("ring_balance", "per-rank / per-ring-step work imbalance of CP placements"),
    "train": ("train", "distributed training with SAB + DST (launches torchrun); --demo compares"),
    "report": ("report", "markdown + PNG report of training runs"),
    "bench-e2e": ("bench_e2e", "measured baseline / SAB / DST / SAB+DST ablation with prediction"),
    "simulate": ("simulate", "predict baseline / SAB / DST / SAB+DST over many virtual ranks"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparsebalance",
        description="Balanced data-parallel long-context training with dynamic sparse attention.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(f"sparsebalance.commands.{module}")
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip())
        mod.add_arguments(p)
        p.set_defaults(func=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with command_line():  # messages name the flags typed, not the Python fields
            return args.func(args)
    except ValueError as err:  # user errors: one clear line, no traceback
        print(f"sparsebalance {args.command}: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a run that failed (e.g. training stopped): say so plainly
        print(f"sparsebalance {args.command}: failed: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
