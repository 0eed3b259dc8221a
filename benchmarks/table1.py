"""The SparseBalance paper's Table I, reproduced: six rows (baseline, +DST, +SAB, +LBB, +SAB+DST,
+LBB+DST) x imbalance, iteration time, overhead, speed-up, with the settings pre-registered in
``benchmarks/configs/table1.toml`` (committed before the first measurement).

    python benchmarks/table1.py --mode measured     # this CPU, --emulate-ranks 8 (one process)
    python benchmarks/table1.py --mode gloo         # this CPU, 2 gloo ranks (torchrun)
    python benchmarks/table1.py --mode simulated    # the paper's setting, analytic H200
    python benchmarks/table1.py --mode simulated --pp 4   # ... as the paper runs it: DP x PP4 (1F1B)
    python benchmarks/table1.py --mode gloo --pp 2        # this CPU, the 2 gloo ranks as one PP2 pipeline
    python benchmarks/table1.py --mode measured --quick   # tiny, for the slow test tier

Measured modes train the real model with the real trainer: one :class:`Trainer` per row in one
process (per rank under torchrun), all on the same data and seed, stepped *interleaved* (round r
runs step r of every row, the row order rotating), so the machine's drift hits every row alike.
The first step of each row is a warm-up; each speed-up is the median over the other rounds of
``baseline step / row step`` in that round. Imbalance = max / mean of the ranks' compute time
(over ranks, not micro-batches as in the paper's PP setting). Overhead = SAB planning + DST's
step decision + the slowest rank's per-layer DST decisions (``overhead_s`` of the trainer), in
ms and as a share of the row's step; and as a share of the analytic H200 step of the paper's
setting (the same pipeline work beside a real GPU step). Run alone: nothing else on the machine.

With ``--pp P`` every data-parallel rank is a 1F1B pipeline of P stages. Simulated
(:mod:`sparsebalance.simulate.pipeline`): a row's iteration is the slowest pipeline's makespan,
its imbalance the paper's max / mean micro-batch time. ``--mode gloo --pp P``: the real pipeline
trainer (``train --pp``) on the gloo ranks, ``[measured.pipeline]``'s batch per pipeline. SAB
packs and orders micro-batches for the 1F1B makespan and DST anchors on makespans
(``PlanConfig.pipeline_stages``, issue 44).

Writes ``benchmarks/results/<date>-table1-<mode>[-ppP]-cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import tomllib
import torch

from sparsebalance.data.prepare import tokenizer_info
from sparsebalance.data.store import StoreWriter
from sparsebalance.data.tokenizer import load_tokenizer
from sparsebalance.results import markdown_table, portable_path, write_results

ROWS = {  # name -> (planner strategy, DST mode)
    "baseline": ("sequential", "off"),
    "+DST": ("sequential", "bidirectional"),
    "+SAB": ("sab", "off"),
    "+LBB": ("lbb", "off"),
    "+SAB+DST": ("sab", "bidirectional"),
    "+LBB+DST": ("lbb", "bidirectional"),
}
CONFIG = Path(__file__).parent / "configs" / "table1.toml"
PIPELINE_NOTE = (
    "Pipelines (--pp {pp}): every data-parallel rank is a 1F1B pipeline of {pp} stages (layers per stage "
    "{split}, balanced against the LM head on the last stage, weighed from the model's shapes as "
    "{head:.2f} layers: the trainer's split, used by the planner, DST and the pricing alike; backward = "
    "2 x forward, sends free); iteration = the "
    "slowest pipeline's makespan, bubbles included; imbalance = max / mean micro-batch time (the "
    "paper's), pipeline imbalance = max / mean makespan, device idle = the mean idle share of the "
    "DP x PP devices. SAB and DST are pipeline-aware (issue 44, point 2): SAB packs each rank's "
    "micro-batches and orders them for the least exact 1F1B makespan and evens the ranks' makespans "
    "(PlanConfig.pipeline_stages); DST's anchor, cuts and raises read makespans, one budget per "
    "pipeline first, then one per micro-batch (the critical micro-batches cut within their own "
    "coverage bound, the others raised to a common level; kept only where it shortens the "
    "makespan). The baseline and LBB are not: their micro-batches run in the order they are dealt. "
    "Overhead = planning + DST wall time on this shared 2-core CPU (noisy)."
)
MEASURED_PIPELINE_NOTE = (
    "Measured pipelines (--mode gloo --pp {pp}): the gloo ranks are DP x PP {pp} processes (one per "
    "core) running the real pipeline trainer (`sparsebalance train --pp {pp}`: 1F1B, activations "
    "sent between processes); [measured.pipeline]'s documents per pipeline and micro-batches. "
    "Iteration = the measured wall time of a step; imbalance = max / mean of the pipelines' summed "
    "micro-batch seconds (1.0 with one pipeline: the gain is inside the pipeline)."
)
LBB_NOTE = (
    "Why +LBB stays below 1.0x: LBB (the paper's length-based batching) cuts length-sorted documents "
    "into consecutive micro-batches, so the longest documents share a micro-batch and that one "
    "micro-batch is every pipeline's critical path ((P - 1) x the slowest micro-batch enters the "
    "makespan); against the dataset-order baseline, which scatters long documents, that is slower. "
    "Its gain in the paper is, we assume, the padding it saves when Megatron pads each micro-batch "
    "to its longest document; our packed (THD) micro-batches have no padding, and the simulator "
    "prices none (unless --pad-micro-batches), so that gain cannot appear. LBB was not made "
    "pipeline-aware: it is a length "
    "bucketing, not a balancing objective, and giving it SAB's makespan search would make it SAB "
    "on token counts, not the paper's baseline."
)

PADDED_NOTE = (
    "Padded micro-batches (--pad-micro-batches): every row runs each micro-batch as a (K, S) batch "
    "without packing, its K documents padded to its longest S (Megatron-LM without cu_seqlens; "
    "the paper's micro-batch 2 as we read it): a padded document costs what a document of S "
    "tokens costs at its own budget (attention and the rest), and the planner, DST and the "
    "pricing all see the padded documents. SAB prices the padding too and adds two "
    "length-grouped plans to its candidates (sparsebalance.batching.padding), one of them LBB's "
    "own: which plan it kept is listed below. Density is the padded documents' (what the kernel "
    "runs), and DST's coverage bound reads them too (conservative: a padded document's real "
    "coverage is at least that). This is a model of frameworks that pad, testing why the paper's "
    "+LBB gains: SparseBalance's trainer packs."
)


def kept_plans(results: dict) -> str:
    """One line per setting: which of SAB's plans the +SAB and +SAB+DST rows kept, in how many steps."""
    lines = [
        f"- {key}: "
        + "; ".join(
            f"{row} " + ", ".join(f"{c} {n}" for c, n in res[row]["candidates"].items()) for row in ("+SAB", "+SAB+DST")
        )
        for key, res in results.items()
    ]
    return "SAB's kept plan per step (of its candidates):\n" + "\n".join(lines)


def draw_lengths(mix: dict, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths: a ``long_share`` of log-uniform draws in ``long``, the rest in ``short``."""

    def logu(lo_hi, size):
        lo, hi = np.log(lo_hi[0]), np.log(lo_hi[1])
        return np.exp(rng.uniform(lo, hi, size)).astype(np.int64)

    is_long = rng.random(n) < mix["long_share"]
    return np.where(is_long, logu(mix["long"], n), logu(mix["short"], n))


def write_store(path: Path, lengths: np.ndarray, seed: int, vocab: int = 4096) -> Path:
    """A token store of random ids below ``vocab`` (the tiny model's embedding) per length."""
    tok = load_tokenizer(None)
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, int(n)).astype(np.int64) for n in lengths]
    with StoreWriter(path, tokenizer_info(tok), overwrite=True) as w:
        w.add_many(docs, ["table1"] * len(docs))
        w.close({"table1": {"seed": seed}})
    return path


# ---------------------------------------------------------------------- measured (real training)
def run_rows(cfg: dict, mix: str, seed: int, store: Path, out: Path, emulate: int, pp: int = 1) -> dict:
    """Every row's trainer, stepped interleaved; returns per row the per-round summaries
    (``pp`` > 1: pipelines of ``pp`` stages, ``[measured.pipeline]``'s batch per pipeline)."""
    from sparsebalance.train.config import TrainConfig
    from sparsebalance.train.trainer import Trainer
    from sparsebalance.tuning import DSTConfig

    m = cfg["measured"]
    batch = {"global_batch": m["global_batch"], "micro_batches": m["micro_batches"]}
    if pp > 1:
        dp = int(os.environ.get("WORLD_SIZE", "1")) // pp
        piped = m["pipeline"]
        batch = {"global_batch": piped["global_batch_per_pipeline"] * dp, "micro_batches": piped["micro_batches"]}
    trainers = {}
    for name, (strategy, mode) in ROWS.items():
        dst = DSTConfig(mode=mode, anchor=cfg["anchor"], p=cfg["p"], budget_tokens=m["budget_tokens"])
        tc = TrainConfig(
            model=m["model"],
            data=str(store),
            steps=cfg["rounds"],
            **batch,
            capacity=None,
            pp=pp,
            strategy=strategy,
            block_size=m["block_size"],
            emulate_ranks=emulate,
            seed=seed,
            out=str(out / name),
            overwrite=True,
            dst=dst,
            overlong="split",
        )
        trainers[name] = Trainer(tc)
    rounds: dict[str, list[dict]] = {name: [] for name in ROWS}
    names = list(ROWS)
    for r in range(cfg["rounds"]):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate who goes first
        for name in order:
            s = trainers[name].run_step().report
            rounds[name].append(
                {
                    "step_s": s.step_seconds,
                    "imbalance": s.imbalance,
                    "overhead_s": s.overhead_s,
                    "plan_s": s.plan_s,
                    "dst_s": s.dst_s,
                    "dst_layer_s": s.dst_layer_s,
                    "density": s.mean_density,
                    "loss": s.loss,
                    "coverage_limited": s.coverage_limited,
                    # the latency model's prediction of the step's compute (slowest rank or
                    # pipeline makespan) before and after DST: what the planner and DST aimed at
                    "predicted_before_s": s.predicted_max_before_s,
                    "predicted_s": s.predicted_max_s,
                }
            )
    return rounds


def summarize(rounds: dict[str, list[dict]]) -> dict:
    """Per row: medians over rounds (warm-up dropped) and the median per-round speed-up."""
    out = {}
    base = [x["step_s"] for x in rounds["baseline"][1:]]
    base_pred = [x.get("predicted_s") for x in rounds["baseline"][1:]]
    for name, rs in rounds.items():
        rs = rs[1:]
        step = [x["step_s"] for x in rs]
        med = statistics.median
        out[name] = {
            "imbalance": med(x["imbalance"] for x in rs),
            "step_ms": 1e3 * med(step),
            "overhead_ms": 1e3 * med(x["overhead_s"] for x in rs),
            "overhead_share": med(x["overhead_s"] / x["step_s"] for x in rs),
            "speedup": med(b / s for b, s in zip(base, step, strict=True)),
            "density": med(x["density"] for x in rs),
            "coverage_limited": med(x["coverage_limited"] for x in rs),
            "rounds": len(rs),
        }
        if all(x.get("predicted_s") for x in rs) and all(base_pred):  # runs made before it: absent
            pred = [x["predicted_s"] for x in rs]
            out[name]["predicted_speedup"] = med(b / s for b, s in zip(base_pred, pred, strict=True))
    return out


def measured(cfg: dict, args, emulate: int) -> dict:
    m = cfg["measured"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="table1-") as tmp:
        tmp = Path(tmp)
        for mix in args.mixes:
            for seed in cfg["seeds"]:
                rng = np.random.default_rng([seed, 27])
                lengths = draw_lengths(m["mixes"][mix], args.num_docs, rng)
                store = write_store(tmp / f"store-{mix}-{seed}", lengths, seed)
                t0 = time.perf_counter()
                rounds = run_rows(cfg, mix, seed, store, tmp / f"runs-{mix}-{seed}", emulate, args.pp)
                results[f"{mix}/seed{seed}"] = {
                    "rows": summarize(rounds),
                    "raw": rounds,
                    "wall_s": time.perf_counter() - t0,
                }
                if int(os.environ.get("RANK", "0")) == 0:  # gloo: one line, not one per rank
                    print(
                        f"{mix} seed {seed}: {format_rows(results[f'{mix}/seed{seed}']['rows'])}",
                        file=sys.stderr,
                        flush=True,
                    )
    return results


def format_rows(rows: dict) -> str:
    return ", ".join(f"{n} {r['speedup']:.2f}x" for n, r in rows.items())


# ---------------------------------------------------------------------- simulated (paper scale)
def pipeline_layers(cfg: dict, pp: int) -> tuple[tuple[int, ...], float]:
    """The simulated model's layers per stage at ``--pp pp`` (the trainer's balanced split; empty
    at pp 1) and its LM head's weight in layers."""
    from sparsebalance.batching.schedule import head_layers
    from sparsebalance.models import load_shapes
    from sparsebalance.simulate.scenario import pipeline_split

    shapes = load_shapes(cfg["simulated"]["model"])
    return pipeline_split(shapes, shapes.num_layers, pp), head_layers(shapes)


def simulate_setting(batches, ranks: int, model, s: dict, strategies: list[str], dst, **pipeline) -> dict:
    """:func:`simulate_steps` at table1's simulated setting ``s`` (its micro-batches per rank and
    block size) with ``strategies``; ``pipeline``: the pipeline's keywords. What this file and
    ``pipeline_interleaved.py`` simulate."""
    from sparsebalance.simulate import simulate_steps

    kw = {"micro_batches": s["micro_batches"], "block_size": s["block_size"]}
    return simulate_steps(batches, ranks, model, strategies=strategies, dst=dst, **kw, **pipeline)


def simulated(cfg: dict, args) -> dict:
    from sparsebalance.latency import LatencyModel, analytic_profile
    from sparsebalance.models import load_shapes
    from sparsebalance.simulate.engine import ABLATIONS
    from sparsebalance.simulate.sparsity import SparsityModel
    from sparsebalance.tuning import DSTConfig

    s = cfg["simulated"]
    shapes = load_shapes(s["model"])
    longest = max(max(mx["long"][1], mx["short"][1]) for mx in s["mixes"].values())
    # the analytic grid spans 2 x max_context tokens: widen it to the largest rank's tokens
    grid = replace(shapes, max_context=max(shapes.max_context, longest * s["samples_per_rank"] // 2 + 1))
    profile = analytic_profile(grid, s["accelerator"], block_size=s["block_size"])
    model = LatencyModel(profile)
    dst = DSTConfig(anchor=cfg["anchor"], p=cfg["p"], budget_tokens=s["budget_tokens"])
    names = {
        "baseline": "baseline",
        "+DST": "dst",
        "+SAB": "sab",
        "+LBB": "lbb",
        "+SAB+DST": "sab+dst",
        "+LBB+DST": "lbb+dst",
    }
    assert all(v in ABLATIONS for v in names.values())
    out = {}
    for mix in args.mixes:
        for r in s["world_sizes"]:
            batches = []
            for step in range(s["steps"]):
                rng = np.random.default_rng([27, r, step])
                n = r * s["samples_per_rank"]
                lengths = draw_lengths(s["mixes"][mix], n, rng)
                content = SparsityModel().sample(rng, lengths, s["block_size"])
                batches.append((lengths, content))
            res = simulate_setting(
                batches,
                r,
                model,
                s,
                list(names.values()),
                dst,
                pipeline_stages=args.pp,
                stage_layers=pipeline_layers(cfg, args.pp)[0],
                pad_micro_batches=args.pad_micro_batches,
            )
            st, ov = res["strategies"], res["overhead_seconds"]
            key_name = f"{mix}/DP{r}" + (f" PP{args.pp}" if args.pp > 1 else "")
            out[key_name] = {
                row: {
                    "imbalance": 1 / st[key]["balance_efficiency"],
                    "step_ms": 1e3 * st[key]["step_seconds"],
                    "overhead_ms": 1e3 * (ov[key]["plan_seconds"] + ov[key]["dst_seconds"]),
                    "overhead_share": (ov[key]["plan_seconds"] + ov[key]["dst_seconds"]) / st[key]["step_seconds"],
                    "speedup": st[key]["speedup"],
                    "density": st[key]["mean_density"],
                    "candidates": st[key]["candidates"],
                    **(
                        {  # the paper's imbalance is over micro-batches; keep the pipelines' too
                            "imbalance": st[key]["microbatch_imbalance"],
                            "dp_imbalance": 1 / st[key]["balance_efficiency"],
                            "device_idle": st[key]["device_idle_fraction"],
                        }
                        if args.pp > 1
                        else {}
                    ),
                }
                for row, key in names.items()
            }
    return out


# ---------------------------------------------------------------------- output
def table(cfg: dict, results: dict, mode: str) -> str:
    paper = cfg["paper"]
    parts = []
    for key, res in results.items():
        rows = res.get("rows", res)
        head = [
            "setting",
            "imbalance",
            "iteration (ms)",
            "overhead (ms)",
            "overhead share",
            "speedup",
            "density",
            "paper: imbalance / iteration / overhead / speedup",
        ]
        pipe = all("device_idle" in r for r in rows.values())
        if pipe:
            head[1] = "imbalance (micro-batch)"
            head += ["pipeline imbalance", "device idle"]
        predicted = all("predicted_speedup" in r for r in rows.values())
        if predicted:
            head.append("predicted speedup (latency model)")
        body = []
        for name, r in rows.items():
            p = paper[name]
            body.append(
                [
                    name,
                    r["imbalance"],
                    r["step_ms"],
                    r.get("overhead_ms", float("nan")),
                    r.get("overhead_share", float("nan")),
                    f"{r['speedup']:.3f}x",
                    r["density"],
                    f"{p[0]} / {p[1]} / {p[2]} / {p[3]:.2f}x",
                    *([r["dp_imbalance"], r["device_idle"]] if pipe else []),
                    *([f"{r['predicted_speedup']:.3f}x"] if predicted else []),
                ]
            )
        parts.append(f"### {key}\n\n" + markdown_table(head, body))
    return "\n\n".join(parts)


def load_config(path: Path, allow_other: bool) -> dict:
    cfg = tomllib.loads(path.read_text())
    if path.resolve() != CONFIG.resolve() and not allow_other:
        raise ValueError(
            f"--config {path}: not the pre-registered {CONFIG} (pass "
            "--not-preregistered to run anyway; the results file will say so)"
        )
    return cfg


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("measured", "gloo", "simulated"), required=True)
    p.add_argument("--config", default=str(CONFIG))
    p.add_argument("--not-preregistered", action="store_true")
    p.add_argument("--mixes", default="chatqa2,longalign", help="comma list")
    p.add_argument("--num-docs", type=int, default=512, help="documents in each store")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one seed, 3 rounds, small batches (a smoke test, not a measurement)",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages per data-parallel rank (simulated: 1F1B makespan; gloo: the pipeline trainer); 1 = none",
    )
    p.add_argument(
        "--pad-micro-batches",
        action="store_true",
        help="simulated: run every micro-batch unpacked, its documents padded to its longest (Megatron-style "
        "(K, S) batches, the paper's setting as we read it) in every row; the trainer packs",
    )
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    cfg = load_config(Path(args.config), args.not_preregistered or args.quick)
    args.mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    if args.pp < 1 or (args.pp > 1 and args.mode == "measured"):
        p.error(f"--pp {args.pp}: must be >= 1, and above 1 only with --mode simulated or gloo (real pipelines)")
    if args.pad_micro_batches and args.mode != "simulated":
        p.error("--pad-micro-batches: only with --mode simulated (the trainer packs its micro-batches)")
    if args.quick:
        cfg["seeds"], cfg["rounds"] = [0], 3
        cfg["measured"].update(global_batch=8, budget_tokens=256)
        for mx in cfg["measured"]["mixes"].values():
            mx["short"] = [64, min(mx["short"][1], 512)]
            mx["long"] = [256, 1024]
        cfg["simulated"]["steps"] = 3
        args.num_docs = 64
    torch.set_num_threads(max(1, torch.get_num_threads()))
    load = os.getloadavg()
    if args.mode == "gloo" and not args.worker:
        return _launch_gloo(args, cfg)
    if args.mode == "simulated":
        results = simulated(cfg, args)
    else:
        emulate = cfg["measured"]["emulate_ranks"] if args.mode == "measured" else 0
        results = measured(cfg, args, emulate)
        if torch.distributed.is_initialized():  # the gloo ranks' one process group, at the end
            torch.distributed.destroy_process_group()
        if args.worker and int(os.environ.get("RANK", "0")) != 0:
            return 0
    if args.worker:  # the results file names the user's command, not torchrun's re-launch
        sys.argv = [a for a in sys.argv if a != "--worker"]
    other = " (NOT the pre-registered file)" if args.not_preregistered else ""
    quick = " --quick: a smoke test, not a measurement" if args.quick else ""
    settings = portable_path(args.config)
    notes = f"Settings: {settings}{other}{quick}; load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}."
    if args.pp > 1:
        note = MEASURED_PIPELINE_NOTE if args.mode == "gloo" else PIPELINE_NOTE
        split, head = pipeline_layers(cfg, args.pp)
        notes += f"\n\n{note.format(pp=args.pp, split=list(split), head=head)}"
    if args.pad_micro_batches:
        notes += f"\n\n{PADDED_NOTE}\n\n{kept_plans(results)}"
    elif args.pp > 1:
        notes += f"\n\n{LBB_NOTE}"
    md, _ = write_results(
        args.out,
        f"table1-{args.mode}{f'-pp{args.pp}' if args.pp > 1 else ''}{'-padded' if args.pad_micro_batches else ''}"
        f"{'-quick' if args.quick else ''}",
        torch.device("cpu"),
        table(cfg, results, args.mode),
        {"results": results, "config": cfg},
        notes,
    )
    print(f"wrote {md}")
    return 0


def _launch_gloo(args, cfg: dict) -> int:
    """Re-run this script under torchrun with the configured number of gloo ranks."""
    n = cfg["measured"]["gloo_ranks"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={n}",
        __file__,
        *[a for a in sys.argv[1:]],
        "--worker",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
