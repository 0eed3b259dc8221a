"""DDP's gradient memory with and without ``gradient_as_bucket_view`` (what the trainer now sets).

    PYTHONPATH=src python benchmarks/ddp_gradients.py [--out benchmarks/results]

What runs: ``torch.nn.parallel.DistributedDataParallel`` on 2 gloo processes (CPU, fp32) over 8
bias-free 4096 x 4096 linear layers (512 MiB of weights, so 512 MiB of gradients), three steps of
two micro-batches (the first under ``no_sync()``, as the trainer runs them), SGD, then
``zero_grad``. Two settings, one fresh pair of processes each:

- ``before``: ``gradient_as_bucket_view=False`` and ``zero_grad(set_to_none=True)`` (the trainer
  until 2026-11-28): the gradients are a copy beside DDP's all-reduce buckets, dropped every step;
- ``now``: zero gradients before wrapping (DDP makes views of missing ones only at the first
  synced backward, after the first step's ``no_sync()`` micro-batches),
  ``gradient_as_bucket_view=True`` and ``zero_grad(set_to_none=False)``: the gradients are views
  of the buckets, zeroed in place.

Reported: rank 0's peak resident size (``VmHWM``) above its size once the model is built: after
wrapping it, after the first step and after all three (the high-water mark only grows); and its
largest resident size in the middle of a step (after the first micro-batch), above the same base.
On a GPU DDP allocates its buckets when it wraps the model, so there ``before`` holds two copies of
the gradients at every moment; here a page counts only once touched. Not measured on a GPU.

Both settings briefly hold two copies while no activation is alive: ``now`` when DDP copies the
zeros into its buckets as it wraps the model, both when DDP rebuilds its buckets in the order the
first step's gradients became ready (at the second step's forward). What differs is the steps:
``before`` holds the gradients beside the buckets through every micro-batch (on a GPU the buckets
are allocated as DDP wraps the model), ``now`` one copy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from sparsebalance.latency.host_memory import current_rss_bytes, peak_rss_bytes
from sparsebalance.results import markdown_table, write_results

MIB = 2**20
SETTINGS = {"before": (False, True), "now": (True, False)}  # (bucket view and zeros first, set_to_none)


def _worker(rank: int, root: str, name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29611 + len(name)))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    view, none = SETTINGS[name]
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(8)])
    base = current_rss_bytes()
    if view:
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
    ddp = nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=view)
    peaks = [peak_rss_bytes()[0]]
    resident = [current_rss_bytes() - base]
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(8, 4096)
    for _ in range(3):
        with ddp.no_sync():
            ddp(x).sum().backward()
        resident.append(current_rss_bytes() - base)  # mid-step: the gradients so far, the buckets
        ddp(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=none)
        peaks.append(peak_rss_bytes()[0])
    if rank == 0:
        row = {"setting": name, "bucket view": view, "set_to_none": none}
        row |= {f"peak after {w} MiB": (peaks[i] - base) / MIB for i, w in ((0, "wrap"), (1, "step 1"), (3, "step 3"))}
        row |= {"resident in a step MiB": max(resident) / MIB}
        Path(root, f"{name}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/ddp-gradients", help="scratch folder")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    Path(args.root).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in SETTINGS:
        mp.spawn(_worker, args=(args.root, name), nprocs=2, join=True)
        rows.append(json.loads(Path(args.root, f"{name}.json").read_text()))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    headers = list(rows[0])
    table = markdown_table(headers, [[r[h] for h in headers] for r in rows])
    notes = __doc__.split("\n\n", 2)[2]
    md, _ = write_results(args.out, "ddp-gradients", torch.device("cpu"), table, {"rows": rows}, notes)
    print(table)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
