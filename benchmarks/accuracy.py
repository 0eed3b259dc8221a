"""Does DST's extra attention help accuracy? Train the tiny model from scratch five ways, evaluate.

    .venv/bin/python benchmarks/accuracy.py            # full run, writes benchmarks/results/
    .venv/bin/python benchmarks/accuracy.py --quick    # smoke run (1 seed, 5 steps), no file

Variants (issue 8), trained on the same built-in synthetic mix (passkey / niah / kv, heavy-tailed
lengths), same data order, steps and seeds, SAB batching over ``--ranks`` emulated data-parallel
ranks (one process; DST needs several ranks to have anything to balance):

- ``dense``: every causal block (the op at gamma 1.0; the tuner's decision is overridden to 1.0
  for every rank, since ``--gamma0`` must be < 1).
- ``fixed``: fixed gamma0 sparse attention (``--dst-mode off``), the baseline.
- ``dst-bidir-mean``: DST bidirectional, mean anchor (SparseBalance's default).
- ``dst-down-mean``: DST down-only (stragglers cut, nobody raised), mean anchor.
- ``dst-bidir-min``: DST bidirectional, min anchor (cuts hard, then raises the rest).

The seed sets the model initialisation, the training documents and their order; every variant
sees the same ones for a given seed. Training uses ``deterministic=True``: DST decides from the
profiled latency model's predictions, not from wall-clock measurements, so the budgets (and hence
the accuracies) do not depend on how loaded this shared machine was.

Evaluation (held-out eval split: keys and values never seen in training): teacher-forced exact
match and per-token answer accuracy (``sparsebalance.evaluation.evaluate_task``) per task and
prompt length, and perplexity of held-out synthetic text. Every model is evaluated with dense
attention, and the sparse variants also at gamma0 (the setting they were trained at).
Time per step is the emulated cluster's step (slowest rank + optimizer), mean over steps after the
first; it is measured on a shared 2-core CPU and is noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from sparsebalance.data import load_tokenizer
from sparsebalance.data.tokenizer import make_codec
from sparsebalance.evaluation import HFRunner, evaluate_task, perplexity, summarize
from sparsebalance.results import markdown_table, write_results
from sparsebalance.tasks import synthetic_mix
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.train.runtime import Runtime
from sparsebalance.tuning import DSTConfig

VARIANTS: dict[str, dict] = {
    "dense": {"mode": "off", "anchor": "mean", "dense": True},
    "fixed": {"mode": "off", "anchor": "mean"},
    "dst-bidir-mean": {"mode": "bidirectional", "anchor": "mean"},
    "dst-down-mean": {"mode": "down", "anchor": "mean"},
    "dst-bidir-min": {"mode": "bidirectional", "anchor": "min"},
}
TASKS = ("passkey", "niah", "kv")


class DenseTuner:
    """Wraps a ``DSTTuner`` (mode off): every rank's budget becomes 1.0 (exact attention)."""

    def __init__(self, tuner):
        self._tuner = tuner
        self.curve = tuner.curve
        self.config = tuner.config

    def decide(self, plan, cost_model, workload=None):
        decision = self._tuner.decide(plan, cost_model, workload)
        ranks = tuple(dataclasses.replace(r, gamma=1.0) for r in decision.ranks)
        return dataclasses.replace(decision, ranks=ranks)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--seeds", type=int, default=3, help="seeds 0..N-1 per variant (>= 3 for claims)"
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    p.add_argument("--ranks", type=int, default=4, help="emulated data-parallel ranks")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--num-builtin", type=int, default=512, help="training documents")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--gamma0", type=float, default=0.7)
    p.add_argument("--gamma-min", type=float, default=0.3)
    p.add_argument("--gamma-max", type=float, default=0.95)
    p.add_argument("--eval-lengths", default="256,1024")
    p.add_argument("--eval-examples", type=int, default=8, help="per task and length")
    p.add_argument("--ppl-windows", type=int, default=8, help="held-out windows of max length")
    p.add_argument("--quick", action="store_true", help="1 seed, 10 steps, tiny eval; no file")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="accuracy", help="results file: <date>-<name>-cpu.md/.json")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.eval_examples, args.ppl_windows = 1, 5, 2, 2
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
    args.eval_lengths = [int(x) for x in args.eval_lengths.split(",")]
    return args


def train_config(args, variant: str, seed: int, out: Path) -> TrainConfig:
    v = VARIANTS[variant]
    dst = DSTConfig(mode=v["mode"], anchor=v["anchor"], gamma0=args.gamma0,
                    gamma_min=args.gamma_min, gamma_max=args.gamma_max)  # fmt: skip
    return TrainConfig(
        model="tiny", num_builtin=args.num_builtin, min_len=args.min_len, max_len=args.max_len,
        steps=args.steps, global_batch=args.global_batch, capacity=args.capacity,
        strategy="sab", block_size=args.block_size, lr=args.lr,
        warmup_steps=args.warmup_steps, schedule="cosine",
        seed=seed, deterministic=True, emulate_ranks=args.ranks, device="cpu",
        out=str(out / f"{variant}-s{seed}"), dst=dst, overwrite=True,  # scratch runs
    )  # fmt: skip


def evaluate(model, vocab_map, tokenizer, gamma: float, args, seed: int) -> dict:
    """Exact match / token accuracy per task and length, and held-out perplexity, at ``gamma``."""
    vocab = model.get_input_embeddings().num_embeddings
    encode, _, eos = make_codec(tokenizer, vocab_map, vocab)
    runner = HFRunner(model, gamma=gamma, block_size=args.block_size, backend="torch")
    scores = []
    for task in TASKS:  # the eval seed is fixed: every model sees the same held-out examples
        scores += evaluate_task(runner, task, args.eval_lengths, encode, args.eval_examples,
                                None, seed=1000, pack_tokens=8192)  # fmt: skip
    summary = summarize(scores)
    n = max(args.eval_lengths)
    texts = [ex.text for ex in synthetic_mix(max(8, args.ppl_windows * n // 300), encode, 1000,
                                             args.min_len, args.max_len, split="eval")]  # fmt: skip
    ppl = perplexity(runner, texts, encode, [n], eos, args.ppl_windows, 8192)[str(n)]
    model.train()
    out = {"gamma": gamma, "ppl": ppl["ppl"], "mean_density": _mean(runner.densities)}
    for task, s in summary.items():
        out[task] = {"exact": s["accuracy"], "token_acc": s["token_accuracy"],
                     "by_length": {k: {"exact": v["accuracy"], "token_acc": v["token_accuracy"]}
                                   for k, v in s["by_length"].items()}}  # fmt: skip
    return out


def _mean(xs) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def run_one(args, variant: str, seed: int, work: Path, tokenizer) -> dict:
    cfg = train_config(args, variant, seed, work)
    trainer = Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    if VARIANTS[variant].get("dense"):
        trainer.tuner = DenseTuner(trainer.tuner)
    t0 = time.perf_counter()
    res = trainer.run()
    train_s = time.perf_counter() - t0
    sums = res["summaries"]
    timed = sums[1:] if len(sums) > 1 else sums
    record = {
        "variant": variant,
        "seed": seed,
        "train_wall_s": train_s,
        "step_s": _mean([s["step_seconds"] for s in timed]),
        "train_density": _mean([s["mean_density"] for s in sums]),
        "efficiency": _mean([s["efficiency"] for s in timed]),
        "final_loss": _mean(res["losses"][-10:]),
        "losses": res["losses"],
        "eval": {},
    }
    model, vmap = trainer.model, trainer.corpus.vocab_map
    record["eval"]["dense"] = evaluate(model, vmap, tokenizer, 1.0, args, seed)
    if not VARIANTS[variant].get("dense"):
        record["eval"]["gamma0"] = evaluate(model, vmap, tokenizer, args.gamma0, args, seed)
    return record


def mean_std(xs: list[float]) -> str:
    if len(xs) < 2:
        return f"{xs[0]:.3f}" if xs else "-"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def tables(records: list[dict], args) -> str:
    variants = [v for v in args.variants if any(r["variant"] == v for r in records)]
    by = {v: [r for r in records if r["variant"] == v] for v in variants}
    rows = []
    for v in variants:
        rs = by[v]
        rows.append([v, len(rs), mean_std([r["step_s"] for r in rs]),
                     mean_std([r["train_density"] for r in rs]),
                     mean_std([r["efficiency"] for r in rs]),
                     mean_std([r["final_loss"] for r in rs])])  # fmt: skip
    out = ["## Training (mean ± std over seeds)", "",
           markdown_table(["variant", "seeds", "s / step", "train density", "balance eff.",
                           "loss (last 10)"], rows)]  # fmt: skip
    own = f"own training setting (dense for `dense`, gamma0 = {args.gamma0} for the others)"
    for setting, title in (("dense", "dense attention (gamma 1.0)"), ("own", own)):
        out += ["", f"## Evaluation with {title}", ""]
        head = ["variant", "ppl"] + [f"{t} {m}" for t in TASKS for m in ("exact", "tok acc")]
        rows = []
        for v in variants:
            evs = [_pick(r, setting) for r in by[v]]
            row = [v, mean_std([e["ppl"] for e in evs])]
            for t in TASKS:
                row += [mean_std([e[t]["exact"] for e in evs]),
                        mean_std([e[t]["token_acc"] for e in evs])]  # fmt: skip
            rows.append(row)
        out.append(markdown_table(head, rows))
        out += ["", "Per-token answer accuracy by prompt length:", ""]
        head = ["variant"] + [f"{t} {n}" for t in TASKS for n in args.eval_lengths]
        rows = []
        for v in variants:
            evs = [_pick(r, setting) for r in by[v]]
            rows.append([v] + [mean_std([e[t]["by_length"][str(n)]["token_acc"] for e in evs])
                               for t in TASKS for n in args.eval_lengths])  # fmt: skip
        out.append(markdown_table(head, rows))
    return "\n".join(out)


def _pick(record: dict, setting: str) -> dict:
    if setting == "own":
        return record["eval"].get("gamma0", record["eval"]["dense"])
    return record["eval"]["dense"]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokenizer = load_tokenizer()
    records = []
    start = time.perf_counter()
    total = args.seeds * len(args.variants)
    with tempfile.TemporaryDirectory(prefix="sb-accuracy-") as tmp:
        for seed in range(args.seeds):  # seeds outer: load drift hits every variant alike
            for variant in args.variants:
                rec = run_one(args, variant, seed, Path(tmp), tokenizer)
                records.append(rec)
                d = rec["eval"]["dense"]
                print(f"[{len(records)}/{total} {time.perf_counter() - start:6.0f}s] "
                      f"{variant:15s} seed {seed}: {rec['step_s']:.3f} s/step, "
                      f"density {rec['train_density']:.3f}, loss {rec['final_loss']:.3f}, "
                      f"dense-eval ppl {d['ppl']:.2f}, "
                      + ", ".join(f"{t} {d[t]['exact']:.2f}/{d[t]['token_acc']:.2f}"
                                  for t in TASKS), flush=True)  # fmt: skip
    table = tables(records, args)
    print("\n" + table)
    if args.quick:
        return 0
    config = {k: v for k, v in vars(args).items() if k not in ("quick", "out", "name")}
    config["train_config_example"] = json.loads(
        json.dumps(dataclasses.asdict(train_config(args, "dst-bidir-mean", 0, Path("runs"))),
                   default=str)
    )  # fmt: skip
    notes = (
        f"Run {dt.date.today().isoformat()}, wall {time.perf_counter() - start:.0f} s. "
        f"Seeds 0..{args.seeds - 1}; ± is the sample std over seeds. Exact = teacher-forced "
        f"exact match of the whole answer; tok acc = share of answer tokens predicted right. "
        f"{args.eval_examples} held-out examples per task and length (eval split, seed 1000), "
        f"perplexity on {args.ppl_windows} held-out windows of {max(args.eval_lengths)} tokens. "
        "s / step: emulated step (slowest of the ranks + optimizer) on a shared CPU."
    )
    payload = {"config": config, "records": records}
    md, js = write_results(args.out, args.name, torch.device("cpu"), table, payload, notes)
    print(f"\nwrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
