"""``sparsebalance plan``: pack a global batch into ranks x micro-batches with every strategy (or
one) and compare predicted step times, balance efficiency and the lower bound.

Input (``--lengths FILE``, read by :func:`sparsebalance.data.read_lengths`): one length per line
(``#`` comments allowed); or JSON, either a list of lengths or an object with a ``lengths`` list
(optional ``densities`` and ``sources`` lists of the same size); or a jsonl dataset, one object
per line, whose ``--text-field`` is tokenized with a whitespace tokenizer (token =
whitespace-separated word; the model's tokenizer comes with the trainer), with optional
``density`` and ``source`` fields.

Densities: those given in the file, else the history estimator's prior (no measurements yet).
Cost model: a :class:`~sparsebalance.latency.LatencyModel` from ``--profile P`` (made by
``sparsebalance profile``), else from the analytic FLOP-count profile of ``--model`` (default the
built-in ``tiny``) on ``--accelerator``. The model used is printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ..batching import OVERLONG, STRATEGIES, HistoryEstimator, PlanConfig, plan_batch
from ..data import read_lengths
from ..latency import ACCELERATORS, context_cost, load_cost_model
from ..results import markdown_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", required=True, metavar="FILE", help="lengths / JSON / jsonl file")
    p.add_argument("--world-size", type=int, required=True, metavar="R", help="ranks")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--micro-batches", type=int, metavar="M", help="micro-batches per rank")
    group.add_argument("--capacity", type=int, metavar="C", help="tokens per micro-batch")
    p.add_argument("--profile", metavar="P", help="latency profile (default: analytic profile)")
    p.add_argument("--model", default="tiny", help="model for the analytic profile")
    p.add_argument(
        "--accelerator",
        choices=sorted(ACCELERATORS),
        default="h100",
        help="accelerator for the analytic profile",
    )
    p.add_argument(
        "--strategy", default="all", help=f"one of {', '.join(STRATEGIES)}, or all (default)"
    )
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="G",
                   help="ranks sharing a node: sab-cp keeps units of <= G ranks inside one node "
                   "(default: the links' node size, 8 for an analytic accelerator)")  # fmt: skip
    p.add_argument("--overlong", choices=OVERLONG, default="split", help="documents longer than C")
    p.add_argument("--text-field", default="text", help="jsonl field to tokenize")
    p.add_argument("--seed", type=int, default=None, help="shuffle the file order with this seed")
    p.add_argument("--save", metavar="PATH", help="write every plan (with assignment) as JSON")
    p.add_argument("--json", action="store_true", help="print only JSON to stdout")


def main(args: argparse.Namespace) -> int:
    if args.strategy != "all" and args.strategy not in STRATEGIES:
        raise ValueError(
            f"--strategy must be one of {', '.join(STRATEGIES)} or all, got {args.strategy!r}"
        )
    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
    shared = {"micro_batches": args.micro_batches, "capacity": args.capacity,
              "overlong": args.overlong, "ranks_per_node": args.ranks_per_node}  # fmt: skip
    configs = [
        PlanConfig(args.world_size, strategy=s, **shared) for s in strategies
    ]  # validates R, M, C before any file is read
    samples, densities = read_lengths(args.lengths, args.text_field)
    if args.seed is not None:
        order = np.random.default_rng(args.seed).permutation(len(samples))
        samples = [samples[i] for i in order]
        densities = None if densities is None else densities[order]
    cost_model, cost_name = load_cost_model(args.profile, args.model, args.accelerator)
    # sab-cp prices split documents with link speeds (the profile's measured ones, else the
    # analytic --accelerator's); every other strategy sees the plain latency model through it.
    cost_model = context_cost(cost_model, args.accelerator)
    g = args.ranks_per_node or cost_model.links.ranks_per_node
    nodes = f"{g} ranks per node" if g < args.world_size else "one node"
    cost_name += f"; links {cost_model.links.source}, {nodes}"
    source = "file" if densities is not None else "HistoryEstimator prior"
    kwargs = (
        {"densities": densities} if densities is not None else {"estimator": HistoryEstimator()}
    )
    plans = [plan_batch(samples, cost_model, cfg, **kwargs) for cfg in configs]
    result = {
        "num_samples": len(samples),
        "num_tokens": int(sum(s.num_tokens for s in samples)),
        "world_size": args.world_size,
        "micro_batches": args.micro_batches,
        "capacity": args.capacity,
        "overlong": args.overlong,
        "cost_model": cost_name,
        "densities": source,
        "strategies": {p.strategy: p.summary() for p in plans},
    }
    if args.save:
        full = {**result, "strategies": {p.strategy: p.to_dict() for p in plans}}
        Path(args.save).write_text(json.dumps(full) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    bound = f"M = {args.micro_batches}" if args.capacity is None else f"C = {args.capacity}"
    print(
        f"{len(samples)} samples, {result['num_tokens']} tokens, R = {args.world_size}, {bound}\n"
        f"cost model: {cost_name}; densities: {source}\n"
    )
    print(format_table(plans))
    over = plans[0].metrics.num_overlong
    if over:
        print(f"\n{over} documents longer than C: --overlong {args.overlong}")
    if args.save:
        print(f"\nwrote {args.save}")
    return 0


def format_table(plans: list) -> str:
    """One row per strategy; times in milliseconds."""
    headers = ["strategy", "max ms", "mean ms", "lower bound ms", "efficiency", "gap to bound",
               "micro-batches", "capacity waste", "split docs", "CP degrees", "comm ms",
               "plan ms", "hash"]  # fmt: skip
    rows = [
        [p.strategy, p.metrics.max_time * 1e3, p.metrics.mean_time * 1e3,
         p.metrics.lower_bound * 1e3, p.metrics.efficiency, p.metrics.gap_to_bound,
         p.metrics.num_microbatches, p.metrics.capacity_waste, p.metrics.num_split_documents,
         _degrees(p.metrics.cp_degrees), p.metrics.comm_seconds * 1e3,
         p.metrics.plan_seconds * 1e3, p.hash()]
        for p in plans
    ]  # fmt: skip
    return markdown_table(headers, rows)


def _degrees(degrees: tuple[int, ...]) -> str:
    """``(4, 4, 2)`` -> ``"4x2, 2x1"`` (degree x count); ``-`` when nothing is split."""
    if not degrees:
        return "-"
    counts: dict[int, int] = {}
    for k in degrees:
        counts[k] = counts.get(k, 0) + 1
    return ", ".join(f"{k}x{n}" for k, n in counts.items())
