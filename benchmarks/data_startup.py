"""Training start-up on a large token store: time to the first planned step and resident memory
growth (the store is memory-mapped: nothing is copied, no token is read to plan).

    python benchmarks/data_startup.py --tokens 1000000000 --tmp /tmp/sb-startup

1. Writes a store of ``--tokens`` random Qwen2.5 token ids (uint32: 4 bytes a token) in documents
   of log-normal length (median 2,048, clipped to [128, 32,768]) with :class:`StoreWriter`.
2. In a fresh process: the data path alone first (resolve ``--data``, map the store, compact
   vocabulary from the token counts, sampler, first global batch and its plan), then a whole
   Trainer. Imports are warmed up (one tiny model built first: importing transformers
   takes seconds to a minute on a loaded machine and has nothing to do with the data; the time is
   reported apart), RSS, then ``Trainer(cfg)`` on ``--data STORE`` (tiny
   model, compact vocabulary built from the store's token counts, an analytic latency profile so
   that no profile is measured), the first global batch and its plan (SAB); the time from before
   ``Trainer`` to the plan and the RSS growth over the same span. The same on the built-in
   synthetic data (256 documents) gives the cost of everything that is not the data.
3. Deletes the store (``--keep`` keeps it).

Writes ``benchmarks/results/<date>-data-startup-cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sparsebalance.data.prepare import tokenizer_info
from sparsebalance.data.store import StoreWriter
from sparsebalance.data.tokenizer import load_tokenizer
from sparsebalance.results import markdown_table, write_results


def write_store(path: Path, num_tokens: int, seed: int = 0) -> dict:
    info = tokenizer_info(load_tokenizer())
    rng = np.random.default_rng(seed)
    t0, written, docs = time.perf_counter(), 0, 0
    with StoreWriter(path, info, overwrite=True) as w:
        while written < num_tokens:
            lengths = np.clip(rng.lognormal(np.log(2048), 1.0, 4096), 128, 32768).astype(np.int64)
            lengths = lengths[np.cumsum(lengths) <= num_tokens - written]
            if not len(lengths):
                lengths = np.array([num_tokens - written])
            flat = rng.integers(0, 151643, int(lengths.sum()), dtype=np.uint32)
            parts = np.split(flat, np.cumsum(lengths)[:-1])
            w.add_many(parts, ["synthetic"] * len(parts))
            written += int(lengths.sum())
            docs += len(parts)
        w.close({"synthetic": "random token ids (benchmarks/data_startup.py)"})
    return {"documents": docs, "tokens": written, "write_s": round(time.perf_counter() - t0, 1)}


CHILD = """
import json, sys, time
from pathlib import Path

def rss_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

import torch
from sparsebalance.batching import PlanConfig, plan_batch
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.models.hf import build_model
from sparsebalance.tuning import DSTConfig
torch.set_num_threads(1)
tw = time.perf_counter()
build_model("tiny", torch.device("cpu"), torch.float32, seed=0)  # imports transformers (not data)
warm = time.perf_counter() - tw
data, profile, out = sys.argv[1] or None, sys.argv[2], sys.argv[3]
cfg = TrainConfig(data=data, profile=profile, out=out, overwrite=True, steps=1, global_batch=16,
                  capacity=4096, block_size=32, dst=DSTConfig(mode="off"))
from sparsebalance.data import load_tokenizer
from sparsebalance.data.batches import BatchSource
from sparsebalance.data.dataset import (apply_vocabulary, compact_vocabulary, open_corpus,
                                        resolve_data)
tt = time.perf_counter()
tok = load_tokenizer()
tokenizer_s = time.perf_counter() - tt
# the data path alone (cold): resolve, map, compact vocabulary, sampler, first batch and plan
rd0, td0 = rss_mb(), time.perf_counter()
corpus = open_corpus(resolve_data(data, tok, num_builtin=256))
apply_vocabulary(corpus, compact_vocabulary(corpus, 4096))
src = BatchSource(corpus, 0, 16)
first = src.next_batch()
from sparsebalance.latency import LatencyModel, load_profile
plan_batch(first, LatencyModel(load_profile(profile)), PlanConfig(1, None, 4096, "sab", "split"),
           estimator=__import__("sparsebalance.batching", fromlist=["x"]).HistoryEstimator())
data_s, data_rss = time.perf_counter() - td0, rss_mb() - rd0
del corpus, src, first
rss0, t0 = rss_mb(), time.perf_counter()
trainer = Trainer(cfg)
t1 = time.perf_counter()
samples = trainer.next_batch()
plan = trainer.engine.plan(samples)  # the trainer's own planning: a StepPlan
t2, rss1 = time.perf_counter(), rss_mb()
print(json.dumps({"import_warmup_s": warm, "tokenizer_s": tokenizer_s, "data_path_s": data_s,
                  "data_path_rss_mb": data_rss, "trainer_s": t1 - t0, "first_plan_s": t2 - t0,
                  "rss_before_mb": rss0,
                  "rss_after_mb": rss1, "rss_growth_mb": rss1 - rss0,
                  "documents": len(trainer.corpus),
                  "planned_tokens": sum(sum(mb.lengths) for r in plan.plan.ranks for mb in r)}))
"""


def startup(data: str, profile: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    res = subprocess.run(
        [sys.executable, "-c", CHILD, data, str(profile), str(out)], capture_output=True, text=True, env=env
    )
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1_000_000_000)
    p.add_argument("--tmp", default="/tmp/sb-startup")
    p.add_argument("--keep", action="store_true", help="keep the store")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    from sparsebalance.latency import analytic_profile
    from sparsebalance.models import load_shapes

    tmp = Path(args.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    profile = tmp / "profile.json"
    analytic_profile(load_shapes("tiny"), "h100", block_size=32).save(profile)
    load_before = os.getloadavg()
    store = tmp / "store"
    try:
        written = write_store(store, args.tokens)
        size_gb = sum(f.stat().st_size for f in store.iterdir()) / 1e9
        builtin = startup("", profile, tmp / "run-builtin")
        big = startup(str(store), profile, tmp / "run-store")
        big_again = startup(str(store), profile, tmp / "run-store")  # page cache warm
    finally:
        if not args.keep:
            shutil.rmtree(store, ignore_errors=True)
    load_after = os.getloadavg()
    named = [
        ("built-in synthetic (256 docs)", builtin),
        (f"store, {written['tokens'] / 1e9:.2f}B tokens (1st run)", big),
        (f"store, {written['tokens'] / 1e9:.2f}B tokens (2nd run)", big_again),
    ]
    rows = [
        [
            name,
            r["documents"],
            r["import_warmup_s"],
            r["tokenizer_s"],
            r["data_path_s"],
            r["data_path_rss_mb"],
            r["trainer_s"],
            r["first_plan_s"],
            r["rss_before_mb"],
            r["rss_after_mb"],
            r["rss_growth_mb"],
        ]
        for name, r in named
    ]
    table = markdown_table(
        [
            "data",
            "documents",
            "import warm-up s (excluded)",
            "tokenizer load s",
            "data path s",
            "data path RSS growth MB",
            "Trainer() s",
            "to first plan s",
            "RSS before MB",
            "RSS after MB",
            "RSS growth MB",
        ],
        rows,
    )
    worst = max(big, big_again, key=lambda r: r["first_plan_s"])
    table += (
        f"\n\nStore: {written['documents']:,} documents, {written['tokens']:,} tokens, "
        f"{size_gb:.2f} GB on disk, written in {written['write_s']} s.\n"
        f"Data path (resolve + map + compact vocabulary + sampler + first batch + its plan), "
        f"cold: **{big['data_path_s']:.2f} s**, RSS growth **{big['data_path_rss_mb']:.0f} MB**; "
        f"whole Trainer() to the first planned step, worst run: **{worst['first_plan_s']:.2f} "
        f"s** (built-in data: {builtin['first_plan_s']:.2f} s), RSS growth "
        f"**{max(big['rss_growth_mb'], big_again['rss_growth_mb']):.0f} MB** (goals: < 5 s, "
        "< 200 MB). On the built-in data the Trainer also parses the tokenizer's "
        "vocabulary (to generate the documents); on a store it never loads it."
    )
    notes = (
        f"Load average (1, 5, 15 min) before: {load_before}, after: {load_after}. The machine "
        "(2 cores, 24 GB) is shared with other engineers' jobs that were running during the "
        "measurement, so times are upper bounds of what an idle machine gives."
    )
    payload = {
        "store": written,
        "size_gb": size_gb,
        "builtin": builtin,
        "store_first": big,
        "store_second": big_again,
        "load_before": load_before,
        "load_after": load_after,
    }
    md, _ = write_results(args.out, "data-startup", torch.device("cpu"), table, payload, notes)
    print(table)
    print(f"\nwrote {md}")


if __name__ == "__main__":
    main()
