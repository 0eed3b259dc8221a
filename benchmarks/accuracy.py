"""Accuracy under sparsity (issue 18): continue a model that retrieves densely, seven ways.

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/accuracy.py \\
        --pretrained runs/retrieval-dense                 # full grid, writes benchmarks/results/
    PYTHONPATH=src .venv/bin/python benchmarks/accuracy.py --quick   # smoke run (~2 min), no file

Step 1 (``benchmarks/accuracy_pretrain.py``, recipe ``benchmarks/configs/accuracy-pretrain.toml``)
trains a small model that solves passkey, single-needle NIAH and MQAR with dense attention; without
``--pretrained`` this script runs it first (``--quick``: a few steps of a tiny recipe, so the model
does not retrieve; the quick mode only checks that the pipeline runs).

Step 2: every variant continues from that checkpoint with the real trainer (``Trainer``: SAB
planner over ``--ranks`` emulated data-parallel ranks in one process, DST tuner, the
``sparsebalance`` attention op) on the same heavy-tailed mix of the three tasks (train split,
lengths log-normal in ``[--min-len, --max-len]``), same documents, same order, same steps for a
given seed (the seed also sets the data order). ``deterministic=True``: DST decides from the
latency model's predictions, not from this loaded machine's clock, so the budgets are reproducible.

Step 3: each continued model is evaluated with dense attention and with its own budget (gamma0 for
the fixed and DST variants, 1.0 for dense): exact match and per-token answer accuracy by length and
needle depth (held-out eval split), perplexity of held-out task text, attention recall per layer.
:mod:`accuracy_report` turns the records into tables, paired-by-seed tests and heatmaps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy_pretrain import load_config, pretrain
from accuracy_report import VARIANT_NOTES, write_report
from sparsebalance.data import load_tokenizer
from sparsebalance.data.tokenizer import make_codec
from sparsebalance.evaluation import HFRunner, evaluate_task, perplexity, summarize
from sparsebalance.evaluation.recall import layer_recall
from sparsebalance.tasks import generate, sample_lengths
from sparsebalance.tasks.generate import TASKS as BUILDERS
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.train.runtime import Runtime
from sparsebalance.train.weights import load_trained_model
from sparsebalance.tuning import DSTConfig

TASKS = ("passkey", "niah1", "mqar")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def variants(gamma_low: float) -> dict[str, dict]:
    """Variant name -> batching strategy, DST mode, anchor and gamma0 (see VARIANT_NOTES)."""
    return {
        "dense": {"strategy": "sab", "mode": "off", "anchor": "mean", "gamma0": 1.0},
        "fixed-0.9": {"strategy": "tokens", "mode": "off", "anchor": "mean", "gamma0": 0.9},
        f"fixed-{gamma_low}": {
            "strategy": "tokens",
            "mode": "off",
            "anchor": "mean",
            "gamma0": gamma_low,
        },
        "sab": {"strategy": "sab", "mode": "off", "anchor": "mean", "gamma0": 0.9},
        "dst-bidir-mean": {
            "strategy": "sab",
            "mode": "bidirectional",
            "anchor": "mean",
            "gamma0": 0.9,
        },
        "dst-down-mean": {"strategy": "sab", "mode": "down", "anchor": "mean", "gamma0": 0.9},
        "dst-bidir-min": {
            "strategy": "sab",
            "mode": "bidirectional",
            "anchor": "min",
            "gamma0": 0.9,
        },
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pretrained", default=None, help="step 1's output folder (else trained now)")
    p.add_argument("--pretrain-config", default="benchmarks/configs/accuracy-pretrain.toml")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per variant (>= 3)")
    p.add_argument("--steps", type=int, default=20, help="continuation steps")
    p.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--gamma-low", type=float, default=0.5, help="the lower fixed gamma")
    p.add_argument("--ranks", type=int, default=4, help="emulated data-parallel ranks")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--num-docs", type=int, default=400, help="continuation training documents")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--gamma-min", type=float, default=0.5)
    p.add_argument("--gamma-max", type=float, default=0.99)
    p.add_argument("--tolerance", type=float, default=0.1, help="DST p")
    p.add_argument("--eval-lengths", default="1024,2048")
    p.add_argument("--eval-examples", type=int, default=2, help="per task, length and depth")
    p.add_argument("--recall-docs", type=int, default=2, help="documents per task for recall")
    p.add_argument("--ppl-docs", type=int, default=6, help="held-out documents for perplexity")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny pretrain, 1 seed, 2 steps; writes a report only with --out",
    )
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--name", default="accuracy", help="results file: <date>-<name>-cpu.md/.json")
    args = p.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = "benchmarks/results"
    if args.quick:
        args.name = args.name + "-quick"
        args.seeds, args.steps, args.eval_examples, args.recall_docs = 1, 2, 1, 1
        args.ppl_docs, args.num_docs, args.max_len, args.min_len = 2, 32, 512, 128
        args.eval_lengths, args.capacity = "512", 2048
    if args.seeds < 1 or args.steps < 1:
        raise ValueError(f"--seeds and --steps must be >= 1, got {args.seeds}, {args.steps}")
    if not 0.0 < args.gamma_low < 0.9:
        raise ValueError(f"--gamma-low must be in (0, 0.9), got {args.gamma_low}")
    table = variants(args.gamma_low)
    args.variants = list(table) if args.variants is None else args.variants.split(",")
    unknown = set(args.variants) - set(table)
    if unknown:
        raise ValueError(f"--variants: unknown {sorted(unknown)}; choose from {list(table)}")
    args.table = table
    args.eval_lengths = [int(x) for x in args.eval_lengths.split(",")]
    return args


def write_data(path: Path, args, encode) -> dict[str, int]:
    """The continuation mix as jsonl (train split, heavy-tailed lengths); task counts."""
    rng = np.random.default_rng([18, args.num_docs])
    lengths = sample_lengths(args.num_docs, rng, args.min_len, args.max_len)
    counts: dict[str, int] = {}
    with path.open("w") as f:
        for i, n in enumerate(lengths):
            task = TASKS[int(rng.integers(len(TASKS)))]
            ex = BUILDERS[task](
                np.random.default_rng([18, i]), int(n), encode, "train", float(rng.uniform())
            )
            f.write(json.dumps({"text": ex.text}) + "\n")
            counts[task] = counts.get(task, 0) + 1
    return counts


def remap_embeddings(model, old_map: dict[int, int], new_map: dict[int, int]) -> int:
    """Move embedding rows from the pretraining vocabulary map to the trainer's (tokenizer id ->
    model id both); returns how many tokenizer ids the trainer's map has that pretraining lacked
    (their rows keep the trainer's initialisation)."""
    emb = model.get_input_embeddings().weight
    missing = 0
    with torch.no_grad():
        old = emb.detach().clone()
        for tok, new_id in new_map.items():
            if tok in old_map:
                emb[new_id] = old[old_map[tok]]
            else:
                missing += 1
        emb[0] = old[0]
    return missing


def continue_training(args, name: str, seed: int, data: Path, pretrained: Path, work: Path):
    v = args.table[name]
    if v["mode"] == "off":  # fixed budget (gamma0 = 1 is dense); bounds unused
        dst = DSTConfig(mode="off", gamma0=v["gamma0"])
    else:
        dst = DSTConfig(
            mode=v["mode"],
            anchor=v["anchor"],
            p=args.tolerance,
            gamma0=v["gamma0"],
            gamma_min=args.gamma_min,
            gamma_max=args.gamma_max,
        )
    cfg = TrainConfig(
        model=str(pretrained),
        data=str(data),
        min_len=1,
        steps=args.steps,
        global_batch=args.global_batch,
        capacity=args.capacity,
        strategy=v["strategy"],
        block_size=args.block_size,
        backend="torch",
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        schedule="cosine",
        seed=seed,
        deterministic=True,
        emulate_ranks=args.ranks,
        device="cpu",
        out=str(work / f"{name}-s{seed}"),
        dst=dst,
        overwrite=True,
    )
    trainer = Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    old_map = json.loads((pretrained / "vocab_map.json").read_text())
    missing = remap_embeddings(
        trainer.model, {int(k): v for k, v in old_map.items()}, trainer.corpus.vocab_map
    )
    res = trainer.run()
    return trainer.model, trainer.corpus.vocab_map, res, missing


def evaluate(model, vocab_map, tokenizer, gamma: float, args) -> dict:
    """Exact match / token accuracy by task, length and depth; perplexity; recall per layer."""
    vocab = model.get_input_embeddings().num_embeddings
    encode, _, eos = make_codec(tokenizer, vocab_map, vocab)
    runner = HFRunner(model, gamma=gamma, block_size=args.block_size, backend="torch")
    scores = []
    for task in TASKS:  # fixed eval seed: every model sees the same held-out examples
        scores += evaluate_task(
            runner,
            task,
            args.eval_lengths,
            encode,
            args.eval_examples,
            DEPTHS,
            seed=1000,
            pack_tokens=8192,
        )
    summary = summarize(scores, num_depth_bins=None)
    n = max(args.eval_lengths)
    held = [ex.text for t in TASKS for ex in generate(t, args.ppl_docs, n, encode, 2000, "eval")]
    ppl = perplexity(runner, held, encode, [n], eos, len(held), 8192)[str(n)]["ppl"]
    density = float(np.mean(runner.densities))
    docs = [
        encode(ex.text)
        for t in TASKS
        for ex in generate(t, args.recall_docs, n, encode, 3000, "eval")
    ]
    recall = layer_recall(model, docs, gamma, args.block_size)
    model.train()
    out = {
        "gamma": gamma,
        "ppl": ppl,
        "eval_density": density,
        "recall": {str(k): v for k, v in recall.items()},
    }
    for task, s in summary.items():
        out[task] = {
            "exact": s["accuracy"],
            "token_acc": s["token_accuracy"],
            "by_length": {k: x["accuracy"] for k, x in s["by_length"].items()},
            "by_depth": {k: x["accuracy"] for k, x in s["by_depth"].items()},
            "grid": s["grid"],
        }
    return out


def run_one(args, name, seed, data, pretrained, work, tokenizer) -> dict:
    t0 = time.perf_counter()
    model, vmap, res, missing = continue_training(args, name, seed, data, pretrained, work)
    train_s = time.perf_counter() - t0
    sums = res["summaries"]
    gamma0 = args.table[name]["gamma0"]
    record = {
        "variant": name,
        "seed": seed,
        "train_wall_s": train_s,
        "unmapped_ids": missing,
        "train_density": float(np.mean([s["mean_density"] for s in sums])),
        "predicted_step_s": float(np.mean([s["predicted_max_s"] for s in sums])),
        "step_s": float(np.mean([s["step_seconds"] for s in sums])),
        "efficiency": float(np.mean([s["efficiency"] for s in sums])),
        "final_loss": float(np.mean(res["losses"][-5:])),
        "losses": res["losses"],
        "eval": {"dense": evaluate(model, vmap, tokenizer, 1.0, args)},
    }
    if gamma0 < 1.0:
        record["eval"]["own"] = evaluate(model, vmap, tokenizer, gamma0, args)
    else:
        record["eval"]["own"] = record["eval"]["dense"]
    return record


def baseline(pretrained: Path, tokenizer, args) -> dict:
    """The pretrained checkpoint itself, dense and at each fixed gamma (where selection misses)."""
    model, vmap = load_trained_model(str(pretrained), vocab_map=str(pretrained / "vocab_map.json"))
    out = {}
    for gamma in sorted({1.0, 0.9, args.gamma_low, 0.3}, reverse=True):
        out[str(gamma)] = evaluate(model, vmap, tokenizer, gamma, args)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sb-accuracy-") as tmp:
        work = Path(tmp)
        pretrained = Path(args.pretrained) if args.pretrained else work / "pretrained"
        if not args.pretrained:
            over = (
                {
                    "stages": ((128, 256, 4),),
                    "eval_lengths": (256,),
                    "eval_examples": 1,
                    "eval_every": 0,
                }
                if args.quick
                else {}
            )
            cfg = load_config(args.pretrain_config, over)
            print(f"pretraining {args.pretrain_config} -> {pretrained}", flush=True)
            pretrain(cfg, pretrained)
        elif not (pretrained / "vocab_map.json").is_file():
            raise ValueError(f"--pretrained {pretrained}: no vocab_map.json (not step 1's output)")
        data = work / "continuation.jsonl"
        task_counts = write_data(data, args, tokenizer.encode)
        base = baseline(pretrained, tokenizer, args)
        print(
            "pretrained checkpoint:",
            json.dumps({g: {t: e[t]["exact"] for t in TASKS} for g, e in base.items()}),
            flush=True,
        )
        records = []
        total = args.seeds * len(args.variants)
        for seed in range(args.seeds):  # seeds outer: load drift hits every variant alike
            for name in args.variants:
                rec = run_one(args, name, seed, data, pretrained, work, tokenizer)
                records.append(rec)
                d, o = rec["eval"]["dense"], rec["eval"]["own"]
                print(
                    f"[{len(records)}/{total} {time.perf_counter() - start:5.0f}s] {name:15s} "
                    f"s{seed}: density {rec['train_density']:.3f}, pred step "
                    f"{rec['predicted_step_s']:.3f}s, loss {rec['final_loss']:.3f} | EM dense "
                    + " ".join(f"{t} {d[t]['exact']:.2f}" for t in TASKS)
                    + " | own "
                    + " ".join(f"{t} {o[t]['exact']:.2f}" for t in TASKS),
                    flush=True,
                )
    wall = time.perf_counter() - start
    payload = {
        "args": {k: v for k, v in vars(args).items() if k != "table"},
        "variants": args.table,
        "notes": VARIANT_NOTES,
        "task_counts": task_counts,
        "pretrained": base,
        "records": records,
        "wall_s": wall,
    }
    print(f"done in {wall:.0f} s ({len(records)} runs)")
    if args.out is None:
        return 0
    md = write_report(payload, args, argv if argv is not None else sys.argv[1:])
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
