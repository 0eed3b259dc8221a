"""``sparsebalance prepare``: throughput against the tokenizer's own batch encoder on the same text
with the same number of threads, and peak memory on a small and a 10x larger input.

    python benchmarks/prepare_throughput.py --small-mb 100 --large-mb 1000 --workers 2

1. Writes synthetic English-like jsonl inputs (log-normal document lengths, median ~2 KB).
2. Throughput (small input, in this process, alternating, ``--repeats`` times each):
   - tokenizer alone: every text already in memory, ``tiktoken.Encoding.encode_batch`` with
     ``--workers`` threads after the same NFC normalisation the Qwen tokenizer applies;
   - prepare: read + parse the jsonl + tokenize + write the store, ``--workers`` threads.
   The ratio uses the best run of each (the machine is shared: the best run is the least
   disturbed one).
3. Peak memory: ``prepare`` in a fresh process on each input: the peak RSS (``VmHWM``, reset
   through ``/proc/self/clear_refs`` after the tokenizer is loaded) while it runs.

Writes ``benchmarks/results/<date>-prepare-throughput-cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import unicodedata
from pathlib import Path

import numpy as np
import torch

from sparsebalance.data.prepare import PrepareConfig, prepare
from sparsebalance.data.tokenizer import load_tokenizer
from sparsebalance.results import markdown_table, write_results

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no more "
    "attention context training sparse balance model layer token budget window memory retrieval "
    "passkey document sequence gradient optimizer schedule distributed rank latency throughput "
    "Alice Bob Paris 2024 3.14 42 (note) [ref] data-parallel long-context naïve café"
)
WORDS = _WORDS.split()


def write_input(path: Path, megabytes: int, seed: int = 0) -> int:
    """jsonl of synthetic documents up to ``megabytes``; returns the number of documents."""
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(2000):
        n = int(np.clip(rng.lognormal(np.log(350), 0.9), 8, 20000))  # words
        words = rng.choice(WORDS, n)
        cut = rng.random(n) < 0.08
        text = " ".join(w + ("." if c else "") for w, c in zip(words, cut, strict=True))
        pool.append(text)
    target, size, count = megabytes * 1_000_000, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            line = json.dumps({"text": f"Document {count}. " + pool[count % len(pool)]}) + "\n"
            f.write(line)
            size += len(line.encode())
            count += 1
    return count


def tokenizer_alone(texts: list[str], workers: int, tokenizer) -> float:
    enc = tokenizer._tok._tokenizer
    t0 = time.perf_counter()
    normal = [unicodedata.normalize("NFC", t) for t in texts]
    enc.encode_batch(normal, num_threads=workers, allowed_special="all")
    return time.perf_counter() - t0


def prepare_once(src: Path, out: Path, workers: int, tokenizer) -> float:
    t0 = time.perf_counter()
    prepare(PrepareConfig([str(src)], str(out), workers=workers, overwrite=True, progress=False), tokenizer)
    return time.perf_counter() - t0


CHILD = """
import sys, time
from pathlib import Path
from sparsebalance.data.prepare import PrepareConfig, prepare
from sparsebalance.data.tokenizer import load_tokenizer

def kb(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])

tok = load_tokenizer()
Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
base = kb("VmRSS")
t0 = time.perf_counter()
m = prepare(PrepareConfig([sys.argv[1]], sys.argv[2], workers=int(sys.argv[3]), overwrite=True,
                          progress=False), tok)
dt = time.perf_counter() - t0
print(base, kb("VmHWM"), dt, m["num_documents"], m["num_tokens"])
"""


def peak_memory(src: Path, out: Path, workers: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(out), str(workers)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    base, peak, dt, docs, tokens = res.stdout.split()
    mb = src.stat().st_size / 1e6
    return {
        "input_mb": round(mb, 1),
        "documents": int(docs),
        "tokens": int(tokens),
        "seconds": round(float(dt), 2),
        "mb_per_s": round(mb / float(dt), 2),
        "rss_before_mb": round(int(base) / 1024, 1),
        "peak_rss_mb": round(int(peak) / 1024, 1),
        "growth_mb": round((int(peak) - int(base)) / 1024, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small-mb", type=int, default=100)
    p.add_argument("--large-mb", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tmp", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    tmp = Path(args.tmp or tempfile.mkdtemp(prefix="sb-prepare-"))
    tmp.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    try:
        small, large = tmp / "small.jsonl", tmp / "large.jsonl"
        n_small = write_input(small, args.small_mb)
        tokenizer = load_tokenizer()
        texts = [json.loads(line)["text"] for line in small.open(encoding="utf-8")]
        mb = small.stat().st_size / 1e6
        alone, prep = [], []
        for _ in range(args.repeats):
            alone.append(tokenizer_alone(texts, args.workers, tokenizer))
            prep.append(prepare_once(small, tmp / "store", args.workers, tokenizer))
        del texts
        ratio = min(alone) / min(prep)
        write_input(large, args.large_mb, seed=1)
        mem = [
            peak_memory(small, tmp / "store-small", args.workers),
            peak_memory(large, tmp / "store-large", args.workers),
        ]
        mem_ratio = mem[1]["peak_rss_mb"] / mem[0]["peak_rss_mb"]
    finally:
        if args.tmp is None:
            shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    rows = [
        [
            "tokenizer alone (texts in memory)",
            args.workers,
            min(alone),
            mb / min(alone),
            ", ".join(f"{t:.2f}" for t in alone),
        ],
        [
            "prepare (read + parse + tokenize + write)",
            args.workers,
            min(prep),
            mb / min(prep),
            ", ".join(f"{t:.2f}" for t in prep),
        ],
    ]
    table = markdown_table(["path", "threads", "best s", "MB/s", "all runs s"], rows)
    table += f"\n\nprepare / tokenizer throughput: **{ratio:.2f}x** (goal >= 0.8x)\n\n"
    table += markdown_table(
        [
            "input MB",
            "documents",
            "tokens",
            "seconds",
            "MB/s",
            "RSS before prepare MB",
            "peak RSS during prepare MB",
            "growth MB",
        ],
        [
            [
                m["input_mb"],
                m["documents"],
                m["tokens"],
                m["seconds"],
                m["mb_per_s"],
                m["rss_before_mb"],
                m["peak_rss_mb"],
                m["growth_mb"],
            ]
            for m in mem
        ],
    )
    table += f"\n\npeak RSS large / small: **{mem_ratio:.2f}x** (goal <= 1.5x)"
    notes = (
        f"Input: synthetic English-like jsonl ({n_small} documents in the small file), "
        f"{args.small_mb} MB and {args.large_mb} MB. Load average (1, 5, 15 min) before: "
        f"{load_before}, after: {load_after}. The machine (2 cores) is shared with other "
        "engineers' jobs that were running during the measurement: absolute MB/s are noisy; the "
        "ratio compares best runs measured alternately in one process."
    )
    payload = {
        "workers": args.workers,
        "small_mb": args.small_mb,
        "large_mb": args.large_mb,
        "tokenizer_alone_s": alone,
        "prepare_s": prep,
        "throughput_ratio": ratio,
        "memory": mem,
        "peak_rss_ratio": mem_ratio,
        "load_before": load_before,
        "load_after": load_after,
        "rss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    md, _ = write_results(args.out, "prepare-throughput", torch.device("cpu"), table, payload, notes)
    print(table)
    print(f"\nwrote {md}")


if __name__ == "__main__":
    main()
