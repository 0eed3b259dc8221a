"""DST's measured effect on SAB (issue 56): SAB alone against SAB + DST on the same samples,
stepped interleaved so that a change of load hits both, on the project's own mixes.

    .venv/bin/python benchmarks/dst_gain.py                    # 3 mixes x 3 seeds, writes results
    .venv/bin/python benchmarks/dst_gain.py --quick            # 1 seed, 3 steps, writes nothing
    .venv/bin/python benchmarks/dst_gain.py --mixes heavy --attention-skew 2 --seeds 0,1

Per mix and seed, two trainers of the tiny model (8 emulated ranks in one process, top-k budgets
of 512 tokens, capacity 4,096, block 64) are built on the same data and seed, so they draw the
same global batches; step i runs one, then the other (the first of the pair alternates). The
slowest rank's compute time of each step (what a synchronised step waits for) gives one paired
ratio SAB / SAB+DST; the first step is a warm-up and left out. Per mix: the median of the ratios
over seeds and steps (a load burst that doubles one rank's step once does not move it) and their
geometric mean (it does), each with a 95 % interval from resampling the step pairs (within each
seed, a fixed resampling seed: the file is reproducible from its numbers), the balance efficiency
(mean / max rank compute, median over steps) of each, the mean density, and per rank and step the
measured and predicted seconds (the JSON's ``per_rank``).

``--profile-scale`` and ``--attention-skew`` run with a latency profile that is off on purpose:
every time scaled, or the attention part alone (2 = the profile thinks attention costs twice
what it does). Run alone: the ratios are robust to a steady load, not to a burst on one side.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import sparsebalance

sys.path.insert(0, str(Path(__file__).parent))
from sparsebalance.engine.runtime import Runtime
from sparsebalance.latency import LatencyModel, load_profile
from sparsebalance.results import markdown_table, write_results
from sparsebalance.simulate.distributions import LengthDistribution
from sparsebalance.train import TrainConfig, Trainer
from sparsebalance.tuning import DSTConfig
from table1 import write_store  # a sibling benchmark's token-store writer

MIXES = {
    "tasks": "the built-in long-context synthetic tasks (passkey, needle, key-value retrieval), 128-4,096 tokens",
    "heavy": "heavy-tailed lengths (the simulator's `heavy`: 60 % 128-2K, 30 % 2K-8K, 10 % longer), clipped to "
    "128-4,096, random token ids",
    "uniform": "near-uniform lengths, uniform in 1,536-2,560 tokens, random token ids",
    "stdlib": "held-out real text: this Python's standard-library source files (up to 40,000 characters each, "
    "tests left out), 128-4,096 tokens (issue 56's held-out check)",
}
RANKS, GLOBAL_BATCH, CAPACITY, BUDGET_TOKENS, BLOCK = 8, 32, 4096, 512, 64


def mix_data(mix: str, seed: int, tmp: Path) -> str | None:
    """The ``--data`` of a mix (None: the built-in tasks)."""
    if mix == "tasks":
        return None
    if mix == "stdlib":
        return stdlib_corpus(tmp)
    rng = np.random.default_rng(1000 + seed)
    if mix == "heavy":
        lengths, _ = LengthDistribution(name="heavy", min_len=128, max_len=4096).sample(rng, 512)
    else:
        lengths = rng.integers(1536, 2561, 512)
    return str(write_store(tmp / f"store-{mix}-{seed}", np.asarray(lengths), seed))


def stdlib_corpus(tmp: Path) -> str:
    """A jsonl of this Python's standard-library sources (sorted paths: the same corpus for every
    run on one Python)."""
    path = tmp / "stdlib.jsonl"
    if not path.exists():
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts and "test" not in str(f))
        with path.open("w") as out:
            for f in files:
                try:
                    text = f.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if len(text) >= 600:
                    out.write(json.dumps({"text": text[:40000]}) + "\n")
    return str(path)


def profile_for(args, tmp: Path) -> str | None:
    """The profile path the runs use: ``--profile`` (or the machine's default, found by a first
    trainer) scaled as asked; None: the default, untouched."""
    args.truth = None
    if args.profile_scale == 1.0 and args.attention_skew == 1.0:
        return args.profile
    path = args.profile
    if path is None:  # the cached (or freshly measured) default of this machine
        probe = Trainer(config(args, "tasks", 0, None, "off", tmp / "probe"), Runtime(0, 1, torch.device("cpu")))
        path = tmp / "default-profile.json"
        probe.latency.profile.save(path)
    args.truth = str(path)
    profile = copy.deepcopy(load_profile(path))
    s = args.profile_scale
    profile.scales = [profile.scales[0] * s * args.attention_skew, profile.scales[1] * s, profile.scales[2] * s]
    out = tmp / "profile-off.json"
    profile.save(out)
    return str(out)


def margin(args) -> dict:
    """``--skew-margin`` when given (else DSTConfig's default)."""
    return {} if args.skew_margin is None else {"skew_margin": args.skew_margin}


def config(args, mix: str, seed: int, data: str | None, mode: str, out: Path, profile: str | None = None):
    """The :class:`TrainConfig` of one run of the pair."""
    return TrainConfig(
        data=data,
        num_builtin=512,
        min_len=128,
        max_len=4096,
        steps=args.steps,
        global_batch=GLOBAL_BATCH,
        capacity=CAPACITY,
        block_size=BLOCK,
        emulate_ranks=RANKS,
        strategy="sab",
        seed=seed,
        device="cpu",
        out=str(out),
        overwrite=True,
        profile=profile,
        dst=DSTConfig(mode=mode, budget="top-k", budget_tokens=BUDGET_TOKENS, **margin(args)),
    )


def step_numbers(result, latency, truth=None) -> dict:
    """What a step's records say (read from the per-rank records only, which every version of
    the trainer since issue 40 has: the benchmark also measures older commits), and the slowest
    rank as its layers ran, priced by ``latency`` (the profile as measured, not recalibrated: one
    clock for both runs; each micro-batch at its realised per-layer densities: the coverage bound
    may stop cuts the step-level decision planned). Per rank (``ranks``): its DST role, measured
    compute, layer controllers' seconds, predictions, and its realised budgets priced by ``latency``
    and by ``truth`` (the profile before ``--profile-scale`` / ``--attention-skew``; None: the
    same)."""
    recs = result.records
    realised = priced(recs, latency)
    compute = np.array([r.compute_s for r in recs])
    weights = np.array([sum(n**2 for mb in r.microbatches for n in mb.lengths) for r in recs], dtype=float)
    density = float(np.sum([r.density for r in recs] * weights) / weights.sum())
    before = np.array([r.predicted_before_s for r in recs])
    after = np.array([r.predicted_s for r in recs])
    return {
        "max_s": float(compute.max()),
        "balance": float(compute.mean() / compute.max()),
        "density": density,
        "predicted_max_before_s": float(before.max()),
        "predicted_max_s": float(after.max()),
        "predicted_balance": float(after.mean() / after.max()),
        "realised_max_s": float(max(realised)),
        "layer_dst_share": float(recs[int(compute.argmax())].dst_layer_s / compute.max()),
        "ranks": [
            {
                "role": r.dst_role,
                "compute_s": r.compute_s,
                "dst_layer_s": r.dst_layer_s,
                "coverage_limited": r.coverage_limited,
                "predicted_before_s": r.predicted_before_s,
                "predicted_s": r.predicted_s,
                "realised_s": float(x),
                "truth_s": float(y),
            }
            for r, x, y in zip(recs, realised, realised if truth is None else priced(recs, truth), strict=True)
        ],
    }


def priced(recs, latency) -> list[float]:
    """Each rank's micro-batches at their realised per-layer densities, priced by ``latency``."""
    return [
        sum(latency.predict(list(mb.lengths), np.asarray(mb.layer_densities)) for mb in r.microbatches) for r in recs
    ]


def run_pair(args, mix: str, seed: int, tmp: Path, profile: str | None) -> dict[str, list[dict]]:
    """SAB and SAB + DST on one mix and seed, stepped interleaved; per run, its steps' numbers."""
    data = mix_data(mix, seed, tmp)
    runs = {}
    for name, mode in (("sab", "off"), ("sab+dst", "bidirectional")):
        cfg = config(args, mix, seed, data, mode, tmp / f"{mix}-{seed}-{name}", profile)
        runs[name] = Trainer(cfg, Runtime(0, 1, torch.device("cpu")))
    steps: dict[str, list[dict]] = {name: [] for name in runs}
    clock = LatencyModel(runs["sab"].latency.profile)  # the profile as measured: one clock for both
    truth = None if args.truth is None else LatencyModel(load_profile(args.truth))
    order = list(runs)
    for i in range(args.steps):
        for name in order if i % 2 == 0 else order[::-1]:  # who goes first alternates
            steps[name].append(step_numbers(runs[name].run_step(), clock, truth))
        print(
            f"  {mix} seed {seed} step {i + 1}: SAB {steps['sab'][-1]['max_s']:.3f} s, "
            f"SAB+DST {steps['sab+dst'][-1]['max_s']:.3f} s",
            flush=True,
        )
    return steps


def interval(ratios_by_seed: list[np.ndarray], stat=np.mean, draws: int = 4000) -> tuple[float, float, float]:
    """``stat`` of the log paired ratios (``np.mean``: the geometric mean; ``np.median``: the
    median, which one load burst cannot move) and its 95 % interval (step pairs resampled within
    each seed; a fixed resampling seed)."""
    logs = [np.log(r) for r in ratios_by_seed]
    point = float(np.exp(stat(np.concatenate(logs))))
    rng = np.random.default_rng(12345)
    stats = np.empty(draws)
    for d in range(draws):
        stats[d] = stat(np.concatenate([x[rng.integers(0, x.size, x.size)] for x in logs]))
    lo, hi = np.exp(np.quantile(stats, [0.025, 0.975]))
    return point, float(lo), float(hi)


BURST = 1.5
"""A rank's step is a load burst when its measured / predicted time (predicted by the true profile:
a deliberately skewed one spreads the ranks itself) is more than this times the step's median over
ranks (a rank measured 2.2x its prediction while its peers were at 0.9-1.1x:
seed 0 of 2026-12-02-dst-gain-attention-x2-ranks)."""


def bursts(step: dict) -> int:
    """Ranks of a step measured ``BURST`` times slower than their peers, relative to the model."""
    residual = np.array([r["compute_s"] / r["truth_s"] for r in step["ranks"]])  # the true profile's
    return int(np.sum(residual > BURST * np.median(residual)))


def summarize(per_seed: dict[int, dict[str, list[dict]]]) -> dict:
    """A mix's row: DST on SAB (median and geometric mean of the paired ratios, each with its
    interval), each run's median balance and mean density, the latency model's own prediction of
    DST's gain (the DST run's predicted max before / after), the realised budgets priced by the
    run's profile and by the true one, and the load bursts seen."""
    pairs = [(a, b) for steps in per_seed.values() for a, b in zip(steps["sab"][1:], steps["sab+dst"][1:], strict=True)]
    ratios = [
        np.array([a["max_s"] / b["max_s"] for a, b in zip(steps["sab"][1:], steps["sab+dst"][1:], strict=True)])
        for steps in per_seed.values()
    ]
    point, lo, hi = interval(ratios)
    median, mlo, mhi = interval(ratios, np.median)
    out = {}
    for name in ("sab", "sab+dst"):
        body = [s for steps in per_seed.values() for s in steps[name][1:]]
        out[name] = {k: float(np.mean([s[k] for s in body])) for k in body[0] if k != "ranks"}
        out[name]["balance"] = float(np.median([s["balance"] for s in body]))
        out[name]["bursts"] = sum(bursts(s) for s in body)

    def geo(key: str, of=max) -> float:
        return float(np.exp(np.mean([np.log(of(a, key) / of(b, key)) for a, b in pairs])))

    return {
        "dst_on_sab": median,
        "interval": [mlo, mhi],
        "geometric_mean": point,
        "geometric_interval": [lo, hi],
        "pairs": len(pairs),
        "predicted_dst_on_sab": out["sab+dst"]["predicted_max_before_s"] / out["sab+dst"]["predicted_max_s"],
        "realised_dst_on_sab": geo("realised_max_s", lambda s, k: s[k]),
        "truth_dst_on_sab": geo("truth_s", lambda s, k: max(r[k] for r in s["ranks"])),
        **out,
        "per_rank": {
            str(seed): {name: [s["ranks"] for s in steps[name]] for name in steps} for seed, steps in per_seed.items()
        },
    }


def code_version() -> str:
    """The commit of the imported package's checkout (``+`` when its ``src`` had uncommitted
    changes), or ``unknown``: a run with another checkout on PYTHONPATH measures that one."""
    root = Path(sparsebalance.__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "src"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (1 min) / {five:.2f} (5 min) on {os.cpu_count()} cores"


def table(rows: dict[str, dict]) -> str:
    headers = [
        "mix",
        "DST on SAB, median (95 % interval)",
        "geometric mean (95 % interval)",
        "predicted",
        "as the layers ran",
        "by the true profile",
        "balance SAB",
        "balance SAB+DST",
        "density SAB",
        "density SAB+DST",
        "layer DST share",
        "load bursts",
        "pairs",
    ]

    def ci(point: float, iv: list[float]) -> str:
        return f"{point:.3f}x ({iv[0]:.3f}-{iv[1]:.3f})"

    body = [
        [
            mix,
            ci(r["dst_on_sab"], r["interval"]),
            ci(r["geometric_mean"], r["geometric_interval"]),
            f"{r['predicted_dst_on_sab']:.3f}x",
            f"{r['realised_dst_on_sab']:.3f}x",
            f"{r['truth_dst_on_sab']:.3f}x",
            f"{r['sab']['balance']:.3f}",
            f"{r['sab+dst']['balance']:.3f}",
            f"{r['sab']['density']:.3f}",
            f"{r['sab+dst']['density']:.3f}",
            f"{r['sab+dst']['layer_dst_share']:.3f}",
            f"{r['sab']['bursts']} / {r['sab+dst']['bursts']}",
            r["pairs"],
        ]
        for mix, r in rows.items()
    ]
    return markdown_table(headers, body)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixes", default="tasks,heavy,uniform", help=f"comma list of {', '.join(MIXES)}")
    p.add_argument("--seeds", default="0,1,2", help="comma list")
    p.add_argument("--steps", type=int, default=8, help="steps per run (the first is a warm-up)")
    p.add_argument("--profile", default=None, help="latency profile (default: the machine's, cached or measured)")
    p.add_argument("--profile-scale", type=float, default=1.0, help="every time of the profile x this")
    p.add_argument("--attention-skew", type=float, default=1.0, help="the profile's attention part x this")
    p.add_argument("--skew-margin", type=float, default=None, help="DST's --skew-margin (default: DST's)")
    p.add_argument("--name", default="dst-gain", help="results file name")
    p.add_argument("--quick", action="store_true", help="1 seed, 3 steps, the first mix; writes nothing")
    args = p.parse_args()
    mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    unknown = [m for m in mixes if m not in MIXES]
    if unknown:
        p.error(f"--mixes: unknown {unknown}; choose from {', '.join(MIXES)}")
    if args.steps < 2 or args.profile_scale <= 0 or args.attention_skew <= 0:
        p.error("--steps must be >= 2, --profile-scale and --attention-skew > 0")
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.quick:
        mixes, seeds, args.steps = mixes[:1], seeds[:1], 3
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    start_load, t0 = load_line(), time.perf_counter()
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        profile = profile_for(args, tmp)
        for mix in mixes:
            rows[mix] = summarize({s: run_pair(args, mix, s, tmp, profile) for s in seeds})
            print(table({mix: rows[mix]}), flush=True)
    md = table(rows)
    dst = DSTConfig(mode="bidirectional", budget="top-k", budget_tokens=BUDGET_TOKENS, **margin(args))
    notes = (
        f"{RANKS} emulated ranks, global batch {GLOBAL_BATCH}, capacity {CAPACITY:,}, top-k {BUDGET_TOKENS} "
        f"tokens (block {BLOCK}), strategy sab; DST ({dst.describe()}) against DST off; code {code_version()}; "
        f"{args.steps} steps per "
        "run, the first left out; "
        f"profile scale {args.profile_scale:g}, attention skew {args.attention_skew:g}. Mixes: "
        + "; ".join(f"{m}: {MIXES[m]}" for m in mixes)
        + f". Load at start: {start_load}; at end: {load_line()}; {time.perf_counter() - t0:.0f} s in all. "
        "DST on SAB = the median over step pairs of SAB's slowest-rank compute / SAB+DST's (one load burst "
        "cannot move it), and their geometric mean (it can); predicted = the latency model's step-level "
        "decision (the DST run's predicted slowest rank before / after DST); as the layers ran = the run's "
        "profile pricing each run's realised per-layer budgets (the coverage bound stops cuts the step level "
        "cannot foresee), SAB's slowest rank over SAB+DST's, geometric mean over pairs; by the true profile = "
        "the same with the profile before --profile-scale / --attention-skew; balance = median over steps of "
        f"mean / max rank compute; load bursts (SAB / SAB+DST) = rank-steps measured over {BURST:g}x slower "
        "than their peers relative to the model. Per rank and step: the JSON's per_rank."
    )
    print(md + "\n\n" + notes)
    if args.quick:
        return 0
    payload = {"rows": rows, "mixes": mixes, "seeds": seeds, "steps": args.steps, "notes": notes}
    paths = write_results("benchmarks/results", args.name, torch.device("cpu"), md, payload, notes)
    print("\n".join(str(x) for x in paths))
    return 0 if all(math.isfinite(r["dst_on_sab"]) for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
