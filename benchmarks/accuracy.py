"""Accuracy under the paper's method (issue 29): continue a model that retrieves densely under
top-k budgets, seven ways, and compare paired by seed.

    PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python benchmarks/accuracy.py \\
        --pretrained runs/retrieval-dense-2k-wide     # full grid, writes benchmarks/results/
    PYTHONPATH=src .venv/bin/python benchmarks/accuracy.py --quick   # smoke run, no file

Step 1 (``benchmarks/accuracy_pretrain.py``, recipe ``benchmarks/configs/accuracy-pretrain-2k-wide
.toml``, 42 min on one thread) trains a model that solves passkey, single-needle NIAH and MQAR at
1K and 2K with dense attention; without ``--pretrained`` this script runs it first
(``--quick``: a few steps of a tiny recipe, which does not retrieve: the quick mode only checks
that the pipeline runs).

Step 2: every variant (:func:`variants`) continues from that checkpoint with the real trainer
(``Trainer``: planner over ``--ranks`` emulated data-parallel ranks in one process, DST, the
``sparsebalance`` top-k attention) on the same heavy-tailed mix of the three tasks (train split,
lengths log-normal in ``[--min-len, --max-len]``); a seed fixes the documents' order, identical
for every variant. ``deterministic=True``: DST decides from the latency model's predictions, not
from this machine's clock, so budgets (and results) do not depend on the load. The trainer reads
the documents through the *pretraining* vocabulary map (its own compact map, built from the
train split, has no ids for eval-split keys: issue 18's continuation evaluated MQAR with its keys
unknown). Checkpoints every ``--steps / --candidates`` steps; the one with the best mean exact
match on the dev examples (at the variant's own base budget) is evaluated on the test examples.

Step 3 (:mod:`accuracy_eval`): each chosen model dense, at its base budget and (DST top-k
variants) at the final per-length-bin k its run ended with; :mod:`accuracy_report` writes
tables, paired-by-seed statistics (:mod:`accuracy_stats`) and plots.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy_eval import (
    DENSE,
    DEV_SEED,
    TASKS,
    BinBudget,
    analytic_density,
    evaluate,
    scores,
)
from accuracy_pretrain import load_config, pretrain
from accuracy_report import write_report
from sparsebalance.data import load_tokenizer
from sparsebalance.data.dataset import apply_vocabulary
from sparsebalance.engine.runtime import Runtime
from sparsebalance.ops import Budget
from sparsebalance.tasks import sample_lengths
from sparsebalance.tasks.generate import TASKS as BUILDERS
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.train.weights import load_trained_model
from sparsebalance.tuning import DSTConfig

# name -> batching strategy, budget kind, k as a multiple of --k-base, DST mode, anchor, p
VARIANTS: dict[str, dict] = {
    "fixed-K": dict(strategy="tokens", budget="top-k", k=1.0, mode="off"),
    "fixed-K/2": dict(strategy="tokens", budget="top-k", k=0.5, mode="off"),
    "dst-mean-p0.1": dict(strategy="tokens", budget="top-k", k=1.0, mode="bidirectional", anchor="mean", p=0.1),
    "dst-mean-p0.2": dict(strategy="tokens", budget="top-k", k=1.0, mode="bidirectional", anchor="mean", p=0.2),
    "dst-min-p0.1": dict(strategy="tokens", budget="top-k", k=1.0, mode="bidirectional", anchor="min", p=0.1),
    "sab-dst-mean-p0.1": dict(strategy="sab", budget="top-k", k=1.0, mode="bidirectional", anchor="mean", p=0.1),
    "gamma-rule": dict(strategy="sab", budget="gamma", mode="bidirectional", anchor="mean"),
    "dense": dict(strategy="tokens", budget="dense", mode="off"),
}
DEFAULT_VARIANTS = [v for v in VARIANTS if v != "dense"]
GAMMA0 = 0.9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pretrained", default=None, help="step 1's output folder (else trained now)")
    p.add_argument("--pretrain-config", default="benchmarks/configs/accuracy-pretrain-2k-wide.toml")
    p.add_argument("--seeds", type=int, default=5, help="training seeds 0..N-1 per variant")
    p.add_argument("--steps", type=int, default=40, help="continuation steps")
    p.add_argument("--candidates", type=int, default=4, help="checkpoints compared on dev")
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated subset of {list(VARIANTS)} (default: all but dense)",
    )
    p.add_argument("--k-base", type=int, default=8, help="base top-k K (blocks); even, >= 2")
    p.add_argument("--ranks", type=int, default=4, help="emulated data-parallel ranks")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--num-docs", type=int, default=400, help="continuation training documents")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--eval-lengths", default="1024,2048")
    p.add_argument(
        "--eval-examples",
        type=int,
        default=100,
        help="test examples per task and length (split evenly over 5 depths)",
    )
    p.add_argument("--dev-examples", type=int, default=25, help="dev examples per task, length")
    p.add_argument("--recall-docs", type=int, default=2, help="documents per task and length")
    p.add_argument("--ppl-docs", type=int, default=4, help="held-out documents for perplexity")
    p.add_argument("--sweep", default="1,2,4,8,16", help="k values of the dev sweep (blocks)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny pretrain, 2 seeds, 2 steps, few examples; no file without --out",
    )
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--name", default="accuracy-topk", help="results: <date>-<name>-cpu.md/.json")
    p.add_argument(
        "--records",
        type=Path,
        default=None,
        help="JSON-lines file: each finished run is appended; runs already in it are not rerun "
        "(resume an interrupted grid with the same arguments; two processes can share a grid, "
        "one with --reverse)",
    )
    p.add_argument("--reverse", action="store_true", help="walk the grid from its last run (see --records)")
    args = p.parse_args(argv)
    if args.out is None and not args.quick:
        args.out = "benchmarks/results"
    if args.quick:
        args.name += "-quick"
        args.seeds, args.steps, args.candidates = 2, 2, 2
        args.eval_examples, args.dev_examples, args.recall_docs, args.ppl_docs = 5, 5, 1, 1
        args.num_docs, args.min_len, args.max_len, args.capacity = 32, 128, 512, 2048
        args.eval_lengths, args.sweep, args.k_base = "512", "1,2", 2
    if args.seeds < 1 or args.steps < 1 or not 1 <= args.candidates <= args.steps:
        raise ValueError("--seeds, --steps >= 1 and 1 <= --candidates <= --steps required")
    if args.k_base < 2 or args.k_base % 2:
        raise ValueError(f"--k-base must be even and >= 2 (K/2 is a variant), got {args.k_base}")
    names = DEFAULT_VARIANTS if args.variants is None else args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise ValueError(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
    args.variants = names
    args.eval_lengths = [int(x) for x in args.eval_lengths.split(",")]
    args.sweep = [int(x) for x in args.sweep.split(",")]
    return args


def dst_config(name: str, args) -> DSTConfig:
    """The DST settings of variant ``name`` (:data:`VARIANTS`)."""
    v = VARIANTS[name]
    if v["budget"] == "dense":
        return DSTConfig(mode="off", budget="gamma", gamma0=1.0)
    if v["budget"] == "gamma":  # today's gamma rule, exactly (time band, raise to the step)
        return DSTConfig(
            mode="bidirectional",
            anchor="mean",
            budget="gamma",
            gamma0=GAMMA0,
            gamma_min=0.5,
            gamma_max=0.99,
            tolerance=0.1,
            raise_to="step",
            p=1.0,
        )
    tokens = int(v["k"] * args.k_base) * args.block_size
    if v["mode"] == "off":
        return DSTConfig(mode="off", budget="top-k", budget_tokens=tokens)
    return DSTConfig(mode=v["mode"], anchor=v["anchor"], p=v["p"], budget="top-k", budget_tokens=tokens)


def describe(name: str, args) -> str:
    """One line: the variant's batching, budget and DST rule (for the report)."""
    v, cfg = VARIANTS[name], dst_config(name, args)
    if cfg.mode == "off":
        budget = base_budget(name, args)
        return f"{v['strategy']}; fixed {budget.kind} {budget.value:g}"
    return f"{v['strategy']}; {cfg.describe()}"


def base_budget(name: str, args) -> Budget:
    """The budget variant ``name`` starts from: its base K (or gamma0, or dense)."""
    v = VARIANTS[name]
    if v["budget"] == "dense":
        return DENSE
    if v["budget"] == "gamma":
        return Budget(gamma=GAMMA0)
    return Budget(top_k=int(v["k"] * args.k_base))


def write_data(path: Path, args, encode) -> dict[str, int]:
    """The continuation mix as jsonl (train split, heavy-tailed lengths); task counts."""
    rng = np.random.default_rng([29, args.num_docs])
    lengths = sample_lengths(args.num_docs, rng, args.min_len, args.max_len)
    counts: dict[str, int] = {}
    with path.open("w") as f:
        for i, n in enumerate(lengths):
            task = TASKS[int(rng.integers(len(TASKS)))]
            ex = BUILDERS[task](np.random.default_rng([29, i]), int(n), encode, "train", float(rng.uniform()))
            f.write(json.dumps({"text": ex.text}) + "\n")
            counts[task] = counts.get(task, 0) + 1
    return counts


def train_metrics(results, base: float) -> dict:
    """What the continuation did, over steps and (emulated) ranks: DST roles, budget range,
    realized density, predicted step time (slowest rank, latency model) before and after DST."""
    sums = [r.report for r in results]
    recs = [rec for r in results for rec in r.records]
    roles = {"cut": 0, "raised": 0, "kept": 0}
    for rec in recs:
        roles[rec.dst_role] = roles.get(rec.dst_role, 0) + 1
    pred_eff = [np.mean([x.predicted_s for x in r.records]) / max(x.predicted_s for x in r.records) for r in results]
    return {
        "density": float(np.mean([s.mean_density for s in sums])),
        "predicted_step_s": float(np.mean([s.predicted_max_s for s in sums])),
        "predicted_step_before_s": float(np.mean([s.predicted_max_before_s for s in sums])),
        "predicted_efficiency": float(np.mean(pred_eff)),
        "roles": roles,
        "budget_min": float(min(rec.budget_min for rec in recs)),
        "budget_mean": float(np.mean([rec.budget_mean for rec in recs])),
        "budget_max": float(max(rec.budget_max for rec in recs)),
        "units_cut": float(np.mean([rec.budget_min < base - 1e-9 for rec in recs])),
        "units_raised": float(np.mean([rec.budget_max > base + 1e-9 for rec in recs])),
        "coverage_limited": int(sum(s.coverage_limited for s in sums)),
        "overhead_s": float(np.mean([s.overhead_s for s in sums])),
        "losses": [s.loss for s in sums],
    }


def continue_training(args, name, seed, data, pretrained, vocab_map, work, tokenizer) -> dict:
    """Train variant ``name`` with ``seed``; choose a checkpoint on dev; evaluate it on test."""
    cfg = TrainConfig(
        model=str(pretrained),
        data=str(data),
        min_len=1,
        steps=args.steps,
        global_batch=args.global_batch,
        capacity=args.capacity,
        strategy=VARIANTS[name]["strategy"],
        block_size=args.block_size,
        backend="torch",
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        schedule="cosine",
        seed=seed,
        deterministic=True,
        emulate_ranks=args.ranks,
        device="cpu",
        out=str(work / "run"),
        dst=dst_config(name, args),
        overwrite=True,
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    apply_vocabulary(trainer.corpus, vocab_map)  # the checkpoint's ids, eval-split keys included
    every = args.steps / args.candidates
    candidates = sorted({round(every * (i + 1)) for i in range(args.candidates)})
    results, snapshots = [], {}
    for step in range(1, args.steps + 1):
        results.append(trainer.run_step())
        if step in candidates:
            bins = getattr(trainer.estimator, "bins", None)
            snapshots[step] = (
                copy.deepcopy(trainer.model.state_dict()),
                None if bins is None else {str(b): k for b, k in bins.items()},
            )
    train_s = time.perf_counter() - t0
    profile = json.dumps(trainer.latency.profile.to_json(), sort_keys=True).encode()
    model, own = trainer.model, base_budget(name, args)
    dev = {}
    for step, (state, _) in snapshots.items():
        model.load_state_dict(state)
        dev[step] = scores(
            model, vocab_map, tokenizer, own, args.eval_lengths, args.dev_examples, DEV_SEED, args.block_size
        )["mean_em"]
    chosen = max(dev, key=lambda s: (dev[s], s))  # ties: the later checkpoint
    state, bins = snapshots[chosen]
    model.load_state_dict(state)
    tuner_base = float(trainer.tuner.knob.base)
    record = {
        "variant": name,
        "seed": seed,
        "train_wall_s": train_s,
        "chosen_step": chosen,
        "dev_mean_em": {str(s): v for s, v in dev.items()},
        "final_bins": bins,
        "unknown_tokens": int(trainer.corpus.meta.get("unknown_tokens", 0)),
        "latency_profile": hashlib.sha256(profile).hexdigest()[:16],
        "train": train_metrics(results, tuner_base),
        "eval": {},
    }
    lengths = args.eval_lengths
    record["eval"]["dense"] = evaluate(model, vocab_map, tokenizer, DENSE, lengths, args.eval_examples, args)
    if own.is_dense:
        record["eval"]["base"] = record["eval"]["dense"]
    else:
        record["eval"]["base"] = evaluate(model, vocab_map, tokenizer, own, lengths, args.eval_examples, args)
    if bins is not None and VARIANTS[name]["mode"] != "off":
        spec = BinBudget(bins, own.top_k)
        record["eval"]["final"] = evaluate(model, vocab_map, tokenizer, spec, lengths, args.eval_examples, args)
        record["eval"]["final"]["analytic_density"] = analytic_density(spec, lengths, args.block_size)
    else:  # a fixed budget ends where it started
        record["eval"]["final"] = record["eval"]["base"]
    record["run_wall_s"] = time.perf_counter() - t0  # training, dev choice and test evaluation
    return record


def baseline(pretrained: Path, tokenizer, args) -> dict:
    """The pretrained checkpoint: test evaluation dense, at K, K/2 and gamma0; the dev sweep of
    k (what K was chosen from: dev examples only)."""
    model, vmap = load_trained_model(str(pretrained), vocab_map=str(pretrained / "vocab_map.json"))
    k = args.k_base
    specs = {
        "dense": DENSE,
        f"top-k {k}": Budget(top_k=k),
        f"top-k {k // 2}": Budget(top_k=k // 2),
        f"gamma {GAMMA0}": Budget(gamma=GAMMA0),
    }
    test = {
        n: evaluate(model, vmap, tokenizer, s, args.eval_lengths, args.eval_examples, args) for n, s in specs.items()
    }
    sweep = {}
    for kk in args.sweep:
        ev = scores(
            model, vmap, tokenizer, Budget(top_k=kk), args.eval_lengths, args.dev_examples, DEV_SEED, args.block_size
        )
        sweep[str(kk)] = {
            "mean_em": ev["mean_em"],
            "density": ev["eval_density"],
            **{t: ev[t]["by_length"] for t in TASKS},
        }
    return {"test": test, "dev_sweep": sweep}


def _run_key(args: argparse.Namespace) -> str:
    """What a run's record depends on: every argument but the grid's size and where it writes."""
    skip = {"seeds", "variants", "records", "out", "name", "reverse"}
    return json.dumps({k: str(v) for k, v in vars(args).items() if k not in skip}, sort_keys=True)


def _checkpoint_id(pretrained: Path) -> str:
    """A fingerprint of the pretrained weights and vocabulary: records of a run key name a path,
    and a model retrained into the same folder must not reuse them."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "vocab_map.json"):
        f = pretrained / name
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _load_records(path: Path | None, key: str, checkpoint: str | None = None) -> dict:
    """``{(variant, seed): record}`` of a ``--records`` file (empty when there is none); a file
    written with other arguments, or from other pretrained weights, is refused (records written
    before the weights were fingerprinted carry no ``checkpoint`` and are accepted)."""
    if path is None or not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.pop("run_key", None) != key:
                raise SystemExit(f"--records {path}: written with other arguments; use a new file")
            if checkpoint is not None and rec.get("checkpoint", checkpoint) != checkpoint:
                raise SystemExit(
                    f"--records {path}: written from other pretrained weights than "
                    f"--pretrained's (retrained?); use a new file"
                )
            out[rec["variant"], rec["seed"]] = rec
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
                    "test_examples": 0,
                }
                if args.quick
                else {}
            )
            cfg = load_config(args.pretrain_config, over)
            print(f"pretraining {args.pretrain_config} -> {pretrained}", flush=True)
            pretrain(cfg, pretrained)
        elif not (pretrained / "vocab_map.json").is_file():
            raise ValueError(f"--pretrained {pretrained}: no vocab_map.json (not step 1's output)")
        vmap = {int(a): b for a, b in json.loads((pretrained / "vocab_map.json").read_text()).items()}
        data = work / "continuation.jsonl"
        task_counts = write_data(data, args, tokenizer.encode)
        base = baseline(pretrained, tokenizer, args)
        print(
            "pretrained checkpoint (test EM):",
            json.dumps({n: round(e["mean_em"], 3) for n, e in base["test"].items()}),
            "| dev sweep of k:",
            json.dumps({k: round(e["mean_em"], 3) for k, e in base["dev_sweep"].items()}),
            flush=True,
        )
        key, ckpt = _run_key(args), _checkpoint_id(pretrained)
        cells = [(name, seed) for seed in range(args.seeds) for name in args.variants]
        total, ran = len(cells), {}
        # seeds outer (load drift hits every variant alike); --reverse walks the grid from the
        # end, so a second process on the same --records file shares the grid
        for name, seed in reversed(cells) if args.reverse else cells:
            if (name, seed) in _load_records(args.records, key, ckpt):  # another's, or earlier
                continue
            rec = continue_training(args, name, seed, data, pretrained, vmap, work / name.replace("/", "_"), tokenizer)
            rec["checkpoint"] = ckpt
            ran[name, seed] = rec
            if args.records is not None:
                with args.records.open("a") as f:
                    f.write(json.dumps({"run_key": key, **rec}) + "\n")
            tr, ev = rec["train"], rec["eval"]
            print(
                f"[{len(ran)} here, {total} in the grid, {time.perf_counter() - start:5.0f}s] "
                f"{name:18s} s{seed}: density {tr['density']:.3f}, pred step "
                f"{tr['predicted_step_s']:.4f}s, roles {tr['roles']}, k "
                f"[{tr['budget_min']:.3g}, {tr['budget_max']:.3g}], ckpt "
                f"{rec['chosen_step']} | EM dense {ev['dense']['mean_em']:.3f} base "
                f"{ev['base']['mean_em']:.3f} final {ev['final']['mean_em']:.3f}",
                flush=True,
            )
        found = {**_load_records(args.records, key, ckpt), **ran}
        missing = [c for c in cells if c not in found]
        if missing:
            print(
                f"{len(missing)} runs of the grid are not in {args.records} yet (another "
                "process is running them): run this command again when it ends for the report"
            )
            return 0
        records = [found[c] for c in cells]
    wall = time.perf_counter() - start
    payload = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "variants": {n: VARIANTS[n] for n in args.variants},
        "dst": {n: describe(n, args) for n in args.variants},
        "task_counts": task_counts,
        "pretrained": base,
        "records": records,
        "wall_s": wall,
        "runs_here": len(ran),
        "latency_profiles": sorted({r["latency_profile"] for r in records}),
    }
    print(f"done in {wall:.0f} s ({len(records)} runs)")
    if args.out is None:
        return 0
    md = write_report(payload, args, argv if argv is not None else sys.argv[1:])
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
