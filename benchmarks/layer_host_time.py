"""The host's time per attention layer of a training step: DST's decision, selection, the kernel's
index form and the launches around the kernel, measured where the arithmetic costs nothing, so
what is left is what a GPU run's host pays per layer (Python, the dispatcher, one launch per
operation). The kernel itself is a stand-in (its time is the device's, not the host's).

    .venv/bin/python benchmarks/layer_host_time.py            # writes benchmarks/results/
    .venv/bin/python benchmarks/layer_host_time.py --quick    # smoke run, writes nothing

Per case: the path a CUDA run takes by default (the one-batch top-k gate, DST's layer controller
deciding on the device, the flex ``BlockMask``, K/V expanded). ``fixed``: a fixed budget (no
controller); ``DST raise`` / ``DST cut``: the controller on a rank below / above its target (a
cut also decides the coverage bound). Two kinds of tensors:

- ``cpu``: CPU tensors with a head dim of 4 (the CPU's arithmetic small beside the host's work),
  the 1K-token cases of issue 42;
- ``meta``: the stand-in device (no values, at any size), Qwen2.5-0.5B's real head dim: issue
  53's cases, a 4K pack of short documents (the default 8,192-token budget keeps them whole;
  its lowest cuts the longest: the layer must not compute a gate for it) and a 32K document at
  density 0.05 (DST cutting). The time spent inside the operations (meta's shape functions,
  slower per op than a CUDA launch) is taken out (:class:`OpTimer`): what is left is this
  project's Python, the dispatcher and a mode's call per operation, about a CUDA dispatch and
  launch each.

The median over layers after the first micro-batch's (which builds the pack's tables once), the
lowest of ``--repeats`` runs (the machine is shared: the least disturbed run is the host's own
time). Run alone: a second process on the machine doubles these times.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparsebalance import launches
from sparsebalance.engine.layers import LayerTimer, packed_attention
from sparsebalance.latency import LatencyModel, analytic_profile
from sparsebalance.models import load_shapes
from sparsebalance.models.attention import sparsebalance_attention
from sparsebalance.ops import Budget, block_sparse_flex
from sparsebalance.ops import attention as op_module
from sparsebalance.results import markdown_table, write_results
from sparsebalance.tuning import DSTConfig, LayerController
from sparsebalance.workload import MicroBatch

HEADS, KV_HEADS, BLOCK = 14, 2, 128
"""Qwen2.5-0.5B's heads and the CUDA block."""
HEAD_DIM = {"cpu": 4, "meta": 64}
"""A head dim of 4 on the CPU keeps its arithmetic on ``T x H x D`` tensors (pooling, the K/V
expansion) out of the host's time (the operations and the Python around them do not depend on
it); the stand-in device computes nothing: Qwen2.5-0.5B's 64."""
CASES = {
    "1 document, 1K tokens": ((1024,), 256, "cpu"),
    "4 documents, 1K tokens": ((600, 250, 100, 74), 256, "cpu"),
    "4K pack, short documents": ((3000, 600, 496), 8192, "meta"),
    "32K document, density 0.05": ((32768,), 640, "meta"),
}
"""name -> (document lengths, top-k budget in tokens, device). 256 tokens = k 2 blocks (DST cuts
to 0): short documents still select, and the 4-document pack has documents kept whole beside a
selected one; 8,192 tokens (the default) keeps the 4K pack's documents whole (its lowest budget,
2,048 tokens, would cut the 3,000-token one); 640 tokens = k 5: density 0.054 at 32K."""
TARGETS = {
    ("4K pack, short documents", "fixed"): 0.15,
    ("4K pack, short documents", "DST raise"): 0.15,
    ("32K document, density 0.05", "DST cut"): 1.0,
}
"""Issue 53's host-time targets (ms per layer): a pack kept whole, and 32K with DST cutting."""


def _stand_ins() -> None:
    """The kernels (flex has no backward on CPU; their time is the device's) as cheap stand-ins."""

    def flex(q, k, v, **kwargs):
        return q * 1.0

    block_sparse_flex._compiled_flex = lambda: flex
    block_sparse_flex.dense_attention = lambda q, k, v, *args: q * 1.0
    op_module.flex_available = lambda device: True  # the path CUDA takes, on any device


class OpTimer(TorchDispatchMode):
    """Seconds spent inside the operations themselves (on ``meta``: torch's shape functions,
    many written in Python, 80-640 us an op where a CUDA launch costs its host ~5 us). What is
    left of a layer's host time without them is this project's Python, the dispatcher and the
    mode's own call per op (~6 us: about what a CUDA dispatch and launch cost the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t0 = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.seconds += time.perf_counter() - t0


class _Module:  # an attention module as the model hands it over: only its layer index is read
    def __init__(self, layer: int) -> None:
        self.layer_idx = layer


def measure(case: tuple, mode: str, layers: int, micro_batches: int) -> dict:
    """Host seconds per layer (median) and one layer's launches / reads (the tables a pack
    builds once, in its first layer, are not in them), for one case."""
    lengths, budget_tokens, device = case
    total, dim = sum(lengths), HEAD_DIM[device]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, total, dim, generator=g).to(device)
    k, v = (torch.randn(1, KV_HEADS, total, dim, generator=g).to(device) for _ in range(2))
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32).to(device)
    cfg = DSTConfig(budget_tokens=budget_tokens)
    knob = cfg.knob(BLOCK)
    base = knob.budget(Budget(top_k=0), knob.base)
    latency = LatencyModel(analytic_profile(load_shapes("qwen2.5-0.5b"), "h100", block_size=128))
    mbs = [MicroBatch(tuple(range(len(lengths))), lengths, (0.3,) * len(lengths))] * micro_batches
    times, ops, reads = [], [], []
    ctl = None
    if mode != "fixed":
        ctl = LayerController(mbs, latency, cfg, 1.0, knob=knob, device="cuda")
        ctl.target_seconds = float(ctl.planned.sum()) * (3.0 if mode == "DST raise" else 0.3)
    modules = [_Module(i) for i in range(layers)]
    in_ops = OpTimer()  # on meta: the operations' own time, taken out of the layer's and DST's
    if ctl is not None and device == "meta":
        choose = ctl.choose

        def net_choose(*args, **kwargs):
            before = in_ops.seconds
            try:
                return choose(*args, **kwargs)
            finally:
                ctl.decide_seconds -= in_ops.seconds - before

        ctl.choose = net_choose
    timing = in_ops if device == "meta" else contextlib.nullcontext()
    for m in range(micro_batches):
        timer = LayerTimer(ctl, m, False)
        ctx = packed_attention(cu, lengths, base, block_size=BLOCK, backend="flex", controller=ctl, m=m, timer=timer)
        for layer in range(layers):
            if m == 1 and layer == 1:  # a layer's launches and reads, counted apart
                with timing, launches.LaunchCounter() as count:
                    sparsebalance_attention(modules[layer], q, k, v, None, sb_attention=ctx)
                ops.append(count.num_ops)
                reads.append(len(count.reads))
                continue
            with timing:
                t0, before = time.perf_counter(), in_ops.seconds
                sparsebalance_attention(modules[layer], q, k, v, None, sb_attention=ctx)
                seconds = time.perf_counter() - t0 - (in_ops.seconds - before)
            if m > 0:
                times.append(seconds)
    decide = ctl.decide_seconds / (micro_batches * layers) if ctl is not None else 0.0
    return {
        "case": None,
        "mode": mode,
        "host_ms": 1e3 * statistics.median(times),
        "decide_ms": 1e3 * decide,
        "ops": ops[0],
        "reads": reads[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=24, help="layers per micro-batch (default 24)")
    p.add_argument("--micro-batches", type=int, default=6, help="micro-batches (default 6)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per case; the least disturbed (lowest median) is reported (default 3)",
    )
    p.add_argument("--cases", default=None, help="comma-separated case numbers (1-based; default all)")
    p.add_argument("--quick", action="store_true", help="one case per device, 2 x 4 layers, no results file")
    p.add_argument("--out", default="benchmarks/results", help="results folder")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the analytic profile's grid warnings: not this figure
    _stand_ins()
    names = list(CASES)
    if args.cases:
        names = [names[int(i) - 1] for i in args.cases.split(",")]
    if args.quick:
        names = [names[0], names[-1]]
    layers, mbs = (4, 2) if args.quick else (args.layers, args.micro_batches)
    if args.quick:
        args.repeats = 1
    rows = []
    for name in names:
        for mode in ("fixed", "DST raise", "DST cut"):
            runs = [measure(CASES[name], mode, layers, mbs) for _ in range(args.repeats)]
            row = min(runs, key=lambda r: r["host_ms"])  # the least disturbed run
            row.update(case=name, device=CASES[name][2], host_ms_runs=[r["host_ms"] for r in runs])
            target = TARGETS.get((name, mode))
            row["target_ms"] = target
            row["met"] = None if target is None else row["host_ms"] <= target
            rows.append(row)
    headers = [
        "case",
        "tensors",
        "budget",
        "host ms / layer",
        "of it DST decision ms",
        "launches / layer",
        "host reads / layer",
        "target ms",
    ]
    body = [
        [
            r["case"],
            r["device"],
            r["mode"],
            r["host_ms"],
            r["decide_ms"],
            r["ops"],
            r["reads"],
            "" if r["target_ms"] is None else f"<= {r['target_ms']} ({'met' if r['met'] else 'NOT met'})",
        ]
        for r in rows
    ]
    table = markdown_table(headers, body)
    print(table)
    if not args.quick:
        notes = (
            "Run as `python benchmarks/layer_host_time.py`, alone, one intra-op thread. Qwen2.5-"
            "0.5B heads (14 / 2), block 128, the analytic H100 profile; "
            f"{args.micro_batches} micro-batches of {args.layers} layers, the median layer after "
            f"the first micro-batch, the lowest of {args.repeats} runs (the JSON file has every "
            "run's). The kernels are stand-ins: this is the host's time per layer (decision + "
            "selection + mask + launches). `cpu` rows: CPU tensors, head dim 4 (issue 42's "
            "cases, budget 256 tokens); `meta` rows: the stand-in device, head dim 64, nothing "
            "computed (issue 53's cases: the 4K pack under the default 8,192-token budget, the "
            "32K document at 640 tokens = density 0.054), the time inside the operations (meta's "
            "shape functions) taken out: our Python, the dispatcher and a dispatch-mode call per "
            "operation (~6 us, about a CUDA dispatch + launch). Targets (issue 53): <= 0.15 ms "
            "for the 4K pack kept whole, <= 1.0 ms at 32K with DST cutting."
        )
        md, js = write_results(args.out, "layer-host-time", torch.device("cpu"), table, {"rows": rows}, notes)
        print(f"wrote {md} and {js}")


if __name__ == "__main__":
    main()
